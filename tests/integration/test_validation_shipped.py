"""The shipped H200 replays, re-simulated with the shipped profiles, stay where docs/PERF.md says.

Two engine builds are shipped with Qwen3-0.6B replays: decode through FlashAttention-4 (session 1,
`_fa4decode`: 13 of 14 targets met) and the current engine (one-row decode through the fused Triton
GEMV, Triton split-KV decode, Triton layer kernels, piecewise CUDA graphs for prefill and mixed
steps; at block 16 two light windows, x5 and x8, at block 256 light and x8, each block from one
calibration run): what each meets and misses is pinned here so that a change shows either way, and
explained in docs/PERF.md. The current engine's profiles carry host floors per step kind; the
`_fa4decode` profile has none (fitted before them: its linear fits alone, as before)."""

from pathlib import Path

import pytest

from simulator.latency.profile import LatencyProfile
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


@pytest.mark.parametrize(
    "run,expected_misses",
    [
        ("bs16_light", set()),
        ("bs16_mid", set()),
        ("bs16_lightb", {"tpot_mean_s", "e2e_p99_s", "ttft_p50_s"}),
        ("bs16_heavy", {"e2e_p50_s", "ttft_p50_s", "ttft_p99_s"}),
        ("bs256_light", {"tpot_mean_s"}),
        ("bs256_heavy", {"ttft_p50_s"}),
    ],
)
def test_current_engine_replays(run, expected_misses):
    """The current engine (one-row GEMV decode, Triton split-KV decode, piecewise prefill graphs):
    blocks 16 and 256 each calibrated with their replays in one device call (session 6). Block 16:
    the light window 600-660 s and x5 meet every target; a second light window (1200-1260 s) misses
    TPOT (+4.5 %), p99 E2E (+9.6 %) and p50 TTFT (+13.8 %); x8 (123 preemptions) misses p50 E2E
    (+9.9 %) and TTFT (p50 +20.4 %, p99 +17.4 %). Block 256: light misses TPOT (-4.0 %), x8 (84
    preemptions) p50 TTFT (+64 % of a short real p50). docs/PERF.md has the tables."""
    block = run.split("_")[0]
    v, table = errors(f"h200_qwen3-0.6b_{run}", f"qwen3-0.6b_h200_tp1_{block}.json")
    assert misses(table) == expected_misses, table
    assert abs(table.loc["throughput_rps", "rel_error"]) < 0.015, table  # -1.4 .. +0.1 % measured
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.12  # 3.8-11.2 % measured


def test_one_row_decode_is_fitted_apart():
    """One-row decode steps take the fused GEMV path (~0.4 ms faster than the linear trend of larger
    batches): the multi_row feature carries that step in both current 0.6B profiles."""
    for block in (16, 256):
        model = LatencyProfile.load(PROFILES / f"qwen3-0.6b_h200_tp1_bs{block}.json").to_latency_model()
        coefficient = model.decode.as_dict()["multi_row"]
        assert 3e-4 < coefficient < 5e-4, (block, coefficient)
        assert model.decode_step_time(2, 200, 101) - model.decode_step_time(1, 100, 101) > 3e-4


@pytest.mark.parametrize(
    "load,allowed_misses,ttft_p99", [("x2", set(), (-0.03, 0.0)), ("x3", set(), (-0.04, -0.01)),
                                     ("light", {"ttft_p99_s"}, (-0.14, -0.1))]
)  # fmt: skip
def test_qwen3_8b_replays(load, allowed_misses, ttft_p99):
    """Qwen3-8B, block 16, profile and replays from one calibration run (session 5): x2 and x3 (past
    saturation: 137 preemptions, TTFT p50 2.3 s) meet every target; light load all but p99 TTFT
    (-12.5 %; -10.1 % without host floors and the multi_row feature: the p99 of 301 requests rests
    on the few slowest first tokens, real 180.5 ms)."""
    v, table = errors(f"h200_qwen3-8b_bs16_{load}", "qwen3-8b_h200_tp1_bs16.json")
    assert misses(table) == allowed_misses, table
    others = [m for m in TARGETS if m != "ttft_p99_s"]
    assert (table.loc[others, "rel_error"].abs() < 0.03).all(), table
    assert ttft_p99[0] < table.loc["ttft_p99_s", "rel_error"] < ttft_p99[1], table
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.05  # 2.9-3.8 % measured


def test_step_residuals_compare_with_the_time_the_profile_was_fitted_on():
    """The shipped profiles fit wall_time_s: residuals are against it, not against gpu_time_s (which
    the replays' records also carry); a model with no profile falls back to gpu_time_s."""
    from simulator.latency.gpus import get_gpu
    from simulator.latency.roofline import RooflineModel
    from simulator.models import resolve_model
    from simulator.validate import measured_column

    v, _ = errors("h200_qwen3-0.6b_bs256_light", "qwen3-0.6b_h200_tp1_bs256.json")
    steps = v.steps
    assert steps["gpu_time_s"].notna().all() and (steps["gpu_time_s"] != steps["wall_time_s"]).all()
    assert (steps["measured_s"] == steps["wall_time_s"]).all()
    roofline = RooflineModel(resolve_model("qwen3-0.6b"), get_gpu("H200"))
    assert measured_column(steps, roofline) == "gpu_time_s"
    assert measured_column(steps.drop(columns="gpu_time_s")) == "wall_time_s"
