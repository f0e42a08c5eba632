"""Greedy sampling's argmax in Triton: each row's first maximum over the logits, read in their own dtype
(no float32 copy), by many programs a row and a second launch that reduces their partials.

Why: torch's argmax over one 151,936-wide row is a single-block reduction, and with the float copy
before it cost ~25 µs of a one-row decode step on an H200. The result equals `x.float().argmax(-1)`
exactly (int64): float16 / bfloat16 widen to float32 exactly, so no tie is made or broken; of equal
maxima the lowest index wins (-0.0 equals 0.0); NaN counts as greater than any number, as in torch, so
a row holding NaN gives its first NaN's index; a row of -inf gives 0. CUDA only (tests run the
kernels in Triton's interpreter); the kernel config's `triton_argmax` ($KVPLAN_TRITON_ARGMAX=0,
engine/envs.py) turns it off (torch's argmax serves).
"""

from __future__ import annotations

import torch

from engine.layers import pdl

try:
    import triton
    import triton.language as tl

    from engine.layers.pdl import pdl_prologue
except ImportError:  # CPU-only installs: torch's argmax serves
    triton = None

BLOCK = 2048  # logits a program of the first launch reads (75 programs over Qwen3's 151,936)
NUM_WARPS = 4
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_COLUMNS = 2**31 - 1  # int32 column indices


def available() -> bool:
    return triton is not None


def serves(x: torch.Tensor) -> bool:
    """Whether the kernels take `x`: CUDA [rows, V], a float dtype of `DTYPES`, columns contiguous."""
    return (
        triton is not None
        and x.is_cuda
        and x.dim() == 2
        and x.dtype in DTYPES
        and x.shape[0] > 0
        and 0 < x.shape[1] < MAX_COLUMNS
        and x.stride(1) == 1
    )


def argmax(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """`x.float().argmax(-1)` of x [rows, V] (int64 [rows]), in two launches and no host sync."""
    rows, vocab = x.shape
    if x.stride(1) != 1:
        raise ValueError("argmax: the logits' columns must be contiguous")
    num_blocks = triton.cdiv(vocab, block)
    values = torch.empty((rows, num_blocks), dtype=torch.float32, device=x.device)
    indices = torch.empty((rows, num_blocks), dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    pdl_kwargs = pdl.launch_kwargs(x.device, rows)
    _block_argmax_kernel[(rows, num_blocks)](
        x, x.stride(0), values, indices, vocab, BLOCK=block, num_warps=NUM_WARPS, **pdl_kwargs
    )
    _reduce_argmax_kernel[(rows,)](
        values,
        indices,
        out,
        NUM_BLOCKS=num_blocks,
        BLOCK_P=triton.next_power_of_2(num_blocks),
        num_warps=1,
        **pdl_kwargs,
    )
    return out


def warmup(vocab: int, dtypes: set[torch.dtype], max_rows: int, device: torch.device) -> None:
    """Compile every variant a run can hit (logits dtype x launch with and without PDL) now."""
    for dtype in dtypes:
        for rows in sorted({1, max_rows}):
            argmax(torch.zeros((rows, vocab), dtype=dtype, device=device))


def compiled_variants() -> int:
    """Kernel variants compiled so far by this module's kernels (0 under the interpreter)."""
    if triton is None:
        return 0
    caches = [getattr(k, "device_caches", {}) for k in (_block_argmax_kernel, _reduce_argmax_kernel)]
    return sum(len(entry[0]) for cache in caches for entry in cache.values())


if triton is not None:
    _NO_INDEX = tl.constexpr(MAX_COLUMNS)  # a masked lane's index: after every real one

    @triton.jit
    def _argmax_combine(value1, index1, value2, index2):
        """The better of two (value, index) pairs, as torch's argmax orders them: the greater value, NaN
        above all numbers; of equal values (or two NaNs) the lower index."""
        nan1, nan2 = value1 != value1, value2 != value2
        tie = (value1 == value2) | (nan1 & nan2)
        first = (value1 > value2) | (nan1 & ~nan2) | (tie & (index1 < index2))
        return tl.where(first, value1, value2), tl.where(first, index1, index2)

    @triton.jit
    def _block_argmax_kernel(
        x_ptr, x_stride, values_ptr, indices_ptr, vocab, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
    ):
        """Program (row, block): the block's maximum (float32) and the first column holding it."""
        pdl_prologue(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        block = tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        valid = cols < vocab
        x = tl.load(x_ptr + row * x_stride + cols, mask=valid, other=float("-inf")).to(tl.float32)
        value, index = tl.reduce((x, tl.where(valid, cols, _NO_INDEX)), 0, _argmax_combine)
        partial = row * tl.num_programs(1) + block
        tl.store(values_ptr + partial, value)
        tl.store(indices_ptr + partial, index)

    @triton.jit
    def _reduce_argmax_kernel(
        values_ptr,
        indices_ptr,
        out_ptr,
        NUM_BLOCKS: tl.constexpr,
        BLOCK_P: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """Program (row): the first maximum over the row's block partials (blocks are in column order,
        so the lowest index among equal partials is the row's first)."""
        pdl_prologue(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_P)
        valid = offs < NUM_BLOCKS
        values = tl.load(values_ptr + row * NUM_BLOCKS + offs, mask=valid, other=float("-inf"))
        indices = tl.load(indices_ptr + row * NUM_BLOCKS + offs, mask=valid, other=_NO_INDEX)
        _, index = tl.reduce((values, indices), 0, _argmax_combine)
        tl.store(out_ptr + row, index.to(tl.int64))
