"""FlashAttention-4 backend (`flash_attn.cute`): one varlen call over the paged cache serves prefill,
chunked prefill over cached prefixes, mixed and decode steps (`page_table` + `seqused_k`).

Any page size works. FA4 compiles a kernel at the first call of each new variant; `compile_count`
exposes its compile cache so that warm-up and the step recorder can see compilations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention.backend import AttentionBackend, module_available
from engine.attention.metadata import AttentionMetadata


class FlashAttnCuteBackend(AttentionBackend):
    name = "flash_attn_cute"
    graph_safe = True  # its kernels read only device tensors: capturable in CUDA graphs

    def __init__(self, varlen_fn: Callable | None = None) -> None:
        self._cache_owner = None
        if varlen_fn is None:
            from flash_attn.cute import interface

            varlen_fn = interface.flash_attn_varlen_func
            self._cache_owner = getattr(interface, "_flash_attn_fwd", None)
        self.varlen_fn = varlen_fn

    @staticmethod
    def supports_block_size(block_size: int) -> bool:
        return block_size > 0

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "flash_attn_cute needs a CUDA device"
        major, _ = torch.cuda.get_device_capability(device)
        if major < 9:
            return f"flash_attn_cute needs Hopper or newer (compute capability {major}.x here)"
        return (
            None
            if module_available("flash_attn.cute")
            else "the flash_attn.cute (FlashAttention-4) package is not installed"
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        md = metadata
        out = self.varlen_fn(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=md.cu_seqlens_q,
            max_seqlen_q=md.max_seqlen_q,
            max_seqlen_k=None if md.is_decode else md.max_seqlen_k,
            seqused_k=md.context_lens,
            page_table=md.block_tables,
            softmax_scale=scale,
            causal=True,
        )
        return out[0] if isinstance(out, tuple) else out

    def compile_count(self) -> int:
        cache = getattr(self._cache_owner, "compile_cache", None)
        entries = getattr(cache, "cache", cache)  # flash_attn.cute wraps its dict in a JITCache
        try:
            return len(entries)
        except TypeError:
            return 0
