"""A latency model with every step time of another multiplied by a constant: the runs of a band.

`ScaledModel(model, decode, prefill)` prices a decode step at `model`'s time times `decode` and a
prefill or mixed step (the prefill fit prices both) at its time times `prefill`. Decode runs stay
exact: each step's time is multiplied, then the end times accumulate in order, the float operations
of `accumulate_decode_times(scaled.decode_step_time, ...)`. No band logic here (simulator/band.py).
"""

from __future__ import annotations

import numpy as np

from simulator.latency.base import BatchShape, LatencyModel, LatencyModelBase, StepTime


class ScaledModel(LatencyModelBase):
    """`model`'s step times x `decode` (decode steps) and x `prefill` (prefill and mixed steps).

    `decode_step_times` takes the base class's numpy passes over `model`'s per-step times (scaled in
    place), so a run's end times equal the reference loop's over `decode_step_time` bit for bit.
    `overlapped_model()` scales `model`'s overlapped view (async scheduling) by the same factors.
    """

    def __init__(self, model: LatencyModel, decode: float, prefill: float) -> None:
        for name, value in (("decode", decode), ("prefill", prefill)):
            if not (isinstance(value, (int, float)) and value > 0 and np.isfinite(value)):
                raise ValueError(f"ScaledModel.{name}: must be a positive finite factor, got {value!r}")
        self.model = model
        self.decode = float(decode)
        self.prefill = float(prefill)
        self.profile = getattr(model, "profile", None)
        self._overlapped: ScaledModel | None = None

    def __repr__(self) -> str:
        return f"ScaledModel({self.model!r}, decode={self.decode!r}, prefill={self.prefill!r})"

    def overlapped_model(self) -> ScaledModel:
        view = getattr(self.model, "overlapped_model", None)
        inner = view() if view is not None else self.model
        if inner is self.model:
            return self
        if self._overlapped is None or self._overlapped.model is not inner:
            self._overlapped = ScaledModel(inner, self.decode, self.prefill)
        return self._overlapped

    def decode_step_time(self, num_seqs: int, num_context_tokens: int, max_seq_len: int) -> float:
        return self.model.decode_step_time(num_seqs, num_context_tokens, max_seq_len) * self.decode

    def _decode_parts(
        self, num_seqs: int, num_context_tokens: int, max_seq_len: int
    ) -> tuple[float, float, float, float]:
        parts = getattr(self.model, "_decode_parts", None)
        if parts is None:
            step = self.model.predict(_DecodeShape(num_seqs, num_context_tokens, max_seq_len))
            lin, att, comm, ovh = step.linear, step.attention, step.communication, step.overhead
        else:
            lin, att, comm, ovh = parts(num_seqs, num_context_tokens, max_seq_len)
        f = self.decode
        return lin * f, att * f, comm * f, ovh * f

    def _predict_prefill(self, batch: BatchShape) -> StepTime:
        s, f = self.model.predict(batch), self.prefill
        return StepTime(s.linear * f, s.attention * f, s.communication * f, s.overhead * f, s.total * f)

    def _decode_step_array(
        self, num_seqs: int, num_context_tokens: int, max_seq_len: int, num_steps: int
    ) -> np.ndarray:
        array = getattr(self.model, "_decode_step_array", None)
        if array is not None:
            steps = array(num_seqs, num_context_tokens, max_seq_len, num_steps)
        else:
            step = self.model.decode_step_time
            steps = np.array(
                [
                    step(num_seqs, num_context_tokens + j * num_seqs, max_seq_len + j)
                    for j in range(num_steps)
                ],
                dtype=np.float64,
            )
        steps *= self.decode  # elementwise, IEEE: the float decode_step_time returns
        return steps

    def _leading_decode_times(
        self,
        num_seqs: int,
        num_context_tokens: int,
        max_seq_len: int,
        max_steps: int,
        start: float,
        deadline: float,
    ) -> list[float]:
        """The reference loop with the wrapped model's step inlined (one call a step, not two)."""
        step, f = self.model.decode_step_time, self.decode
        times = [start]
        append = times.append
        t, ctx, length = start, num_context_tokens, max_seq_len
        for _ in range(max_steps):
            if t >= deadline:
                break
            t = t + step(num_seqs, ctx, length) * f
            append(t)
            ctx += num_seqs
            length += 1
        return times


class _DecodeShape:
    """A decode step's totals, for a wrapped model without `_decode_parts`."""

    __slots__ = ("max_seq_len", "num_context_tokens", "num_seqs")
    kind = "decode"
    num_prefill_seqs = 0
    num_prefill_tokens = 0
    prefill_attn_work = 0.0
    total_num_cached_tokens = 0

    def __init__(self, num_seqs: int, num_context_tokens: int, max_seq_len: int) -> None:
        self.num_seqs, self.num_context_tokens, self.max_seq_len = num_seqs, num_context_tokens, max_seq_len

    @property
    def num_decode_seqs(self) -> int:
        return self.num_seqs

    @property
    def total_num_scheduled_tokens(self) -> int:
        return self.num_seqs
