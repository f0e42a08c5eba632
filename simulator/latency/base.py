"""The latency-model interface: `StepTime`, the `LatencyModel` protocol and the shape of a step.

A latency model turns one `ScheduledBatch` (or anything with its totals, see `BatchShape`) into
seconds. This module holds no model of its own; `roofline.py` and `fitted.py` implement it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from itertools import compress
from typing import Any, Protocol, runtime_checkable

import numpy as np

from engine.core.scheduler import ScheduledBatch
from simulator.fast_forward import accumulate_decode_times

KINDS = ("prefill", "decode", "mixed", "empty")
# `decode_step_times`: passes of up to _SCALAR_STEPS steps go step by step, longer ones to numpy, in
# passes of growing size.
_SCALAR_STEPS = 128
_FIRST_CHUNK = 256
_MAX_CHUNK = 4096


@dataclass(frozen=True, slots=True)
class StepTime:
    """Predicted time of one step, in seconds, split by what it is spent on.

    `total` is the step's duration. For the linear models here it is the sum of the four parts (to
    within float rounding); it is carried separately so that a decode step's total is exactly the
    float that `decode_step_time` returns.
    """

    linear: float  # weight GEMMs (QKV/O projections, MLP, LM head)
    attention: float  # attention kernels: KV reads and query-key work
    communication: float  # tensor-parallel all-reduces
    overhead: float  # per-step and per-sequence fixed costs (CPU, launches, sampling)
    total: float


ZERO_STEP = StepTime(0.0, 0.0, 0.0, 0.0, 0.0)


class BatchShape(Protocol):
    """The totals of a step that latency models read: a subset of `ScheduledBatch`'s attributes,
    with the same meanings (CONTRACT.md). Step records and `StepShape` provide them too."""

    @property
    def kind(self) -> str: ...
    @property
    def num_seqs(self) -> int: ...
    @property
    def num_prefill_seqs(self) -> int: ...
    @property
    def num_decode_seqs(self) -> int: ...
    @property
    def total_num_scheduled_tokens(self) -> int: ...
    @property
    def num_prefill_tokens(self) -> int: ...
    @property
    def total_num_cached_tokens(self) -> int: ...
    @property
    def num_context_tokens(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def prefill_attn_work(self) -> float: ...


@dataclass(frozen=True, slots=True)
class StepShape:
    """A step's totals without its sequences: for predictions from step records, sweeps and tests.

    For a decode step: num_context_tokens = tokens cached before the step, summed over sequences;
    max_seq_len = max(computed + 1); prefill_attn_work = 0.
    """

    kind: str
    num_seqs: int
    num_prefill_seqs: int
    total_num_scheduled_tokens: int
    num_prefill_tokens: int
    num_context_tokens: int
    max_seq_len: int
    prefill_attn_work: float = 0.0
    total_num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"StepShape.kind: {self.kind!r} is not one of {list(KINDS)}")
        if not 0 <= self.num_prefill_seqs <= self.num_seqs:
            raise ValueError(
                f"StepShape.num_prefill_seqs: {self.num_prefill_seqs} must be in [0, num_seqs={self.num_seqs}]"
            )

    @property
    def num_decode_seqs(self) -> int:
        return self.num_seqs - self.num_prefill_seqs

    @classmethod
    def decode(cls, num_seqs: int, num_context_tokens: int, max_seq_len: int) -> StepShape:
        """A decode-only step: one new token for each of `num_seqs` sequences."""
        return cls("decode", num_seqs, 0, num_seqs, 0, num_context_tokens, max_seq_len)

    @classmethod
    def of(cls, batch: Any) -> StepShape:
        """The totals of a `ScheduledBatch`, a step-record row (pandas Series / namedtuple) or a dict."""

        def get(name: str) -> Any:
            try:
                return getattr(batch, name)
            except AttributeError:
                return batch[name]

        return cls(
            kind=str(get("kind")),
            num_seqs=int(get("num_seqs")),
            num_prefill_seqs=int(get("num_prefill_seqs")),
            total_num_scheduled_tokens=int(get("total_num_scheduled_tokens")),
            num_prefill_tokens=int(get("num_prefill_tokens")),
            num_context_tokens=int(get("num_context_tokens")),
            max_seq_len=int(get("max_seq_len")),
            prefill_attn_work=float(get("prefill_attn_work")),
            total_num_cached_tokens=int(get("total_num_cached_tokens")),
        )


@runtime_checkable
class LatencyModel(Protocol):
    """What the simulator needs from a latency model. Models built on `LatencyModelBase` also offer
    `decode_step_times(...)`, a vectorised, bit-identical form of the scheduler's
    `accumulate_decode_times(decode_step_time, ...)` that the simulator uses when present."""

    def predict(self, batch: BatchShape) -> StepTime:
        """Time of one step (a `ScheduledBatch` or any `BatchShape`)."""
        ...

    def decode_step_time(self, num_seqs: int, num_context_tokens: int, max_seq_len: int) -> float:
        """Total time of a decode-only step with these totals; bit-for-bit `predict(batch).total`."""
        ...


class LatencyModelBase(ABC):
    """Routes `predict`: decode-only batches through the scalar `decode_step_time` (so that the two
    agree bit for bit), empty batches to zero, prefill and mixed batches to `_predict_prefill`."""

    @abstractmethod
    def decode_step_time(self, num_seqs: int, num_context_tokens: int, max_seq_len: int) -> float:
        """Hot path of the scheduler's fast-forward: plain scalar arithmetic, no allocation."""

    @abstractmethod
    def _decode_parts(
        self, num_seqs: int, num_context_tokens: int, max_seq_len: int
    ) -> tuple[float, float, float, float]:
        """(linear, attention, communication, overhead) of a decode step."""

    @abstractmethod
    def _predict_prefill(self, batch: BatchShape) -> StepTime:
        """A prefill or mixed step."""

    @abstractmethod
    def _decode_step_array(
        self, num_seqs: int, num_context_tokens: int, max_seq_len: int, num_steps: int
    ) -> np.ndarray:
        """`decode_step_time` of the first `num_steps` steps of a decode run (step j, from 0, reads
        num_context_tokens + j * num_seqs cached tokens; its longest sequence is max_seq_len + j),
        same operations in the same order (so the same floats: numpy float64 ops are IEEE like
        Python's), as a new array the caller may reuse."""

    def decode_step_times(
        self,
        num_seqs: int,
        num_context_tokens: int,
        max_seq_len: int,
        max_steps: int,
        start: float,
        deadline: float,
    ) -> list[float]:
        """End times of consecutive decode steps, bit-for-bit those of the scheduler's reference
        `accumulate_decode_times(self.decode_step_time, ...)`: times[0] = start, times[j] =
        times[j-1] + time of step j (whose context is num_context_tokens + (j-1) * num_seqs), up to
        `max_steps` steps, each starting before `deadline`. Vectorised with numpy."""
        # Short runs (a request due soon, one about to finish) are cheaper step by step; longer ones
        # go to numpy at once, in growing passes sized to the deadline (the step's time says how
        # many steps reach it), step by step again when it is near.
        if max_steps <= _SCALAR_STEPS or start >= deadline:
            return self._leading_decode_times(
                num_seqs, num_context_tokens, max_seq_len, max_steps, start, deadline
            )
        times = [start]
        done, t, last_step = 0, start, self.decode_step_time(num_seqs, num_context_tokens, max_seq_len)
        chunk = _FIRST_CHUNK
        while done < max_steps and t < deadline:
            m = _chunk_size(min(chunk, max_steps - done), deadline - t, last_step)
            context, length = num_context_tokens + done * num_seqs, max_seq_len + done
            if m <= _SCALAR_STEPS:
                times += self._leading_decode_times(num_seqs, context, length, m, t, deadline)[1:]
            else:
                ends = self._decode_step_array(num_seqs, context, length, m)
                ends[0] += t  # then add.accumulate: sequential, like the loop (t + step 1, + step 2, ...)
                np.add.accumulate(ends, out=ends)
                late = np.flatnonzero(ends[: m - 1] >= deadline)  # step i + 2 starts at ends[i]: not run
                times += (ends[: late[0] + 1] if late.size else ends).tolist()
                chunk = min(4 * chunk, _MAX_CHUNK)
            done, t = len(times) - 1, times[-1]
            last_step = t - times[-2]
        return times

    def _leading_decode_times(
        self,
        num_seqs: int,
        num_context_tokens: int,
        max_seq_len: int,
        max_steps: int,
        start: float,
        deadline: float,
    ) -> list[float]:
        """The scalar phase of `decode_step_times` (at most `_SCALAR_STEPS` steps): the reference
        loop here; models override it with the same float operations inlined, without a call a step."""
        return accumulate_decode_times(
            self.decode_step_time, num_seqs, num_context_tokens, max_seq_len, max_steps, start, deadline
        )

    def predict(self, batch: BatchShape) -> StepTime:
        kind = batch.kind
        if kind == "decode":
            n, ctx, max_len = batch.num_seqs, batch.num_context_tokens, batch.max_seq_len
            lin, att, comm, ovh = self._decode_parts(n, ctx, max_len)
            return StepTime(lin, att, comm, ovh, self.decode_step_time(n, ctx, max_len))
        if kind == "prefill" or kind == "mixed":
            return self._predict_prefill(batch)
        if kind == "empty":
            return ZERO_STEP
        raise ValueError(f"batch.kind: {kind!r} is not one of {list(KINDS)}")


