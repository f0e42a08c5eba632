"""The attention layer of a decoder block: store this step's K/V into its cache slots, then attend
through the engine's backend. Cache views and backend are bound by layer index (`KVCache.bind`);
the step's metadata comes from the installed forward context."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata, get_forward_context
from engine.kv_cache import store_kv_cache


class Attention(nn.Module):
    def __init__(
        self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def bind(self, backend: object, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.backend, self.k_cache, self.v_cache = backend, k_cache, v_cache

    def unbind(self) -> None:
        self.backend = self.k_cache = self.v_cache = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H * D]."""
        if self.backend is None:
            raise RuntimeError(f"attention layer {self.layer_idx}: no KV cache bound")
        metadata = get_forward_context()
        self.store(k, v, metadata.slot_mapping)
        return self.attend(q, k, v, metadata)

    def store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this step's keys and values into their cache slots (-1: skip the row)."""
        store_kv_cache(k, v, self.k_cache, self.v_cache, slot_mapping)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Attention of q over the cache (k/v: this step's, for backends that use them) -> [T, H * D]."""
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, metadata, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
