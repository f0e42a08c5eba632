"""The band's wrapper scales single steps and whole decode runs exactly, and a banded simulation's
range holds its point value."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from simulator.band import (
    BandErrors,
    band_errors,
    band_ranges,
    format_containment,
    profile_band_errors,
    replay_containment,
    run_with_band,
    scaled_model,
)
from simulator.fast_forward import accumulate_decode_times
from simulator.latency import LatencyProfile, RooflineModel, StepShape
from simulator.latency.scaled import ScaledModel
from simulator.report import format_summary

PROFILES = Path(__file__).resolve().parents[2] / "simulator" / "profiles"
SYNC = PROFILES / "qwen3-0.6b_h200_tp1_bs16.json"
ASYNC = PROFILES / "qwen3-0.6b_h200_tp1_bs16_async.json"
# (num_seqs, context tokens, longest sequence, steps, deadline): short runs go step by step, long
# ones through numpy passes; some stop at a deadline
RUNS = [
    (1, 500, 500, 40, math.inf),
    (7, 9_000, 2_100, 129, math.inf),
    (64, 60_000, 3_000, 1_500, math.inf),
    (200, 150_000, 4_000, 5_000, 3.0),
    (33, 20_000, 1_000, 800, 0.05),
]


def models() -> dict:
    sync = LatencyProfile.load(SYNC).to_latency_model()
    overlapped = LatencyProfile.load(ASYNC).to_latency_model()
    roofline = RooflineModel(sync.profile.model_spec(), "H200")
    return {
        "fitted": sync,
        "fitted-async": overlapped,
        "async-overlapped": overlapped.overlapped_model(),
        "roofline": roofline,
    }


@pytest.mark.parametrize("name", ["fitted", "fitted-async", "async-overlapped", "roofline"])
@pytest.mark.parametrize("factors", [(0.9, 0.8), (1.1031, 1.17953), (1.0, 1.0)])
def test_scaled_steps_are_the_model_times_the_factor(name, factors):
    inner = models()[name]
    model = ScaledModel(inner, *factors)
    for n, ctx, length, _, _ in RUNS:
        want = inner.decode_step_time(n, ctx, length) * factors[0]
        assert model.decode_step_time(n, ctx, length) == want
        assert model.predict(StepShape.decode(n, ctx, length)).total == want
    for shape in (
        StepShape("prefill", 3, 3, 1500, 1500, 0, 700, prefill_attn_work=4e5),
        StepShape("mixed", 40, 2, 900, 860, 30_000, 1_200, prefill_attn_work=2e5),
    ):
        a, b = inner.predict(shape), model.predict(shape)
        assert b.total == a.total * factors[1]
        assert b.linear == a.linear * factors[1] and b.attention == a.attention * factors[1]
    assert model.predict(StepShape("empty", 0, 0, 0, 0, 0, 0)).total == 0.0


@pytest.mark.parametrize("name", ["fitted", "fitted-async", "async-overlapped", "roofline"])
def test_scaled_decode_runs_are_the_reference_loop_bit_for_bit(name):
    """Each step's time multiplied, then accumulated in order: `decode_step_times` (numpy passes,
    scalar phases, deadlines) gives the floats of the scheduler's reference loop over the scaled
    step, not the wrapped run's end times rescaled."""
    model = ScaledModel(models()[name], 1.1031, 1.2)
    for n, ctx, length, steps, deadline in RUNS:
        start = 0.37
        want = accumulate_decode_times(model.decode_step_time, n, ctx, length, steps, start, deadline)
        got = model.decode_step_times(n, ctx, length, steps, start, deadline)
        assert [t.hex() for t in got] == [t.hex() for t in want], (n, ctx, steps)


def test_overlapped_view_is_scaled_too():
    inner = LatencyProfile.load(ASYNC).to_latency_model()
    model = ScaledModel(inner, 0.95, 0.86)
    view = model.overlapped_model()
    assert isinstance(view, ScaledModel) and view.model is inner.overlapped_model()
    assert (view.decode, view.prefill) == (0.95, 0.86)
    assert (
        view.decode_step_time(64, 50_000, 2_000)
        == inner.overlapped_model().decode_step_time(64, 50_000, 2_000) * 0.95
    )
    assert model.overlapped_model() is view
    sync_only = ScaledModel(LatencyProfile.load(SYNC).to_latency_model(), 0.9, 0.9)
    assert sync_only.overlapped_model() is sync_only  # a model without sync terms is its own view


def test_factors_are_checked():
    with pytest.raises(ValueError, match="ScaledModel.decode: must be a positive finite factor"):
        ScaledModel(models()["roofline"], 0.0, 1.0)
    with pytest.raises(ValueError, match=r"BandErrors.prefill: must be in \[0, 1\)"):
        BandErrors(0.1, 1.5, "x")


def test_errors_come_from_the_profile():
    prof = LatencyProfile.load(SYNC)
    errors = band_errors(prof.to_latency_model(), SYNC)
    assert errors == profile_band_errors(SYNC)
    assert errors.decode == prof.decode.error.p90_rel_error
    assert errors.prefill == prof.prefill.error.p90_rel_error
    assert errors.source == "held-back p90 relative error of qwen3-0.6b_h200_tp1_bs16.json"
    assert errors.factors("low") == (1 - errors.decode, 1 - errors.prefill)
    assert errors.factors("high") == (1 + errors.decode, 1 + errors.prefill)
    assert band_errors(models()["roofline"]) is None
    assert band_errors(scaled_model(prof.to_latency_model(), errors, "low")) == band_errors(
        prof.to_latency_model()
    )


