"""FittedModel: CUDA-graph padding, NNLS, recovery of known coefficients, record validation, host floors."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.decode_splits import longest_split_divisor, split_block
from simulator.latency import (
    DECODE_FEATURES,
    PREFILL_FEATURES,
    FittedModel,
    LinearFit,
    SplitKV,
    StepFloors,
    StepShape,
    StepTime,
    decode_graph_batch_sizes,
    fit_floor,
    fit_step_records,
    graph_padded_batch_size,
    max_graph_batch_size,
)
from simulator.latency.base import predict_frame
from simulator.latency.fitted import decode_features, nnls


def test_graph_batch_sizes_match_the_engine() -> None:
    assert decode_graph_batch_sizes(256) == (1, 2, 4, 8, *range(16, 257, 16))
    assert decode_graph_batch_sizes(1024)[-1] == 1024  # kvplan's engine captures up to max_num_seqs
    assert decode_graph_batch_sizes(1024, max_capture=512)[-1] == 512  # nano-vllm's cap
    assert decode_graph_batch_sizes(100)[-3:] == (64, 80, 96)
    assert decode_graph_batch_sizes(5) == (1, 2, 4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_graph_batch_sizes(0)
    try:  # the engine's own list (its module needs torch, which the CPU test venv may lack)
        from engine.model_runner import graph_batch_sizes
    except ImportError:
        return
    for m in (1, 3, 8, 9, 16, 100, 256, 600, 1024):
        assert tuple(graph_batch_sizes(m)) == decode_graph_batch_sizes(m), m


@pytest.mark.parametrize("max_num_seqs", [1, 3, 5, 8, 15, 16, 100, 256, 300, 512, 1000])
def test_padding_is_the_smallest_graph_that_fits(max_num_seqs: int) -> None:
    sizes = decode_graph_batch_sizes(max_num_seqs)
    gmax = max_graph_batch_size(max_num_seqs)
    for n in range(1, 1100):
        expected = next((s for s in sizes if s >= n), n)  # eager above the largest graph
        assert graph_padded_batch_size(n, gmax) == expected, n
    assert graph_padded_batch_size(37, 0) == 37  # graphs off


def test_nnls_meets_kkt_conditions_and_matches_brute_force() -> None:
    rng = np.random.default_rng(3)
    for _ in range(30):
        a = rng.normal(size=(12, 4))
        b = rng.normal(size=12)
        x = nnls(a, b)
        assert (x >= 0).all()
        # Brute force: the best unconstrained LS over every support whose solution is non-negative.
        best = np.inf
        for k in range(5):
            for support in itertools.combinations(range(4), k):
                z = np.zeros(4)
                if support:
                    z[list(support)] = np.linalg.lstsq(a[:, support], b, rcond=None)[0]
                if (z >= 0).all():
                    best = min(best, float(np.sum((a @ z - b) ** 2)))
        assert np.sum((a @ x - b) ** 2) == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_noise_free_records_are_recovered_exactly(make_records, truth) -> None:
    fit = fit_step_records(make_records(noise=0.0), max_num_seqs=truth.gmax, split_kv=truth.split_kv)
    np.testing.assert_allclose(fit.decode.coefficients, truth.decode, rtol=1e-6)
    np.testing.assert_allclose(fit.prefill.coefficients, truth.prefill, rtol=1e-6)
    assert fit.decode.error.median_rel_error < 1e-9 and fit.prefill.error.p90_rel_error < 1e-9


def test_noisy_records_recover_coefficients_and_report_small_error(records: pd.DataFrame, truth) -> None:
    # multiplicative noise: the relative loss
    fit = fit_step_records(records, max_num_seqs=truth.gmax, seed=0, loss="relative", split_kv=truth.split_kv)
    dec, pre = fit.decode.as_dict(), fit.prefill.as_dict()
    assert tuple(dec) == DECODE_FEATURES and tuple(pre) == PREFILL_FEATURES
    # The terms that carry most of the time are pinned down to a few percent under 1% noise.
    for name, true in zip(DECODE_FEATURES, truth.decode):
        assert dec[name] == pytest.approx(true, rel=0.12), name
    for name in ("const", "total_num_scheduled_tokens", "prefill_attn_work", "num_context_tokens"):
        assert pre[name] == pytest.approx(truth.prefill[PREFILL_FEATURES.index(name)], rel=0.08), name
    for err in (fit.decode.error, fit.prefill.error):
        assert err.median_rel_error < 0.012  # 1% lognormal noise: median |error| ~ 0.7%
        assert err.p90_rel_error < 0.03
        assert err.n_test > 50
    s = fit.summary
    assert (s.num_records, s.num_used, s.num_compiled_dropped) == (700, 697, 3)
    assert (s.target, s.tp, s.block_size) == ("gpu_time_s", 1, 256)


def test_split_is_deterministic_by_seed(records: pd.DataFrame, truth) -> None:
    a = fit_step_records(records, max_num_seqs=truth.gmax, seed=7)
    b = fit_step_records(records.copy(), max_num_seqs=truth.gmax, seed=7)
    c = fit_step_records(records, max_num_seqs=truth.gmax, seed=8)
    assert a.decode == b.decode and a.prefill == b.prefill
    assert a.decode.coefficients != c.decode.coefficients


def test_compiled_steps_do_not_leak_into_the_fit(records: pd.DataFrame, truth) -> None:
    fit = fit_step_records(records, max_num_seqs=truth.gmax)
    first_prefill = StepShape.of(records.iloc[400])  # a compiled step measured at 3.4 s
    assert fit.predict(first_prefill).total < 0.5


def test_target_falls_back_to_wall_time(records: pd.DataFrame, truth) -> None:
    no_gpu = records.drop(columns=["gpu_time_s"]).assign(wall_time_s=records["gpu_time_s"])
    fit = fit_step_records(no_gpu, max_num_seqs=truth.gmax)
    assert fit.summary.target == "wall_time_s"
    with_nan = records.copy()
    with_nan.loc[5, "gpu_time_s"] = np.nan
    assert fit_step_records(with_nan, max_num_seqs=truth.gmax).summary.target == "wall_time_s"
    with pytest.raises(ValueError, match=r"gpu_time_s must be a positive finite time; bad at step\(s\) 5"):
        fit_step_records(with_nan, max_num_seqs=truth.gmax, target="gpu_time_s")


def test_bad_records_get_clear_errors(records: pd.DataFrame) -> None:
    with pytest.raises(ValueError, match=r"missing column\(s\) \['prefill_attn_work'\]"):
        fit_step_records(records.drop(columns=["prefill_attn_work"]))
    bad = records.copy()
    bad.loc[7, "kind"] = "warmup"
    with pytest.raises(ValueError, match=r"unknown kind at step\(s\) 7"):
        fit_step_records(bad)
    with pytest.raises(ValueError, match="got 0 decode and"):
        fit_step_records(records[records.kind != "decode"])
    with pytest.raises(ValueError, match="need at least 6"):
        fit_step_records(
            pd.concat([records[records.kind == "decode"], records[records.kind == "prefill"][1:5]])
        )
    two_tp = records.copy()
    two_tp.loc[9, "tp"] = 2
    with pytest.raises(ValueError, match="column 'tp' has several values"):
        fit_step_records(two_tp)
    with pytest.raises(ValueError, match="graph_batch_size disagrees"):
        fit_step_records(records, max_graph_batch_size=64)


def test_graph_size_is_inferred_from_records(records: pd.DataFrame, truth) -> None:
    assert fit_step_records(records).max_graph_batch_size == truth.gmax  # largest graph seen (n up to 256)
    assert fit_step_records(records.assign(graph_batch_size=0)).max_graph_batch_size == 0


def test_breakdown_and_predict_frame(records: pd.DataFrame, truth) -> None:
    fit = fit_step_records(records, max_num_seqs=truth.gmax, split_kv=truth.split_kv)
    d = fit.decode.coefficients
    st = fit.predict(StepShape.decode(20, 10_000, 900))  # runs as a 32-wide graph: 2 splits
    assert st.overhead == d[0] + d[6] and st.linear == d[1] * 32 and st.communication == 0.0
    assert fit.predict(StepShape.decode(1, 100, 101)).overhead == d[0]  # one row: no multi_row step
    assert st.attention == d[2] * 10_000 + (d[3] + d[4] * 32 + d[5] / 2) * 900
    kept = records[~records.compiled]
    totals = np.array([s.total for s in predict_frame(fit, kept)])
    rel = np.abs(totals - kept["gpu_time_s"]) / kept["gpu_time_s"]
    assert np.median(rel) < 0.012


def test_legacy_decode_fits_load_with_zeros_for_the_newer_features() -> None:
    pre = LinearFit(PREFILL_FEATURES, (1e-3,) * 6)
    old = FittedModel(LinearFit(DECODE_FEATURES[:4], (2e-3, 2e-5, 3e-8, 1e-7)), pre, max_graph_batch_size=256)
    assert old.decode.coefficients == (2e-3, 2e-5, 3e-8, 1e-7, 0.0, 0.0, 0.0)
    assert old.decode_step_time(20, 10_000, 900) == 2e-3 + 2e-5 * 32 + 3e-8 * 10_000 + 1e-7 * 900
    five = FittedModel(LinearFit(DECODE_FEATURES[:5], (2e-3, 2e-5, 3e-8, 1e-7, 1e-9)), pre, 256)
    assert five.decode.coefficients == (2e-3, 2e-5, 3e-8, 1e-7, 1e-9, 0.0, 0.0)
    six = FittedModel(LinearFit(DECODE_FEATURES[:6], (2e-3, 2e-5, 3e-8, 1e-7, 1e-9, 1e-7)), pre, 256)
    assert six.decode.coefficients == (2e-3, 2e-5, 3e-8, 1e-7, 1e-9, 1e-7, 0.0)
    assert six.decode_step_time(1, 10, 11) == 2e-3 + 2e-5 * 1 + 3e-8 * 10 + (1e-7 + 1e-9 * 1 + 1e-7 / 1) * 11


def test_longest_split_follows_the_kernels_split_policy(make_records, truth) -> None:
    """max_seq_len / splits, splits by the padded batch as engine.decode_splits chooses them: 32 at
    batch 1, 17 at 2, 5 at 8, 3 at 9..16 (padded to 16), 2 at 32, 1 from 48 on; 1 without split_kv."""
    pre = LinearFit(PREFILL_FEATURES, (1e-3,) * 6)
    dec = LinearFit(DECODE_FEATURES, (0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0))
    split = FittedModel(dec, pre, max_graph_batch_size=256, split_kv=truth.split_kv)
    plain = FittedModel(dec, pre, max_graph_batch_size=256)
    got = [split.decode_step_time(n, 0, 960) for n in (1, 2, 8, 9, 32, 48, 300)]
    assert got == [960 / 32, 960 / 17, 960 / 5, 960 / 3, 960 / 2, 960.0, 960.0]
    assert plain.decode_step_time(1, 0, 960) == 960.0
    # the fit leaves the feature out without a split kernel (it would repeat max_seq_len)
    records = make_records(noise=0.0)
    assert fit_step_records(records, max_num_seqs=truth.gmax).decode.coefficients[5] == 0.0
    with pytest.raises(ValueError, match=r"split_kv.num_sms: must be a positive integer, got 0"):
        SplitKV(8, 0)


def test_balanced_longest_split_exact_values() -> None:
    """Balanced splits (engine.decode_splits.longest_split_divisor): the longest sequence's splits
    depend on the step's keys. 96 rows over 114,000 keys: the longest of 6,360 takes 4, one of 900
    takes 2; at batch 1 a 256-token sequence takes its 4 units; over 300 rows (grid 4) 4 again."""
    pre = LinearFit(PREFILL_FEATURES, (1e-3,) * 6)
    dec = LinearFit(DECODE_FEATURES, (0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0))
    model = FittedModel(dec, pre, max_graph_batch_size=512, split_kv=SplitKV(8, 132, 16, balanced=True))
    got = [
        model.decode_step_time(n, c, m)
        for n, c, m in ((96, 114_000, 6360), (96, 114_000, 900), (1, 255, 256))
    ]
    assert got == [6360 / 4, 900 / 2, 256 / 4]
    assert model.decode_step_time(300, 300_000, 9000) == 9000 / 4
    assert model.decode_step_time(300, 300_000, 1000) == 1000.0  # under its share of the keys: one split
    frame = pd.DataFrame(
        {"num_seqs": [96, 1], "num_context_tokens": [114_000, 255], "max_seq_len": [6360, 256]}
    )
    assert decode_features(frame, 512, SplitKV(8, 132, 16, balanced=True))[:, 5].tolist() == [1590.0, 64.0]
    with pytest.raises(
        ValueError, match=r"split_kv.block_size: must be a positive integer when balanced, got 0"
    ):
        SplitKV(8, 132, balanced=True)


def test_split_tokens_count_units_inside_large_pages() -> None:
    """A block-256 engine that splits pages inside (split_tokens 64, the default): one row of 384
    keys takes 6 splits, as a block-64 model says; a profile without split_tokens (whole pages, the
    engine before) keeps 2, and its dict is as before."""
    fine = SplitKV(8, 132, 256, balanced=True, split_tokens=64)
    whole = SplitKV(8, 132, 256, balanced=True)
    assert [fine.divisor(1, 383, 384), whole.divisor(1, 383, 384)] == [6, 2]
    ctx, longest = np.array([383, 114_000]), np.array([384, 6360])
    assert (
        fine.divisors(1, ctx, longest).tolist()
        == SplitKV(8, 132, 64, balanced=True).divisors(1, ctx, longest).tolist()
    )
    assert whole.as_dict() == {"num_kv_heads": 8, "num_sms": 132, "block_size": 256, "balanced": True}
    pre = LinearFit(PREFILL_FEATURES, (1e-3,) * 6)
    model = FittedModel(LinearFit(DECODE_FEATURES, (0.0,) * 7), pre, 512, split_kv=fine)
    assert model._splits(1, 383, 384) == 6
    with pytest.raises(ValueError, match=r"split_kv.split_tokens: must be a non-negative integer, got True"):
        SplitKV(8, 132, 256, balanced=True, split_tokens=True)


def test_feature_lists_are_checked() -> None:
    dec = LinearFit(DECODE_FEATURES, (0.0,) * 7)
    with pytest.raises(ValueError, match="prefill fit features"):
        FittedModel(dec, LinearFit(("const",), (1.0,)))
    with pytest.raises(ValueError, match="2 features but 1 coefficients"):
        LinearFit(("a", "b"), (1.0,))


def test_absolute_loss_weighs_long_steps_and_bad_loss_is_named(make_records, truth) -> None:
    records = make_records(noise=0.0)
    fit = fit_step_records(records, max_num_seqs=truth.gmax, loss="absolute", split_kv=truth.split_kv)
    np.testing.assert_allclose(fit.decode.coefficients, truth.decode, rtol=1e-6)
    # a long step measured 20% slow pulls an absolute fit more than a relative one
    slow = records.copy()
    longest = slow["wall_time_s"].where(slow["kind"] == "decode").idxmax()
    slow.loc[longest, ["gpu_time_s", "wall_time_s"]] *= 1.2
    shape = slow.loc[longest]
    common = dict(max_num_seqs=truth.gmax, holdout_fraction=0.0, split_kv=truth.split_kv)
    a = fit_step_records(slow, loss="absolute", **common)
    r = fit_step_records(slow, loss="relative", **common)
    args = (int(shape.num_seqs), int(shape.num_context_tokens), int(shape.max_seq_len))
    assert a.decode_step_time(*args) > r.decode_step_time(*args)
    with pytest.raises(ValueError, match="loss: 'l1' is not one of"):
        fit_step_records(records, max_num_seqs=truth.gmax, loss="l1")


def test_batch_x_max_seq_len_is_left_out_when_records_cannot_separate_it(make_records, truth) -> None:
    records = make_records(noise=0.0)
    uniform = records.copy()
    dec = uniform["kind"] == "decode"
    # every sequence of a step equally long: b * max_seq_len is a multiple of the context sum
    uniform.loc[dec, "max_seq_len"] = uniform.loc[dec, "num_context_tokens"] // uniform.loc[dec, "num_seqs"]
    fit = fit_step_records(uniform, max_num_seqs=truth.gmax)
    assert fit.decode.as_dict()["batch_x_max_seq_len"] == 0.0
    assert fit_step_records(records, max_num_seqs=truth.gmax).decode.as_dict()["batch_x_max_seq_len"] > 0


def test_median_loss_fits_through_the_typical_step(make_records, truth) -> None:
    """A fifth of the steps measured 1.6x slow (a host in a slow phase): the median fit still
    finds the true coefficients' step times; the squared-seconds fit is dragged up."""
    records = make_records(noise=0.0)
    rng = np.random.default_rng(3)
    slow = records.copy()
    hit = rng.random(len(slow)) < 0.2
    slow.loc[hit, ["gpu_time_s", "wall_time_s"]] *= 1.6
    common = dict(max_num_seqs=truth.gmax, split_kv=truth.split_kv, holdout_fraction=0.0)
    exact = fit_step_records(records, **common)
    median = fit_step_records(slow, loss="median", **common)
    squared = fit_step_records(slow, loss="absolute", **common)
    shapes = [(1, 500, 501), (8, 8_000, 2_000), (100, 120_000, 4_000), (256, 300_000, 3_000)]
    for shape in shapes:
        truth_s = exact.decode_step_time(*shape)
        assert median.decode_step_time(*shape) == pytest.approx(truth_s, rel=0.01), shape
        assert squared.decode_step_time(*shape) > 1.05 * truth_s, shape
    mixed = StepShape("mixed", 10, 2, 2008, 2000, 50_000, 4000, 1.5e6)
    assert median.predict(mixed).total == pytest.approx(exact.predict(mixed).total, rel=0.01)


