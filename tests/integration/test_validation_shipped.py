"""The shipped H200 replays, re-simulated with the shipped profiles, stay where docs/PERF.md says.

Three engine builds are shipped with replays: decode through FlashAttention-4 (2026-11-29,
`_fa4decode`: 13 of 14 targets met), the engine before balanced decode splits (Qwen3-8B light and
x3), and the one whose Triton split-KV decode kernel balances its splits (2026-11-30; Qwen3-0.6B at
block 16 light, lightb, x5, x8 twice, x10 on two machines and x12, at block 256 light, x10 and x12;
the same engine with async scheduling, `_async`: block 16 light, x8 and x10, block 256 light, x8
and x10 twice, Qwen3-8B at block 16 light and x3, and block 16 again on another machine with the
Triton argmax and graph-input copy, `_async_s12`). What each meets and misses is pinned here so
that a change shows either way, and explained in docs/PERF.md ("Fidelity"). These tests detect
change in shipped measured data (or in the simulator that re-simulates it), not correctness; their
names say so (`test_measured_...`, `test_pinned_...`). The profiles of the balanced engine carry
host floors per step kind; the `_fa4decode` profile has none."""

import json
from pathlib import Path

import pytest

from simulator.latency.profile import LatencyProfile
from simulator.validate import TARGETS, format_table, overlapped_steps, validate_run

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "simulator/profiles"
RUNS = ROOT / "simulator/data/validation"


def errors(run: str, profile: str):
    v = validate_run(RUNS / run, PROFILES / profile)
    return v, v.table.set_index("metric")


def misses(table) -> set[str]:
    return {m for m in TARGETS if not table.loc[m, "ok"]}


@pytest.mark.parametrize("load,allowed_misses", [("heavy", set()), ("light", {"ttft_p99_s"})])
def test_measured_fa4_decode_replays_within_targets(load, allowed_misses):
    """The first engine's replays (decode through FlashAttention-4) with its own profile.
    Pinned to shipped measured data: detects change (in the data or the simulator), not correctness."""
    v, table = errors(f"h200_qwen3-0.6b_bs16_fa4decode_{load}", "qwen3-0.6b_h200_tp1_bs16_fa4decode.json")
    assert misses(table) <= allowed_misses, table
    assert abs(table.loc["ttft_p99_s", "rel_error"]) < 0.2
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.1


EVERY_LATENCY = {"tpot_mean_s", "e2e_p50_s", "e2e_p99_s", "ttft_p50_s", "ttft_p99_s"}
THROUGHPUT = {"throughput_rps", "output_tok_s"}


@pytest.mark.parametrize(
    "run,expected_misses,throughput",
    [
        ("bs16_light", {"tpot_mean_s", "e2e_p50_s", "ttft_p50_s", "ttft_p99_s"}, (-0.01, 0.01)),
        ("bs16_lightb", set(), (-0.01, 0.01)),
        ("bs16_mid", {"tpot_mean_s", "e2e_p50_s", "e2e_p99_s"}, (-0.01, 0.01)),
        ("bs16_x8", {"tpot_mean_s"}, (-0.01, 0.01)),
        ("bs16_x8b", {"ttft_p99_s"}, (-0.01, 0.01)),
        ("bs16_x10", {"e2e_p50_s", "ttft_p99_s"}, (0.01, 0.02)),
        ("bs16_x10b", EVERY_LATENCY | THROUGHPUT, (0.09, 0.10)),
        ("bs16_x12", EVERY_LATENCY | THROUGHPUT, (0.09, 0.10)),
        ("bs256_light", {"tpot_mean_s", "e2e_p50_s"}, (-0.01, 0.01)),
        ("bs256_x10", EVERY_LATENCY | THROUGHPUT, (0.05, 0.06)),
        ("bs256_x12", EVERY_LATENCY | THROUGHPUT, (0.04, 0.05)),
    ],
)
def test_measured_balanced_engine_replays(run, expected_misses, throughput):
    """The engine with balanced decode splits (2026-11-30). Each block size's profile comes from one
    calibration process (its sweep, with serving-like full-cache decode batches), which then served
    light and x10; lightb, x5 and x8 (twice) were served by another process on another machine, x10b
    and x12 by a third (on that machine). Near saturation the simulation is faster than those other
    processes' real runs: their decode steps took ~7-10 % longer than the profile's process's
    (summed), and queueing makes that TTFT p50 -34 to -44 %; the x10 served beside the sweep meets 5
    of 7. At block 256 the sweep's fullest decode batches stay below serving's ~118k cached tokens
    (room for a 256-token page per sequence): x10 -9 % on decode steps. docs/PERF.md has the tables.
    Pinned to shipped measured data: detects change (in the data or the simulator), not correctness."""
    block = run.split("_")[0]
    v, table = errors(f"h200_qwen3-0.6b_{run}", f"superseded/qwen3-0.6b_h200_tp1_{block}_2026-11-30.json")
    assert misses(table) == expected_misses, table
    assert throughput[0] < table.loc["throughput_rps", "rel_error"] < throughput[1], table
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.11  # 3.4-10.5 % measured


