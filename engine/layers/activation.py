"""SiLU-and-multiply over the merged gate/up projection (SwiGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import triton_ops
from engine.layers.layernorm import compiled


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.impl = "torch"  # or "compile" / "triton": see layernorm.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "triton":
            return triton_ops.silu_and_mul(x)
        return (compiled(silu_and_mul) if self.impl == "compile" else silu_and_mul)(x)
