"""The simulator's async scheduling: requests that arrive during a decode step wait one step more,
decode steps scheduled ahead cost the latency model's overlapped view, and fast-forward stays exact."""

import dataclasses
import math

import numpy as np
import pandas as pd
import pytest

import traces
from simulator.config import SimConfig
from simulator.latency.fitted import ASYNC_DECODE_FEATURES, PREFILL_FEATURES, FittedModel, LinearFit
from simulator.run import collect, run_simulation, simulate_config
from simulator.sim import LaggedDecodeTimes


def async_model(decode=(2e-3, 2e-5, 3e-8, 1e-7, 0.0, 0.0, 3e-4, 5e-4, 4e-6), graphs=256) -> FittedModel:
    """A fitted model with sync terms: decode steps not scheduled ahead pay 0.5 ms + 4 us a row more."""
    prefill = LinearFit(PREFILL_FEATURES, (3e-3, 2.5e-6, 1e-10, 2e-8, 5e-5, 1e-5))
    return FittedModel(LinearFit(ASYNC_DECODE_FEATURES, decode), prefill, graphs)


def step_model() -> FittedModel:
    """Whole seconds: a decode step 1 s (1.5 s when not scheduled ahead), a prefill or mixed step 2 s."""
    prefill = LinearFit(PREFILL_FEATURES, (2.0, 0.0, 0.0, 0.0, 0.0, 0.0))
    decode = LinearFit(ASYNC_DECODE_FEATURES, (1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0))
    return FittedModel(decode, prefill, 0)


def test_the_overlapped_view_drops_the_sync_terms():
    model = async_model()
    ahead = model.overlapped_model()
    assert ahead.overlapped and not model.overlapped and ahead.overlapped_model() is ahead
    assert model.overlapped_model() is ahead  # built once
    # padded batch 16: sync terms 5e-4 + 4e-6 * 16
    assert model.decode_step_time(10, 5000, 900) - ahead.decode_step_time(10, 5000, 900) == pytest.approx(
        5e-4 + 4e-6 * 16, rel=1e-12
    )
    legacy = FittedModel(
        LinearFit(ASYNC_DECODE_FEATURES[:7], model.decode.coefficients[:7]), model.prefill, 256
    )
    assert legacy.overlapped_model() is legacy and not legacy.has_sync_terms


def test_lagged_decode_times_run_one_step_past_the_deadline():
    def each_second(num_seqs, ctx, length, max_steps, start, deadline):
        times = [start]
        while len(times) <= max_steps and times[-1] < deadline:
            times.append(times[-1] + 1.0)
        return times

    lagged = LaggedDecodeTimes(each_second)
    assert lagged(1, 10, 10, 100, 0.0, 2.5) == [0.0, 1.0, 2.0, 3.0, 4.0]  # steps from 0, 1, 2, then 3
    assert lagged.times == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert lagged(1, 10, 10, 2, 0.0, 2.5) == [0.0, 1.0, 2.0]  # the run's own limit comes first
    assert lagged(1, 10, 10, 100, 5.0, 4.0) == [5.0, 6.0]  # arrived before the run: one step still
    assert lagged(1, 10, 10, 100, 0.0, math.inf)[:3] == [0.0, 1.0, 2.0]


def _two_requests():
    df = pd.DataFrame(
        {"request_id": [0, 1], "arrival_s": [0.0, 3.2], "prompt_len": [20, 20], "output_len": [10, 2]}
    )
    return traces.Trace(df, name="two")


@pytest.mark.parametrize("fast_forward", [True, False])
def test_a_request_arriving_during_a_decode_waits_one_step_more(qwen06, fast_forward):
    """A: prefill 0-2 s, decodes from 2 s. B arrives at 3.2 s, during the decode 2-3.5 s (1.5 s: the
    first after a prefill is not scheduled ahead). Synchronously, B is scheduled at 3.5 s. With async
    scheduling the step 3.5-4.5 s was scheduled at 2 s (and ahead: 1 s), so B waits until 4.5 s."""
    trace = _two_requests()
    base = dict(model=qwen06, num_kv_blocks=64, fast_forward=fast_forward)
    sync = run_simulation(trace, SimConfig(**base), latency=step_model()).requests.set_index("request_id")
    ahead = run_simulation(trace, SimConfig(**base, async_scheduling=True), latency=step_model())
    req = ahead.requests.set_index("request_id")
    assert sync.loc[1, "first_scheduled_s"] == 3.5
    assert req.loc[1, "first_scheduled_s"] == 4.5
    assert req.loc[1, "first_token_s"] == 6.5  # the mixed step 4.5-6.5 s
    assert req.loc[0, "first_token_s"] == 2.0
    # A: 2 + 1.5 (after the prefill) + 1 (ahead) = 4.5, the mixed step to 6.5, then 1.5 (after a
    # mixed step) and 1 s steps. The one to 8 s finished B, the last of the running requests, so
    # the step after it still follows it (`schedules_ahead`): A's 5 steps left are all ahead
    assert req.loc[1, "finish_s"] == 8.0
    assert req.loc[0, "finish_s"] == 6.5 + 1.5 + 1.0 * 5
    assert ahead.summary["sim_overlapped_steps"] == 6


def _equal_runs(a, b):
    pd.testing.assert_frame_equal(a.requests, b.requests, check_exact=True)
    assert np.array_equal(a.itl[0], b.itl[0]) and np.array_equal(a.itl[1], b.itl[1])
    assert a.summary["sim_overlapped_steps"] == b.summary["sim_overlapped_steps"]
    assert a.summary["sim_steps"] == b.summary["sim_steps"]