ASYNC_06B_256 = "superseded/qwen3-0.6b_h200_tp1_bs256_async_2026-11-30.json"
# the profiles these replays were calibrated with (a cache of 8,192 blocks, max_model_len 16384),
# superseded by the shipped ones, calibrated on the engine's own cache and 32k contexts
ASYNC_06B_16 = "superseded/qwen3-0.6b_h200_tp1_bs16_async_2026-11-30.json"
ASYNC_8B_16 = "superseded/qwen3-8b_h200_tp1_bs16_async_2026-11-30.json"


@pytest.mark.parametrize(
    "run,profile,expected_misses,throughput",
    [
        ("0.6b_bs16_async_light", ASYNC_06B_16, set(), (-0.005, 0.005)),
        ("0.6b_bs16_async_x8", ASYNC_06B_16, set(), (-0.005, 0.005)),
        ("0.6b_bs16_async_x10", ASYNC_06B_16, {"e2e_p50_s", "ttft_p99_s"}, (0.015, 0.025)),
        ("0.6b_bs256_async_light", ASYNC_06B_256, set(), (-0.005, 0.005)),
        ("0.6b_bs256_async_x8", ASYNC_06B_256, set(), (-0.005, 0.005)),
        ("0.6b_bs256_async_x10", ASYNC_06B_256, {"e2e_p50_s", "e2e_p99_s", "ttft_p99_s"}, (0.015, 0.02)),
        ("0.6b_bs256_async_x10b", ASYNC_06B_256, set(), (-0.005, 0.005)),
        ("8b_bs16_async_light", ASYNC_8B_16, set(), (-0.005, 0.005)),
        ("8b_bs16_async_x3", ASYNC_8B_16, set(), (-0.005, 0.005)),
    ],
)
def test_measured_async_scheduling_replays(run, profile, expected_misses, throughput):
    """The balanced engine served with async scheduling, its records marking which decode steps were
    scheduled while the step before them ran (`overlapped`). Each profile comes from one calibration
    process (2026-11-30): the sweep (fitted into the `_async` profile, whose sync terms price the
    host's time a step not scheduled ahead pays), then the replays: Qwen3-0.6B at block 16 and 256
    (at 256 x10 served twice, 103 and 93 preemptions), Qwen3-8B at block 16 (x3 with 63
    preemptions). The simulation schedules ahead where the engine would, and about as often (within
    3.5 %); requests arriving during a decode step wait one step more, as in the engine.
    Pinned to shipped measured data: detects change (in the data or the simulator), not correctness."""
    v, table = errors(f"h200_qwen3-{run}", profile)
    assert v.sim.summary["config"]["async_scheduling"] is True
    assert misses(table) == expected_misses, table
    assert throughput[0] < table.loc["throughput_rps", "rel_error"] < throughput[1], table
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.055  # 0.7-5.1 % measured
    ahead = overlapped_steps(v)
    assert abs(ahead["sim"] / ahead["real"] - 1) < 0.035, ahead
    assert f"real {ahead['real']:,}, simulated {ahead['sim']:,}" in format_table(v)


