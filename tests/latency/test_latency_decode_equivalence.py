"""decode_step_time(n, ctx, max_len) is bit-for-bit predict(batch).total for real decode batches,
and a Scheduler fast-forward with it lands on the same clock as stepping with predict."""

from __future__ import annotations

from functools import partial

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.core.block_manager import BlockManager
from engine.core.config import SchedulerConfig
from engine.model_spec import ModelSpec
from engine.sampling_params import SamplingParams
from simulator.fast_forward import FastForwardScheduler as Scheduler
from simulator.fast_forward import accumulate_decode_times
from simulator.latency import LatencyModel, RooflineModel, StepShape


def test_models_satisfy_protocol(latency_models: dict[str, LatencyModel]) -> None:
    for model in latency_models.values():
        assert isinstance(model, LatencyModel)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(computed=st.lists(st.integers(min_value=0, max_value=9000), min_size=1, max_size=300))
def test_decode_step_time_is_predict_total_bit_for_bit(
    computed: list[int], latency_models: dict[str, LatencyModel], make_decode_batch
) -> None:
    batch = make_decode_batch(computed)
    n, ctx, max_len = len(computed), sum(computed), max(computed) + 1
    assert (batch.num_seqs, batch.num_context_tokens, batch.max_seq_len) == (n, ctx, max_len)
    for name, model in latency_models.items():
        fast = model.decode_step_time(n, ctx, max_len)
        assert type(fast) is float, name
        for shape in (batch, StepShape.decode(n, ctx, max_len), StepShape.of(batch)):
            st_ = model.predict(shape)
            assert st_.total.hex() == fast.hex(), name
            parts = st_.linear + st_.attention + st_.communication + st_.overhead
            assert abs(parts - st_.total) <= 1e-12 * st_.total, name


def test_fast_forward_matches_stepping_with_predict(latency_models: dict[str, LatencyModel]) -> None:
    """A Scheduler run that fast-forwards decode stretches with decode_step_time ends on the same
    clock, with the same inter-token gaps, as stepping every batch with predict().total."""
    model = latency_models["fitted"]
    forwarded = [0]
    reference = partial(accumulate_decode_times, model.decode_step_time)

    def run(fast: bool, decode_times=reference) -> tuple[float, list[float]]:
        now = [0.0]
        sched = Scheduler(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=4096), BlockManager(512, 16),
                          clock=lambda: now[0])  # fmt: skip
        seqs = [
            sched.add_request(
                [i + 1] * (50 + 37 * i), SamplingParams(max_tokens=40 + 3 * i, ignore_eos=True), 0.0
            )
            for i in range(20)
        ]
        while sched.has_unfinished():
            if fast:
                k, end, _ = sched.fast_forward(decode_times, now[0], float("inf"))
                if k:
                    forwarded[0] += k
                    now[0] = end
                    continue
            batch = sched.schedule()
            now[0] = now[0] + model.predict(batch).total
            sched.postprocess(batch, [0] * batch.num_seqs)
        assert all(s.is_finished and s.num_output_tokens == 40 + 3 * i for i, s in enumerate(seqs))
        return now[0], [(s.first_token_time, s.finish_time) for s in seqs]

    slow_end, slow_last = run(False)
    for decode_times in (reference, model.decode_step_times):
        forwarded[0] = 0
        fast_end, fast_last = run(True, decode_times)
        assert fast_end.hex() == slow_end.hex()
        assert fast_last == slow_last
        assert forwarded[0] > 100  # the fast path did run


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_seqs=st.integers(min_value=1, max_value=600),
    context=st.integers(min_value=0, max_value=2_000_000),
    max_len=st.integers(min_value=1, max_value=40_000),
    max_steps=st.integers(min_value=0, max_value=5000),
    start=st.floats(min_value=0.0, max_value=1e5, allow_nan=False),
    horizon=st.floats(min_value=-1.0, max_value=50.0, allow_nan=False),
)
@example(
    num_seqs=64, context=64_000, max_len=1001, max_steps=5000, start=0.0, horizon=float("inf")
)  # 3 chunks
@example(num_seqs=8, context=0, max_len=1, max_steps=4096, start=10.0, horizon=0.0)  # deadline at start
@example(num_seqs=8, context=0, max_len=1, max_steps=4096, start=10.0, horizon=2.0048)
def test_vectorised_decode_step_times_match_the_scheduler_reference(
    latency_models: dict[str, LatencyModel],
    num_seqs: int,
    context: int,
    max_len: int,
    max_steps: int,
    start: float,
    horizon: float,
) -> None:
    deadline = start + horizon
    for name, model in latency_models.items():
        expected = accumulate_decode_times(
            model.decode_step_time, num_seqs, context, max_len, max_steps, start, deadline
        )
        got = model.decode_step_times(num_seqs, context, max_len, max_steps, start, deadline)
        assert [t.hex() for t in got] == [t.hex() for t in expected], name


def test_inlined_leading_decode_times_match_the_reference_step_by_step(
    latency_models: dict[str, LatencyModel],
) -> None:
    """Each model's inlined scalar phase (`_leading_decode_times`) gives the reference loop's floats
    exactly, whatever stops it: max_steps, a deadline at the start, a deadline mid-run."""
    cases = [
        (1, 0, 1, 0, 0.0, float("inf")),
        (1, 0, 1, 64, 0.0, float("inf")),
        (3, 4_000, 2_001, 64, 12.5, 12.5),
        (7, 12_345, 3_000, 64, 1.0, 1.2),
        (256, 1_000_000, 9_000, 40, 3600.0, float("inf")),
        (600, 2_000_000, 40_000, 64, 0.1, 0.35),
    ]
    for name, model in latency_models.items():
        for n, ctx, max_len, steps, start, deadline in cases:
            expected = accumulate_decode_times(
                model.decode_step_time, n, ctx, max_len, steps, start, deadline
            )
            got = model._leading_decode_times(n, ctx, max_len, steps, start, deadline)
            assert [t.hex() for t in got] == [t.hex() for t in expected], (name, n, ctx, steps)


