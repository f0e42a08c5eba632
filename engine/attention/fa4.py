"""FlashAttention-4 backend (`flash_attn.cute`): one varlen call over the paged cache serves prefill,
chunked prefill over cached prefixes, mixed and decode steps (`page_table` + `seqused_k`).

Any page size works. FA4 compiles a kernel at the first call of each new variant; `compile_count`
exposes its compile cache so that warm-up and the step recorder can see compilations.

Decode steps go to the Triton split-KV kernel (`triton_decode.py`) by default where Triton can run
(FA4 has no split-KV on Hopper: one sequence reads its KV from a handful of SMs); `decode_kernel`
("triton" or "fa4"; default: the engine's kernel config's, "auto": "triton" when available) says which
runs. The Triton kernel balances its splits (`engine.decode_splits`) unless the config's
`decode_balanced` is off, and splits pages of more than 64 tokens inside unless its
`decode_fine_splits` is off (engine/envs.py: $KVPLAN_DECODE_KERNEL, $KVPLAN_DECODE_BALANCE,
$KVPLAN_DECODE_FINE_SPLITS).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention.backend import AttentionBackend, module_available
from engine.attention.metadata import AttentionMetadata
from engine.decode_splits import split_block
from engine.envs import KernelConfig


class FlashAttnCuteBackend(AttentionBackend):
    name = "flash_attn_cute"
    graph_safe = True  # its kernels read only device tensors: capturable in CUDA graphs
    reads_new_kv = False  # pages only (page_table)
    step_graph_safe = True  # grid from q's rows and the batch; lengths from cu_seqlens_q / seqused_k

    def __init__(
        self,
        varlen_fn: Callable | None = None,
        decode_kernel: str | None = None,
        decode_fn: Callable | None = None,
        kernels: KernelConfig | None = None,
    ) -> None:
        """`kernels`: the engine's kernel config (default: what the environment asks for); an explicit
        `decode_kernel` wins over its. `decode_fn` stands in for the Triton decode kernel (tests pass
        a recorder)."""
        kernels = kernels or KernelConfig.from_env()
        self._cache_owner = None
        if varlen_fn is None:
            from flash_attn.cute import interface

            varlen_fn = interface.flash_attn_varlen_func
            self._cache_owner = getattr(interface, "_flash_attn_fwd", None)
        self.varlen_fn = varlen_fn
        self.decode_kernel = _resolve_decode_kernel(
            decode_kernel or kernels.decode_kernel, decode_fn is not None
        )
        self.decode_fn, self._triton = decode_fn, None
        if self.decode_kernel == "triton":
            from engine.attention import triton_decode

            self._triton = triton_decode
            self.decode_fn = decode_fn or triton_decode.paged_decode_attention
        self.decode_balanced = kernels.decode_balanced is not False  # on by default: balanced splits
        # on by default: splits of 64-token units inside pages over 64 tokens (decode_splits.split_block)
        self.decode_fine_splits = kernels.decode_fine_splits is not False
        self._num_sms: int | None = None

    @classmethod
    def from_config(cls, kernels: KernelConfig | None = None) -> FlashAttnCuteBackend:
        return cls(kernels=kernels)

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
        if md.is_decode and self.decode_kernel == "triton":
            return self._triton_decode(q, k_cache, v_cache, md, scale)
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

    def _triton_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Split-KV decode. The split count depends on the batch size and `max_seqlen_k` only; under a
        decode graph capture the runner sets `max_seqlen_k` to max_model_len, so a replay keeps it
        (the kernel splits each sequence's actual context itself)."""
        if q.stride(-1) != 1:
            q = q.contiguous()
        num_sms, balanced = self.num_sms(q.device), self.decode_balanced
        split_bs = split_block(k_cache.shape[1], self.decode_fine_splits)
        num_splits = self._triton.choose_num_splits(
            q.shape[0], k_cache.shape[2], md.max_seqlen_k, split_bs, num_sms, balanced
        )
        grid = self._triton.grid_splits(q.shape[0], k_cache.shape[2], num_sms, balanced)
        kwargs = {"balance": self._triton.balance_programs(num_sms, balanced, grid)}
        if split_bs != k_cache.shape[1]:  # pages over 64 tokens, split inside
            kwargs["split_block"] = split_bs
        return self.decode_fn(
            q, k_cache, v_cache, md.block_tables, md.context_lens, scale, num_splits, **kwargs
        )

    def num_sms(self, device: torch.device | None = None) -> int:
        """SMs of the GPU the Triton decode kernel splits for, found once (on `device`, else the
        current CUDA device; 132 off the GPU)."""
        if self._num_sms is None:
            if device is None:
                cuda = torch.cuda.is_available()
                device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
            self._num_sms = _num_sms(device)
        return self._num_sms

    def compile_count(self) -> int:
        cache = getattr(self._cache_owner, "compile_cache", None)
        entries = getattr(cache, "cache", cache)  # flash_attn.cute wraps its dict in a JITCache
        try:
            count = len(entries)
        except TypeError:
            count = 0
        return count + (self._triton.compiled_variants() if self._triton is not None else 0)


DECODE_KERNELS = ("triton", "fa4")


def triton_decode_available() -> bool:
    """Whether the Triton decode kernel can run here (Triton installed, a CUDA device present)."""
    return module_available("triton") and torch.cuda.is_available()


def _resolve_decode_kernel(decode_kernel: str | None, injected: bool) -> str:
    """The asked-for decode kernel; "auto" (or None): "triton" where it can run, else "fa4"."""
    choice = decode_kernel or "auto"
    if choice == "auto":
        return "triton" if injected or triton_decode_available() else "fa4"
    if choice not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel: {choice!r} is not one of {['auto', *DECODE_KERNELS]}")
    if choice == "triton" and not (injected or module_available("triton")):
        raise ValueError("decode_kernel 'triton': the triton package is not installed")
    return choice


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H100/H200's count: only shapes the split choice off the GPU
    return torch.cuda.get_device_properties(device).multi_processor_count
