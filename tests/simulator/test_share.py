"""One run standing for other capacity limits (simulator/share.py): at each limit's edge, a config
that the run is said to share gives, run alone, the very tables and summary that `derive` gives."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

import traces
from simulator import share
from simulator.latency.roofline import RooflineModel
from simulator.run import collect, run_simulation, simulate_config
from simulator.sim import trace_prompts
from traces.schema import synthetic_vocab_size

# Seconds of host time, not simulated ones.
TIMING = ("sim_wall_s", "sim_speedup")


@pytest.fixture(scope="module")
def busy_trace():
    """Distinct prompts (no prefix in common), long enough that a few steps need big budgets."""
    return traces.generate(
        num_requests=300,
        rate=12.0,
        seed=11,
        prompt={"kind": "uniform", "low": 20, "high": 1500},
        output={"kind": "uniform", "low": 5, "high": 300},
    )


def _prompts(trace, config):
    return trace_prompts(trace, synthetic_vocab_size(config.model.vocab_size, config.block_size))


def _same_result(derived, alone) -> None:
    pd.testing.assert_frame_equal(derived.requests, alone.requests, check_exact=True)
    pd.testing.assert_frame_equal(derived.timeline, alone.timeline, check_exact=True)
    assert [derived.itl[0].tolist(), derived.itl[1].tolist()] == [
        alone.itl[0].tolist(),
        alone.itl[1].tolist(),
    ]
    drop = set(TIMING)
    assert {k: v for k, v in derived.summary.items() if k not in drop} == {
        k: v for k, v in alone.summary.items() if k not in drop
    }


def test_a_run_stands_for_limits_up_to_the_edge_of_what_it_used(busy_trace, small_config):
    base = small_config(num_kv_blocks=5000, max_num_seqs=256, max_num_batched_tokens=8192)
    latency = RooflineModel(base.model, "H100")
    prompts = _prompts(busy_trace, base)
    run = simulate_config(busy_trace, base, latency=latency, prompts=prompts)
    (use,) = [r.capacity for r in run.replicas]
    s, t, q = use.max_running, use.max_step_tokens, use.max_kv_blocks
    assert (s, t, q, use.kv_blocks) == (12, 1497, 772, 0)  # limits the run came near, not to
    neutral = share.prefix_neutral(prompts, base.block_size)
    assert neutral
    edges = {
        (s + 1, t + 1, q): True,
        (s, 8192, 5000): False,
        (256, t, 5000): False,  # a budget other than the run's must exceed what a step took
        (256, 8192, q - 1): False,
        (s + 1, 8192, q): True,
    }
    for (seqs, budget, blocks), shared in edges.items():
        config = dataclasses.replace(
            base, max_num_seqs=seqs, max_num_batched_tokens=budget, num_kv_blocks=blocks
        )
        assert share.shares_run(run, config, blocks, neutral) is shared, (seqs, budget, blocks)
        if shared:
            alone = run_simulation(busy_trace, config, latency=latency, prompts=prompts)
            _same_result(share.derive(run, config, blocks), alone)
    _same_result(collect(run), run_simulation(busy_trace, base, latency=latency, prompts=prompts))


def test_only_capacity_limits_may_differ(busy_trace, small_config):
    base = small_config(num_kv_blocks=5000, max_num_seqs=256, max_num_batched_tokens=8192)
    run = simulate_config(busy_trace, base, latency=RooflineModel(base.model, "H100"))
    for other in (
        dataclasses.replace(base, block_size=32),
        dataclasses.replace(base, policy="prefill_first"),
        dataclasses.replace(base, gpu="A100"),
        dataclasses.replace(base, async_scheduling=True),
    ):
        assert not share.shares_run(run, other, 5000, True)
    assert share.shares_run(run, dataclasses.replace(base, gpu_memory_utilization=0.5), 5000, True)


def test_a_run_that_met_its_cache_size_stands_for_no_other(prefix_trace, small_config):
    """The prefix trace preempts in 400 blocks: neither fewer nor more blocks schedule alike."""
    base = small_config()
    run = simulate_config(prefix_trace, base, latency=RooflineModel(base.model, "H100"))
    assert sum(r.scheduler.num_preemptions for r in run.replicas) > 0
    for blocks in (300, 400, 4000):
        assert not share.shares_run(run, dataclasses.replace(base, num_kv_blocks=blocks), blocks, True)


def test_prefix_neutral_prompts_have_distinct_first_blocks(prefix_trace, busy_trace, small_config):
    config = small_config()
    assert not share.prefix_neutral(_prompts(prefix_trace, config), 16)  # shared system prompts
    assert share.prefix_neutral(_prompts(busy_trace, config), 16)
    # short prompts pad their first block with the sampled token: two such blocks may be equal
    assert not share.prefix_neutral([[5, 7], [5, 7, 0]], 4)
    assert share.prefix_neutral([[5, 7], [5, 7, 1]], 4)