def _chunk_size(limit: int, time_left: float, last_step: float) -> int:
    """Steps of the next numpy pass of `decode_step_times`: `limit`, or fewer when the deadline comes
    first. Decode steps only grow longer, so time_left / last_step + 1 steps reach it; a pass that
    falls short (a model whose steps shrink) is followed by another, so any size stays exact."""
    if last_step > 0 and time_left < limit * last_step:
        return min(limit, int(time_left / last_step) + 2)
    return limit


def arange_int64(first: int, num: int, step: int) -> np.ndarray:
    """int64 first, first + step, ... (num values)."""
    if step:
        return np.arange(first, first + num * step, step, dtype=np.int64)
    return np.full(num, first, dtype=np.int64)


def decode_context_tokens(batch: Any) -> int:
    """Tokens cached before the step, summed over the batch's decode sequences only.

    Exact for decode and prefill steps and for a mixed `ScheduledBatch` (per-sequence tuples); for a
    mixed step known only by its totals (step records) it is `num_context_tokens`, an upper bound.
    """
    kind = batch.kind
    if kind == "decode":
        return batch.num_context_tokens
    if kind != "mixed":
        return 0
    if batch.__class__ is ScheduledBatch:  # (make_batch's: aligned tuples, totals that add up)
        return batch.num_context_tokens - sum(compress(batch.num_computed_tokens, batch.is_prefill))
    computed = getattr(batch, "num_computed_tokens", None)
    is_prefill = getattr(batch, "is_prefill", None)
    if isinstance(computed, tuple) and isinstance(is_prefill, tuple):
        if len(computed) == len(is_prefill) == batch.num_seqs and batch.num_context_tokens == sum(computed):
            return batch.num_context_tokens - sum(compress(computed, is_prefill))  # the few prefills, in C
        return sum(c for c, p in zip(computed, is_prefill) if not p)
    return batch.num_context_tokens


def predict_frame(model: LatencyModel, records: Any) -> list[StepTime]:
    """`model.predict` for every row of a step-record DataFrame (e.g. to compare with measured times)."""
    return [model.predict(StepShape.of(row)) for row in records.to_dict("records")]
