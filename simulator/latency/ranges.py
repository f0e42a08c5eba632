"""The ranges a fitted profile was measured over, and a wrapper that counts the steps a simulation
prices outside them (the fit extrapolates there).

`FitRanges` holds, per step kind (decode; prefill and mixed, which one fit prices), the largest
batch, sum of context, longest sequence and step tokens of the profile's step records; a step is
outside when any of its figures exceeds them (the sum of context stands for the KV blocks in use).
`CountingModel` prices every step with the wrapped model, unchanged, and counts those outside.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from simulator.latency.base import BatchShape, LatencyModelBase, StepTime

RANGE_FIELDS = ("num_seqs", "num_context_tokens", "max_seq_len", "total_num_scheduled_tokens")
RECORDS_DIR = Path(__file__).resolve().parent.parent / "profiles" / "records"


@dataclass(frozen=True)
class KindRange:
    """The largest figures of one step kind in the step records."""

    num_seqs: int
    num_context_tokens: int  # sum of context over the batch
    max_seq_len: int
    total_num_scheduled_tokens: int

    def describe(self) -> str:
        longest = f", longest <= {self.max_seq_len:,}" if self.max_seq_len < 1 << 62 else ""
        return (
            f"batch <= {self.num_seqs:,}, context <= {self.num_context_tokens:,} tokens{longest}, "
            f"step tokens <= {self.total_num_scheduled_tokens:,}"
        )


@dataclass(frozen=True)
class FitRanges:
    """What a profile's step records cover: decode steps, and prefill with mixed steps."""

    decode: KindRange
    prefill: KindRange
    source: str = ""  # where the ranges come from (the records' file name)

    @classmethod
    def of_records(cls, records: Any, source: str = "") -> FitRanges:
        """The ranges of step records (a DataFrame with the docs/CONTRACT.md columns); compiled
        steps, which a fit leaves out, are left out here too. A kind without records gets zero
        ranges: every step of it is outside."""
        frame = records
        if "compiled" in frame.columns:
            frame = frame[~frame["compiled"].astype(bool)]
        kinds = {"decode": frame[frame["kind"] == "decode"], "prefill": frame[frame["kind"] != "decode"]}
        kinds["prefill"] = kinds["prefill"][kinds["prefill"]["kind"] != "empty"]
        ranges = {}
        for kind, rows in kinds.items():
            ranges[kind] = KindRange(*(int(rows[f].max()) if len(rows) else 0 for f in RANGE_FIELDS))
        return cls(ranges["decode"], ranges["prefill"], source)

    def as_dict(self) -> dict[str, Any]:
        return {"decode": asdict(self.decode), "prefill": asdict(self.prefill), "source": self.source}

    @classmethod
    def from_dict(cls, raw: Any, where: str = "fit_ranges") -> FitRanges:
        try:
            return cls(KindRange(**raw["decode"]), KindRange(**raw["prefill"]), str(raw.get("source", "")))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{where}: malformed fit ranges ({e})") from None

    def describe(self) -> str:
        return f"decode {self.decode.describe()}; prefill and mixed {self.prefill.describe()}"

    def decode_outside(self, num_seqs: int, num_context_tokens: int, max_seq_len: int) -> bool:
        d = self.decode
        return (
            num_seqs > d.num_seqs or num_context_tokens > d.num_context_tokens or max_seq_len > d.max_seq_len
        )

    def decode_run_outside(self, num_seqs: int, num_context_tokens: int, max_seq_len: int, steps: int) -> int:
        """Steps outside among the first `steps` of a decode run (step i reads num_context_tokens +
        i * num_seqs cached tokens; its longest sequence is max_seq_len + i): once a step is
        outside, every later one is."""
        if steps <= 0:
            return 0
        d = self.decode
        if num_seqs > d.num_seqs:
            return steps
        first_context = max(0, (d.num_context_tokens - num_context_tokens) // num_seqs + 1)
        first_length = max(0, d.max_seq_len - max_seq_len + 1)
        return max(0, steps - min(first_context, first_length))

    def batch_outside(self, batch: BatchShape) -> bool:
        kind = batch.kind
        if kind == "decode":
            return self.decode_outside(batch.num_seqs, batch.num_context_tokens, batch.max_seq_len)
        if kind == "empty":
            return False
        p = self.prefill
        return (
            batch.num_seqs > p.num_seqs
            or batch.num_context_tokens > p.num_context_tokens
            or batch.max_seq_len > p.max_seq_len
            or batch.total_num_scheduled_tokens > p.total_num_scheduled_tokens
        )


@lru_cache(maxsize=16)
def _records_ranges(path: str, mtime_ns: int) -> FitRanges:
    import pandas as pd

    return FitRanges.of_records(pd.read_parquet(path), Path(path).name)


def limit_ranges(profile: Any) -> FitRanges | None:
    """Ranges from a profile's calibration limits alone, when its step records are not at hand:
    batch <= max_num_seqs, step tokens <= max_num_batched_tokens, context <= its calibration
    cache (blocks x block size); the longest sequence is not bounded. None without a cache size."""
    blocks = getattr(profile, "calibration_num_kv_blocks", None)
    if not blocks:
        return None
    context = int(blocks) * int(profile.block_size)
    seqs, tokens = int(profile.max_num_seqs), int(profile.max_num_batched_tokens)
    unbounded = 1 << 62
    return FitRanges(
        KindRange(seqs, context, unbounded, seqs),
        KindRange(seqs, context, unbounded, tokens),
        "the profile's calibration limits",
    )


def profile_fit_ranges(profile: Any) -> FitRanges | None:
    """The ranges of a LatencyProfile: those it records (`extra["fit_ranges"]`, written by
    `fit_profile`), else those of its step records when they ship beside the profiles
    (`extra["records"]` under simulator/profiles/records/), else its calibration limits
    (`limit_ranges`), else None."""
    extra = getattr(profile, "extra", None) or {}
    if extra.get("fit_ranges"):
        return FitRanges.from_dict(extra["fit_ranges"])
    name = extra.get("records")
    path = RECORDS_DIR / Path(str(name)).name if name else None
    if path is not None and path.is_file():
        return _records_ranges(str(path), path.stat().st_mtime_ns)
    return limit_ranges(profile)


class OutsideCount:
    """Steps priced outside the ranges, by kind (shared by a model and its overlapped view)."""

    __slots__ = ("decode", "prefill")

    def __init__(self) -> None:
        self.decode = 0
        self.prefill = 0

    @property
    def total(self) -> int:
        return self.decode + self.prefill


class CountingModel:
    """`model`'s step times, unchanged, counting the steps priced outside `ranges` in `count`: the
    steps `predict` prices and the steps of the fast-forwarded runs the simulator reports (`count_run`)."""

    def __init__(self, model: LatencyModelBase, ranges: FitRanges, count: OutsideCount | None = None) -> None:
        self.model = model
        self.ranges = ranges
        self.count = count if count is not None else OutsideCount()
        self.profile = getattr(model, "profile", None)
        if hasattr(model, "overlapped_model"):
            self.overlapped_model = self._overlapped_model
        # decode times pass through unchanged: the model's own methods, without a call between
        self.decode_step_time = model.decode_step_time
        self.decode_step_times = model.decode_step_times
        d = ranges.decode
        self._decode_max = (d.num_seqs, d.num_context_tokens, d.max_seq_len)

    def _overlapped_model(self) -> CountingModel:
        overlapped = self.model.overlapped_model()
        return self if overlapped is self.model else CountingModel(overlapped, self.ranges, self.count)

    def predict(self, batch: BatchShape) -> StepTime:
        if self.ranges.batch_outside(batch):
            if batch.kind == "decode":
                self.count.decode += 1
            else:
                self.count.prefill += 1
        return self.model.predict(batch)

    def count_run(self, num_seqs: int, num_context_tokens: int, max_seq_len: int, steps: int) -> None:
        """Count the steps outside among a fast-forwarded decode run's `steps` (its shape at its first
        step: `FastForwardScheduler.last_run`); the simulator calls it after each run."""
        most_seqs, most_context, longest = self._decode_max
        last = steps - 1  # its last step's context and longest sequence are its largest
        inside = num_context_tokens + last * num_seqs <= most_context and max_seq_len + last <= longest
        if inside and num_seqs <= most_seqs:
            return  # every step inside (the usual case)
        self.count.decode += self.ranges.decode_run_outside(num_seqs, num_context_tokens, max_seq_len, steps)
