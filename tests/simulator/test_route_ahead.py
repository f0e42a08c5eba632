"""A replica's decode runs end at its own next arrival where the router tells it in advance
(`RouteAhead`): the same requests, ITL and steps as runs cut at every arrival, and as stepping;
and an async run's step past the deadline priced once, from where the run stopped."""

import math

import numpy as np
import pandas as pd
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

import traces
from simulator.cluster import least_outstanding_lead
from simulator.latency.roofline import RooflineModel
from simulator.run import run_simulation
from simulator.sim import RouteAhead


def _run(trace, config):
    return run_simulation(
        trace, config, latency=RooflineModel(config.model, config.gpu, config.tensor_parallel_size)
    )


def _runs(summary_of):
    return sum(r.counters.num_fast_forwards for r in summary_of.replicas)


def _same(a, b):
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    assert np.array_equal(a.itl[0], b.itl[0]) and np.array_equal(a.itl[1], b.itl[1])
    assert a.summary["sim_steps"] == b.summary["sim_steps"]
    assert a.summary["duration_s"] == b.summary["duration_s"]


@pytest.fixture(scope="module")
def busy_trace():
    """Many arrivals per request's lifetime: runs cut at every arrival stay short."""
    return traces.generate(
        num_requests=500,
        rate=60.0,
        seed=3,
        prompt={"kind": "uniform", "low": 20, "high": 600},
        output={"kind": "uniform", "low": 5, "high": 300},
        shared_prefix={"num_prefixes": 8, "prefix_len": 256, "zipf": 1.0},
    )


@pytest.mark.parametrize(
    "router,async_scheduling",
    [("round_robin", False), ("least_outstanding", False), ("round_robin", True)],
)
@pytest.mark.parametrize("policy", ["chunked", "prefill_first"])
def test_runs_to_the_own_next_arrival_change_nothing(
    busy_trace, small_config, monkeypatch, router, async_scheduling, policy
):
    kw = dict(num_replicas=4, router=router, policy=policy, async_scheduling=async_scheduling)
    config = small_config(**kw)
    own = _run(busy_trace, config)
    stepped = _run(busy_trace, small_config(**kw, fast_forward=False))
    monkeypatch.setattr(RouteAhead, "of", classmethod(lambda cls, *args: None))
    shared = _run(busy_trace, config)
    _same(own, shared)
    _same(own, stepped)
    assert own.summary["sim_fast_forwarded_steps"] == shared.summary["sim_fast_forwarded_steps"]
    assert own.summary["num_finished"] == 500


@pytest.mark.parametrize("router", ["round_robin", "least_outstanding"])
def test_fewer_runs_when_they_end_at_the_own_next_arrival(busy_trace, small_config, monkeypatch, router):
    from simulator.sim import simulate

    config = small_config(num_replicas=4, router=router)
    latency = RooflineModel(config.model, config.gpu, config.tensor_parallel_size)
    own = simulate(busy_trace, config, latency, 400)
    monkeypatch.setattr(RouteAhead, "of", classmethod(lambda cls, *args: None))
    shared = simulate(busy_trace, config, latency, 400)
    assert sum(r.counters.num_fast_forward_steps for r in own.replicas) == sum(
        r.counters.num_fast_forward_steps for r in shared.replicas
    )
    assert _runs(own) < 0.8 * _runs(shared)


@pytest.mark.parametrize("router", ["round_robin", "least_outstanding"])
def test_chained_steps_equal_waiting_with_own_arrivals(busy_trace, small_config, monkeypatch, router):
    """Every table, the ITL and the counters: a replica that chains past other replicas' arrivals
    lands where one that waits after every segment does."""
    from simulator.sim import Replica

    config = small_config(num_replicas=3, router=router)
    chained = _run(busy_trace, config)
    monkeypatch.setattr(Replica, "chain_steps", False)
    waited = _run(busy_trace, config)
    pd.testing.assert_frame_equal(chained.requests, waited.requests, check_exact=True)
    pd.testing.assert_frame_equal(chained.timeline, waited.timeline, check_exact=True)
    skip = {"sim_wall_s", "sim_speedup"}
    assert {k: v for k, v in chained.summary.items() if k not in skip} == {
        k: v for k, v in waited.summary.items() if k not in skip
    }