def test_measured_async_near_saturation_misses_are_the_real_runs_spread():
    """Block 256's 10x window served twice in one process: E2E p50 2.12 and 1.80 s (-15 % real against
    real), TTFT p99 -28 %. The simulation is +0.3 % and +2.4 % off the second, so its misses on the
    first are that spread, not the fit's.
    Pinned to shipped measured data: detects change (in the data or the simulator), not correctness."""
    v = validate_run(
        RUNS / "h200_qwen3-0.6b_bs256_async_x10",
        PROFILES / ASYNC_06B_256,
        RUNS / "h200_qwen3-0.6b_bs256_async_x10b",
    )
    table = v.table.set_index("metric")
    assert -0.16 < table.loc["e2e_p50_s", "repeat_error"] < -0.14, table
    assert -0.29 < table.loc["ttft_p99_s", "repeat_error"] < -0.27, table
    for metric in ("e2e_p50_s", "ttft_p99_s"):
        sim_vs_repeat = table.loc[metric, "sim"] / table.loc[metric, "repeat"] - 1
        assert abs(sim_vs_repeat) < 0.03, (metric, table)


@pytest.mark.parametrize(
    "load,expected_misses,throughput",
    [
        ("light", set(), (-0.005, 0.005)),
        ("x8", set(), (-0.005, 0.005)),
        ("x10", EVERY_LATENCY | THROUGHPUT, (0.03, 0.04)),
        ("x10b", EVERY_LATENCY | THROUGHPUT, (0.05, 0.055)),
    ],
)
def test_measured_block_16_async_profile_on_another_machine(load, expected_misses, throughput):
    """The block-16 async calibration run again on another machine (2026-11-30), the engine now with
    the Triton argmax and graph-input copy (one-row steps ~20 us faster), x10 served twice. That
    day's `_async` profile (now superseded/) still meets light and x8 (TPOT +1.6 and -1.9 %); at 10x this machine's
    real runs are far slower than the simulation (decode steps -5.6 and -6.6 % summed, TTFT p50 -27
    and -52 %), and differ from each other by 51 % on TTFT p50. That run's own profile met 19 of 28
    on these four and 10 of 21 on that day's `_async` replays, so it was not shipped.
    Pinned to shipped measured data: detects change (in the data or the simulator), not correctness."""
    v, table = errors(f"h200_qwen3-0.6b_bs16_async_s12_{load}", ASYNC_06B_16)
    assert misses(table) == expected_misses, table
    assert throughput[0] < table.loc["throughput_rps", "rel_error"] < throughput[1], table
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.06  # 1.6-5.7 % measured
    if load == "x10":
        again = validate_run(
            RUNS / "h200_qwen3-0.6b_bs16_async_s12_x10",
            PROFILES / ASYNC_06B_16,
            RUNS / "h200_qwen3-0.6b_bs16_async_s12_x10b",
        )
        assert 0.5 < again.table.set_index("metric").loc["ttft_p50_s", "repeat_error"] < 0.52, again.table


def test_measured_async_replays_need_the_simulated_async_loop(tmp_path):
    """The same x8 replay and profile, simulated as if the engine scheduled synchronously (every
    decode step paying the host's time, arrivals seen a step sooner): TPOT +22 %, 3 of 7 targets
    missed (TPOT, E2E p50 and p99), where the async simulation meets all 7.
    Pinned to shipped measured data: detects change (in the data or the simulator), not correctness."""
    import shutil

    run = tmp_path / "x8"
    shutil.copytree(RUNS / "h200_qwen3-0.6b_bs16_async_x8", run)
    meta = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**meta, "async_scheduling": False}))
    v = validate_run(run, PROFILES / ASYNC_06B_16)
    table = v.table.set_index("metric")
    assert misses(table) == {"tpot_mean_s", "e2e_p50_s", "e2e_p99_s"}, table
    assert 0.2 < table.loc["tpot_mean_s", "rel_error"] < 0.25, table