# ---- host floors --------------------------------------------------------------------------------
def test_fit_floor_exact_values() -> None:
    # least absolute deviations: the three host-bound steps measured 3 s lift the floor to 3 s
    assert (
        fit_floor(np.array([1.0, 2.0, 3.0, 4.0, 10.0]), np.array([3.0, 3.0, 3.0, 4.0, 10.0]), "median") == 3.0
    )
    assert fit_floor(np.array([1.0, 1.0]), np.array([2.0, 4.0]), "median") == 2.0  # flat on [2, 4]: lowest
    # squared seconds: the mean of the floored steps, clipped to where they are the floored ones
    assert fit_floor(np.array([1.0, 1.0, 5.0]), np.array([2.0, 4.0, 5.0]), "absolute") == 3.0
    assert fit_floor(np.array([1.0, 3.0]), np.array([5.0, 3.0]), "absolute") == 4.0
    # squared relative errors: weights 1 / y^2, (2 / 4 + 4 / 16) / (1 / 4 + 1 / 16)
    assert fit_floor(np.array([1.0, 1.0]), np.array([2.0, 4.0]), "relative") == 0.75 / 0.3125
    # steps the linear fit predicts from below (or exactly) are not host-bound: no floor
    for loss in ("median", "absolute", "relative"):
        assert fit_floor(np.array([1.0, 2.0, 3.0]), np.array([1.0, 1.5, 3.0]), loss) == 0.0
        assert fit_floor(np.array([]), np.array([]), loss) == 0.0
    with pytest.raises(ValueError, match="loss: 'l1' is not one of"):
        fit_floor(np.array([1.0]), np.array([1.0]), "l1")
    with pytest.raises(ValueError, match="must be equal 1-d shapes"):
        fit_floor(np.array([1.0, 2.0]), np.array([1.0]))


