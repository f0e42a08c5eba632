"""The shipped H200 replays, re-simulated with the shipped profiles, stay where docs/PERF.md says.

Two engine builds are shipped with Qwen3-0.6B replays: decode through FlashAttention-4 (session 1,
`_fa4decode`: 13 of 14 targets met) and the current engine (session 9: one-row decode through the
fused Triton GEMV with its weight prefetch, Triton split-KV decode, the KV store fused into q/k norm +
rotary, PDL, piecewise CUDA graphs for prefill and mixed steps; at block 16 two light windows, x5 and
x8 twice, at block 256 light and x8 twice; Qwen3-8B light and x3). What each meets and misses is
pinned here so that a change shows either way, and explained in docs/PERF.md. The current engine's
profiles carry host floors per step kind; the `_fa4decode` profile has none (fitted before them)."""

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


EVERY_LATENCY = {"tpot_mean_s", "e2e_p50_s", "e2e_p99_s", "ttft_p50_s", "ttft_p99_s"}
THROUGHPUT = {"throughput_rps", "output_tok_s"}


@pytest.mark.parametrize(
    "run,expected_misses",
    [
        ("bs16_light", {"tpot_mean_s", "ttft_p50_s", "ttft_p99_s"}),
        ("bs16_lightb", {"ttft_p50_s"}),
        ("bs16_mid", EVERY_LATENCY),
        ("bs16_heavy", EVERY_LATENCY),
        ("bs16_heavyb", EVERY_LATENCY | THROUGHPUT),
        ("bs256_light", {"tpot_mean_s", "e2e_p99_s"}),
        ("bs256_heavy", EVERY_LATENCY | THROUGHPUT),
        ("bs256_heavyb", EVERY_LATENCY),
    ],
)
def test_current_engine_replays(run, expected_misses):
    """The current engine, session 9: each block size's replays served in one device call right after
    that call's sweep; the shipped profiles fit the sweeps of two calls on two machines (sessions 8
    and 9, 27k steps each). The simulation is faster than these replays: their decode steps took
    2-5 % longer than the profile predicts (summed; lightb's 3.6 % less), and near saturation (x8)
    queueing turns that into TTFT p50 -37 % (block 16) and -63..-68 % (block 256). Light load: TTFT p50 -23 % and -12 %
    at block 16 (small mixed steps, summed -27 % and -7 %), -6 % at block 256. docs/PERF.md has
    the tables, the other profiles tried and the other machines' replays."""
    block = run.split("_")[0]
    v, table = errors(f"h200_qwen3-0.6b_{run}", f"qwen3-0.6b_h200_tp1_{block}.json")
    assert misses(table) == expected_misses, table
    assert abs(table.loc["throughput_rps", "rel_error"]) < 0.04, table  # -0.1 .. +3.4 % measured
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.08  # 3.9-6.9 % measured


@pytest.mark.parametrize("block,ttft_p50", [(16, (0.0, 0.03)), (256, (-0.16, -0.14))])
def test_the_real_run_again_next_to_the_simulated_one(block, ttft_p50):
    """x8 served twice in one process (`--repeat`): at block 16 the two real runs agree within 3 %
    on every latency target while the simulation misses TTFT p50 by -37 %; at block 256 they differ
    by 15 % on TTFT p50 (0.76 and 0.65 s), still far inside the simulation's -68 %."""
    run = RUNS / f"h200_qwen3-0.6b_bs{block}_heavy"
    v = validate_run(run, PROFILES / f"qwen3-0.6b_h200_tp1_bs{block}.json", RUNS / f"{run.name}b")
    table = v.table.set_index("metric")
    assert ttft_p50[0] < table.loc["ttft_p50_s", "repeat_error"] < ttft_p50[1], table
    assert abs(table.loc["tpot_mean_s", "repeat_error"]) < 0.01, table
    sim_error, real_spread = table.loc["ttft_p50_s", ["rel_error", "repeat_error"]].abs()
    assert sim_error > 3 * real_spread, table  # the miss is the simulator's, not the real run's draw


def test_one_row_decode_is_fitted_apart():
    """One-row decode steps take the fused GEMV path (~0.5 ms faster than the linear trend of larger
    batches): the multi_row feature carries that step in both current 0.6B profiles."""
    for block in (16, 256):
        model = LatencyProfile.load(PROFILES / f"qwen3-0.6b_h200_tp1_bs{block}.json").to_latency_model()
        coefficient = model.decode.as_dict()["multi_row"]
        assert 4e-4 < coefficient < 6e-4, (block, coefficient)  # 0.51 and 0.49 ms
        assert model.decode_step_time(2, 200, 101) - model.decode_step_time(1, 100, 101) > 4e-4


@pytest.mark.parametrize(
    "load,ttft_p99", [("light", (-0.03, 0.0)), ("x3", (0.06, 0.09))]
)  # fmt: skip
def test_qwen3_8b_replays(load, ttft_p99):
    """Qwen3-8B, block 16, profile and replays from one calibration call (session 9): light load and
    x3 (past saturation: 125 preemptions, TTFT p50 2.6 s) meet every target; the 8B steps are
    GPU-bound (a one-row decode step takes ~5.3 ms), so the host's phases blur them far less than the
    0.6B's."""
    v, table = errors(f"h200_qwen3-8b_bs16_{load}", "qwen3-8b_h200_tp1_bs16.json")
    assert misses(table) == set(), table
    assert (table.loc[["throughput_rps", "tpot_mean_s"], "rel_error"].abs() < 0.01).all(), table
    assert ttft_p99[0] < table.loc["ttft_p99_s", "rel_error"] < ttft_p99[1], table
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.05  # 2.7-3.6 % measured


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
