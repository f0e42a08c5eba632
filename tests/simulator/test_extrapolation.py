"""Steps a fitted profile prices outside the ranges of its step records are counted, exactly.

The count of a run with fast-forwarded decode runs equals the count of the same run stepped one
step at a time (where every step goes through `predict`), and counting changes no result.
"""

import dataclasses

import pandas as pd
import pytest

import traces
from simulator.config import SimConfig
from simulator.defaults import SHIPPED_PROFILE_DIR
from simulator.latency.profile import LatencyProfile
from simulator.latency.ranges import CountingModel, FitRanges, KindRange, limit_ranges, profile_fit_ranges
from simulator.run import collect, run_simulation
from simulator.sim import simulate

PROFILE = SHIPPED_PROFILE_DIR / "qwen3-0.6b_h200_tp1_bs16.json"
ASYNC_PROFILE = SHIPPED_PROFILE_DIR / "qwen3-0.6b_h200_tp1_bs16_async.json"
# small ranges, so that a short trace crosses them: decode runs go outside part way through
SMALL = FitRanges(KindRange(8, 6000, 2000, 8), KindRange(8, 3000, 2000, 2048), "test ranges")


@pytest.fixture(scope="module")
def trace():
    return traces.generate(
        num_requests=120, rate=40.0, prompt="lognormal:600,0.8", output="lognormal:300,0.8"
    )


def with_ranges(path, ranges: FitRanges):
    profile = LatencyProfile.load(path)
    return dataclasses.replace(
        profile, extra={**profile.extra, "fit_ranges": ranges.as_dict()}
    ).to_latency_model()


def test_decode_run_outside_is_the_step_by_step_count():
    for n, ctx, length in [
        (1, 0, 1),
        (4, 5990, 10),
        (3, 100, 1995),
        (5, 7000, 10),
        (9, 0, 1),
        (2, 5999, 2001),
    ]:
        for steps in (0, 1, 3, 50):
            want = sum(SMALL.decode_outside(n, ctx + i * n, length + i) for i in range(steps))
            assert SMALL.decode_run_outside(n, ctx, length, steps) == want, (n, ctx, length, steps)


def test_count_run_counts_the_step_by_step_count():
    """`CountingModel.count_run` (its test for a run wholly inside first) adds what stepping counts,
    at the edges of each range too."""
    counting = CountingModel(LatencyProfile.load(PROFILE).to_latency_model(), SMALL)
    total = 0
    for n in (1, 2, 7, 8, 9):
        for ctx in (0, 5000, 5999 - 3 * n, 5999, 6000, 7000):
            for length in (1, 1950, 1996, 2000, 2001):
                for steps in (1, 2, 3, 4, 5, 50):
                    total += sum(SMALL.decode_outside(n, ctx + i * n, length + i) for i in range(steps))
                    counting.count_run(n, ctx, length, steps)
                    assert counting.count.decode == total, (n, ctx, length, steps)


@pytest.mark.parametrize(
    ("path", "async_scheduling", "want"),
    [(PROFILE, False, (2305, 110)), (ASYNC_PROFILE, True, (2302, 112))],
)
def test_fast_forward_counts_what_stepping_counts(trace, path, async_scheduling, want):
    counts = []
    for fast_forward in (True, False):
        cfg = SimConfig(
            model=LatencyProfile.load(path).model_spec(),
            num_kv_blocks=2000,
            max_num_seqs=16,
            max_num_batched_tokens=2048,
            fast_forward=fast_forward,
            async_scheduling=async_scheduling,
        )
        s = run_simulation(trace, cfg, latency=with_ranges(path, SMALL)).summary
        counts.append((s["decode_steps_outside_fit"], s["prefill_steps_outside_fit"], s["sim_steps"]))
        assert s["fit_ranges"].startswith("test ranges: decode batch <= 8, context <= 6,000 tokens")
        assert s["steps_outside_fit"] == sum(counts[-1][:2])
        assert s["steps_outside_fit_share"] == s["steps_outside_fit"] / s["sim_steps"]
    assert counts[0] == counts[1]
    assert counts[0][:2] == want and sum(want) < counts[0][2]  # some steps inside, some outside


def test_counting_changes_no_result(trace):
    cfg = SimConfig(model=LatencyProfile.load(PROFILE).model_spec(), num_kv_blocks=2000, max_num_seqs=16)
    model = with_ranges(PROFILE, SMALL)
    counted = run_simulation(trace, cfg, latency=model)
    assert 0 < counted.summary["steps_outside_fit"] < counted.summary["sim_steps"]
    plain = collect(simulate(trace, cfg, model, 2000))  # the model itself, not wrapped
    pd.testing.assert_frame_equal(counted.requests, plain.requests)
    pd.testing.assert_frame_equal(counted.timeline, plain.timeline)
    assert counted.summary["sim_steps"] == plain.summary["sim_steps"]


def test_profile_ranges_come_from_the_fit_then_the_records_then_the_limits():
    profile = LatencyProfile.load(PROFILE)
    got = profile_fit_ranges(profile)  # the shipped step records
    assert got == FitRanges(
        KindRange(256, 1085485, 32727, 256),
        KindRange(256, 1075648, 32700, 8192),
        "steps_qwen3-0.6b_h200_tp1_bs16.parquet",
    )
    no_records = dataclasses.replace(profile, extra={})
    assert profile_fit_ranges(no_records) == limit_ranges(no_records)
    assert limit_ranges(no_records) == FitRanges(
        KindRange(256, 1_143_280, 1 << 62, 256),  # 71,455 blocks of 16
        KindRange(256, 1_143_280, 1 << 62, 8192),
        "the profile's calibration limits",
    )
    recorded = dataclasses.replace(profile, extra={"fit_ranges": SMALL.as_dict()})
    assert profile_fit_ranges(recorded) == SMALL
    assert profile_fit_ranges(dataclasses.replace(no_records, num_kv_blocks=None)) is None


def test_roofline_runs_are_not_checked(trace):
    cfg = SimConfig(model=LatencyProfile.load(PROFILE).model_spec(), num_kv_blocks=2000)
    s = run_simulation(trace, cfg).summary
    assert (s["steps_outside_fit"], s["steps_outside_fit_share"], s["fit_ranges"]) == (None, None, None)


def test_simulate_prints_the_share_outside(capsys):
    from simulator.cli import main

    assert main(["simulate", "--window", "0:300", "--rate-scale", "10", "--quiet"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == (
        "extrapolation    3 of 6,282 steps (0.0%) outside the fit's ranges (decode 0, prefill/mixed 3); "
        "steps_qwen3-0.6b_h200_tp1_bs16.parquet: decode batch <= 256, context <= 1,085,485 tokens, "
        "longest <= 32,727, step tokens <= 256; prefill and mixed batch <= 256, context <= 1,075,648 tokens, "
        "longest <= 32,700, step tokens <= 8,192"
    )
    assert main(["simulate", "--limit", "5", "--quiet", "--profile", "roofline"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "extrapolation    not checked (roofline)"