def test_band_ranges_are_the_hull():
    point = {"ttft_p50_s": 1.0, "e2e_p99_s": 2.0, "tpot_mean_s": math.nan}
    ranges = band_ranges(point, {"ttft_p50_s": 0.8, "e2e_p99_s": 2.5}, {"ttft_p50_s": 1.3, "e2e_p99_s": 1.9})
    assert ranges["ttft_p50_s"] == (0.8, 1.3)
    assert ranges["e2e_p99_s"] == (1.9, 2.5)
    assert all(math.isnan(v) for v in ranges["tpot_mean_s"])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_banded_run_brackets_the_point(prefix_trace, small_config, async_scheduling):
    cfg = small_config(num_kv_blocks=600, async_scheduling=async_scheduling)
    profile = ASYNC if async_scheduling else SYNC
    out = run_with_band(prefix_trace, cfg, profile=profile)
    point, low, high = out.result.summary, out.low.summary, out.high.summary
    assert low["step_time_scale_decode"] == 1 - out.errors.decode
    assert high["step_time_scale_prefill"] == 1 + out.errors.prefill
    assert low["latency_model"] == high["latency_model"] == "fitted"
    assert "step_time_scale_decode" not in point
    for key in ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s", "tpot_mean_s"):
        lo, hi = point["band"]["ranges"][key]
        assert lo <= point[key] <= hi
        # at this load every metric moves with the step times: optimistic below, pessimistic above
        assert low[key] < point[key] < high[key], key
    table = format_summary(point)
    assert "band" in table and "held-back p90 relative error of" in table


def test_roofline_has_no_band(prefix_trace, small_config):
    cfg = small_config()
    out = run_with_band(prefix_trace, cfg, latency=RooflineModel(cfg.model, "H200"))
    assert out.low is None and out.result.summary["band"] is None
    assert "roofline's error has not been measured" in out.result.summary["band_note"]
    assert "band: none: the roofline" in format_summary(out.result.summary)


def test_containment_of_a_shipped_replay():
    run = PROFILES.parent / "data" / "validation" / "h200_qwen3-0.6b_bs16_async_light"
    rows = replay_containment(run)
    assert [r["metric"] for r in rows] == ["ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99"]
    for r in rows:  # the profile of its engine (piecewise)
        assert r["profile"] == "qwen3-0.6b_h200_tp1_bs16_async_2026-12-02_1222.json"
        assert r["low"] <= r["sim"] <= r["high"]
        assert r["inside"] == (r["low"] <= r["real"] <= r["high"])
    assert f"of {len(rows)} real figures inside the band" in format_containment(rows)


class _PlainModel:
    """A latency model with only the protocol's two methods (no numpy passes of its own)."""

    def predict(self, batch):
        from simulator.latency import StepTime

        t = 1e-3 + 2e-7 * batch.num_context_tokens if batch.num_seqs else 0.0
        return StepTime(t, 0.0, 0.0, 0.0, t)

    def decode_step_time(self, num_seqs, num_context_tokens, max_seq_len):
        return 1e-3 + 2e-7 * num_context_tokens


def test_a_model_without_numpy_passes_is_scaled_exactly():
    model = ScaledModel(_PlainModel(), 1.07, 0.93)
    for n, ctx, length, steps, deadline in RUNS:
        want = accumulate_decode_times(model.decode_step_time, n, ctx, length, steps, 0.0, deadline)
        assert model.decode_step_times(n, ctx, length, steps, 0.0, deadline) == want
    step = model.predict(StepShape.decode(4, 1000, 300))
    assert step.total == step.linear == _PlainModel().decode_step_time(4, 1000, 300) * 1.07
    assert model.overlapped_model() is model


def test_band_runs_in_forked_processes_give_the_inline_summaries(prefix_trace, small_config, monkeypatch):
    """The two side runs go to forked processes beside the point run where the machine has two
    cores; on one core they run inline: the same summaries either way (wall times aside)."""
    import simulator.band as band

    cfg = small_config(num_kv_blocks=600)
    forked = run_with_band(prefix_trace, cfg, profile=SYNC)
    monkeypatch.setattr(band.os, "cpu_count", lambda: 1)
    assert band._start_forked([lambda: {}]) is None
    inline = run_with_band(prefix_trace, cfg, profile=SYNC)

    def steady(summary):
        return {k: v for k, v in summary.items() if k not in ("sim_wall_s", "sim_speedup", "band")}

    for a, b in ((forked.low, inline.low), (forked.high, inline.high)):
        assert steady(a.summary) == steady(b.summary)
    assert forked.result.summary["band"]["ranges"] == inline.result.summary["band"]["ranges"]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="band runs fork only with two cores or more")
def test_a_failed_band_run_is_an_error_naming_it():
    import simulator.band as band

    def boom():
        raise ValueError("no such profile")

    started = band._start_forked([boom])
    with pytest.raises(RuntimeError, match="a band run failed: ValueError: no such profile"):
        band._join_forked(started)
