"""The paged KV cache: one tensor [2, layers, blocks, block_size, kv_heads, head_dim], bound to the
attention layers by explicit layer index, and the store of a step's K/V into its slots.

The store is a Triton kernel on CUDA (CUDA-graph safe, skips slot -1) and torch `index_copy_` on CPU.
Sizing comes from the control plane's pure `num_kv_blocks`; the runner measures the free memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.layers import pdl

try:  # Triton is optional: CPU-only installs store with torch
    import triton
    import triton.language as tl

    from engine.layers.pdl import pdl_prologue
except ImportError:  # pragma: no cover - depends on the install
    triton = None


class KVCache:
    """Owns the cache tensor; `k(i)` / `v(i)` are layer i's [num_blocks, block_size, Hkv, D] views."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_kv_blocks: must be positive, got {num_blocks} (too little memory?)")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        # zeros, not empty: FA4 reads whole pages and needs finite values past a sequence's end
        shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.tensor = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def k(self, layer: int) -> torch.Tensor:
        return self.tensor[0, layer]

    def v(self, layer: int) -> torch.Tensor:
        return self.tensor[1, layer]

    def bind(self, attention_layers: Sequence[torch.nn.Module], backend: object) -> None:
        """Give attention layer i the views of layer i (checked against its `layer_idx`)."""
        if len(attention_layers) != self.num_layers:
            raise ValueError(
                f"KVCache: {len(attention_layers)} attention layers for {self.num_layers} cache layers"
            )
        for i, layer in enumerate(attention_layers):
            if layer.layer_idx != i:
                raise ValueError(f"KVCache: attention layer at position {i} has layer_idx {layer.layer_idx}")
            layer.bind(backend, self.k(i), self.v(i))

    def release(self, attention_layers: Sequence[torch.nn.Module]) -> None:
        for layer in attention_layers:
            layer.unbind()
        self.tensor = torch.empty(0)


def store_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int32, -1 = skip
) -> None:
    if key.is_cuda and triton is not None:
        _store_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_cache_torch(key, value, k_cache, v_cache, slot_mapping)


def store_kv_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[keep].to(v_cache.dtype))


if triton is not None:

    @triton.jit(do_not_specialize=["key_stride", "value_stride"])
    def _store_kv_kernel(
        key_ptr,
        key_stride,
        value_ptr,
        value_stride,
        k_cache_ptr,
        v_cache_ptr,
        slot_mapping_ptr,
        ROW: tl.constexpr,
        BLOCK: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_prologue(USE_PDL)
        token = tl.program_id(0)
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot < 0:
            return
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW
        k = tl.load(key_ptr + token.to(tl.int64) * key_stride + offs, mask=mask)
        v = tl.load(value_ptr + token.to(tl.int64) * value_stride + offs, mask=mask)
        tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def _store_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, heads, dim = key.shape
    row = heads * dim
    if key.stride(-1) != 1 or key.stride(-2) != dim or value.stride(-1) != 1 or value.stride(-2) != dim:
        raise ValueError("store_kv_cache: each token's K/V row must be contiguous")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        key.stride(0),
        value,
        value.stride(0),
        k_cache,
        v_cache,
        slot_mapping,
        ROW=row,
        BLOCK=triton.next_power_of_2(row),
        **pdl.launch_kwargs(key.device, num_tokens),
    )
