"""FlashAttention-2 backend (`flash_attn` package): varlen prefill, over the paged cache through
`block_table` when some sequence has cached context, and `flash_attn_with_kvcache` for decode.

FA2's paged KV needs pages of a multiple of 256 tokens. The kernels can be injected (tests pass
plain-torch fakes of the documented semantics to check the call shapes on a CPU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention.backend import AttentionBackend, module_available
from engine.attention.metadata import AttentionMetadata


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    graph_safe = True  # its kernels read only device tensors: capturable in CUDA graphs

    def __init__(self, varlen_fn: Callable | None = None, kvcache_fn: Callable | None = None) -> None:
        if varlen_fn is None or kvcache_fn is None:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

            varlen_fn = varlen_fn or flash_attn_varlen_func
            kvcache_fn = kvcache_fn or flash_attn_with_kvcache
        self.varlen_fn = varlen_fn
        self.kvcache_fn = kvcache_fn

    @staticmethod
    def supports_block_size(block_size: int) -> bool:
        return block_size > 0 and block_size % 256 == 0

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "flash_attn needs a CUDA device"
        return (
            None
            if module_available("flash_attn.flash_attn_interface")
            else "the flash_attn (FlashAttention-2) package is not installed"
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
        if md.is_decode:
            out = self.kvcache_fn(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=md.context_lens,
                block_table=md.block_tables,
                softmax_scale=scale,
                causal=True,
            )
            return out.squeeze(1)
        if not md.has_context:  # plain prefill: attend over the fresh k/v, no pages needed
            return self.varlen_fn(
                q,
                k,
                v,
                cu_seqlens_q=md.cu_seqlens_q,
                cu_seqlens_k=md.cu_seqlens_q,
                max_seqlen_q=md.max_seqlen_q,
                max_seqlen_k=md.max_seqlen_q,
                softmax_scale=scale,
                causal=True,
            )
        return self.varlen_fn(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=md.cu_seqlens_q,
            cu_seqlens_k=md.cu_seqlens_k,
            max_seqlen_q=md.max_seqlen_q,
            max_seqlen_k=md.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=md.block_tables,
        )
