"""SiLU-and-multiply over the merged gate/up projection (SwiGLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.layernorm import compiled


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.use_compile = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (compiled(silu_and_mul) if self.use_compile else silu_and_mul)(x)
