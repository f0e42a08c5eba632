"""simulator/calibration.py: a sweep's device time priced on a shipped profile (or the roofline) and
held to its budget, and the sweep run through a tiny CPU engine exactly as it was planned."""

from __future__ import annotations

from pathlib import Path

import engine_helpers
import pandas as pd
import pytest

from engine.llm import LLM
from engine.profiling import SweepLimits, envelope
from simulator.calibration import check_budget, estimate_seconds, plan_sweep, run_profile, step_seconds
from simulator.latency.profile import LatencyProfile

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


@pytest.fixture(scope="module")
def h200_plan():
    return engine_helpers.h200_plan()


def test_estimate_prices_each_phase_on_a_shipped_profile(h200_plan):
    _, steps = h200_plan
    # a fixed fit (the block-16 async profile of 2026-12-02 07:09, before the prefix-hit term)
    model = LatencyProfile.load(SHIPPED / "superseded/qwen3-0.6b_h200_tp1_bs16_async_2026-12-02_0709.json")
    model = model.to_latency_model()
    est = estimate_seconds(steps, model)
    assert est == pytest.approx(
        {"short": 23.4764189458, "long": 20.436913551645, "mixed_long": 2.92623074156,
         "mixed_serving": 1.852650886311, "full": 4.680031937404, "serving": 28.0,
         "total": 81.372246062719}, rel=1e-9
    )  # fmt: skip
    # a step run ahead is priced without the host's sync terms
    seconds = step_seconds(steps, model)
    row = steps[(steps.kind == "decode") & steps.overlapped].iloc[0]
    j = steps.index.get_loc(row.name)
    assert seconds[j] == model.overlapped_model().decode_step_time(
        row.num_seqs, row.num_context_tokens, row.max_seq_len
    )
    assert estimate_seconds(steps, model, serving=False)["total"] == pytest.approx(
        est["total"] - 28.0, rel=1e-12
    )


def test_budget_is_enforced_before_running():
    est = {"short": 200.0, "long": 90.0, "mixed_long": 5.0, "full": 10.0, "serving": 28.0, "total": 333.0}
    check_budget(est, 333.0)
    with pytest.raises(
        ValueError, match=r"--profile-budget: the sweep is estimated at 333 s .*over the budget of 300 s"
    ):
        check_budget(est, 300.0, "--profile-budget")


def test_sweep_end_to_end_runs_the_steps_it_planned(eos_checkpoint, capsys):
    """Every phase through a tiny CPU engine with async scheduling: the engine's step records have
    exactly the planned shapes, steps run ahead or not included; the estimate is printed first."""
    model = LatencyProfile.load(SHIPPED / "qwen3-0.6b_h200_tp1_bs16_async.json").to_latency_model()
    kwargs = dict(num_kv_blocks=256, block_size=16, max_num_seqs=8, max_num_batched_tokens=256)
    with LLM(eos_checkpoint, max_model_len=512, device="cpu", async_scheduling=True, **kwargs) as llm:
        plan = plan_sweep(llm, model, serving=False)
        assert plan.limits == SweepLimits(8, 256, 512, 4096, "chunked", 16, async_scheduling=True)
        assert [w.phase for w in plan.work].count("short") == 13
        assert {w.phase for w in plan.work} == {"short", "long", "mixed_long", "mixed_serving", "full"}
        records = run_profile(llm, progress=False, serving=False, plan=plan, time_budget_s=10)
    assert capsys.readouterr().out.startswith("profile: estimated device time 1 s on qwen3-0.6b on H200")
    planned = plan.steps[STEP_COLUMNS].reset_index(drop=True)
    measured = records[STEP_COLUMNS].astype(planned.dtypes.to_dict()).reset_index(drop=True)
    pd.testing.assert_frame_equal(planned, measured)
    assert len(records) == 691
    assert envelope(records, 16) == envelope(plan.steps, 16)
    assert envelope(records, 16)["decode_sync"] == {
        "steps": 221, "batch": [1, 8], "longest": [129, 471], "context": [128, 3732], "step_tokens": [1, 8],
        "kv_blocks": [9, 238], "table_width": [9, 240],
    }  # fmt: skip
    assert plan.steps.groupby("phase").size().to_dict() == {
        "full": 87,
        "long": 333,
        "mixed_long": 42,
        "mixed_serving": 13,
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
