"""Simulator behaviour: exact fast-forward, determinism, rejections, routers, bad input."""

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

import traces
from simulator.config import SimConfig
from simulator.latency.roofline import RooflineModel
from simulator.run import run_simulation


def _run(trace, config, **kw):
    return run_simulation(
        trace, config, latency=RooflineModel(config.model, config.gpu, config.tensor_parallel_size), **kw
    )


@pytest.mark.parametrize("policy", ["chunked", "prefill_first"])
@pytest.mark.parametrize(
    "replicas,router", [(1, "round_robin"), (3, "least_outstanding"), (2, "prefix_aware")]
)
def test_fast_forward_is_exact(prefix_trace, small_config, policy, replicas, router):
    a = _run(prefix_trace, small_config(policy=policy, num_replicas=replicas, router=router))
    b = _run(
        prefix_trace, small_config(policy=policy, num_replicas=replicas, router=router, fast_forward=False)
    )
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    assert np.array_equal(a.itl[0], b.itl[0]) and np.array_equal(a.itl[1], b.itl[1])
    assert a.summary["sim_fast_forwarded_steps"] > a.summary["sim_steps"] / 3
    assert b.summary["sim_fast_forwarded_steps"] == 0
    assert a.summary["sim_steps"] == b.summary["sim_steps"]


def test_prefix_hits_and_preemptions_happen(prefix_trace, small_config):
    s = _run(prefix_trace, small_config(num_kv_blocks=120)).summary
    assert s["num_finished"] == 400
    assert s["num_preemptions"] > 0
    assert s["prefix_hit_rate"] > 0.3


def test_seeded_runs_are_bit_identical(prefix_trace, small_config):
    a = _run(prefix_trace, small_config(num_replicas=2, router="least_outstanding"))
    b = _run(prefix_trace, small_config(num_replicas=2, router="least_outstanding"))
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.timeline, b.timeline, check_exact=True)


def test_requests_that_cannot_fit_are_rejected_and_counted(qwen06):
    df = pd.DataFrame(
        {
            "request_id": [0, 1, 2],
            "arrival_s": [0.0, 0.1, 0.2],
            "prompt_len": [100, 5000, 300],
            "output_len": [10, 10, 10],
        }
    )
    trace = traces.Trace(df, name="tiny")
    cfg = SimConfig(
        model=qwen06, num_kv_blocks=50, block_size=16, max_model_len=4096, max_num_batched_tokens=512
    )
    res = _run(trace, cfg)
    reasons = res.requests.set_index("request_id")["finish_reason"]
    assert reasons[0] == "length"
    assert reasons[1] == "rejected_prompt_too_long"
    assert reasons[2] == "length"
    assert res.summary["num_rejected"] == 1 and res.summary["num_finished"] == 2
    cfg_small = SimConfig(model=qwen06, num_kv_blocks=10, block_size=16, max_num_batched_tokens=512)
    res = _run(trace.with_frame(df.iloc[[2]].reset_index(drop=True)), cfg_small)
    assert res.requests["finish_reason"][0] == "rejected_kv_capacity"


def test_output_that_outgrows_the_cache_is_truncated_not_hung(qwen06):
    df = pd.DataFrame({"request_id": [0], "arrival_s": [0.0], "prompt_len": [100], "output_len": [1000]})
    cfg = SimConfig(model=qwen06, num_kv_blocks=10, block_size=16, max_num_batched_tokens=512)
    res = _run(traces.Trace(df, name="long"), cfg)
    row = res.requests.iloc[0]
    assert row["finish_reason"] == "kv_capacity"
    # 10 blocks hold the KV of 160 tokens; the token sampled last needs no slot yet: 161 - 100
    assert row["num_output_tokens"] == 61


