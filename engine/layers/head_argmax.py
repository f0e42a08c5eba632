"""The LM head and greedy sampling in one pass for a one-row step: logits = x W^T read at memory speed,
each program's maximum taken as it is computed, and a second launch that reduces those partials.

Why: a one-token greedy step read the head's weight through cuBLAS, wrote 151,936 logits, then read
them back for the argmax (two more launches); here the argmax rides on the weight read and the logits
are never written. Each logit is rounded to the weight's dtype before it is compared, as the argmax
over the head's output would see it; ties go to the lowest index and NaN counts as the greatest, as
in engine/layers/argmax.py. The dot products sum in another order than cuBLAS's, so a logit may
differ from F.linear's in its last bit (like engine/layers/gemv.py's projections). CUDA only (tests
run the kernels in Triton's interpreter); the kernel config's `fused_head_argmax` ($KVPLAN_HEAD_ARGMAX=0,
engine/envs.py) turns it off.
"""

from __future__ import annotations

import torch

from engine.layers import argmax, pdl

try:
    import triton
    import triton.language as tl

    from engine.layers.argmax import _NO_INDEX, _argmax_combine, _reduce_argmax_kernel
    from engine.layers.pdl import pdl_launch_dependents, pdl_wait
except ImportError:  # CPU-only installs: F.linear and the sampler serve
    triton = None

# (BLOCK_N, BLOCK_K, num_warps): the best of benchmarks/bench_head_argmax.py --sweep on an H200.
TILES = (64, 128, 4)
REDUCE_WARPS = 4


def available() -> bool:
    return triton is not None


def serves(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernels take this head: one CUDA row, contiguous, of the weight's dtype."""
    return (
        triton is not None
        and hidden.is_cuda
        and hidden.dim() == 2
        and hidden.shape[0] == 1
        and hidden.shape[1] == weight.shape[1]
        and hidden.dtype == weight.dtype
        and hidden.dtype in argmax.DTYPES
        and hidden.stride(-1) == 1
        and weight.is_contiguous()
        and 0 < weight.shape[0] < argmax.MAX_COLUMNS
    )


def head_argmax(
    hidden: torch.Tensor, weight: torch.Tensor, tiles: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """`F.linear(hidden, weight).float().argmax(-1)` (int64 [1]) of one row, without the logits.
    `tiles`: (BLOCK_N, BLOCK_K, num_warps) in place of TILES (for tuning them)."""
    if not serves(hidden, weight):
        raise ValueError(
            f"head_argmax: takes one contiguous CUDA row of the weight's dtype; got hidden "
            f"{tuple(hidden.shape)} {hidden.dtype} on {hidden.device}, weight {tuple(weight.shape)}"
        )
    vocab, k = weight.shape
    block_n, block_k, warps = tiles or TILES
    num_blocks = triton.cdiv(vocab, block_n)
    values = torch.empty(num_blocks, dtype=torch.float32, device=hidden.device)
    indices = torch.empty(num_blocks, dtype=torch.int32, device=hidden.device)
    out = torch.empty(1, dtype=torch.int64, device=hidden.device)
    pdl_kwargs = pdl.launch_kwargs(hidden.device, 1)
    _head_argmax_kernel[(num_blocks,)](
        hidden,
        weight,
        values,
        indices,
        vocab,
        K=k,
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(k)),
        num_warps=warps,
        **pdl_kwargs,
    )
    _reduce_argmax_kernel[(1,)](
        values,
        indices,
        out,
        NUM_BLOCKS=num_blocks,
        BLOCK_P=triton.next_power_of_2(num_blocks),
        num_warps=REDUCE_WARPS,
        **pdl_kwargs,
    )
    return out


def warmup(weight: torch.Tensor) -> None:
    """Compile the variant a run hits (this head's shape and dtype, with PDL where it is on) now."""
    head_argmax(torch.zeros((1, weight.shape[1]), dtype=weight.dtype, device=weight.device), weight)


def compiled_variants() -> int:
    """Kernel variants compiled so far by this module's first kernel (the second is argmax.py's)."""
    if triton is None:
        return 0
    return sum(len(entry[0]) for entry in getattr(_head_argmax_kernel, "device_caches", {}).values())


if triton is not None:

    @triton.jit(do_not_specialize=["vocab"])
    def _head_argmax_kernel(
        x_ptr,
        w_ptr,
        values_ptr,
        indices_ptr,
        vocab,
        K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """Program: BLOCK_N logits, each rounded to the weight's dtype, and the first maximum of
        them (float32) with its column. The first weight tile is loaded before waiting for the kernel
        before (the weight is never written during a step)."""
        pdl_launch_dependents(USE_PDL)
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < vocab
        rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
        offs_k = tl.arange(0, BLOCK_K)
        w = tl.load(rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        pdl_wait(USE_PDL)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            cols = k0 + offs_k
            k_mask = cols < K
            if k0 > 0:
                w = tl.load(rows + cols[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_ptr + cols, mask=k_mask, other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        logits = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
        logits = tl.where(n_mask, logits, float("-inf"))
        value, index = tl.reduce((logits, tl.where(n_mask, offs_n, _NO_INDEX)), 0, _argmax_combine)
        tl.store(values_ptr + pid, value)
        tl.store(indices_ptr + pid, index)