@pytest.mark.parametrize("loss", ["median", "absolute", "relative"])
def test_fit_floor_is_the_minimum_over_every_candidate(loss: str) -> None:
    """No floor on a fine grid, nor at any prediction or measurement, has a lower loss."""
    rng = np.random.default_rng(5)
    p = rng.uniform(1.0, 10.0, 300)
    y = np.maximum(rng.uniform(4.0, 6.0, 300), p) * rng.lognormal(0.0, 0.1, 300)

    def cost(f: float) -> float:
        r = np.maximum(p, f) - y
        return float(
            np.abs(r).sum() if loss == "median" else ((r / y if loss == "relative" else r) ** 2).sum()
        )

    best = fit_floor(p, y, loss)
    assert 4.0 < best < 7.0
    candidates = np.concatenate([p, y, np.linspace(0.0, 12.0, 4001)])
    assert cost(best) <= min(cost(f) for f in candidates) * (1 + 1e-12)


def test_floors_are_fitted_per_kind_from_host_bound_records(make_records, truth) -> None:
    """Noise-free steps held up to 2.3 ms (decode: one-row steps of short contexts), 8 ms (prefill)
    and 15 ms (mixed) by the host: the median fit finds the line through the rest and the floors
    exactly; the held-back error with floors is tiny, without them far larger."""
    records = make_records(noise=0.0)
    floors = {"decode": 2.3e-3, "prefill": 8e-3, "mixed": 15e-3}
    held = records.copy()
    for kind, floor in floors.items():
        rows = (held["kind"] == kind) & ~held["compiled"]
        held.loc[rows, "gpu_time_s"] = held.loc[rows, "gpu_time_s"].clip(lower=floor)
    common = dict(max_num_seqs=truth.gmax, split_kv=truth.split_kv, loss="median")
    fit = fit_step_records(held, **common)
    assert fit.floors == StepFloors(**floors)
    for err in (fit.decode.error, fit.prefill.error):  # IRLS: the line to within 0.5 %
        assert err.p90_rel_error < 1e-4 and err.max_rel_error < 5e-3
    plain = fit_step_records(held, floors=False, **common)
    assert plain.floors is None
    assert plain.decode.coefficients == fit.decode.coefficients  # the floors leave the line as fitted
    assert plain.prefill.coefficients == fit.prefill.coefficients
    assert plain.decode.error.max_rel_error > 0.03 and plain.prefill.error.max_rel_error > 0.5
    # no host-bound steps (and an exact fit): the floors change no prediction
    exact = fit_step_records(make_records(noise=0.0), **{**common, "loss": "absolute"})
    kept = make_records(noise=0.0).query("not compiled")
    with_floors = np.array([s.total for s in predict_frame(exact, kept)])
    without = FittedModel(exact.decode, exact.prefill, truth.gmax, split_kv=truth.split_kv)
    np.testing.assert_allclose(with_floors, [s.total for s in predict_frame(without, kept)], rtol=1e-12)


