"""Cost functions, SLO objectives, the plan search (cheapest feasible configuration) and the capacity
search (highest sustainable rate), on synthetic evaluators and on the simulator with a stub latency."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from plan_helpers import StubByGpu, one_token_trace

from simulator.latency.gpus import GPUS_JSON, get_gpu
from simulator.plan import (
    Objective,
    Option,
    cost_per_hour,
    cost_per_million_tokens,
    failures,
    find_capacity,
    find_plan,
    format_capacity,
    format_plan,
    parse_objectives,
    plan_options,
    search_max_scale,
    violations,
)
from simulator.sweep import PointRunner, RunContext

PRICES = {
    name: g["price_per_hour_usd"] for name, g in json.loads(Path(GPUS_JSON).read_text())["gpus"].items()
}


# ---- cost -----------------------------------------------------------------------------------------------


def test_cost_per_hour_reads_the_price_table():
    assert cost_per_hour("h100", 4) == pytest.approx(4 * PRICES["H100-SXM"])
    assert cost_per_hour("H200", 0) == 0.0
    with pytest.raises(ValueError, match="num_gpus"):
        cost_per_hour("H200", -1)
    with pytest.raises(ValueError, match="unknown GPU"):
        cost_per_hour("H900", 1)


def test_cost_per_million_tokens():
    # $/h x GPUs / (tok/s x 3600) x 1e6
    assert cost_per_million_tokens("H200", 2, 1000.0) == pytest.approx(2 * PRICES["H200-SXM"] / 3.6)
    assert cost_per_million_tokens(get_gpu("a100"), 1, 3600.0) == pytest.approx(
        PRICES["A100-80GB-SXM"] / 3600 * 1e6 / 3600
    )
    assert cost_per_million_tokens("H200", 1, 0.0) == math.inf
    with pytest.raises(ValueError, match="tokens_per_s"):
        cost_per_million_tokens("H200", 1, -5.0)


# ---- objectives ---------------------------------------------------------------------------------------


def test_parse_objectives():
    assert parse_objectives("ttft_p99=2s, tpot_p99=80ms") == (
        Objective("ttft", "p99", 2.0),
        Objective("tpot", "p99", 0.08),
    )
    assert parse_objectives("ttft=500ms,e2e_mean=30") == (
        Objective("ttft", "p99", 0.5),
        Objective("e2e", "mean", 30.0),
    )
    for bad, match in [
        ("ttft_p95=1s", "unknown objective"),
        ("itl=1s", "unknown objective"),
        ("ttft", "NAME=VALUE"),
        ("", "at least one"),
        ("ttft=fast", "no number"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_objectives(bad)


def test_violations_say_which_objective_failed_by_how_much():
    objs = parse_objectives("ttft_p99=2s,tpot_p99=80ms")
    ok = {
        "num_requests": 10,
        "num_finished": 10,
        "num_truncated": 0,
        "ttft_p99_s": 2.0,
        "tpot_p99_s": float("nan"),
    }
    assert violations(ok, objs) == []  # at the limit passes; NaN (no decode tokens) is not applicable
    bad = {**ok, "ttft_p99_s": 3.1, "tpot_p99_s": 0.1}
    assert [str(v) for v in violations(bad, objs)] == [
        "ttft_p99 3.1s > 2s (+55%)",
        "tpot_p99 100ms > 80ms (+25%)",
    ]
    short = {**ok, "num_finished": 8, "num_truncated": 1}
    assert [str(v) for v in violations(short, objs)] == [
        "3 of 10 requests not served (rejected or cut short)"
    ]


# ---- plan: the replica search on a synthetic evaluator ------------------------------------------------------


def synthetic(need: dict[tuple[str, int], int], calls: list | None = None):
    """Rows where (gpu, tp) meets ttft_p99 <= 1s from need[(gpu, tp)] replicas on (monotone)."""

    def evaluate(points):
        rows = []
        for p in points:
            if calls is not None:
                calls.append((p["gpu"], p["tp"], p["replicas"]))
            n = need.get((p["gpu"], p["tp"]))
            if n is None:
                rows.append({"error": f"tp={p['tp']} does not fit"})
                continue
            ttft = 0.5 if p["replicas"] >= n else 1.0 + (n - p["replicas"]) * 0.5
            rows.append({"num_requests": 10, "num_finished": 10, "num_truncated": 0, "ttft_p99_s": ttft})
        return rows

    return evaluate


@pytest.mark.parametrize("need", range(1, 17))
def test_replica_search_finds_the_fewest_replicas_exactly(need):
    calls: list = []
    opt = Option("H200-SXM", 1, 16, 256, 16384)
    res = find_plan(
        synthetic({("H200-SXM", 1): need}, calls), [opt], parse_objectives("ttft=1s"), max_gpus=16
    )
    assert res.best is not None and res.best.replicas == need and res.best.num_gpus == need
    assert len(calls) <= 2 * math.ceil(math.log2(need)) + 2  # galloping + bisection, not a linear scan
    assert res.best.cost_per_hour == pytest.approx(need * PRICES["H200-SXM"])


def test_plan_ranks_by_cost_and_prunes_what_cannot_be_cheaper():
    objs = parse_objectives("ttft=1s")
    # H100 needs 3 x tp1 ($8.07); H200 needs 2 x tp1 ($7.18); tp2 options need 1 replica (2 GPUs).
    need = {("H100-SXM", 1): 3, ("H200-SXM", 1): 2, ("H100-SXM", 2): 1, ("H200-SXM", 2): 1}
    options = plan_options(["H100", "H200"], [1, 2, 4], [16], [256], [16384])
    calls: list = []
    res = find_plan(synthetic(need, calls), options, objs, max_gpus=4, rate=5.0)
    best = res.best
    assert (best.option.gpu, best.option.tp, best.replicas) == ("H100-SXM", 2, 1)
    by = {(c.option.gpu, c.option.tp): c for c in res.candidates}
    assert by[("H200-SXM", 2)].status == "feasible"
    assert "costs $1.80/h more (+33%" in by[("H200-SXM", 2)].reason
    assert by[("H100-SXM", 4)].status == "invalid" and "does not fit" in by[("H100-SXM", 4)].reason
    # H200 tp1 fails at 1 replica; 2 replicas ($7.18) would not beat the best ($5.38).
    assert by[("H200-SXM", 1)].status == "pruned"
    assert "fails with 1 replica (ttft_p99 1.5s > 1s (+50%))" in by[("H200-SXM", 1)].reason
    assert [c.status for c in res.candidates][:2] == ["best", "feasible"]
    assert res.num_simulations == len(calls) < 3 * len(options)
    text = format_plan(res, "tr", "m")
    assert "Best: 1 x (H100-SXM tp=2" in text and "[pruned]" in text


NEED = {("H100-SXM", 1): 3, ("H200-SXM", 1): 2, ("H100-SXM", 2): 1, ("H200-SXM", 2): 1}


def test_small_waves_try_cheap_options_first_and_prune_the_rest():
    options = plan_options(["H100", "H200"], [1, 2, 4], [16], [256], [16384])
    calls: list = []
    res = find_plan(synthetic(NEED, calls), options, parse_objectives("ttft=1s"), max_gpus=4, wave_size=1)
    assert (res.best.option.gpu, res.best.option.tp, res.best.replicas) == ("H100-SXM", 2, 1)
    # In cost order: H100x1 $2.69 (fails), H200x1 $3.59 (fails), H100x2 $5.38 (fails; ties with H100 tp2
    # x1, listed first), H100 tp2 x1 $5.38 (passes: best); every other proposal costs more.
    assert calls == [("H100-SXM", 1, 1), ("H200-SXM", 1, 1), ("H100-SXM", 1, 2), ("H100-SXM", 2, 1)]
    by = {(c.option.gpu, c.option.tp): c for c in res.candidates}
    assert by[("H200-SXM", 2)].status == "pruned"
    assert by[("H200-SXM", 2)].reason == "one replica costs $7.18/h, more than the best"
    assert by[("H100-SXM", 1)].reason.endswith("3 would cost $8.07/h, not cheaper than the best")
    assert by[("H200-SXM", 1)].reason.endswith("2 would cost $7.18/h, not cheaper than the best")


def test_exhaustive_search_finds_every_options_fewest_replicas():
    options = plan_options(["H100", "H200"], [1, 2], [16], [256], [16384])
    res = find_plan(synthetic(NEED), options, parse_objectives("ttft=1s"), max_gpus=4, prune=False)
    got = {(c.option.gpu, c.option.tp): (c.status, c.replicas) for c in res.candidates}
    assert got == {
        ("H100-SXM", 2): ("best", 1),
        ("H200-SXM", 1): ("feasible", 2),
        ("H200-SXM", 2): ("feasible", 1),
        ("H100-SXM", 1): ("feasible", 3),
    }
    assert [c.cost_per_hour for c in res.candidates] == sorted(c.cost_per_hour for c in res.candidates)


def test_infeasible_plan_names_the_closest_point_and_what_failed():
    need = {("H200-SXM", 1): 9}
    res = find_plan(
        synthetic(need), [Option("H200-SXM", 1, 16, 256, 16384)], parse_objectives("ttft=1s"), max_gpus=4
    )
    assert res.best is None
    (c,) = res.candidates
    assert c.status == "infeasible" and c.replicas == 4
    assert c.reason == "fails with 4 replicas, the most max_gpus=4 allows: ttft_p99 3.5s > 1s (+250%)"
    assert res.closest.replicas == 4
    assert "Infeasible" in format_plan(res) and "closest: 4 x" in format_plan(res)


# ---- plan through the simulator, with a stub latency model ----------------------------------------------------


def stub_plan(step_s: dict[str, float], max_gpus: int = 4, n: int = 100, slo: str = "ttft_p99=500ms"):
    """10 req/s of one-token requests; SLO ttft_p99 <= 0.5 s; one request per step (max_num_seqs=1)."""
    trace = one_token_trace(rate=10.0, n=n)
    ctx = RunContext(trace, "qwen3-0.6b", "roofline", slo, "const", latency=StubByGpu(step_s))
    options = plan_options(list(step_s), [1], [16], [1], [16384])
    with PointRunner(ctx, workers=1) as runner:
        return find_plan(
            runner.run, options, parse_objectives(slo), max_gpus, 10.0, {"router": "round_robin"}
        )


def test_plan_picks_the_cheaper_of_two_feasible_gpus():
    # Both meet the SLO with one replica; H100 is cheaper per hour.
    res = stub_plan({"H100": 0.06, "H200": 0.04})
    assert (res.best.option.gpu, res.best.replicas) == ("H100-SXM", 1)
    assert res.best.row["ttft_p99_s"] == pytest.approx(0.06)
    (other,) = res.candidates[1:]
    assert other.option.gpu == "H200-SXM" and other.status == "feasible"
    extra = PRICES["H200-SXM"] - PRICES["H100-SXM"]
    assert other.reason.startswith(f"costs ${extra:.2f}/h more (+{extra / PRICES['H100-SXM'] * 100:.0f}%")


def test_plan_prefers_one_fast_gpu_to_two_cheap_ones():
    # H100 at 0.15 s/request cannot keep up with 10 req/s alone; H200 at 0.08 s can.
    res = stub_plan({"H100": 0.15, "H200": 0.08})
    assert (res.best.option.gpu, res.best.replicas) == ("H200-SXM", 1)
    (h100,) = res.candidates[1:]
    assert h100.status == "pruned" and h100.replicas == 1
    # Request i waits i * (0.15 - 0.1) s: p99 over 100 requests is 0.15 + 98.01 * 0.05.
    assert h100.failed[0].value == pytest.approx(5.0505)
    assert "ttft_p99 5.05s > 500ms (+910%)" in h100.reason
    assert f"2 would cost ${2 * PRICES['H100-SXM']:.2f}/h" in h100.reason


def test_plan_does_not_pick_a_cheaper_gpu_that_falls_behind():
    # H100 at 0.15 s/request serves 1 / 0.15 = 6.67 req/s of the 10 offered; over 100 requests its
    # ttft_p99 (5.05 s, as above) is still within 6 s: on the latency objective alone it would be the
    # best (one H100 is cheaper than one H200). Its queue grows for as long as the traffic lasts, so
    # it is infeasible; one H200 (12.5 req/s) keeps up and is the best.
    res = stub_plan({"H100": 0.15, "H200": 0.08}, slo="ttft_p99=6s")
    (h100,) = res.candidates[1:]
    assert violations(h100.row, parse_objectives("ttft_p99=6s")) == []  # the objective alone: met
    assert PRICES["H100-SXM"] < PRICES["H200-SXM"]
    assert (res.best.option.gpu, res.best.replicas) == ("H200-SXM", 1)
    assert h100.status == "pruned" and h100.replicas == 1
    # offered: 100 requests over 9.9 s of arrivals; served from the mean wait 49.5 x 0.05 s
    # (simulator.load): 10.1 / (1 + 2 x 2.475 / 9.9) = 6.73 req/s.
    (behind,) = h100.failed
    assert behind.objective is None and behind.load.verdict == "overloaded"
    assert behind.load.offered_rps == pytest.approx(100 / 9.9)
    assert behind.load.served_rps == pytest.approx(100 / 9.9 / 1.5)
    assert h100.reason == (
        "fails with 1 replica (overloaded: serves 6.73 of 10.1 req/s offered); "
        f"2 would cost ${2 * PRICES['H100-SXM']:.2f}/h, not cheaper than the best"
    )
    text = format_plan(res, "const", "m")
    assert "Best: 1 x (H200-SXM tp=1" in text
    assert "ttft_p99 80ms (<= 6s)" in text and "keeps up: serves 10.1 of 10.1 req/s offered" in text
    assert (
        "[pruned] 1 x (H100-SXM tp=1 block=16 seqs=1 batched_tokens=16384) $2.69/h [ConstantLatency]: "
        in text
    )
    assert "fails with 1 replica (overloaded: serves 6.73 of 10.1 req/s offered)" in text


def test_plan_with_only_runs_that_fall_behind_is_infeasible():
    res = stub_plan({"H100": 0.15}, max_gpus=1, slo="ttft_p99=6s")
    assert res.best is None
    (c,) = res.candidates
    assert c.status == "infeasible" and c.reason == (
        "fails with 1 replica, the most max_gpus=1 allows: overloaded: serves 6.73 of 10.1 req/s offered"
    )
    text = format_plan(res)
    assert "Infeasible: no configuration meets the SLOs and keeps up with the rate within 1 GPUs." in text
    assert "$2.69/h [ConstantLatency]: overloaded: serves 6.73 of 10.1 req/s offered" in text  # the closest


def test_failures_add_falling_behind_to_the_violations():
    objs = parse_objectives("ttft_p99=2s")
    keeps = {"num_requests": 100, "num_finished": 100, "num_truncated": 0, "ttft_p99_s": 1.0}
    keeps |= {"queue_mean_s": 0.0, "arrival_span_s": 10.0}
    assert failures(keeps, objs) == []
    # Mean wait 5 s over 10 s of arrivals: served = 10 / (1 + 2 x 5 / 10) = 5 req/s of 10.
    behind = {**keeps, "queue_mean_s": 5.0}
    assert violations(behind, objs) == []
    assert [str(v) for v in failures(behind, objs)] == ["overloaded: serves 5 of 10 req/s offered"]
    assert failures(behind, objs)[0].ratio == pytest.approx(2.0)  # offered / served
    # 0.5 s: served 10 / 1.1 = 9.09 req/s, below 95 % of offered: near saturation, also behind.
    near = {**keeps, "queue_mean_s": 0.5, "ttft_p99_s": 3.0}
    assert [str(v) for v in failures(near, objs)] == [
        "ttft_p99 3s > 2s (+50%)",
        "near saturation: serves 9.09 of 10 req/s offered",
    ]
    assert failures({**behind, "arrival_span_s": 0.0}, objs) == []  # no span: the load is not known


def test_infeasible_stub_plan_reports_the_failed_slo():
    res = stub_plan({"H100": 0.15}, max_gpus=1)
    assert res.best is None
    assert res.closest.failed[0].value == pytest.approx(5.0505)
    assert "ttft_p99 5.05s > 500ms (+910%)" in format_plan(res)


# ---- capacity ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("parallel", [1, 3])
@pytest.mark.parametrize("true_max", [3.7, 0.013, 1.0])
def test_scale_search_brackets_the_true_max(true_max, parallel):
    seen: list[float] = []

    def feasible(xs):
        seen.extend(xs)
        return [x <= true_max for x in xs]

    s = search_max_scale(feasible, tolerance=0.02, parallel=parallel)
    assert s.lo <= true_max < s.hi and s.hi / s.lo <= 1.02
    assert len(seen) == len(s.evaluations) <= 30


def test_scale_search_reports_unbounded_ends():
    up = search_max_scale(lambda xs: [True] * len(xs), max_scale=64)
    assert up.lo == 64 and up.hi is None
    down = search_max_scale(lambda xs: [False] * len(xs), min_scale=1 / 8)
    assert down.lo is None and down.hi == 1 / 8


def test_capacity_of_a_stub_model_is_within_tolerance():
    # One replica, 0.08 s per request, 100 requests 1/x s apart: ttft_p99 = 0.08 + 98.01 (0.08 - 1/x)
    # <= 0.5 s  <=>  x <= 1 / (0.08 - 0.42 / 98.01) = 13.21. Above 1 / 0.08 = 12.5 the queue grows:
    # request i waits i (0.08 - 1/x), the mean wait over the 99/x s of arrivals gives served / offered
    # = 1 / (0.08 x) (simulator.load), below 95 % from x = 1 / (0.95 x 0.08) = 13.16 on, where the
    # run falls behind while its ttft_p99 is still within 0.5 s.
    slo_max = 1.0 / (0.08 - 0.42 / 98.01)
    true_max = 1.0 / (0.95 * 0.08)
    assert true_max < slo_max
    trace = one_token_trace(rate=1.0, n=100)
    ctx = RunContext(
        trace, "qwen3-0.6b", "roofline", "ttft_p99=500ms", "const", latency=StubByGpu({"H200": 0.08})
    )
    point = {"gpu": "H200", "max_num_seqs": 1}
    base_rate = len(trace) / trace.duration_s
    with PointRunner(ctx, workers=1) as runner:
        res = find_capacity(runner.run, point, parse_objectives("ttft_p99=500ms"), base_rate, tolerance=0.01)
    assert res.max_scale <= true_max < res.search.hi and res.search.hi / res.max_scale <= 1.01
    assert res.max_rate == pytest.approx(base_rate * res.max_scale)
    assert res.row["ttft_p99_s"] <= 0.5 and res.fail_row["ttft_p99_s"] <= 0.5
    (behind,) = failures(res.fail_row, parse_objectives("ttft_p99=500ms"))
    offered = len(trace) / (trace.duration_s / res.search.hi)
    assert behind.load.verdict == "near saturation"
    assert behind.load.offered_rps == pytest.approx(offered)
    assert behind.load.served_rps == pytest.approx(offered / (0.08 * res.search.hi))
    tok_s = res.row["output_tok_s"]
    assert res.cost_per_million_output_tokens == pytest.approx(PRICES["H200-SXM"] / (tok_s * 3600) * 1e6)
    text = format_capacity(res, "stub")
    assert "max sustainable rate" in text and "per million output tokens" in text
    assert (
        f"  above it: near saturation: serves {behind.load.served_rps:.3g} of {offered:.3g} req/s offered"
        in text
    )
    at = res.row
    served = len(trace) / (trace.duration_s / res.max_scale) / (0.08 * res.max_scale)
    assert at["num_finished"] == 100 and f"keeps up: serves {served:.3g} of" in text
