"""Split-KV paged decode attention in Triton: one query per sequence, GQA, any page size, graph-safe;
stage 1 covers a share of each sequence's pages (found in-kernel), stage 2 merges the shares by LSE.

With `balance` > 0 a sequence uses only the splits it needs for none to read more than about
1 / balance of the step's keys (`engine.decode_splits`); one that uses a single split writes its
output itself and the merge leaves it alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.decode_splits import (  # noqa: F401 (re-exported)
    MAX_SPLITS,
    balance_programs,
    choose_num_splits,
    grid_splits,
    split_unit,
)
from engine.layers import pdl
from engine.layers.pdl import pdl_prologue

NUM_WARPS = 4
NUM_STAGES = 2

Workspace = tuple[torch.Tensor, torch.Tensor]  # partial outputs [B, H, S, D] fp32, their LSE [B, H, S]


def make_workspace(
    batch: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
) -> Workspace:
    """The fp32 buffers stage 1 writes and stage 2 reads; pass them in to keep fixed buffers."""
    partial = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=device)
    return partial, lse


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, keys per sequence (the new token's included)
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,  # [B, H, D], q's dtype
    workspace: Workspace | None = None,  # make_workspace(B, H, D, num_splits); unused when 1 split
    balance: int = 0,  # programs to spread the step's keys over (decode_splits.balance_programs); 0 = off
    split_block: int = 0,  # the page size splits count in (decode_splits.split_block); 0 = the cache's
) -> torch.Tensor:
    """Softmax(scale * q k^T) v of each sequence's query over its `context_lens` cached keys."""
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, num_splits)
    batch, num_heads, head_dim = q.shape
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if balance < 0:
        raise ValueError(f"paged_decode_attention: balance must be >= 0, got {balance}")
    if split_block < 0:
        raise ValueError(f"paged_decode_attention: split_block must be >= 0, got {split_block}")
    unit = split_unit(split_block or k_cache.shape[1])
    if num_splits == 1:
        _launch_split_kv(q, k_cache, v_cache, block_tables, context_lens, scale, 1, out, None, 0, unit)
        return out
    if workspace is None:
        workspace = make_workspace(batch, num_heads, head_dim, num_splits, q.device)
    _check_workspace(workspace, q, num_splits)
    args = (block_tables, context_lens, scale, num_splits, out, workspace, balance, unit)
    _launch_split_kv(q, k_cache, v_cache, *args)
    _launch_merge(workspace, num_splits, out, context_lens, unit, k_cache.shape[2], balance)
    return out


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens, num_splits: int) -> None:
    """Shape checks on the host (no device sync)."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)}, k/v caches {tuple(k_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"paged_decode_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_decode_attention: q and the caches need a contiguous last dimension")
    if block_tables.shape[0] < q.shape[0] or context_lens.shape[0] < q.shape[0]:
        raise ValueError("paged_decode_attention: block_tables / context_lens have fewer rows than q")
    if num_splits < 1:
        raise ValueError(f"paged_decode_attention: num_splits must be >= 1, got {num_splits}")


def _check_workspace(workspace: Workspace, q: torch.Tensor, num_splits: int) -> None:
    partial, lse = workspace
    batch, num_heads, head_dim = q.shape
    if (
        partial.shape[0] < batch
        or partial.shape[1:] != (num_heads, num_splits, head_dim)
        or lse.shape[0] < batch
        or lse.shape[1:] != (num_heads, num_splits)
        or partial.dtype != torch.float32
        or lse.dtype != torch.float32
        or not (partial.is_contiguous() and lse.is_contiguous())
    ):
        raise ValueError(
            f"paged_decode_attention: workspace {tuple(partial.shape)}/{tuple(lse.shape)} does not fit "
            f"batch {batch}, heads {num_heads}, splits {num_splits}, head_dim {head_dim} (fp32, contiguous)"
        )


def _tile_tokens(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32


def _launch_split_kv(
    q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, out, workspace, balance, unit
):
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    direct = workspace is None
    partial, lse = (out, out) if direct else workspace  # the unused pointers are never dereferenced
    _split_kv_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, partial, lse,
        scale * 1.4426950408889634,  # log2(e): the kernel works in base 2
        num_splits, balance,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        TILE_N=_tile_tokens(head_dim),
        SPLIT_UNIT=unit,
        DIRECT=direct,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32 only matters for fp32 inputs
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        **pdl.launch_kwargs(q.device, batch),
    )  # fmt: skip


def _launch_merge(
    workspace: Workspace, num_splits: int, out: torch.Tensor, context_lens, unit, num_kv_heads, balance
) -> None:
    partial, lse = workspace
    batch, num_heads, head_dim = out.shape
    _merge_splits_kernel[(batch, num_heads)](
        partial, lse, out, context_lens,
        num_splits, balance,
        out.stride(0), out.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        SPLIT_UNIT=unit,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        SPLIT_CHUNK=MAX_SPLITS,
        num_warps=NUM_WARPS,
        **pdl.launch_kwargs(out.device, batch),
    )  # fmt: skip


@triton.jit
def _sequence_splits(
    context_lens_ptr, b, num_splits, balance, NUM_KV_HEADS: tl.constexpr, SPLIT_UNIT: tl.constexpr
):
    """(keys of sequence b, splits it uses, units each covers): `engine.decode_splits.sequence_splits`
    with the target of `target_split_units` over every row of the grid (axis 0) when balance > 0."""
    context = tl.load(context_lens_ptr + b)
    units = tl.maximum(tl.cdiv(context, SPLIT_UNIT), 1)
    wanted = num_splits
    if balance > 0:
        num_rows = tl.num_programs(0)
        total = tl.zeros([], tl.int64)
        for first in range(0, num_rows, 128):
            rows = first + tl.arange(0, 128)
            total += tl.sum(tl.load(context_lens_ptr + rows, mask=rows < num_rows, other=0).to(tl.int64))
        per_program = tl.cdiv(total * NUM_KV_HEADS, balance)
        target = tl.maximum(tl.cdiv(per_program, SPLIT_UNIT), 1).to(tl.int32)
        wanted = tl.minimum(tl.cdiv(units, target), num_splits)
    per_split = tl.cdiv(units, wanted)
    return context, tl.cdiv(units, per_split), per_split


# Eager decode steps (enforce_eager) pass views into the step's packed metadata: their addresses and
# the block table's row stride change from step to step, so they are not specialised on (a new
# alignment or stride would compile a new variant mid-run; decode graphs use fixed buffers).
@triton.jit(do_not_specialize=["num_splits", "balance", "tables_ptr", "context_lens_ptr", "stride_tb"])
def _split_kv_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, context_lens_ptr, out_ptr, partial_ptr, lse_ptr,
    qk_scale,  # softmax scale * log2(e)
    num_splits,  # runtime: a new value does not compile a new variant
    balance,  # programs the step's keys are spread over; 0: every sequence uses every split
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_tb, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, SPLIT_UNIT: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the normalised output, no workspace
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (sequence b, kv head, split): every query head of the kv head's group (rows padded to
    GROUP_PAD for tl.dot) over the split's contiguous run of SPLIT_UNIT-token units, online softmax
    in fp32 and base 2. A sequence that uses one split writes its normalised output; else each used
    split writes its normalised partial output and its LSE (-inf when empty) for the merge. Splits
    past those the sequence uses do nothing."""
    pdl_prologue(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context, used, units_per_split = _sequence_splits(
        context_lens_ptr, b, num_splits, balance, NUM_KV_HEADS, SPLIT_UNIT
    )
    active = split < used
    start = split * units_per_split * SPLIT_UNIT
    end = tl.where(active, tl.minimum(start + units_per_split * SPLIT_UNIT, context), start)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    q_mask = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q_offs = b * stride_qb + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(
        q_ptr + q_offs, mask=q_mask & ((tl.zeros([GROUP_PAD], tl.int32) + split) < used)[:, None], other=0.0
    )

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    table = tables_ptr + b * stride_tb
    for tile_start in range(start, end, TILE_N):
        tokens = tile_start + tl.arange(0, TILE_N)
        valid = tokens < end
        if BLOCK_D == HEAD_DIM:
            kv_mask = tl.broadcast_to(valid[:, None], [TILE_N, BLOCK_D])  # constant along D: vectorised
        else:
            kv_mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
        blocks = tl.load(table + tokens // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        in_page = (tokens % BLOCK_SIZE)[:, None]
        k_offs = blocks[:, None] * stride_kb + in_page * stride_kt + kv_head * stride_kh + dims[None, :]
        k = tl.load(k_ptr + k_offs, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))  # finite: every tile has a valid token
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_offs = blocks[:, None] * stride_vb + in_page * stride_vt + kv_head * stride_vh + dims[None, :]
        v = tl.load(v_ptr + v_offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    acc = acc / l_safe[:, None]  # an empty split leaves zeros, never NaN
    if DIRECT:
        o_offs = b * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        used_rows = tl.zeros([GROUP_PAD], tl.int32) + used  # masks of vectors (the interpreter's too)
        split_rows = tl.zeros([GROUP_PAD], tl.int32) + split
        alone = ((used_rows == 1) & (split_rows == 0))[:, None]
        o_offs = b * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=q_mask & alone)
        shared = (split_rows < used_rows) & (used_rows > 1) & (rows < GROUP)
        slot = (b * NUM_HEADS + heads) * num_splits + split  # [B, H, S] index of each row
        tl.store(partial_ptr + slot[:, None] * HEAD_DIM + dims[None, :], acc, mask=q_mask & shared[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + slot, lse, mask=shared)


@triton.jit(do_not_specialize=["num_splits", "balance", "context_lens_ptr"])
def _merge_splits_kernel(
    partial_ptr, lse_ptr, out_ptr, context_lens_ptr,
    num_splits, balance,
    stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, SPLIT_UNIT: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (sequence b, head h): the LSE-weighted sum of the outputs of the splits sequence b
    used, SPLIT_CHUNK splits per load; zeros when every split is empty (no keys). A sequence that
    used one split wrote its output in stage 1: nothing to do."""
    pdl_prologue(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    _, used, _ = _sequence_splits(context_lens_ptr, b, num_splits, balance, NUM_KV_HEADS, SPLIT_UNIT)
    used = tl.where(used > 1, used, 0)  # one split: no loads, no store
    base = (b * NUM_HEADS + h) * num_splits
    dims = tl.arange(0, BLOCK_D)
    chunk = tl.arange(0, SPLIT_CHUNK)
    m = float("-inf")
    denom = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for first in range(0, used, SPLIT_CHUNK):
        splits = first + chunk
        in_range = splits < used
        lse = tl.load(lse_ptr + base + splits, mask=in_range, other=float("-inf"))
        part_mask = in_range[:, None] & (dims < HEAD_DIM)[None, :]
        part = tl.load(
            partial_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :], mask=part_mask, other=0.0
        )
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights stay 0
        alpha = tl.exp2(m - m_ref)
        weights = tl.exp2(lse - m_ref)
        acc = acc * alpha + tl.sum(weights[:, None] * part, 0)
        denom = denom * alpha + tl.sum(weights, 0)
        m = m_new
    out = acc / tl.where(denom > 0.0, denom, 1.0)  # no keys at all: acc is 0, so zeros
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=(dims < HEAD_DIM) & ((tl.zeros([BLOCK_D], tl.int32) + used) > 1),
    )


def compiled_variants() -> int:
    """Kernel variants compiled so far by this module's kernels (0 under the interpreter)."""
    caches = [getattr(k, "device_caches", {}) for k in (_split_kv_kernel, _merge_splits_kernel)]
    return sum(len(entry[0]) for cache in caches for entry in cache.values())  # (kernel cache, ...)
