"""Timeline rows go at the first step end at least `timeline_interval_s` after the row before, inside
fast-forwarded runs too (`Replica._sample_run`): the fast-forwarded simulation's timeline and its
summary fields are the stepped simulation's, wherever runs stop (they used to differ: a row went at
the first segment end)."""

import numpy as np
import pandas as pd
import pytest

from simulator.latency.base import StepTime
from simulator.latency.roofline import RooflineModel
from simulator.run import run_simulation

TIMELINE_KEYS = ("kv_usage_mean", "kv_usage_max", "queue_len_max")


class GridModel:
    """A latency model whose step times are whole multiples of 1/256 s (at least one): with arrivals
    on a coarser grid, step ends and arrivals tie."""

    def __init__(self, inner) -> None:
        self.inner = inner

    @staticmethod
    def _grid(t: float) -> float:
        return max(1.0, round(t * 2048)) / 256

    def decode_step_time(self, num_seqs: int, num_context_tokens: int, max_seq_len: int) -> float:
        return self._grid(self.inner.decode_step_time(num_seqs, num_context_tokens, max_seq_len))

    def predict(self, batch) -> StepTime:
        t = self._grid(self.inner.predict(batch).total)
        return StepTime(t, 0.0, 0.0, 0.0, t)


def _runs(trace, config_of, monkeypatch, grid: bool = False):
    """(fast-forwarded, stepped) runs, and how many runs the first took rows inside."""
    from simulator.sim import Replica

    inside = []
    sample_run = Replica._sample_run
    monkeypatch.setattr(Replica, "_sample_run", lambda self, span: inside.append(1) or sample_run(self, span))
    out = []
    for ff in (True, False):
        config = config_of(fast_forward=ff)
        latency = RooflineModel(config.model, config.gpu, config.tensor_parallel_size)
        out.append(run_simulation(trace, config, latency=GridModel(latency) if grid else latency))
        if ff:
            runs_inside = len(inside)
    return out[0], out[1], runs_inside


def _same_timeline(fast, stepped) -> None:
    pd.testing.assert_frame_equal(fast.requests, stepped.requests, check_exact=True)
    assert np.array_equal(fast.itl[1], stepped.itl[1])
    assert fast.summary["sim_steps"] == stepped.summary["sim_steps"]
    pd.testing.assert_frame_equal(fast.timeline, stepped.timeline, check_exact=True)
    assert [fast.summary[k] for k in TIMELINE_KEYS] == [stepped.summary[k] for k in TIMELINE_KEYS]


@pytest.mark.parametrize("interval", [0.05, 1.0])
@pytest.mark.parametrize(
    "replicas,router,async_scheduling,num_kv_blocks",
    [
        (1, "round_robin", False, 400),
        (1, "round_robin", True, 400),
        (4, "least_outstanding", False, 120),  # runs held past other replicas' arrivals, capped
        (2, "prefix_aware", False, 400),
        (3, "round_robin", True, 120),
    ],
)
def test_fast_forwarded_timeline_is_stepping_s(
    prefix_trace, small_config, monkeypatch, interval, replicas, router, async_scheduling, num_kv_blocks
):
    def config_of(**kw):
        return small_config(
            num_replicas=replicas,
            router=router,
            async_scheduling=async_scheduling,
            num_kv_blocks=num_kv_blocks,
            timeline_interval_s=interval,
            **kw,
        )

    fast, stepped, runs_inside = _runs(prefix_trace, config_of, monkeypatch)
    _same_timeline(fast, stepped)
    assert runs_inside > 0 and len(fast.timeline) >= 10


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rows_at_arrival_ties_are_stepping_s(prefix_trace, small_config, monkeypatch, async_scheduling):
    """Arrivals on a 1/32 s grid, step times on a 1/256 s grid: rows land on arrival times. A request
    arriving at a row's own time is not counted waiting in the inbox (async), whichever of the two
    SimPy runs first."""
    df = prefix_trace.df.copy()
    df["arrival_s"] = np.floor(df["arrival_s"] * 32) / 32
    trace = prefix_trace.with_frame(df)

    def config_of(**kw):
        return small_config(async_scheduling=async_scheduling, timeline_interval_s=0.05, **kw)

    fast, stepped, runs_inside = _runs(trace, config_of, monkeypatch, grid=True)
    _same_timeline(fast, stepped)
    assert runs_inside > 0
    arrivals = set(df["arrival_s"])
    assert sum(t in arrivals for t in fast.timeline["time_s"]) > 10  # rows that tie with an arrival
