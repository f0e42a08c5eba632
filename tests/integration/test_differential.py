"""One control plane, two clocks: the real engine (CPU, torch backend, tiny random Qwen3) and the
simulator make identical scheduling decisions, step by step, on the same requests."""

import pandas as pd
import pytest

import traces
from engine.model_spec import ModelSpec
from simulator.config import SimConfig
from simulator.latency.roofline import RooflineModel
from simulator.sim import batch_decisions, simulate

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from engine.checkpoint import make_random_checkpoint

    return make_random_checkpoint(
        tmp_path_factory.mktemp("diff") / "qwen3", "qwen3", "tiny", seed=3, dtype="float32"
    )


@pytest.fixture(scope="module")
def trace():
    t = traces.generate(
        num_requests=24,
        rate=100.0,
        seed=11,
        prompt={"kind": "uniform", "low": 5, "high": 120},
        output={"kind": "uniform", "low": 1, "high": 40},
        shared_prefix={"num_prefixes": 3, "prefix_len": 48, "fraction": 0.7},
    )
    df = t.df.copy()
    df["arrival_s"] = 0.0  # everything queued at once: decisions then depend on the control plane only
    return t.with_frame(df)


def _engine_decisions(ckpt, trace, policy, num_blocks, async_scheduling=False, overlapped=None):
    """The engine's per-step decisions and per-request counts; with `overlapped` (a list), each
    recorded step's overlapped flag appended to it."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    log = []
    with LLM(
        ckpt,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=512,
        policy=policy,
        num_kv_blocks=num_blocks,
        attention_backend="torch",
        device="cpu",
        dtype="float32",
        async_scheduling=async_scheduling,
    ) as llm:
        schedule = llm.scheduler.schedule

        def logged():
            batch = schedule()
            log.append(batch_decisions(batch))
            return batch

        llm.scheduler.schedule = logged
        vocab = llm.spec.vocab_size
        seqs = [
            llm.add_request(
                trace.token_ids(i, vocab), SamplingParams(temperature=0.0, max_tokens=int(n), ignore_eos=True)
            )
            for i, n in enumerate(trace.df["output_len"])
        ]
        while llm.has_unfinished():
            llm.step()
        if overlapped is not None:
            overlapped += llm.recorder.to_dataframe()["overlapped"].tolist()
            assert sum(overlapped) == llm.num_async_steps
    counts = {s.seq_id: (s.num_output_tokens, s.num_preemptions, s.num_cached_tokens) for s in seqs}
    return log, counts


@pytest.mark.parametrize("policy,num_blocks", [("chunked", 60), ("prefill_first", 60), ("chunked", 24)])
def test_engine_and_simulator_decide_alike(tiny_ckpt, trace, policy, num_blocks):
    real_log, real_counts = _engine_decisions(tiny_ckpt, trace, policy, num_blocks)
    spec = ModelSpec.from_hf_config(tiny_ckpt)
    cfg = dict(
        model=spec,
        block_size=16,
        num_kv_blocks=num_blocks,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=512,
        policy=policy,
    )
    lat = RooflineModel(spec, "H200")
    run = simulate(trace, SimConfig(**cfg, fast_forward=False), lat, num_blocks, record_batches=True)
    sim_log = [d for d in run.replicas[0].batch_log if d[0]]
    assert [d for d in real_log if d[0]] == sim_log
    assert any(d[3] for d in sim_log) == (num_blocks == 24)  # the small cache preempts
    for ff in (False, True):
        run = simulate(trace, SimConfig(**cfg, fast_forward=ff), lat, num_blocks)
        rows = pd.DataFrame(run.replicas[0].records)
        sim_counts = {r[0]: (r[8], r[9], r[10]) for r in run.replicas[0].records}
        assert sim_counts == real_counts, (ff, rows)


@pytest.mark.parametrize("policy,num_blocks", [("chunked", 60), ("prefill_first", 60), ("chunked", 24)])
def test_async_engine_and_simulator_schedule_ahead_alike(tiny_ckpt, trace, policy, num_blocks):
    """With async scheduling, on requests that share their first blocks: the same decisions, and the
    same steps scheduled while the one before ran, step by step; fast-forward counts them alike."""
    real_overlapped: list[bool] = []
    real_log, real_counts = _engine_decisions(
        tiny_ckpt, trace, policy, num_blocks, async_scheduling=True, overlapped=real_overlapped
    )
    spec = ModelSpec.from_hf_config(tiny_ckpt)
    cfg = dict(
        model=spec,
        block_size=16,
        num_kv_blocks=num_blocks,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        max_model_len=512,
        policy=policy,
        async_scheduling=True,
    )
    lat = RooflineModel(spec, "H200")
    run = simulate(trace, SimConfig(**cfg, fast_forward=False), lat, num_blocks, record_batches=True)
    replica = run.replicas[0]
    sim_log = [d for d in replica.batch_log if d[0]]
    assert [d for d in real_log if d[0]] == sim_log
    assert replica.overlap_log == real_overlapped
    assert 0 < sum(real_overlapped) < len(real_overlapped)
    for ff in (False, True):
        run = simulate(trace, SimConfig(**cfg, fast_forward=ff), lat, num_blocks)
        sim_counts = {r[0]: (r[8], r[9], r[10]) for r in run.replicas[0].records}
        assert sim_counts == real_counts, ff
        assert run.replicas[0].counters.num_overlapped_steps == sum(real_overlapped), ff
