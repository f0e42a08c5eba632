"""The interface every attention backend implements: paged attention over the KV cache of one layer.

The attention layer stores the step's K/V into the cache first, then calls `forward` with the new
tokens' q/k/v, that layer's cache and the step's `AttentionMetadata`. A backend whose
`fuses_decode_prologue(metadata)` is True for a decode step instead takes the raw projected q/k/v and a
`DecodePrologue`: it applies q/k norm and rotary and stores K/V itself, in its attention kernel.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

import torch

from engine.attention.metadata import AttentionMetadata


def module_available(name: str) -> bool:
    """Whether `name` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


class DecodePrologue(NamedTuple):
    """What a decode step's q/k norm, rotary and K/V store need (`triton_ops.qk_norm_rotary` with
    `kv_store`), for a backend that does them inside its attention kernel. k and v are the raw
    projected [B, Hkv, D] views (strided rows, contiguous heads), as is the q passed beside it."""

    k: torch.Tensor  # [B, Hkv, D] raw keys (neither normed nor rotated)
    v: torch.Tensor  # [B, Hkv, D] values
    positions: torch.Tensor  # [B] int32
    cos_sin: torch.Tensor  # [max_pos, D] float32: cos | sin halves
    q_weight: torch.Tensor | None  # [D] per-head q RMSNorm weight (Qwen3), None without q/k norm (Llama)
    k_weight: torch.Tensor | None
    eps: float
    slot_mapping: torch.Tensor  # [B] int32 cache slot of each new token (-1: do not store)


class AttentionBackend:
    name = "base"
    graph_safe = False  # True when forward() can be captured in a CUDA graph
    reads_new_kv = True  # False when forward() reads keys/values only from the cache, never k/v

    @staticmethod
    def supports_block_size(block_size: int) -> bool:
        raise NotImplementedError

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on `device`, or None when it can."""
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D] new tokens' queries
        k: torch.Tensor,  # [T, Hkv, D] new tokens' keys (already stored in the cache)
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        prologue: DecodePrologue | None = None,  # only where fuses_decode_prologue(metadata)
    ) -> torch.Tensor:  # [T, H, D]
        raise NotImplementedError

    def fuses_decode_prologue(self, metadata: AttentionMetadata) -> bool:
        """Whether forward() of this step takes the raw q/k/v and a `DecodePrologue` (and stores K/V)."""
        return False

    def compile_count(self) -> int:
        """Kernel variants compiled so far (grows when a step hits a new variant)."""
        return 0