@pytest.mark.parametrize("num_kv_blocks", [400, 120])  # 120: preemptions, requests waiting
@pytest.mark.parametrize("policy", ["chunked", "prefill_first"])
def test_async_fast_forward_is_exact(prefix_trace, small_config, num_kv_blocks, policy):
    model = async_model()
    runs = [
        run_simulation(
            prefix_trace,
            small_config(num_kv_blocks=num_kv_blocks, policy=policy, async_scheduling=True, fast_forward=ff),
            latency=model,
        )
        for ff in (True, False)
    ]
    _equal_runs(*runs)
    fast, stepped = runs
    assert fast.summary["sim_fast_forwarded_steps"] > 0 and stepped.summary["sim_fast_forwarded_steps"] == 0
    assert 0 < fast.summary["sim_overlapped_steps"] < fast.summary["sim_steps"]
    if num_kv_blocks == 120:
        assert fast.summary["num_preemptions"] > 0


def test_async_chained_steps_equal_waiting_after_every_step(prefix_trace, small_config, monkeypatch):
    from simulator.sim import Replica

    config = small_config(num_replicas=2, router="least_outstanding", async_scheduling=True)
    chained = run_simulation(prefix_trace, config, latency=async_model())
    monkeypatch.setattr(Replica, "chain_steps", False)
    waited = run_simulation(prefix_trace, config, latency=async_model())
    _equal_runs(chained, waited)


def test_async_scheduling_shortens_tpot_on_the_same_model(prefix_trace, small_config):
    """Against the same model run synchronously: decode steps scheduled ahead make TPOT shorter."""
    sync = run_simulation(prefix_trace, small_config(), latency=async_model()).summary
    ahead = run_simulation(prefix_trace, small_config(async_scheduling=True), latency=async_model()).summary
    assert ahead["tpot_mean_s"] < sync["tpot_mean_s"]
    assert ahead["num_finished"] == sync["num_finished"] == 400
    assert "sim_overlapped_steps" not in sync


def test_async_scheduling_must_be_a_bool(qwen06):
    with pytest.raises(ValueError, match="SimConfig.async_scheduling: must be true or false"):
        SimConfig(model=qwen06, async_scheduling="yes")


def test_steps_scheduled_ahead_are_counted_alike_without_sync_terms(prefix_trace, small_config):
    """A model without an overlapped view (the roofline) charges both kinds of step alike, but the
    count of steps scheduled ahead is the same whether they run one by one or fast-forwarded."""
    from simulator.latency.roofline import RooflineModel

    counts = []
    for ff in (True, False):
        config = small_config(async_scheduling=True, fast_forward=ff)
        model = RooflineModel(config.model, config.gpu, config.tensor_parallel_size)
        counts.append(run_simulation(prefix_trace, config, latency=model).summary["sim_overlapped_steps"])
    assert counts[0] == counts[1] > 0, counts


@pytest.mark.parametrize("fast_forward", [True, False])
def test_the_timeline_counts_requests_waiting_in_the_inbox(qwen06, fast_forward):
    """B arrives at 3.2 s and waits in the inbox until the step of 4.5 s is scheduled: the timeline's
    samples at 3.5 s and 4.5 s count it waiting, as the synchronous run's sample at 3.5 s does."""
    config = SimConfig(model=qwen06, num_kv_blocks=64, fast_forward=fast_forward, timeline_interval_s=0.25)
    runs = {
        a: run_simulation(
            _two_requests(), dataclasses.replace(config, async_scheduling=a), latency=step_model()
        ).timeline.set_index("time_s")
        for a in (False, True)
    }
    assert runs[False].loc[[2.0, 3.5, 5.5], "num_waiting"].tolist() == [0, 1, 0]
    assert runs[True].loc[[2.0, 3.5, 4.5, 6.5], "num_waiting"].tolist() == [0, 1, 1, 0]
    assert runs[True].loc[[3.5, 4.5, 6.5], "num_running"].tolist() == [1, 1, 2]


@pytest.mark.parametrize("router", ["round_robin", "least_outstanding"])
@pytest.mark.parametrize("num_kv_blocks", [400, 120])
def test_async_runs_from_a_step_paying_the_host_equal_stepping(
    prefix_trace, small_config, router, num_kv_blocks
):
    """A run whose first step is scheduled after the step before ended (`HostFirstDecodeTimes`):
    the requests, ITL, step counts and capacity use of stepping, on one replica and on two (the
    timeline sampled often, so that runs stop at samples)."""
    model = async_model()
    for replicas in (1, 2):
        runs = []
        for ff in (True, False):
            config = small_config(
                num_replicas=replicas,
                router=router,
                num_kv_blocks=num_kv_blocks,
                async_scheduling=True,
                fast_forward=ff,
                timeline_interval_s=0.05,
            )
            runs.append(simulate_config(prefix_trace, config, latency=model))
        fast, stepped = (collect(r) for r in runs)
        _equal_runs(fast, stepped)
        for a, b in zip(*(r.replicas for r in runs)):
            assert (a.capacity.max_step_tokens, a.capacity.max_running, a.capacity.max_kv_blocks) == (
                b.capacity.max_step_tokens,
                b.capacity.max_running,
                b.capacity.max_kv_blocks,
            )