def test_event_times_are_where_the_arrival_process_lands():
    """`RouteAhead.event_times`: the SimPy time of each arrival's event, floats included (waiting
    now + (a - now) is not always a), and the time of the arrival before it where none is waited."""
    arrivals = [0.0, 0.9492279489729363, 0.9492279489729363, 48.421782516849895, 50.0]
    env = simpy.Environment()
    seen = []

    def process():
        for a in arrivals:
            if a > env.now:
                yield env.timeout(a - env.now)
            seen.append(env.now)

    env.process(process())
    env.run()
    replicas = [type("R", (), {"index": i, "outstanding_tokens": 0})() for i in range(2)]
    plan = RouteAhead(object(), replicas, arrivals, [1] * len(arrivals), [1] * len(arrivals))
    assert list(plan.event_times) == seen
    assert seen[2] == seen[1] and seen[3] == 48.42178251684989 != arrivals[3]


def test_round_robin_marks_each_replica_s_next_arrival():
    from simulator.cluster import RoundRobinRouter

    arrivals = [0.5, 1.0, 1.5, 2.0, 2.5]
    replicas = [type("R", (), {"index": i, "outstanding_tokens": 0})() for i in range(3)]
    plan = RouteAhead(RoundRobinRouter(replicas), replicas, arrivals, [1] * 5, [1] * 5)
    assert [(r.own.time, r.own.event_time) for r in replicas] == [(0.5, 0.5), (1.0, 1.0), (1.5, 1.5)]
    plan.routed(0, replicas[0])
    assert (replicas[0].own.time, replicas[0].own.event_time) == (2.0, 2.0)
    plan.routed(2, replicas[2])
    assert (replicas[2].own.time, replicas[2].own.event_time) == (math.inf, math.inf)


def test_least_outstanding_lead_counts_what_the_others_must_be_sent():
    # replica 1 holds 100: replica 0 (lower index) must pass it, replica 2 reach it, replica 3 is past
    assert least_outstanding_lead(100, 1, [40, 999, 100, 150]) == 61 + 0 + 0
    assert least_outstanding_lead(100, 1, [40, 999, 90, 150]) == 61 + 10
    assert least_outstanding_lead(0, 0, [0, 0, 0]) == 0  # the router's next choice
    assert least_outstanding_lead(0, 2, [0, 0, 0]) == 2  # ties go to lower indices first


def test_least_outstanding_marks_the_first_arrival_that_could_come():
    from simulator.cluster import LeastOutstandingRouter

    arrivals = [1.0, 2.0, 3.0, 4.0, 5.0]
    replicas = [type("R", (), {"index": i, "outstanding_tokens": 0, "own_stale": False})() for i in range(2)]
    plan = RouteAhead(LeastOutstandingRouter(replicas), replicas, arrivals, [10, 20, 30, 40, 50], [0] * 5)
    replicas[0].outstanding_tokens = 10  # arrival 0 went to replica 0
    plan.routed(0, replicas[0])
    assert replicas[0].own_stale
    replicas[0].outstanding_tokens = 0  # then it finished
    plan.refresh(replicas[0])
    assert replicas[0].own.time == 2.0  # it could take arrival 1 at once
    replicas[0].outstanding_tokens = 45
    plan.refresh(replicas[0])
    # replica 1 (0 tokens, higher index) must be sent 45 first: arrivals 1 and 2 bring 50
    assert (replicas[0].own.time, replicas[0].own.event_time) == (4.0, 4.0)
    replicas[0].outstanding_tokens = 1000
    plan.refresh(replicas[0])
    assert replicas[0].own.time == math.inf


