"""RMSNorm, optionally fused with the residual add that precedes it (HF's arithmetic: float32
statistics, the weight applied in the input dtype). `impl` picks the kernels: "torch" (eager, CPU),
"compile" (torch.compile) or "triton" (engine/layers/triton_ops.py); the model runner sets it."""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine.layers import triton_ops

LAYER_IMPLS = ("torch", "compile", "triton")


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
        self.impl = "torch"

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.impl == "triton":
            if residual is None:
                return triton_ops.rms_norm(x, self.weight, self.eps)
            return triton_ops.add_rms_norm(x, residual, self.weight, self.eps)
        compile_ = self.impl == "compile"
        if residual is None:
            return (compiled(rms_norm) if compile_ else rms_norm)(x, self.weight, self.eps)
        return (compiled(add_rms_norm) if compile_ else add_rms_norm)(x, residual, self.weight, self.eps)