def test_roofline_decode_step_times_exact_values(model: ModelSpec) -> None:
    """Known floats for the H200 roofline of Qwen3-0.6B: 2 sequences, 100 cached tokens."""
    roofline = RooflineModel(model, "h200")
    times = roofline.decode_step_times(2, 100, 51, 3, 0.0, float("inf"))
    step = roofline.decode_step_time(2, 100, 51)
    assert times[1] == step
    assert times == [
        0.0,
        step,
        step + roofline.decode_step_time(2, 102, 52),
        times[2] + roofline.decode_step_time(2, 104, 53),
    ]
    # about 2.315 ms a step
    assert [t.hex() for t in times] == [
        "0x0.0p+0",
        "0x1.2f7626cb7fbadp-9",
        "0x1.2f772758fe56bp-8",
        "0x1.c7343bd9bb6bep-8",
    ]


def test_numpy_passes_sized_to_the_deadline_stay_exact(latency_models: dict[str, LatencyModel]) -> None:
    """Runs of many allowed steps cut by a deadline: near (step by step), far (numpy passes sized
    to reach it), and across several passes, each equal to the reference float for float."""
    for name, model in latency_models.items():
        for steps in (65, 80, 129, 200, 300, 700, 3000):
            ref = accumulate_decode_times(
                model.decode_step_time, 5, 7_000, 1_500, steps + 1, 1.0, float("inf")
            )
            deadline = (ref[steps - 1] + ref[steps]) / 2  # exactly `steps` steps start before it
            got = model.decode_step_times(5, 7_000, 1_500, 1 << 20, 1.0, deadline)
            assert [t.hex() for t in got] == [t.hex() for t in ref[:-1]], (name, steps)


def test_steps_that_shrink_still_give_the_reference_times() -> None:
    """A fit with a negative context coefficient (steps shrink as contexts grow) makes a deadline-
    sized numpy pass fall short: another pass follows and the times stay exact."""
    from simulator.latency.fitted import DECODE_FEATURES, PREFILL_FEATURES, FittedModel, LinearFit

    decode = LinearFit(DECODE_FEATURES, (2e-3, 2e-5, -1e-8, 1e-7, 2e-9, 1e-7, 3e-4))
    prefill = LinearFit(PREFILL_FEATURES, (3e-3, 2.5e-6, 1e-10, 2e-8, 5e-5, 1e-5))
    model = FittedModel(decode, prefill, max_graph_batch_size=256)
    ref = accumulate_decode_times(model.decode_step_time, 64, 100_000, 3_000, 2001, 0.0, float("inf"))
    assert 0 < ref[2000] - ref[1999] < ref[1] - ref[0]  # about 2.96 ms, then 0.4 us less each step
    deadline = (ref[1999] + ref[2000]) / 2
    got = model.decode_step_times(64, 100_000, 3_000, 1 << 20, 0.0, deadline)
    assert [t.hex() for t in got] == [t.hex() for t in ref[:-1]]


def test_chunk_size_of_a_numpy_pass() -> None:
    from simulator.latency.base import _chunk_size, arange_int64

    assert _chunk_size(256, float("inf"), 0.002) == 256  # no deadline
    assert _chunk_size(256, 1.0, 0.002) == 256  # the deadline is 500 steps away
    assert _chunk_size(256, 0.2, 0.002) == 102  # 100 steps away: 100 + 2
    assert _chunk_size(256, 0.0001, 0.002) == 2
    assert _chunk_size(256, 0.2, 0.0) == 256  # no estimate from an empty step
    assert arange_int64(10, 4, 3).tolist() == [10, 13, 16, 19]
    assert arange_int64(7, 3, 0).tolist() == [7, 7, 7]


def test_decode_context_tokens_of_mixed_batches() -> None:
    """The decodes' cached tokens of a mixed batch: total minus the prefills' (exact integers), and
    the sum over decodes for any batch-like object whose totals do not add up."""
    from types import SimpleNamespace

    from engine.core.scheduler import make_batch
    from engine.core.sequence import Sequence
    from simulator.latency.base import decode_context_tokens

    params = SamplingParams(max_tokens=100, ignore_eos=True)
    seqs = [Sequence(i, [3] * n, params) for i, n in enumerate((50, 70, 400, 90, 1000))]
    computed = [49, 69, 128, 89, 0]  # decode, decode, chunk, decode, a new prompt
    batch = make_batch(seqs, [1, 1, 100, 1, 500], computed, [0] * 5, [], 9, num_leading_decodes=2)
    assert (batch.kind, batch.is_prefill) == ("mixed", (False, False, True, False, True))
    assert decode_context_tokens(batch) == 49 + 69 + 89
    odd = SimpleNamespace(
        kind="mixed",
        num_seqs=3,
        num_context_tokens=999,
        num_computed_tokens=(5, 7, 11),
        is_prefill=(False, True, False),
    )
    assert decode_context_tokens(odd) == 16