@pytest.mark.parametrize("span", [0.05, 2.0])  # a short run (step by step) and a long one (numpy)
def test_lagged_times_price_one_step_more_as_the_run_would(qwen06, span):
    """The step past the deadline is priced from where the run stopped: the very floats of a run of
    k + 1 steps (step k + 1 reads k * num_seqs more tokens), and the same steps counted outside."""
    from simulator.fast_forward import accumulate_decode_times
    from simulator.latency.ranges import CountingModel, FitRanges, KindRange
    from simulator.sim import LaggedDecodeTimes

    model = RooflineModel(qwen06, "H200", 1)
    n, ctx, length, start = 24, 24 * 900, 1500, 0.25
    deadline = start + span
    plain = model.decode_step_times(n, ctx, length, 1 << 20, start, deadline)
    k = len(plain) - 1
    assert 1 < k < 1 << 20
    reference = accumulate_decode_times(model.decode_step_time, n, ctx, length, k + 1, start, math.inf)
    assert LaggedDecodeTimes(model.decode_step_times)(n, ctx, length, 1 << 20, start, deadline) == reference
    # a profile fitted on shorter contexts: the last steps of the run are outside it, counted from
    # the run's shape when the simulator reports the run (`CountingModel.count_run`)
    fit = KindRange(64, ctx + (k // 2) * n, 1 << 40, 64)
    counted = CountingModel(model, FitRanges(fit, fit))
    times = LaggedDecodeTimes(counted.decode_step_times)(n, ctx, length, 1 << 20, start, deadline)
    assert times[: k + 2] == reference and counted.count.decode == 0
    counted.count_run(n, ctx, length, k + 1)
    assert counted.count.decode == k + 1 - (k // 2 + 1)


def test_least_outstanding_needs_one_arrival_for_each_replica_chosen_first():
    from simulator.cluster import least_outstanding_needs

    # replicas 0 and 2 would be chosen before replica 1 (100 tokens): each must be sent one first
    assert least_outstanding_needs(100, 1, [40, 999, 90, 150]) == (61 + 10, 2)
    assert least_outstanding_needs(100, 1, [101, 999, 100, 150]) == (0, 0)
    assert least_outstanding_needs(0, 2, [0, 0, 0]) == (2, 2)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=2, max_size=9), st.data())
def test_least_outstanding_needs_is_its_definition(others, data):
    """Against the rule read straight: replica q (not `index`) is chosen first while it holds fewer
    tokens, or as many from a lower index; it must be sent the difference (plus one below `index`)."""
    from simulator.cluster import least_outstanding_needs

    index = data.draw(st.integers(0, len(others) - 1))
    outstanding = data.draw(st.integers(0, 45))
    needs = [outstanding + (q < index) - o for q, o in enumerate(others) if q != index]
    want = (sum(n for n in needs if n > 0), sum(1 for n in needs if n > 0))
    assert least_outstanding_needs(outstanding, index, others) == want


@pytest.mark.parametrize("num_kv_blocks", [400, 120])  # 120: runs capped before preemptions
@pytest.mark.parametrize("policy", ["chunked", "prefill_first"])
def test_held_runs_equal_runs_applied_as_they_stop(
    busy_trace, small_config, monkeypatch, num_kv_blocks, policy
):
    """Runs held past other replicas' arrivals (`FastForwardScheduler.hold_runs`) and applied once:
    every table, the ITL, the summary and the capacity use of runs applied where they stop."""
    from simulator.fast_forward import FastForwardScheduler
    from simulator.run import collect, simulate_config
    from simulator.sim import Replica

    config = small_config(
        num_replicas=4,
        router="least_outstanding",
        policy=policy,
        num_kv_blocks=num_kv_blocks,
        timeline_interval_s=0.05,
    )
    latency = RooflineModel(config.model, config.gpu, config.tensor_parallel_size)
    extended = []
    extend = FastForwardScheduler._extend_held
    monkeypatch.setattr(FastForwardScheduler, "_extend_held", lambda s, d: extended.append(d) or extend(s, d))
    held = simulate_config(busy_trace, config, latency=latency)
    monkeypatch.setattr(Replica, "hold_runs", False)
    applied = simulate_config(busy_trace, config, latency=latency)
    assert len(extended) > 100
    a, b = collect(held), collect(applied)
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    pd.testing.assert_frame_equal(a.timeline, b.timeline, check_exact=True)
    assert np.array_equal(a.itl[0], b.itl[0]) and np.array_equal(a.itl[1], b.itl[1])
    skip = {"sim_wall_s", "sim_speedup"}
    assert {k: v for k, v in a.summary.items() if k not in skip} == {
        k: v for k, v in b.summary.items() if k not in skip
    }
    assert [r.capacity for r in held.replicas] == [r.capacity for r in applied.replicas]


@pytest.mark.parametrize("span", [0.05, 2.0])
def test_the_step_past_the_deadline_priced_alone_is_the_same_float(qwen06, span):
    """`LaggedDecodeTimes` with the model's `decode_step_time` for the step past the deadline: the
    times of the run priced as one (and of the reference loop)."""
    from simulator.defaults import default_profile
    from simulator.fast_forward import accumulate_decode_times
    from simulator.latency.gpus import get_gpu
    from simulator.latency.profile import load_latency_model
    from simulator.sim import LaggedDecodeTimes

    fitted = load_latency_model(default_profile("qwen3-0.6b", "H200", 16, 1), qwen06, get_gpu("H200"), 1, 16)
    for model in (RooflineModel(qwen06, "H200", 1), fitted, fitted.overlapped_model()):
        n, ctx, length, start = 24, 24 * 900, 1500, 0.25
        by_run = LaggedDecodeTimes(model.decode_step_times)(n, ctx, length, 1 << 20, start, start + span)
        by_step = LaggedDecodeTimes(model.decode_step_times, model.decode_step_time)
        assert by_step(n, ctx, length, 1 << 20, start, start + span) == by_run
        k = len(by_run) - 1
        assert by_run == accumulate_decode_times(model.decode_step_time, n, ctx, length, k, start, math.inf)
