"""StepRecorder: one row per engine step — the batch's shape and its measured time — for fitting
the simulator's latency model. Columns are CONTRACT.md's "Step record columns".

GPU time comes from CUDA event pairs that are resolved lazily in batches (no sync per step); on a
CPU the "device" time is the forward's host time. A step that compiled a kernel is flagged.
`allreduce_time_s` is the tensor-parallel all-reduce time when the engine profiles it, else NaN;
`idle_before_s` the wall time the engine sat idle between the previous step and this one.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from pathlib import Path

import torch

from engine.core.scheduler import ScheduledBatch
from engine.records import STEP_RECORD_COLUMNS

COLUMNS = STEP_RECORD_COLUMNS
_RESOLVE_EVERY = 64  # steps between resolving CUDA events (long done by then): timers are reused


class StepTimer:
    """Marks the start and end of a step's device work (CUDA events on `stream`, or the host clock
    when stream is None). The stream is given, not looked up: torch's lookup of the current stream
    costs ~15 µs of host time a call, a tenth of a one-token decode step's host time."""

    __slots__ = ("start_event", "end_event", "stream", "t0", "t1")

    def __init__(self, stream: torch.cuda.Stream | None) -> None:
        cuda = stream is not None
        self.start_event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.end_event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.stream = stream
        self.t0 = self.t1 = math.nan

    def start(self) -> None:
        if self.start_event is not None:
            self.start_event.record(self.stream)
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.end_event is not None:
            self.end_event.record(self.stream)
        else:
            self.t1 = time.perf_counter()

    def seconds(self) -> float:
        if self.start_event is None:
            return self.t1 - self.t0
        self.end_event.synchronize()
        return self.start_event.elapsed_time(self.end_event) / 1e3


class StepRecorder:
    """Collects step rows. `compiled` is set when the engine saw a new kernel variant compile, or when
    a step's wall time exceeds `compile_ratio` x the median of recent steps of its kind (and
    `compile_min_s`): the fallback for compilations nobody reports."""

    def __init__(
        self,
        tp: int = 1,
        block_size: int = 16,
        cuda: bool = False,
        compile_ratio: float = 10.0,
        compile_min_s: float = 0.5,
    ) -> None:
        self.tp, self.block_size, self.cuda = tp, block_size, cuda
        self.compile_ratio, self.compile_min_s = compile_ratio, compile_min_s
        self._rows: list[list] = []
        self._pending: list[tuple[int, StepTimer]] = []
        self._spare: list[StepTimer] = []
        self._recent: dict[str, deque[float]] = {}
        self._last_end = math.nan  # perf_counter when the last recorded step ended

    def __len__(self) -> int:
        return len(self._rows)

    def timer(self) -> StepTimer:
        """A timer on the stream that is current now (the engine runs every step on one stream)."""
        if self._spare:
            return self._spare.pop()
        return StepTimer(torch.cuda.current_stream() if self.cuda else None)

    def record(
        self,
        batch: ScheduledBatch,
        timer: StepTimer,
        wall_time_s: float,
        graph_batch_size: int = 0,
        compiled: bool = False,
        allreduce_time_s: float = math.nan,
        start_s: float = math.nan,
        graph_num_tokens: int = 0,
        overlapped: bool = False,
        num_waiting: int = 0,
    ) -> None:
        """One step's row; `start_s` (perf_counter at the step's start) gives `idle_before_s`;
        `graph_num_tokens` the token bucket of a piecewise-graph step (0 otherwise); `overlapped`:
        scheduled and launched while the step before it still ran (async scheduling), so the host's
        work for it was hidden behind the device's; `num_waiting`: requests left waiting when it was
        scheduled."""
        compiled = compiled or self._looks_compiled(batch.kind, wall_time_s)
        idle_before_s, self._last_end = start_s - self._last_end, start_s + wall_time_s
        self._rows.append(
            [
                len(self._rows),
                batch.kind,
                batch.num_seqs,
                batch.num_prefill_seqs,
                batch.num_decode_seqs,
                batch.total_num_scheduled_tokens,
                batch.num_prefill_tokens,
                batch.total_num_cached_tokens,
                batch.num_context_tokens,
                batch.max_seq_len,
                batch.prefill_attn_work,
                batch.num_kv_blocks_used,
                graph_batch_size,
                self.tp,
                self.block_size,
                math.nan,
                wall_time_s,
                compiled,
                allreduce_time_s,
                idle_before_s,
                graph_num_tokens,
                overlapped,
                num_waiting,
            ]
        )
        self._pending.append((len(self._rows) - 1, timer))
        if len(self._pending) >= _RESOLVE_EVERY:
            self._resolve()

    def _looks_compiled(self, kind: str, wall: float) -> bool:
        recent = self._recent.get(kind)
        if recent is None:
            recent = self._recent[kind] = deque(maxlen=32)
        slow = wall > self.compile_min_s and len(recent) >= 3
        if slow and wall > self.compile_ratio * statistics.median(recent):
            return True
        recent.append(wall)
        return False

    def _resolve(self) -> None:
        gpu_col = COLUMNS.index("gpu_time_s")
        for row, timer in self._pending:
            self._rows[row][gpu_col] = timer.seconds()
            self._spare.append(timer)
        self._pending.clear()

    def reset(self) -> None:
        self._resolve()
        self._rows.clear()
        self._recent.clear()
        self._last_end = math.nan

    def to_dataframe(self):
        import pandas as pd

        self._resolve()
        return pd.DataFrame(self._rows, columns=list(COLUMNS))

    def save(self, path: str | Path) -> Path:
        """Write the rows as Parquet (or CSV when `path` ends in .csv)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        df = self.to_dataframe()
        if path.suffix == ".csv":
            df.to_csv(path, index=False)
        else:
            df.to_parquet(path, index=False)
        return path
