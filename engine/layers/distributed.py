"""Tensor-parallel rank and world size, read from torch.distributed when it is initialised.

Layers take `tp_rank` / `tp_size` at construction (defaults from here) and never look them up again;
the collectives below are no-ops for a single rank.
"""

from __future__ import annotations

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


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dimension."""
    if tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
