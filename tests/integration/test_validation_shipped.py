"""The shipped H200 replays, re-simulated with the shipped profiles, stay where docs/PERF.md says.

Two engine builds were calibrated: decode through FlashAttention-4 (session 1, `_fa4decode`: 13 of
14 targets met) and decode through the Triton split-KV kernel (the current default, fewer met: the
misses are pinned here so that a regression shows, and explained in docs/PERF.md)."""

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


def test_triton_decode_heavy_replay():
    v, table = errors("h200_qwen3-0.6b_bs16_heavy", "qwen3-0.6b_h200_tp1_bs16.json")
    misses = {m for m in TARGETS if not table.loc[m, "ok"]}
    assert misses <= {"throughput_rps", "output_tok_s", "tpot_mean_s", "e2e_p99_s"}, table
    assert (table.loc[list(TARGETS), "rel_error"].abs() < 0.08).all(), table
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.15  # 13 % measured


def test_triton_decode_light_replay():
    v, table = errors("h200_qwen3-0.6b_bs16_light", "qwen3-0.6b_h200_tp1_bs16.json")
    assert table.loc["throughput_rps", "ok"] and table.loc["output_tok_s", "ok"], table
    for metric in ("tpot_mean_s", "e2e_p50_s", "e2e_p99_s", "ttft_p50_s"):
        assert abs(table.loc[metric, "rel_error"]) < 0.17, (metric, table)
    assert v.steps is not None and v.steps["residual"].abs().median() < 0.1
