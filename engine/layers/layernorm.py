"""RMSNorm, optionally fused with the residual add that precedes it (HF's arithmetic: float32
statistics, the weight applied in the input dtype). Compiled with torch.compile when enabled."""

from __future__ import annotations

import functools

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to the input dtype as HF does."""
    dtype = x.dtype
    summed = (x.float() + residual.float()).to(dtype)
    return rms_norm(summed, weight, eps), summed


@functools.cache
def compiled(fn):
    """torch.compile'd twin of a pure function (built on first use, then reused)."""
    return torch.compile(fn, dynamic=True)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.use_compile = False

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            fn = compiled(rms_norm) if self.use_compile else rms_norm
            return fn(x, self.weight, self.eps)
        fn = compiled(add_rms_norm) if self.use_compile else add_rms_norm
        return fn(x, residual, self.weight, self.eps)