def test_floored_predictions_exact_values() -> None:
    """max(floor of the kind, linear): the time below the floor is reported as overhead."""
    decode = LinearFit(DECODE_FEATURES, (1e-3, 1e-5, 0.0, 0.0, 0.0, 0.0, 0.0))
    prefill = LinearFit(PREFILL_FEATURES, (1e-3, 1e-6, 0.0, 0.0, 0.0, 0.0))
    floors = StepFloors(decode=2e-3, prefill=4e-3, mixed=3e-3)
    model = FittedModel(decode, prefill, max_graph_batch_size=256, floors=floors)
    plain = FittedModel(decode, prefill, max_graph_batch_size=256)
    assert model.decode_step_time(1, 100, 101) == 2e-3  # 1.01 ms of GPU work
    st = model.predict(StepShape.decode(1, 100, 101))
    assert (st.total, st.linear, st.overhead) == (2e-3, 1e-5, 1e-3 + (2e-3 - (1e-3 + 1e-5 + 0.0)))
    assert model.decode_step_time(200, 100, 101) == plain.decode_step_time(200, 100, 101) == 1e-3 + 1e-5 * 208
    assert model.decode_step_times(1, 100, 101, 2, 1.0, float("inf")) == [1.0, 1.0 + 2e-3, 1.0 + 2e-3 + 2e-3]
    prefill_1k = StepShape("prefill", 1, 1, 1000, 1000, 0, 1000, 5e5)
    mixed_1k = StepShape("mixed", 3, 1, 1002, 1000, 4000, 2000, 5e5)
    mixed_8k = StepShape("mixed", 3, 1, 8002, 8000, 4000, 8000, 3.2e7)
    assert model.predict(prefill_1k) == StepTime(1e-6 * 1000, 0.0, 0.0, 1e-3 + (4e-3 - (1e-3 + 1e-3)), 4e-3)
    assert model.predict(mixed_1k).total == 3e-3
    assert model.predict(mixed_8k) == plain.predict(mixed_8k) and plain.predict(mixed_8k).total > 3e-3
    assert plain.predict(prefill_1k).total == 1e-6 * 1000 + 0.0 + 1e-3


