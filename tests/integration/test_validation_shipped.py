"""The shipped H200 replays, re-simulated with the shipped profiles, stay where docs/PERF.md says.

Two engine builds are shipped with replays: decode through FlashAttention-4 (session 1,
`_fa4decode`: 13 of 14 targets met) and the current engine (Triton split-KV decode, Triton layer
kernels, piecewise CUDA graphs for prefill and mixed steps: light load meets every target, the
heavy replay's misses are pinned here so that a regression shows, and explained in docs/PERF.md)."""

from pathlib import Path

import pytest

from simulator.validate import TARGETS, validate_run

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "simulator/profiles"
RUNS = ROOT / "simulator/data/validation"


def errors(run: str, profile: str):
    v = validate_run(RUNS / run, PROFILES / profile)
    return v, v.table.set_index("metric")


@pytest.mark.parametrize("load,allowed_misses", [("heavy", set()), ("light", {"ttft_p99_s"})])
def test_fa4_decode_replays_within_targets(load, allowed_misses):
    v, table = errors(f"h200_qwen3-0.6b_bs16_fa4decode_{load}", "qwen3-0.6b_h200_tp1_bs16_fa4decode.json")
    misses = {m for m in TARGETS if not table.loc[m, "ok"]}
    assert misses <= allowed_misses, table
    assert abs(table.loc["ttft_p99_s", "rel_error"]) < 0.2
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.1


def test_current_engine_heavy_replay():
    """Near saturation the simulator runs ~8 % slow: the replay's decode steps (~100 sequences over
    ~128k cached tokens, longest ~4k) cost ~10 % less than the profile predicts, and queueing
    compounds it into TTFT (docs/PERF.md, session 4). Pinned so that a change shows either way."""
    v, table = errors("h200_qwen3-0.6b_bs16_heavy", "qwen3-0.6b_h200_tp1_bs16.json")
    assert -0.10 < table.loc["throughput_rps", "rel_error"] < -0.05, table
    assert 0.07 < table.loc["tpot_mean_s", "rel_error"] < 0.15, table
    assert (table.loc[list(TARGETS), "rel_error"].abs() < 1.6).all(), table
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.2  # 14.4 % measured


def test_current_engine_light_replay():
    """Light load: every target met (session 4, piecewise CUDA graphs for prefill/mixed steps)."""
    v, table = errors("h200_qwen3-0.6b_bs16_light", "qwen3-0.6b_h200_tp1_bs16.json")
    misses = {m for m in TARGETS if not table.loc[m, "ok"]}
    assert not misses, table
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.12  # 8.5 % measured
