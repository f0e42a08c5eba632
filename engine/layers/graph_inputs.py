"""A decode step's inputs copied into the decode CUDA graph's static buffers in one Triton launch (token
ids, positions, slots, context lengths, block tables; padding rows get slot -1 and context 1).

Why: the torch path is up to seven launches (five copies, two fills), ~11 µs of a one-row decode step
on an H200. The kernel writes what `copy_torch` writes, no more: the first `n` rows of each buffer,
the block tables' first `width` columns only, and of the padding rows n..bs only the slot and the
context length. CUDA only (tests run it in Triton's interpreter); the kernel config's `graph_copy_kernel`
($KVPLAN_GRAPH_COPY=0, engine/envs.py) turns it off.
"""

from __future__ import annotations

import torch

from engine.layers import pdl

try:
    import triton
    import triton.language as tl

    from engine.layers.pdl import pdl_prologue
except ImportError:  # CPU-only installs: the torch copies serve
    triton = None

# (input_ids, positions, slot_mapping, context_lens, block_tables): the step's (n rows, the tables
# [n, width]) or the graph's (its largest batch, the tables [rows, max width]); int32
DecodeInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

MAX_BLOCK_COLUMNS = 1024  # block-table columns a program copies at a time


def available() -> bool:
    return triton is not None


def copy_torch(src: DecodeInputs, dst: DecodeInputs, bs: int) -> None:
    """The step's `src` into rows [0, n) of `dst`; padding rows [n, bs) get slot -1 and context 1."""
    n, width = src[4].shape
    for s, d in zip(src[:4], dst[:4]):
        d[:n].copy_(s, non_blocking=True)
    dst[4][:n, :width].copy_(src[4], non_blocking=True)
    if bs > n:
        dst[2][n:bs].fill_(-1)
        dst[3][n:bs].fill_(1)


def copy_triton(src: DecodeInputs, dst: DecodeInputs, bs: int) -> None:
    """What `copy_torch` does, in one launch of `bs` programs."""
    n, width = src[4].shape
    rows, max_width = dst[4].shape
    if not n <= bs <= rows or width > max_width:
        raise ValueError(f"graph inputs: {n} rows x {width} blocks do not fit {bs} of {rows} x {max_width}")
    if src[4].stride(1) != 1 or dst[4].stride(1) != 1:
        raise ValueError("graph inputs: the block tables' columns must be contiguous")
    _copy_decode_inputs_kernel[(bs,)](
        *src[:4],
        src[4],
        src[4].stride(0),
        *dst[:4],
        dst[4],
        dst[4].stride(0),
        n,
        width,
        BLOCK_W=block_columns(max_width),
        num_warps=1,
        **pdl.launch_kwargs(dst[0].device, bs),
    )


def block_columns(max_width: int) -> int:
    """Block-table columns a program copies at a time (one value per graph: one compiled variant)."""
    return min(MAX_BLOCK_COLUMNS, triton.next_power_of_2(max(max_width, 16)))


def compiled_variants() -> int:
    """Kernel variants compiled so far by this module's kernel (0 under the interpreter)."""
    if triton is None:
        return 0
    return sum(len(entry[0]) for entry in getattr(_copy_decode_inputs_kernel, "device_caches", {}).values())


if triton is not None:
    # the step's tensors are views of one packed buffer at offsets that vary with the batch, and n,
    # width vary from step to step: none is specialised on, so no step compiles a variant of its own
    @triton.jit(
        do_not_specialize=[
            "ids_ptr", "pos_ptr", "slot_ptr", "ctx_ptr", "tables_ptr", "tables_stride", "n", "width",
        ]
    )  # fmt: skip
    def _copy_decode_inputs_kernel(
        ids_ptr,
        pos_ptr,
        slot_ptr,
        ctx_ptr,
        tables_ptr,
        tables_stride,
        dst_ids_ptr,
        dst_pos_ptr,
        dst_slot_ptr,
        dst_ctx_ptr,
        dst_tables_ptr,
        dst_tables_stride,
        n,
        width,
        BLOCK_W: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """Program (row): a step row's values and block-table columns, or a padding row's slot and
        context length."""
        pdl_prologue(USE_PDL)
        row = tl.program_id(0)
        if row < n:
            tl.store(dst_ids_ptr + row, tl.load(ids_ptr + row))
            tl.store(dst_pos_ptr + row, tl.load(pos_ptr + row))
            tl.store(dst_slot_ptr + row, tl.load(slot_ptr + row))
            tl.store(dst_ctx_ptr + row, tl.load(ctx_ptr + row))
            src = tables_ptr + row.to(tl.int64) * tables_stride
            dst = dst_tables_ptr + row.to(tl.int64) * dst_tables_stride
            for start in range(0, width, BLOCK_W):
                cols = start + tl.arange(0, BLOCK_W)
                mask = cols < width
                tl.store(dst + cols, tl.load(src + cols, mask=mask), mask=mask)
        else:
            tl.store(dst_slot_ptr + row, -1)
            tl.store(dst_ctx_ptr + row, 1)