def test_bad_configs_name_the_field(qwen06):
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide num_heads 16"):
        SimConfig(model=qwen06, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="router"):
        SimConfig(model=qwen06, router="random")
    with pytest.raises(ValueError, match="block_size"):
        SimConfig(model=qwen06, block_size=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens .* must be >= max_num_seqs"):
        _run(
            traces.generate(num_requests=3, seed=0),
            SimConfig(model=qwen06, max_num_seqs=64, max_num_batched_tokens=32),
        )


def test_model_too_big_for_the_gpu_is_a_clear_error():
    from simulator.models import resolve_model

    cfg = SimConfig(model=resolve_model("llama-3-8b"), gpu="L40S", gpu_memory_utilization=0.3)
    with pytest.raises(ValueError, match="does not fit on L40S"):
        _run(traces.generate(num_requests=3, seed=0), cfg)


def test_reset_prefix_cache_forgets_every_prefix():
    from engine.core.block_manager import BlockManager
    from engine.core.sequence import Sequence
    from engine.sampling_params import SamplingParams

    bm = BlockManager(8, 4)
    seq = Sequence(0, list(range(10)), SamplingParams())
    assert bm.allocate_slots(seq, 10)
    with pytest.raises(RuntimeError, match="3 blocks are still in use"):
        bm.reset_prefix_cache()
    bm.free(seq)
    assert len(bm.lookup_prefix(Sequence(1, list(range(10)), SamplingParams()))) == 2
    bm.reset_prefix_cache()
    assert bm.lookup_prefix(Sequence(2, list(range(10)), SamplingParams())) == []
    assert list(bm.free_block_ids) == list(range(8))


def test_relaxed_gc_restores_the_collector():
    import gc

    from simulator.run import relaxed_gc

    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    with relaxed_gc((12_345, 7, 9)):
        assert gc.get_threshold() == (12_345, 7, 9)
        assert gc.get_freeze_count() > frozen
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
    with pytest.raises(RuntimeError), relaxed_gc((999, 1, 1)):
        raise RuntimeError("a failed simulation")
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen


def test_relaxed_gc_leaves_an_engines_freeze_in_place():
    import gc

    from simulator.run import relaxed_gc

    gc.freeze()  # as an LLM(freeze_gc=True) of this process does
    try:
        engine_frozen = gc.get_freeze_count()
        with relaxed_gc((12_345, 7, 9)):
            pass
        assert gc.get_freeze_count() >= engine_frozen > 0
    finally:
        gc.unfreeze()


def _counting_waits(monkeypatch):
    """Count the SimPy timeouts replicas take (Replica._wait), keeping its behaviour."""
    from simulator.sim import Replica

    counts = {"waits": 0}
    wait = Replica._wait

    def counted(self, delays, until, *rest):
        counts["waits"] += 1
        return wait(self, delays, until, *rest)

    monkeypatch.setattr(Replica, "_wait", counted)
    return counts


@pytest.mark.parametrize("fast_forward", [True, False])
@pytest.mark.parametrize(
    "replicas,router,policy",
    [
        (1, "round_robin", "chunked"),
        (3, "least_outstanding", "prefill_first"),
        (2, "prefix_aware", "chunked"),
    ],
)
def test_chained_steps_equal_waiting_after_every_step(
    prefix_trace, small_config, monkeypatch, fast_forward, replicas, router, policy
):
    """Steps and runs that end before the next arrival are computed without waiting for SimPy in
    between; every table, the ITL and the counters equal those of a replica that waits each time."""
    from simulator.sim import Replica

    config = small_config(num_replicas=replicas, router=router, policy=policy, fast_forward=fast_forward)
    counts = _counting_waits(monkeypatch)
    chained = _run(prefix_trace, config)
    chained_waits = counts["waits"]
    monkeypatch.setattr(Replica, "chain_steps", False)
    counts["waits"] = 0
    waited = _run(prefix_trace, config)
    pd.testing.assert_frame_equal(chained.requests, waited.requests, check_exact=True)
    pd.testing.assert_frame_equal(chained.timeline, waited.timeline, check_exact=True)
    assert np.array_equal(chained.itl[0], waited.itl[0]) and np.array_equal(chained.itl[1], waited.itl[1])
    skip = {"sim_wall_s", "sim_speedup"}
    assert {k: v for k, v in chained.summary.items() if k not in skip} == {
        k: v for k, v in waited.summary.items() if k not in skip
    }
    assert chained_waits < 0.8 * counts["waits"]  # many steps end before the next arrival here


def test_wait_lands_exactly_where_one_wait_per_step_would():
    """Replica._wait: one SimPy timeout when now + (until - now) is exactly `until`, else one per
    delay, so the replica resumes at the very float that waiting after every step gives."""
    import simpy

    from simulator.sim import Replica

    def waits(start: float, delays: list[float]) -> tuple[float, int]:
        env = simpy.Environment(initial_time=start)
        taken = []
        timeout = env.timeout
        env.timeout = lambda d: (taken.append(d), timeout(d))[1]
        until = start
        for d in delays:
            until += d
        env.process(Replica._wait(SimpleNamespace(env=env), delays, until))
        env.run()
        assert env.now == until
        return env.now, len(taken)

    # 0.949... + (48.42... - 0.949...) is not 48.42... in floats: one timeout per delay
    start, d1, d2 = 0.9492279489729363, 8.662105418580179, 38.81044914929678
    assert start + (((start + d1) + d2) - start) != (start + d1) + d2
    assert waits(start, [d1, d2]) == ((start + d1) + d2, 2)
    assert waits(0.5, [0.25, 0.125]) == (0.875, 1)  # exact: one timeout
    assert waits(0.5, [0.25]) == (0.75, 1)