def test_measured_real_run_again_next_to_the_simulated_one():
    """The real engine's own spread beside the simulator's miss (`--repeat`). x8 twice in one process:
    TTFT p50 -6.5 % apart, the simulation +2.6 % off the first. The same 10x window on two machines
    (x10 beside the profile's sweep, x10b by another process): TTFT p50 +70 % apart (0.95 and 1.62
    s), the simulation -5 % off x10, so its misses on x10b and x12 are that spread, not the fit's.
    Pinned to shipped measured data: detects change (in the data or the simulator), not correctness."""
    x8 = validate_run(
        RUNS / "h200_qwen3-0.6b_bs16_x8",
        PROFILES / "superseded/qwen3-0.6b_h200_tp1_bs16_2026-11-30.json",
        RUNS / "h200_qwen3-0.6b_bs16_x8b",
    )
    table = x8.table.set_index("metric")
    assert -0.07 < table.loc["ttft_p50_s", "repeat_error"] < -0.06, table
    assert 0.02 < table.loc["ttft_p50_s", "rel_error"] < 0.03, table
    x10 = validate_run(
        RUNS / "h200_qwen3-0.6b_bs16_x10",
        PROFILES / "superseded/qwen3-0.6b_h200_tp1_bs16_2026-11-30.json",
        RUNS / "h200_qwen3-0.6b_bs16_x10b",
    )
    table = x10.table.set_index("metric")
    assert 0.69 < table.loc["ttft_p50_s", "repeat_error"] < 0.71, table
    sim_error, real_spread = table.loc["ttft_p50_s", ["rel_error", "repeat_error"]].abs()
    assert real_spread > 10 * sim_error, table


def test_pinned_one_row_decode_is_fitted_apart():
    """One-row decode steps take the fused GEMV path (~0.5 ms faster than the linear trend of larger
    batches): the multi_row feature carries that step in both synchronous 0.6B profiles, which split
    decode KV as the balanced kernel does.
    Pinned to the shipped profiles' fitted coefficients: detects change in them, not correctness."""
    for block in (16, 256):
        model = LatencyProfile.load(
            PROFILES / f"superseded/qwen3-0.6b_h200_tp1_bs{block}_2026-11-30.json"
        ).to_latency_model()
        coefficient = model.decode.as_dict()["multi_row"]
        assert 4e-4 < coefficient < 6e-4, (block, coefficient)  # 0.53 and 0.51 ms
        assert model.split_kv is not None and model.split_kv.balanced
        assert model.decode_step_time(2, 200, 101) - model.decode_step_time(1, 100, 101) > 4e-4


@pytest.mark.parametrize(
    "load,ttft_p99", [("light", (-0.03, 0.0)), ("x3", (0.06, 0.09))]
)  # fmt: skip
def test_measured_qwen3_8b_replays(load, ttft_p99):
    """Qwen3-8B, block 16, profile and replays from one calibration process (2026-11-30, before the
    balanced decode splits: its profile's split_kv is the batch-size policy): light load and
    x3 (past saturation: 125 preemptions, TTFT p50 2.6 s) meet every target; the 8B steps are
    GPU-bound (a one-row decode step takes ~5.3 ms), so the host's phases blur them far less than the
    0.6B's.
    Pinned to shipped measured data: detects change (in the data or the simulator), not correctness."""
    v, table = errors(f"h200_qwen3-8b_bs16_{load}", "superseded/qwen3-8b_h200_tp1_bs16_2026-11-30.json")
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

    v, _ = errors("h200_qwen3-0.6b_bs256_light", "superseded/qwen3-0.6b_h200_tp1_bs256_2026-11-30.json")
    steps = v.steps
    assert steps["gpu_time_s"].notna().all() and (steps["gpu_time_s"] != steps["wall_time_s"]).all()
    assert (steps["measured_s"] == steps["wall_time_s"]).all()
    roofline = RooflineModel(resolve_model("qwen3-0.6b"), get_gpu("H200"))
    assert measured_column(steps, roofline) == "gpu_time_s"
    assert measured_column(steps.drop(columns="gpu_time_s")) == "wall_time_s"