def test_step_floors_are_checked_and_no_floors_predicts_as_before(records: pd.DataFrame, truth) -> None:
    for bad in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"floors.mixed: must be a finite time >= 0 s"):
            StepFloors(mixed=bad)
    fit = fit_step_records(records, max_num_seqs=truth.gmax, floors=False)
    zero = FittedModel(fit.decode, fit.prefill, truth.gmax, floors=StepFloors())
    shapes = [StepShape.decode(n, 300 * n, 400) for n in (1, 5, 40, 256)]
    shapes.append(StepShape("mixed", 10, 2, 2008, 2000, 50_000, 4000, 1.5e6))
    for shape in shapes:
        assert zero.predict(shape) == fit.predict(shape)


@settings(max_examples=300, deadline=None)
@given(
    b=st.sampled_from([1, 2, 4, 8, 16, 32, 48, 96, 128, 256, 512]),
    ctx=st.integers(0, 3_000_000),
    max_len=st.integers(1, 200_000),
    heads=st.sampled_from([1, 2, 8, 32]),
    sms=st.sampled_from([66, 132]),
    block=st.sampled_from([16, 64, 256]),
    fine=st.booleans(),
)
def test_balanced_model_splits_follow_the_engines_rule(b, ctx, max_len, heads, sms, block, fine) -> None:
    """The fitted model's inlined split count (its hot path) is engine.decode_splits' rule, as
    SplitKV.divisor and the vectorised SplitKV.divisors give it (whole pages or split inside)."""
    split_kv = SplitKV(heads, sms, block, balanced=True, split_tokens=64 if fine and block > 64 else 0)
    pre = LinearFit(PREFILL_FEATURES, (1e-3,) * 6)
    model = FittedModel(LinearFit(DECODE_FEATURES, (0.0,) * 7), pre, 512, split_kv=split_kv)
    expected = split_kv.divisor(b, ctx, max_len)
    assert expected == longest_split_divisor(b, ctx, max_len, heads, sms, split_block(block, fine))
    assert model._splits(b, ctx, max_len) == expected
    assert split_kv.divisors(b, np.array([ctx]), np.array([max_len])).tolist() == [expected]


