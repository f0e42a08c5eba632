"""The summary's load line: offered against served request rate and a verdict (simulator.load), the
same figures the dashboard shows, from the span of the requests' arrivals."""

from __future__ import annotations

import math

import pytest

from simulator.latency.roofline import RooflineModel
from simulator.load import KEEPS_UP, NEAR_SATURATION, NO_LOAD, OVERLOADED, Load, load_verdict, run_load
from simulator.report import format_summary
from simulator.run import run_simulation
from traces.transforms import scale_rate


@pytest.mark.parametrize("scale,verdict", [(0.25, KEEPS_UP), (40.0, OVERLOADED)])
def test_the_summary_says_whether_the_configuration_keeps_up(prefix_trace, small_config, scale, verdict):
    cfg = small_config()
    trace = scale_rate(prefix_trace, scale)
    summary = run_simulation(trace, cfg, latency=RooflineModel(cfg.model, "H200")).summary
    a = trace.df["arrival_s"]
    assert summary["arrival_span_s"] == float(a.max()) - float(a.min())
    load = load_verdict(summary, summary["arrival_span_s"])
    assert load.verdict == verdict
    assert load.offered_rps == pytest.approx(len(trace) / summary["arrival_span_s"], rel=1e-12)
    line = f"offered {load.offered_rps:,.2f} req/s, served {load.served_rps:,.2f} req/s ({verdict})"
    assert line in format_summary(summary)


def test_falling_behind_is_near_saturation_or_overloaded():
    """`Load.falls_behind`, the rule plan, capacity and the dashboard share, and its words."""
    assert [Load(10.0, 10.0 * r, v).falls_behind for r, v in ((1.0, KEEPS_UP), (0.9, NEAR_SATURATION))] == [
        False,
        True,
    ]
    assert Load(10.0, 5.0, OVERLOADED).falls_behind and not Load(math.nan, math.nan, NO_LOAD).falls_behind
    assert (
        Load(100 / 9.9, 100 / 9.9 / 1.5, OVERLOADED).describe()
        == "overloaded: serves 6.73 of 10.1 req/s offered"
    )
    # Over the summary's own span: 100 requests in 10 s, mean wait 0.5 s -> 10 / 1.1 req/s served.
    summary = {"num_requests": 100, "num_finished": 100, "queue_mean_s": 0.5, "arrival_span_s": 10.0}
    assert run_load(summary) == load_verdict(summary, 10.0)
    assert run_load(summary).describe() == "near saturation: serves 9.09 of 10 req/s offered"
    assert run_load({**summary, "arrival_span_s": None}).verdict == NO_LOAD


def test_no_load_line_for_a_single_request():
    assert not any(line.startswith("load ") for line in format_summary(_one_request()).splitlines())


def _one_request() -> dict:
    keys = ("ttft", "tpot", "itl", "e2e", "queue")
    stats = {f"{k}_{s}_s": 0.1 for k in keys for s in ("mean", "p50", "p90", "p99")}
    return {
        **stats,
        "num_requests": 1,
        "num_finished": 1,
        "num_rejected": 0,
        "num_truncated": 0,
        "num_preemptions": 0,
        "throughput_rps": 1.0,
        "output_tok_s": 10.0,
        "arrival_span_s": 0.0,
        "duration_s": 1.0,
    }
