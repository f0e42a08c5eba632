"""The shipped H200 replays, re-simulated with the shipped profiles, stay where docs/PERF.md says.

Two engine builds are shipped with Qwen3-0.6B replays: decode through FlashAttention-4 (session 1,
`_fa4decode`: 13 of 14 targets met) and the current engine (Triton split-KV decode, Triton layer
kernels, piecewise CUDA graphs for prefill and mixed steps; replays at x1, x5 and twice at x8 from
one calibration run): what each meets and misses is pinned here so that a change shows either way,
and explained in docs/PERF.md. The current engine's profiles carry host floors per step kind; the
`_fa4decode` profile has none (fitted before them: its linear fits alone, as before)."""

from pathlib import Path

import pytest

from simulator.validate import TARGETS, validate_run

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "simulator/profiles"
RUNS = ROOT / "simulator/data/validation"


def errors(run: str, profile: str):
    v = validate_run(RUNS / run, PROFILES / profile)
    return v, v.table.set_index("metric")


def misses(table) -> set[str]:
    return {m for m in TARGETS if not table.loc[m, "ok"]}


@pytest.mark.parametrize("load,allowed_misses", [("heavy", set()), ("light", {"ttft_p99_s"})])
def test_fa4_decode_replays_within_targets(load, allowed_misses):
    v, table = errors(f"h200_qwen3-0.6b_bs16_fa4decode_{load}", "qwen3-0.6b_h200_tp1_bs16_fa4decode.json")
    assert misses(table) <= allowed_misses, table
    assert abs(table.loc["ttft_p99_s", "rel_error"]) < 0.2
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.1


def test_current_engine_mid_load_replay():
    """x5 (no preemption, batches of tens): every target met (docs/PERF.md, session 5; with host
    floors TTFT p50 +4.4 %, +2.8 % without)."""
    v, table = errors("h200_qwen3-0.6b_bs16_mid", "qwen3-0.6b_h200_tp1_bs16.json")
    assert not misses(table), table
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.1  # 7.3 % measured


def test_current_engine_heavy_replays():
    """x8, past saturation (preemptions, a queue that builds): the same window served twice in a row
    by one engine gave real TTFT p50 0.87 s and 0.40 s. One simulation sits between them: the second
    run meets all but TTFT p50 (+22 %), the first only throughput and TPOT (TTFT p50 -44 %)."""
    _, first = errors("h200_qwen3-0.6b_bs16_heavy", "qwen3-0.6b_h200_tp1_bs16.json")
    _, second = errors("h200_qwen3-0.6b_bs16_heavy2", "qwen3-0.6b_h200_tp1_bs16.json")
    assert misses(second) <= {"ttft_p50_s"}, second
    assert 0.1 < second.loc["ttft_p50_s", "rel_error"] < 0.35, second
    assert {"throughput_rps", "tpot_mean_s"}.isdisjoint(misses(first)), first
    assert -0.55 < first.loc["ttft_p50_s", "rel_error"] < -0.3, first
    assert first.loc["ttft_p50_s", "sim"] == second.loc["ttft_p50_s", "sim"]  # one simulated run
    assert first.loc["ttft_p50_s", "real"] > 2 * second.loc["ttft_p50_s", "real"]


def test_current_engine_light_replay():
    """Light load: throughput, TPOT, p99 E2E and, since the profile's host floors (small prefill and
    mixed steps take at least 7.6 / 5.3 ms), p50 TTFT met (-8.2 %; -12.9 % without floors). Still
    missed: p50 E2E (-6.1 %) and p99 TTFT (-14.5 %), both moved by one 330 ms engine stall (a decode
    step of the real run) that four requests in flight sat through."""
    v, table = errors("h200_qwen3-0.6b_bs16_light", "qwen3-0.6b_h200_tp1_bs16.json")
    assert misses(table) == {"e2e_p50_s", "ttft_p99_s"}, table
    assert -0.1 < table.loc["ttft_p50_s", "rel_error"] < -0.07, table
    assert -0.07 < table.loc["e2e_p50_s", "rel_error"] < -0.05, table
    assert -0.16 < table.loc["ttft_p99_s", "rel_error"] < -0.13, table
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.1  # 6.7 % measured


@pytest.mark.parametrize(
    "load,allowed_misses,ttft_p99", [("x2", set(), (-0.03, 0.0)), ("x3", set(), (-0.04, -0.01)),
                                     ("light", {"ttft_p99_s"}, (-0.13, -0.1))]
)  # fmt: skip
def test_qwen3_8b_replays(load, allowed_misses, ttft_p99):
    """Qwen3-8B, block 16, profile and replays from one calibration run (session 5): x2 and x3 (past
    saturation: 137 preemptions, TTFT p50 2.3 s) meet every target; light load all but p99 TTFT
    (-11.8 %; -10.1 % without host floors: the p99 of 301 requests rests on the few slowest first
    tokens, and the floors move the simulated one from 162.4 to 159.2 ms, real 180.5 ms)."""
    v, table = errors(f"h200_qwen3-8b_bs16_{load}", "qwen3-8b_h200_tp1_bs16.json")
    assert misses(table) == allowed_misses, table
    others = [m for m in TARGETS if m != "ttft_p99_s"]
    assert (table.loc[others, "rel_error"].abs() < 0.03).all(), table
    assert ttft_p99[0] < table.loc["ttft_p99_s", "rel_error"] < ttft_p99[1], table
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.05  # 2.9-3.8 % measured