def test_records_of_async_scheduling_fit_the_host_time_of_steps_not_scheduled_ahead(
    make_records, truth
) -> None:
    """Decode steps the records mark not `overlapped` took 0.5 ms + 4 us a padded row more: the fit
    adds SYNC_FEATURES and recovers them; the overlapped view predicts the others. Records without
    the column, or where every step is on one side, keep the seven features."""
    from simulator.latency.fitted import ASYNC_DECODE_FEATURES

    records = make_records(noise=0.0)
    rng = np.random.default_rng(5)
    decode = records["kind"] == "decode"
    sync = decode & (rng.random(len(records)) < 0.3)
    records["overlapped"] = decode & ~sync
    records.loc[sync, "gpu_time_s"] += 5e-4 + 4e-6 * records.loc[sync, "graph_batch_size"]
    fit = fit_step_records(records, max_num_seqs=truth.gmax, split_kv=truth.split_kv, host_table=False)
    assert fit.decode.features == ASYNC_DECODE_FEATURES and fit.has_sync_terms
    np.testing.assert_allclose(fit.decode.coefficients, (*truth.decode, 5e-4, 4e-6), rtol=1e-6)
    assert fit.decode.error.median_rel_error < 1e-9
    row = records[sync].iloc[0]
    shape = (int(row["num_seqs"]), int(row["num_context_tokens"]), int(row["max_seq_len"]))
    assert fit.decode_step_time(*shape) == pytest.approx(row["gpu_time_s"], rel=1e-9)
    ahead = fit.overlapped_model().decode_step_time(*shape)
    assert ahead == pytest.approx(row["gpu_time_s"] - 5e-4 - 4e-6 * row["graph_batch_size"], rel=1e-9)
    for no_split in (records.drop(columns="overlapped"), records.assign(overlapped=False)):
        plain = fit_step_records(no_split, max_num_seqs=truth.gmax, split_kv=truth.split_kv)
        assert plain.decode.features == DECODE_FEATURES and not plain.has_sync_terms


def test_records_of_async_scheduling_fit_the_block_table_term_of_steps_not_scheduled_ahead(
    make_records, truth
) -> None:
    """Decode steps not `overlapped` took 0.5 ms + 4 us a padded row + 30 ns a block-table entry
    (num_seqs x ceil(max_seq_len / 256), the records' block size) more: the fit adds TABLE_FEATURES
    and recovers all three; the overlapped view leaves them out. Records without a block size, or
    host_table=False, fit ASYNC_DECODE_FEATURES."""
    from simulator.latency.fitted import ASYNC_DECODE_FEATURES, TABLE_DECODE_FEATURES, table_entries

    records = make_records(noise=0.0)
    rng = np.random.default_rng(5)
    decode = records["kind"] == "decode"
    sync = decode & (rng.random(len(records)) < 0.3)
    records["overlapped"] = decode & ~sync
    entries = table_entries(records["num_seqs"], records["max_seq_len"], 256)
    assert entries[sync].nunique() > 50
    records.loc[sync, "gpu_time_s"] += (
        5e-4 + 4e-6 * records.loc[sync, "graph_batch_size"] + 3e-8 * entries[sync]
    )
    fit = fit_step_records(records, max_num_seqs=truth.gmax, split_kv=truth.split_kv)
    assert fit.decode.features == TABLE_DECODE_FEATURES and fit.block_size == 256
    np.testing.assert_allclose(fit.decode.coefficients, (*truth.decode, 5e-4, 4e-6, 3e-8), rtol=1e-6)
    assert fit.decode.error.median_rel_error < 1e-9
    row = records[sync].iloc[0]
    shape = (int(row["num_seqs"]), int(row["num_context_tokens"]), int(row["max_seq_len"]))
    assert fit.decode_step_time(*shape) == pytest.approx(row["gpu_time_s"], rel=1e-9)
    ahead = fit.overlapped_model().decode_step_time(*shape)
    added = 5e-4 + 4e-6 * row["graph_batch_size"] + 3e-8 * entries[row.name]
    assert ahead == pytest.approx(row["gpu_time_s"] - added, rel=1e-9)
    for older in (
        fit_step_records(records.drop(columns="block_size"), max_num_seqs=truth.gmax),
        fit_step_records(records, max_num_seqs=truth.gmax, host_table=False),
    ):
        assert older.decode.features == ASYNC_DECODE_FEATURES and older.table_coefficient == 0.0


def test_the_block_table_term_exact_values() -> None:
    """c9 * num_seqs * ceil(max_seq_len / block_size) added after the linear terms, before the floor,
    for steps not scheduled ahead only; reported as overhead; the same floats in a run's
    vectorised pricing. A fit without it predicts as before bit for bit."""
    from simulator.latency.base import StepShape, accumulate_decode_times
    from simulator.latency.fitted import ASYNC_DECODE_FEATURES, TABLE_DECODE_FEATURES, table_entries

    pre = LinearFit(PREFILL_FEATURES, (1e-3,) * 6)
    coefs = (2e-3, 2e-5, 3e-8, 1e-7, 2e-9, 0.0, 4e-4, 3e-4, 5e-6)
    old = FittedModel(LinearFit(ASYNC_DECODE_FEATURES, coefs), pre, 256)
    new = FittedModel(LinearFit(TABLE_DECODE_FEATURES, (*coefs, 1e-6)), pre, 256, block_size=16)
    assert table_entries(5, 33, 16) == 15 and table_entries(5, 32, 16) == 10
    assert new.decode_step_time(5, 1000, 33) == old.decode_step_time(5, 1000, 33) + 1e-6 * 15
    # 2.9 ms (const, multi_row, sync, rows at b = 8) + 30 us + 3.828 us + 15 us
    assert new.decode_step_time(5, 1000, 33) == 0.002948828
    assert new.overlapped_model().decode_step_time(5, 1000, 33) == old.overlapped_model().decode_step_time(
        5, 1000, 33
    )
    step = new.predict(StepShape.decode(5, 1000, 33))
    assert step.total == new.decode_step_time(5, 1000, 33)
    assert step.overhead == pytest.approx(2e-3 + 4e-4 + 3e-4 + 1e-6 * 15, rel=1e-12)
    times = new.decode_step_times(5, 1000, 33, 400, 0.0, 1e9)
    assert times == accumulate_decode_times(new.decode_step_time, 5, 1000, 33, 400, 0.0, 1e9)
    with pytest.raises(ValueError, match="block_size"):
        FittedModel(LinearFit(TABLE_DECODE_FEATURES, (*coefs, 1e-6)), pre, 256)


