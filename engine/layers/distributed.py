"""Tensor-parallel rank and world size, read from torch.distributed when it is initialised, and the
collectives the layers call (no-ops for a single rank). Process start-up and the step loop are in
`engine/distributed.py`; `time_all_reduces` installs an optional timer of the all-reduces.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.distributed as dist


def tp_rank_and_size() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def resolve_tp(tp_rank: int | None, tp_size: int | None) -> tuple[int, int]:
    rank, size = tp_rank_and_size()
    rank = rank if tp_rank is None else tp_rank
    size = size if tp_size is None else tp_size
    if not 0 <= rank < size:
        raise ValueError(f"tp_rank: {rank} is not in [0, {size})")
    return rank, size


class AllReduceTimer:
    """Host seconds spent in all-reduces while installed; on CUDA the device is synchronised before
    and after each one, so queued compute is not counted (and the step is slowed: profiling only)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.seconds = 0.0
        self.calls = 0

    def total(self) -> float:
        """Seconds measured, NaN when no all-reduce ran eagerly (one rank, or a CUDA-graph replay)."""
        return self.seconds if self.calls else float("nan")

    def timed_all_reduce(self, x: torch.Tensor) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0
        self.calls += 1


_ALL_REDUCE_TIMER: ContextVar[AllReduceTimer | None] = ContextVar("kvplan_all_reduce_timer", default=None)


@contextmanager
def time_all_reduces(timer: AllReduceTimer | None) -> Iterator[AllReduceTimer | None]:
    """Time every all-reduce run inside the block with `timer` (None: no timing)."""
    token = _ALL_REDUCE_TIMER.set(timer)
    try:
        yield timer
    finally:
        _ALL_REDUCE_TIMER.reset(token)


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum `x` over the ranks, in place."""
    if tp_size > 1:
        timer = _ALL_REDUCE_TIMER.get()
        if timer is None:
            dist.all_reduce(x)
        else:
            timer.timed_all_reduce(x)
    return x


def gather_last_dim(x: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor | None:
    """Every rank's `x` concatenated along the last dimension on rank 0; None on the other ranks."""
    if tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp_size)] if tp_rank == 0 else None
    dist.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if parts is not None else None


def min_over_ranks(value: int, tp_size: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (e.g. the KV blocks that fit on each GPU)."""
    if tp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
