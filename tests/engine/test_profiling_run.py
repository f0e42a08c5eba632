"""Profile-sweep workloads run through a real (tiny, CPU) engine: spread prompts over a full cache,
with and without a joining prefill chunk, give the step shapes the sweep means them to; the whole
sweep runs exactly the steps its control-plane plan says; a sweep over its budget does not start."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from engine.llm import LLM
from engine.profiling import SweepLimits, Workload, _run, envelope, plan_sweep, run_profile, spread_lengths
from simulator.latency.profile import LatencyProfile


def test_spread_workloads_fill_the_cache_and_mix_in_a_chunk(checkpoints):
    with LLM(checkpoints["qwen3"], num_kv_blocks=96, block_size=16, max_model_len=512, device="cpu") as llm:
        vocab, rng = llm.spec.vocab_size, np.random.default_rng(0)
        lengths = spread_lengths(8, 160, shortest=20)
        _run(llm, Workload("decode_spread", 8, 160, 4, shortest=20), rng, vocab)
        steps = llm.recorder.to_dataframe()
        decode = steps[steps.kind == "decode"]
        # the prefill samples the first of 4 tokens; 3 decode steps of all 8 follow
        assert decode.num_seqs.tolist() == [8, 8, 8]
        assert decode.max_seq_len.tolist() == [161, 162, 163]  # the longest prompt, 1..3 tokens on
        assert decode.num_context_tokens.tolist() == [sum(lengths) + 8 * i for i in range(3)]
        llm.recorder.reset()
        _run(llm, Workload("mixed", 8, 160, 8, chunk_len=40, shortest=20), rng, vocab)
        steps = llm.recorder.to_dataframe()
        mixed = steps[(steps.kind == "mixed") & (steps.num_prefill_tokens == 40)]
        assert len(mixed) == 6 and (mixed.num_decode_seqs == 8).all()  # six joins, each in one step


SHIPPED = Path(__file__).resolve().parents[2] / "simulator" / "profiles"
STEP_COLUMNS = ["kind", "num_seqs", "num_prefill_seqs", "total_num_scheduled_tokens", "num_prefill_tokens",
                "total_num_cached_tokens", "num_context_tokens", "max_seq_len", "num_kv_blocks_used",
                "overlapped"]  # fmt: skip


@pytest.fixture(scope="module")
def eos_checkpoint(tmp_path_factory):
    """The tiny Qwen3 with an EOS token (300, one this sweep's greedy steps never sample: the `sync`
    requests stop at it, so a sampled one would end a request before the plan does)."""
    from engine.checkpoint import make_random_checkpoint

    root = tmp_path_factory.mktemp("eos")
    return make_random_checkpoint(root / "qwen3", "qwen3", "tiny", seed=1, dtype="float32", init_std=0.2,
                                  eos_token_id=300)  # fmt: skip


def test_sweep_end_to_end_runs_the_steps_it_planned(eos_checkpoint, capsys):
    """Every phase through a tiny CPU engine with async scheduling: the engine's step records have
    exactly the planned shapes, steps run ahead or not included; the estimate is printed first."""
    model = LatencyProfile.load(SHIPPED / "qwen3-0.6b_h200_tp1_bs16_async.json").to_latency_model()
    kwargs = dict(num_kv_blocks=256, block_size=16, max_num_seqs=8, max_num_batched_tokens=256)
    with LLM(eos_checkpoint, max_model_len=512, device="cpu", async_scheduling=True, **kwargs) as llm:
        plan = plan_sweep(llm, model, serving=False)
        assert plan.limits == SweepLimits(8, 256, 512, 4096, "chunked", 16, async_scheduling=True)
        assert [w.phase for w in plan.work].count("short") == 13
        assert {w.phase for w in plan.work} == {"short", "long", "mixed_long", "full"}
        records = run_profile(llm, progress=False, serving=False, plan=plan, time_budget_s=10)
    assert capsys.readouterr().out.startswith("profile: estimated device time 1 s on qwen3-0.6b on H200")
    planned = plan.steps[STEP_COLUMNS].reset_index(drop=True)
    measured = records[STEP_COLUMNS].astype(planned.dtypes.to_dict()).reset_index(drop=True)
    pd.testing.assert_frame_equal(planned, measured)
    assert len(records) == 678
    assert envelope(records, 16) == envelope(plan.steps, 16)
    assert envelope(records, 16)["decode_sync"] == {
        "steps": 220, "batch": [1, 8], "longest": [129, 471], "context": [128, 3732], "step_tokens": [1, 8],
        "kv_blocks": [9, 238], "table_width": [9, 240],
    }  # fmt: skip
    assert plan.steps.groupby("phase").size().to_dict() == {
        "full": 87,
        "long": 333,
        "mixed_long": 42,
        "short": 216,
    }


def test_run_profile_refuses_a_sweep_over_its_budget(eos_checkpoint):
    model = LatencyProfile.load(SHIPPED / "qwen3-0.6b_h200_tp1_bs16_async.json").to_latency_model()
    with LLM(eos_checkpoint, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=256,
             device="cpu") as llm:  # fmt: skip
        with pytest.raises(
            ValueError, match=r"--time-budget: the sweep is estimated at \d+ s of device time"
        ):
            run_profile(llm, progress=False, serving=True, estimator=model, time_budget_s=5)
        assert len(llm.recorder.to_dataframe()) == 0  # nothing ran


def test_a_model_without_a_shipped_profile_is_priced_on_the_roofline(eos_checkpoint):
    with LLM(eos_checkpoint, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=256,
             device="cpu") as llm:  # fmt: skip
        plan = plan_sweep(llm, gpu="H200", serving=False)
    assert plan.source == "the roofline model (H200-SXM)"
    assert len(plan.steps) == 329 and plan.estimate["serving"] == 0.0
    assert plan.estimate["total"] == pytest.approx(0.666033009373, rel=1e-9)