def _with_prefix_hits(records: pd.DataFrame, per_token: float) -> pd.DataFrame:
    """The synthetic records with prefix hits on some prefill/mixed steps, each costing `per_token`
    a cached token more (wall and GPU time alike)."""
    out = records.copy()
    rows = np.flatnonzero((out["kind"] != "decode").to_numpy() & ~out["compiled"].to_numpy())
    cached = np.zeros(len(out), np.int64)
    cached[rows] = (np.arange(len(rows)) % 5) * 4096  # 0, 4k, ..., 16k hit tokens
    out["total_num_cached_tokens"] = cached
    for column in ("gpu_time_s", "wall_time_s"):
        out[column] = out[column] + per_token * cached
    return out


def test_prefix_hit_term_is_recovered_and_priced(make_records, truth) -> None:
    from simulator.latency.base import StepShape
    from simulator.latency.fitted import PREFIX_PREFILL_FEATURES

    records = _with_prefix_hits(make_records(noise=0.0), 1.25e-7)
    fit = fit_step_records(records, max_num_seqs=truth.gmax, split_kv=truth.split_kv, prefix_hits=True)
    assert fit.prefill.features == PREFIX_PREFILL_FEATURES
    np.testing.assert_allclose(fit.prefill.coefficients, (*truth.prefill, 1.25e-7), rtol=1e-6)
    shape = StepShape("prefill", 2, 2, 600, 600, 0, 500, 90_000.0, total_num_cached_tokens=8192)
    hits = fit.predict(shape)
    none = fit.predict(StepShape("prefill", 2, 2, 600, 600, 0, 500, 90_000.0))
    assert hits.total - none.total == pytest.approx(1.25e-7 * 8192, rel=1e-6)
    assert hits.overhead - none.overhead == pytest.approx(1.25e-7 * 8192, rel=1e-6)  # a host cost
    plain = fit_step_records(records, max_num_seqs=truth.gmax, split_kv=truth.split_kv)
    assert plain.prefill.features == PREFILL_FEATURES  # off unless asked
    assert (
        plain.predict(shape).total
        == plain.predict(StepShape("prefill", 2, 2, 600, 600, 0, 500, 90_000.0)).total
    )


def test_prefix_hit_term_needs_its_column(make_records, truth) -> None:
    records = make_records(noise=0.0).drop(columns="total_num_cached_tokens")
    with pytest.raises(ValueError, match="prefix-hit term needs the total_num_cached_tokens column"):
        fit_step_records(records, max_num_seqs=truth.gmax, prefix_hits=True)


def test_kvplan_fit_prefix_hit_term_round_trips(tmp_path, make_records, truth, capsys) -> None:
    from simulator.cli import main
    from simulator.defaults import SHIPPED_PROFILE_DIR
    from simulator.latency.base import StepShape
    from simulator.latency.profile import LatencyProfile

    records = tmp_path / "r.parquet"
    _with_prefix_hits(make_records(noise=0.0), 1.25e-7).to_parquet(records, index=False)
    like = SHIPPED_PROFILE_DIR / "qwen3-0.6b_h200_tp1_bs256.json"
    out = tmp_path / "p.json"
    argv = ["fit", "--records", str(records), "--like", str(like), "--out", str(out), "--split-kv", "8:132"]
    assert main([*argv, "--prefix-hit-term", "--no-span-term", "--loss", "absolute"]) == 0
    assert "prefix-hit term: 125.0 ns a cached prompt token" in capsys.readouterr().out
    profile = LatencyProfile.load(out)
    assert profile.prefill.as_dict()["total_num_cached_tokens"] == pytest.approx(1.25e-7, rel=1e-6)
    model = profile.to_latency_model()
    shape = dict(kind="prefill", num_seqs=1, num_prefill_seqs=1, total_num_scheduled_tokens=100,
                 num_prefill_tokens=100, num_context_tokens=0, max_seq_len=100, prefill_attn_work=5_000.0)  # fmt: skip
    gap = (
        model.predict(StepShape(**shape, total_num_cached_tokens=1000)).total
        - model.predict(StepShape(**shape)).total
    )
    assert gap == pytest.approx(1.25e-4, rel=1e-6)


def test_attributed_times_move_queued_gpu_work_to_the_chunk_that_queued_it() -> None:
    from simulator.latency.fitted import attributed_times

    steps = pd.DataFrame(
        {
            "step": [0, 1, 2, 3, 4],
            "kind": ["decode", "prefill", "prefill", "prefill", "decode"],
            "wall_time_s": [0.002, 0.006, 0.005, 0.120, 0.003],
            "gpu_time_s": [0.0018, 0.030, 0.050, 0.040, 0.0028],
        }
    )
    got = attributed_times(steps)
    # chunks 1 and 2 queued (GPU time far past wall time): charged their GPU time; step 3 waited for
    # their 0.069 s and pays it out of its 0.080 s beyond its own GPU time; the total is kept
    np.testing.assert_allclose(got, [0.002, 0.030, 0.050, 0.051, 0.003], rtol=1e-12)
    assert got.sum() == pytest.approx(steps["wall_time_s"].sum(), rel=1e-12)
    with pytest.raises(ValueError, match="step order"):
        attributed_times(steps.iloc[::-1])


# ---- the attention-span term --------------------------------------------------------------------
SPAN = dict(num_kv_heads=8, num_q_per_kv=2, num_sms=132)


