"""The band of a plan and of a capacity search: on synthetic evaluators (the note that a cheaper
configuration is inside the band; the rate range brackets the point) and end to end on a shipped
fitted profile."""

from __future__ import annotations

import argparse

import pytest

from simulator import plan_cli
from simulator.plan import (
    CapacityBand,
    CapacityResult,
    Option,
    capacity_band,
    cheaper_failures,
    find_capacity,
    find_plan,
    format_capacity_band,
    format_plan_band,
    parse_objectives,
    plan_band,
)

OBJECTIVES = parse_objectives("ttft=1s")


def needs(n: int, scale: tuple[float, float] | None = None):
    """Rows where an option meets ttft_p99 <= 1s from `n` replicas on; `scale`: the factors a band
    run's row names."""

    def evaluate(points):
        rows = []
        for p in points:
            ttft = 0.5 if p["replicas"] >= n else 1.0 + (n - p["replicas"]) * 0.5
            row = {"num_requests": 10, "num_finished": 10, "num_truncated": 0, "ttft_p99_s": ttft}
            if scale is not None:
                row["step_time_scale_decode"], row["step_time_scale_prefill"] = scale
            rows.append(row)
        return rows

    return evaluate


OPTION = Option("H200-SXM", 1, 16, 256, 16384)


def test_cheaper_failures_are_what_the_search_saw_fail_below_the_best():
    result = find_plan(needs(5), [OPTION], OBJECTIVES, max_gpus=8)
    assert result.best.replicas == 5 and result.best.fails_at == 4
    assert cheaper_failures(result) == [(OPTION, 4)]


def test_plan_notes_a_cheaper_configuration_inside_the_band():
    """The point needs 3 replicas; on the optimistic run 2 suffice: the note names them. On the
    pessimistic run the best itself misses."""
    result = find_plan(needs(3), [OPTION], OBJECTIVES, max_gpus=8)
    band = plan_band(result, needs(2, (0.9, 0.8)), needs(4, (1.1, 1.2)))
    assert band.checked == [(OPTION, 2)] and [(o, k) for o, k, _ in band.inside] == [(OPTION, 2)]
    assert band.high_failed and band.low["ttft_p99_s"] == 0.5
    text = format_plan_band(band, result)
    assert "note: 2 x (H200-SXM tp=1 block=16 seqs=256 batched_tokens=16384)" in text
    assert "fails on the point run but meets every objective on the optimistic one" in text
    assert "inside the latency model's error band" in text
    assert (
        "best, pessimistic (steps x1.100 decode, x1.200 prefill): ttft_p99 1.5s; misses ttft_p99 1.5s > 1s"
        in text
    )
    assert "best, optimistic (steps x0.900 decode, x0.800 prefill)" in text


def test_plan_without_a_cheaper_configuration_inside_the_band():
    result = find_plan(needs(3), [OPTION], OBJECTIVES, max_gpus=8)
    band = plan_band(result, needs(3), needs(3))
    assert band.inside == [] and band.high_failed == []
    text = format_plan_band(band, result)
    assert "note:" not in text and "still fail on the optimistic run" in text
    assert "meets every objective" in text


def test_plan_band_of_an_infeasible_plan_tries_the_closest():
    result = find_plan(needs(20), [OPTION], OBJECTIVES, max_gpus=4)
    assert result.best is None and result.closest.replicas == 4
    band = plan_band(result, needs(4), needs(20))
    assert band.closest_passes and band.high is None
    assert "the closest, 4 x (H200-SXM" in format_plan_band(band, result)


def rate_limited(true_max: float):
    """Rows meeting ttft_p99 <= 1s up to a rate scale of `true_max`."""

    def evaluate(points):
        return [
            {
                "num_requests": 10,
                "num_finished": 10,
                "num_truncated": 0,
                "ttft_p99_s": 0.5 if p["rate_scale"] <= true_max else 2.0,
                "output_tok_s": 100.0,
            }
            for p in points
        ]

    return evaluate


@pytest.mark.parametrize("parallel", [1, 2])
def test_capacity_range_brackets_the_point(parallel):
    point = {"gpu": "H200"}
    result = find_capacity(
        rate_limited(3.7), point, OBJECTIVES, base_rate=2.0, tolerance=0.02, parallel=parallel
    )
    band = capacity_band(
        result, rate_limited(4.4), rate_limited(3.1), point, tolerance=0.02, parallel=parallel
    )
    lo, hi = band.rate_range(result)
    assert lo <= result.max_rate <= hi
    assert lo == pytest.approx(2.0 * band.high.lo) and band.high.lo <= 3.1 < band.high.hi
    assert hi == pytest.approx(2.0 * band.low.lo) and band.low.lo <= 4.4 < band.low.hi
    assert band.num_simulations == len(band.low.evaluations) + len(band.high.evaluations)
    assert "band: max sustainable rate" in format_capacity_band(band, result)


def test_capacity_range_is_the_hull_when_an_end_is_not_monotone():
    point = {"gpu": "H200"}
    result = find_capacity(rate_limited(3.7), point, OBJECTIVES, base_rate=1.0, tolerance=0.02)
    band = capacity_band(result, rate_limited(3.0), rate_limited(4.0), point, tolerance=0.02)
    lo, hi = band.rate_range(result)
    assert lo <= result.max_rate <= hi and lo <= 3.0 and hi >= 4.0 * 0.98


def test_capacity_band_names_why_there_is_none():
    result = CapacityResult(
        1.0, OBJECTIVES, find_capacity(rate_limited(2), {}, OBJECTIVES, 1.0).search, None, None, "H200-SXM", 1
    )
    assert "band: none (the roofline" in format_capacity_band(
        CapacityBand(note="the roofline's error has not been measured"), result
    )


# ---- end to end: the commands on the shipped H200 profile ----------------------------------------------------


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvplan")
    plan_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_capacity_command_prints_a_rate_range(capsys):
    argv = ["capacity", "--limit", "60", "--slo", "ttft_p99=40ms", "--tolerance", "0.1"]
    assert run([*argv, "--workers", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "band: max sustainable rate" in out and "held-back p90" in out
    assert "pessimistic (steps x1.121 decode, x1.141 prefill)" in out
    assert run([*argv, "--workers", "1", "--quiet", "--no-band"]) == 0
    assert "band:" not in capsys.readouterr().out


def test_plan_command_prints_the_band(capsys):
    argv = ["plan", "--limit", "60", "--rate", "6", "--slo", "ttft_p99=40ms", "--gpus", "H200"]
    assert run([*argv, "--max-gpus", "2", "--tp", "1", "--workers", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "Band (every step time x (1 -/+ e)" in out and "best, pessimistic (steps x1.121" in out


def test_roofline_plan_has_no_band(capsys):
    argv = ["plan", "--limit", "60", "--rate", "6", "--slo", "ttft_p99=2s", "--gpus", "L40S"]
    assert run([*argv, "--max-gpus", "1", "--profile", "roofline", "--workers", "1", "--quiet"]) == 0
    assert "none: the roofline's error has not been measured" in capsys.readouterr().out
