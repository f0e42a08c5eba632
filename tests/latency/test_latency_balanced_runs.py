"""Runs of decode steps priced by a balanced split-KV fitted or transferred model: the stretch-wise
scalar phase and the whole `decode_step_times` give the reference loop's floats exactly, long runs too."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from simulator.defaults import TRANSFER_MODEL
from simulator.fast_forward import accumulate_decode_times
from simulator.latency.fitted import (
    DECODE_FEATURES,
    PREFILL_FEATURES,
    FittedModel,
    LinearFit,
    SplitKV,
    StepFloors,
)
from simulator.latency.transfer import TransferCoefficients, TransferredModel
from simulator.models import resolve_model

# decode: const, padded batch, context, max_seq_len, b * max_seq_len, longest split, multi-row
_DECODE = (1.1e-3, 2.0e-6, 3.0e-9, 1.0e-8, 2.0e-11, 6.0e-7, 1.5e-4)
_PREFILL = LinearFit(PREFILL_FEATURES, (3e-3, 2.5e-6, 1e-10, 2e-8, 5e-5, 1e-5))


def _model(heads: int, sms: int, block: int, fine: bool, floor: float, gmax: int = 512) -> FittedModel:
    split_kv = SplitKV(heads, sms, block, balanced=True, split_tokens=64 if fine and block > 64 else 0)
    floors = StepFloors(decode=floor) if floor else None
    return FittedModel(LinearFit(DECODE_FEATURES, _DECODE), _PREFILL, gmax, split_kv=split_kv, floors=floors)


def _hex(times: list[float]) -> list[str]:
    return [t.hex() for t in times]


_shapes = dict(
    heads=st.sampled_from([1, 2, 8, 32]),
    sms=st.sampled_from([66, 132]),
    block=st.sampled_from([16, 64, 256]),
    fine=st.booleans(),
    num_seqs=st.integers(1, 600),
    context=st.integers(0, 2_000_000),
    max_len=st.integers(0, 40_000),
)


@settings(max_examples=150, deadline=None)
@given(**_shapes, d=st.integers(0, 3000))
def test_split_run_holds_its_splits_for_the_steps_it_says(
    heads, sms, block, fine, num_seqs, context, max_len, d
) -> None:
    """`_split_run`'s count is `_splits`' (the engine's rule), and so is that of every step it says
    the run keeps it for."""
    model = _model(heads, sms, block, fine, 0.0)
    b = 512 if num_seqs > 512 else num_seqs
    splits, hold = model._split_run(b, context, max_len, num_seqs)
    assert hold >= 1
    assert splits == model._splits(b, context, max_len) == model.split_kv.divisor(b, context, max_len)
    j = d % hold
    assert model._splits(b, context + j * num_seqs, max_len + j) == splits


@settings(max_examples=80, deadline=None)
@given(
    **_shapes,
    max_steps=st.integers(0, 3000),
    start=st.floats(0.0, 1e5, allow_nan=False),
    horizon=st.floats(-1.0, 20.0, allow_nan=False),
    floor=st.sampled_from([0.0, 1.26e-3, 5e-3]),
)
def test_long_balanced_runs_match_the_reference_loop(
    heads, sms, block, fine, num_seqs, context, max_len, max_steps, start, horizon, floor
) -> None:
    """The scalar phase on its own (any length) and `decode_step_times` (scalar, then numpy passes)
    end every step on the reference's float, with floors that bind or not."""
    model = _model(heads, sms, block, fine, floor)
    deadline = start + horizon
    args = (num_seqs, context, max_len, max_steps, start, deadline)
    expected = _hex(accumulate_decode_times(model.decode_step_time, *args))
    assert _hex(model._leading_decode_times(*args)) == expected
    assert _hex(model.decode_step_times(*args)) == expected


def test_a_run_across_many_split_changes_is_exact() -> None:
    """One run of 3,000 steps of 96 rows from a short context: 78 stretches (unit boundaries of the
    longest sequence, and the step's keys per program), over which its split count changes 5 times;
    every end time is the reference's."""
    model = _model(8, 132, 16, False, 1.26e-3)
    args = (96, 1_000, 20, 3_000, 0.0, float("inf"))
    expected = accumulate_decode_times(model.decode_step_time, *args)
    splits = [model._splits(96, 1_000 + j * 96, 20 + j) for j in range(3_000)]
    assert sum(a != b for a, b in zip(splits, splits[1:])) == 5
    assert _hex(model._leading_decode_times(*args)) == _hex(expected)
    assert _hex(model.decode_step_times(*args)) == _hex(expected)


@settings(max_examples=20, deadline=None)
@given(
    heads=_shapes["heads"],
    sms=_shapes["sms"],
    block=_shapes["block"],
    fine=_shapes["fine"],
    runs=st.lists(
        st.tuples(
            st.integers(1, 40),
            st.integers(0, 200_000),
            st.integers(0, 5_000),
            st.integers(0, 300),
            st.floats(0.0, 1.0, allow_nan=False),
        ),
        min_size=2,
        max_size=30,
    ),
    floor=st.sampled_from([0.0, 1.26e-3]),
)
def test_runs_priced_one_after_another_match_the_reference_loop(heads, sms, block, fine, runs, floor) -> None:
    """One model prices many runs, of batches it has priced before and new ones (its constants
    kept by batch), each on the reference loop's floats."""
    model = _model(heads, sms, block, fine, floor)
    for num_seqs, context, max_len, max_steps, horizon in runs:
        args = (num_seqs, context, max_len, max_steps, 2.0, 2.0 + horizon)
        expected = _hex(accumulate_decode_times(model.decode_step_time, *args))
        assert _hex(model.decode_step_times(*args)) == expected


@settings(max_examples=60, deadline=None)
@given(
    **_shapes,
    num_steps=st.sampled_from([1, 65, 300, 2_000, 4_096]),
    floor=st.sampled_from([0.0, 1.26e-3]),
)
def test_numpy_pass_prices_each_step_as_decode_step_time(
    heads, sms, block, fine, num_seqs, context, max_len, num_steps, floor
) -> None:
    """`_decode_step_array` of a run, its coefficients filled stretch by stretch (few stretches) or
    step by step (many), is `decode_step_time` of each of its steps."""
    model = _model(heads, sms, block, fine, floor)
    got = model._decode_step_array(num_seqs, context, max_len, num_steps).tolist()
    expected = [
        model.decode_step_time(num_seqs, context + j * num_seqs, max_len + j) for j in range(num_steps)
    ]
    assert _hex(got) == _hex(expected)


@settings(max_examples=80, deadline=None)
@given(
    heads=st.sampled_from([1, 2, 8]),
    block=st.sampled_from([16, 32, 256]),
    gpu=st.sampled_from(["h200", "h100"]),
    balanced=st.booleans(),
    num_seqs=st.integers(1, 600),
    context=st.integers(0, 2_000_000),
    max_len=st.integers(0, 40_000),
    max_steps=st.integers(0, 3000),
    start=st.floats(0.0, 1e5, allow_nan=False),
    horizon=st.floats(-1.0, 20.0, allow_nan=False),
)
def test_transferred_runs_match_the_reference_loop(
    heads, block, gpu, balanced, num_seqs, context, max_len, max_steps, start, horizon
) -> None:
    """The shipped transferred model's scalar phase, which prices a stretch of steps that keep their
    splits with one coefficient (`split_run`), and `decode_step_times` end every step on the
    reference's float, balanced kernel or not."""
    model = _transferred(heads, block, gpu, balanced)
    args = (num_seqs, context, max_len, max_steps, start, start + horizon)
    expected = _hex(accumulate_decode_times(model.decode_step_time, *args))
    assert _hex(model._leading_decode_times(*args)) == expected
    assert _hex(model.decode_step_times(*args)) == expected


def _transferred(heads: int, block: int, gpu: str, balanced: bool) -> TransferredModel:
    """The shipped transferred model of a toy model with `heads` kv heads on `gpu`, with the balanced
    kernel of the engine or the batch-size rule."""
    model = replace(resolve_model("qwen3-0.6b"), num_kv_heads=heads, num_heads=heads * 2)
    split_kv = SplitKV(heads, 132, block, balanced=True) if balanced else SplitKV(heads, 132)
    return TransferredModel(TransferCoefficients.load(TRANSFER_MODEL), model, gpu, 1, block, split_kv)