def test_attn_span_of_a_short_query_over_a_long_prefix() -> None:
    from simulator.latency.base import StepShape
    from simulator.latency.fitted import SPAN_COLUMNS, AttnSpan, attn_span, attn_spans

    span = AttnSpan(**SPAN)

    def of(shape: StepShape) -> float:
        return attn_span(span, *(getattr(shape, c) for c in SPAN_COLUMNS))

    # 16 new tokens over 32,672 cached: one 128-row tile per kv head, 8 programs over 32,688 keys
    short = StepShape("prefill", 1, 1, 16, 16, 32_672, 32_688, 16 * (32_672 + 17 / 2))
    assert of(short) == pytest.approx(32_688 - 8 * 32_688 / 132, rel=1e-12)
    # a whole 8,192-token chunk from empty fills the SMs many times over: no span
    full = StepShape("prefill", 1, 1, 8192, 8192, 0, 8192, 8192 * 8193 / 2)
    assert of(full) == 0.0
    # a mixed step: 100 new tokens over 20,000 cached beside 3 decodes of 4,000 cached each
    mixed = StepShape("mixed", 4, 1, 103, 100, 32_000, 20_100, 100 * (20_000 + 101 / 2))
    keys = 8 * (2 * 20_100 + 12_000 + 3)  # 100 rows x 2 query heads = 2 tiles; decodes one each
    assert of(mixed) == pytest.approx(20_100 - keys / 132, rel=1e-12)
    # the form over record columns (fits) gives the same floats
    frame = pd.DataFrame([{c: getattr(s, c) for c in SPAN_COLUMNS} for s in (short, full, mixed)])
    np.testing.assert_array_equal(attn_spans(span, frame), [of(s) for s in (short, full, mixed)])


def _with_span(records: pd.DataFrame, per_key: float) -> pd.DataFrame:
    """The synthetic records with each prefill/mixed step costing `per_key` a key of its span more."""
    from simulator.latency.fitted import AttnSpan, attn_spans

    out = records.copy()
    extra = attn_spans(AttnSpan(**SPAN), out)
    extra = np.where((out["kind"] != "decode").to_numpy(), extra * per_key, 0.0)
    for column in ("gpu_time_s", "wall_time_s"):
        out[column] = out[column] + extra
    return out


def test_span_term_is_recovered_and_priced_as_attention(make_records, truth) -> None:
    from simulator.latency.base import StepShape
    from simulator.latency.fitted import SPAN_FEATURES, AttnSpan

    records = _with_span(make_records(noise=0.0), 3e-7)
    fit = fit_step_records(
        records, max_num_seqs=truth.gmax, split_kv=truth.split_kv, attn_span=AttnSpan(**SPAN)
    )
    assert fit.prefill.features == PREFILL_FEATURES + SPAN_FEATURES
    np.testing.assert_allclose(fit.prefill.coefficients, (*truth.prefill, 3e-7), rtol=1e-6)
    short = StepShape("prefill", 1, 1, 16, 16, 32_672, 32_688, 16 * (32_672 + 17 / 2))
    c = fit.prefill.coefficients
    without = c[2] * short.prefill_attn_work + c[3] * short.num_context_tokens
    assert fit.predict(short).attention - without == pytest.approx(
        c[6] * (32_688 - 8 * 32_688 / 132), rel=1e-9
    )


def test_span_term_needs_its_geometry(truth) -> None:
    from simulator.latency.fitted import SPAN_FEATURES

    pre = LinearFit(PREFILL_FEATURES + SPAN_FEATURES, (1e-3, 1e-6, 0.0, 0.0, 0.0, 0.0, 1e-7))
    dec = LinearFit(DECODE_FEATURES, (1e-3, 1e-6, 1e-9, 0.0, 0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="attn_span: a prefill fit with attn_span needs"):
        FittedModel(dec, pre, 256)


def test_kvplan_fit_span_term_round_trips_and_follows_like(tmp_path, make_records, capsys) -> None:
    from simulator.cli import main
    from simulator.defaults import SHIPPED_PROFILE_DIR
    from simulator.latency.fitted import SPAN_FEATURES, AttnSpan
    from simulator.latency.profile import LatencyProfile

    records = tmp_path / "r.parquet"
    _with_span(make_records(noise=0.0), 3e-7).to_parquet(records, index=False)
    like = SHIPPED_PROFILE_DIR / "qwen3-0.6b_h200_tp1_bs256.json"
    argv = [
        "fit",
        "--records",
        str(records),
        "--like",
        str(like),
        "--split-kv",
        "8:132",
        "--loss",
        "absolute",
    ]
    assert main([*argv, "--span-term", "--out", str(tmp_path / "a.json")]) == 0
    assert "span term: 300.0 ns a key of the longest sequence" in capsys.readouterr().out
    profile = LatencyProfile.load(tmp_path / "a.json")
    assert profile.attn_span == AttnSpan(**SPAN)  # Qwen3-0.6B: 16 query heads over 8 kv heads, 132 SMs
    assert profile.prefill.as_dict()["attn_span"] == pytest.approx(3e-7, rel=1e-6)
    assert main([*argv, "--out", str(tmp_path / "b.json")]) == 0  # as --like has it
    assert LatencyProfile.load(tmp_path / "b.json").prefill.features[-1] == SPAN_FEATURES[0]
    assert main([*argv, "--no-span-term", "--out", str(tmp_path / "c.json")]) == 0
    plain = LatencyProfile.load(tmp_path / "c.json")
    assert SPAN_FEATURES[0] not in plain.prefill.features and plain.attn_span is None
    capsys.readouterr()
    assert main([*argv, "--span-term", "--no-span-term", "--out", str(tmp_path / "d.json")]) != 0
    assert "--span-term and --no-span-term: give one of them" in capsys.readouterr().err
