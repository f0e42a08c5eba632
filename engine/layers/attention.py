"""The attention layer of a decoder block: the store of a step's K/V into its cache slots (the Triton
layers fuse it into q/k norm + rotary instead) and attention through the engine's backend. Cache views
and backend are bound by layer index (`KVCache.bind`); the model passes the step's metadata."""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata
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

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's (k_cache, v_cache) views; a clear error when no KV cache is bound."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError(f"attention layer {self.layer_idx}: no KV cache bound")
        return self.k_cache, self.v_cache

    def store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this step's keys and values into their cache slots (-1: skip the row)."""
        store_kv_cache(k, v, *self.caches(), slot_mapping)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Attention of q [T, H, D] over the cache (k/v [T, Hkv, D]: this step's, already stored, for
        backends that read them) -> [T, H * D]."""
        if self.backend is None:
            raise RuntimeError(f"attention layer {self.layer_idx}: no KV cache bound")
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, metadata, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
