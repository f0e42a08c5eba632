"""Decode attention on a GPU: FlashAttention-4 (`flash_attn.cute` varlen over the paged cache) against
the Triton split-KV kernel, both called through the engine's FA4 backend exactly as a decode step
calls them, each captured in a CUDA graph and replayed. Prints µs per call, KV read bandwidth (K+V
bytes / time), the split count, and the max abs error of each kernel (FA4 vs Triton, and Triton vs
an fp32 torch reference on a few sequences); the table comes last.

    PYTHONPATH=. python3 benchmarks/bench_decode_attention.py                # Qwen3-0.6B shapes
    PYTHONPATH=. python3 benchmarks/bench_decode_attention.py --no-fa4 --pages 16 --batches 1 256

A graph holds up to 64 calls, each over its own pages (as the layers of a step are), so that small
shapes read from HBM rather than L2. FA4 compiles each new variant for seconds: once FA4 has spent
`--fa4-budget-s`, the remaining rows skip it. Splits are chosen for the row's context unless
`--max-model-len` is given (a decode graph of the engine chooses them for its max_model_len).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from engine.attention.fa4 import FlashAttnCuteBackend
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_sdpa import paged_reference
from engine.attention.triton_decode import choose_num_splits
from engine.decode_splits import split_block

L2_FLUSH_BYTES = 256 << 20  # distinct pages read per graph replay, at least (H200 L2: 50 MB)
MAX_CALLS_PER_GRAPH = 64
DEVICE = "cuda"


def _no_varlen(*args, **kwargs):
    raise RuntimeError("FA4 is off (--no-fa4)")


def make_inputs(batch, context, page, heads, kv_heads, head_dim, calls, dtype, seed=0):
    """q, caches and one (block table, metadata) per call, each call over its own random pages."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    pages_per_seq = -(-context // page)
    num_blocks = calls * batch * pages_per_seq
    shape = (num_blocks, page, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=DEVICE, dtype=dtype)
    q = torch.randn(batch, heads, head_dim, generator=gen, device=DEVICE, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32)
    tables = perm.view(calls, batch, pages_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    mds = [
        AttentionMetadata(
            num_seqs=batch,
            num_tokens=batch,
            max_seqlen_q=1,
            max_seqlen_k=context,
            has_context=True,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu * context,
            context_lens=lens,
            slot_mapping=torch.full((batch,), -1, dtype=torch.int32, device=DEVICE),
            block_tables=tables[i],
        )
        for i in range(calls)
    ]
    return q, k_cache, v_cache, mds


def time_graph(backend, q, k_cache, v_cache, mds, scale, max_context):
    """(µs per call, output of the first call) of `len(mds)` calls captured in one CUDA graph."""
    mds = [_with_max_context(md, max_context) for md in mds]
    backend.forward(q, None, None, k_cache, v_cache, mds[0], scale)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [backend.forward(q, None, None, k_cache, v_cache, md, scale) for md in mds]
    graph.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    stop.record()
    torch.cuda.synchronize()
    reps = max(3, min(200, int(50.0 / max(start.elapsed_time(stop), 1e-3))))  # about 50 ms of replays
    start.record()
    for _ in range(reps):
        graph.replay()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) * 1e3 / (reps * len(mds)), outs[0].clone()


def _with_max_context(md: AttentionMetadata, max_context: int) -> AttentionMetadata:
    """The metadata a decode graph is captured with: max_seqlen_k = the engine's max_model_len."""
    return AttentionMetadata(**{**md.__dict__, "max_seqlen_k": max_context})


def reference_error(out, q, k_cache, v_cache, md, scale, rows=4) -> float:
    """Max abs error of `out` against fp32 torch attention on the first `rows` sequences."""
    page, err = k_cache.shape[1], 0.0
    for i in range(min(rows, q.shape[0])):
        n = int(md.context_lens[i])
        blocks = md.block_tables[i, : -(-n // page)].long()
        keys = k_cache[blocks].flatten(0, 1)[:n].float()
        values = v_cache[blocks].flatten(0, 1)[:n].float()
        ref = paged_reference(q[i : i + 1].float(), keys, values, scale)[0]
        err = max(err, (out[i].float() - ref).abs().max().item())
    return err


def run_row(args, page, batch, context, fa4, triton) -> dict:
    """One table row; FA4 is timed only when `fa4` is given (its time goes in the row's fa4_s)."""
    dtype = getattr(torch, args.dtype)
    kv_bytes = batch * context * args.kv_heads * args.head_dim * 2 * torch.finfo(dtype).bits // 8
    calls = max(1, min(MAX_CALLS_PER_GRAPH, math.ceil(L2_FLUSH_BYTES / kv_bytes)))
    q, k_cache, v_cache, mds = make_inputs(
        batch, context, page, args.heads, args.kv_heads, args.head_dim, calls, dtype
    )
    scale = args.head_dim**-0.5
    max_context = args.max_model_len or context
    split_bs = split_block(page, triton.decode_fine_splits)  # as the backend counts them
    splits = choose_num_splits(batch, args.kv_heads, max_context, split_bs, _sms())
    t_us, t_out = time_graph(triton, q, k_cache, v_cache, mds, scale, max_context)
    row = dict(page=page, batch=batch, context=context, splits=splits, calls=calls)
    row.update(triton_us=t_us, triton_tbs=kv_bytes / t_us / 1e6)
    row["err_ref"] = reference_error(t_out, q, k_cache, v_cache, mds[0], scale)
    if fa4 is not None:
        start = time.perf_counter()
        f_us, f_out = time_graph(fa4, q, k_cache, v_cache, mds, scale, max_context)
        row.update(fa4_us=f_us, fa4_tbs=kv_bytes / f_us / 1e6, speedup=f_us / t_us)
        row["err_fa4"] = (f_out.float() - t_out.float()).abs().max().item()
        row["fa4_s"] = time.perf_counter() - start
    del q, k_cache, v_cache, mds, t_out
    torch.cuda.empty_cache()
    return row


def _sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


COLUMNS = [  # (key, header, width, format)
    ("page", "page", 4, "d"), ("batch", "batch", 5, "d"), ("context", "context", 7, "d"),
    ("splits", "splits", 6, "d"), ("fa4_us", "FA4 µs", 9, ".1f"), ("fa4_tbs", "FA4 TB/s", 8, ".2f"),
    ("triton_us", "Triton µs", 9, ".1f"), ("triton_tbs", "Triton TB/s", 11, ".2f"),
    ("speedup", "speedup", 7, ".2f"), ("err_fa4", "err vs FA4", 10, ".1e"), ("err_ref", "err vs ref", 10, ".1e"),
]  # fmt: skip


def format_row(row: dict) -> str:
    return "  ".join(
        format(row[key], f">{width}{fmt}") if key in row else "-".rjust(width)
        for key, _, width, fmt in COLUMNS
    )


def print_table(rows: list[dict]) -> None:
    print("  ".join(header.rjust(width) for _, header, width, _ in COLUMNS))
    for row in rows:
        print(format_row(row))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", type=int, nargs="+", default=[16, 128, 256])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 4096])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument(
        "--max-model-len", type=int, default=0,
        help="choose splits for this max context, as a decode graph of the engine does (default: the context)",
    )  # fmt: skip
    p.add_argument("--no-fa4", action="store_true", help="time the Triton kernel only")
    p.add_argument("--fa4-budget-s", type=float, default=60.0, help="stop timing FA4 after this long")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention needs a CUDA GPU")

    fa4 = None if args.no_fa4 else FlashAttnCuteBackend(decode_kernel="fa4")
    triton = FlashAttnCuteBackend(varlen_fn=fa4.varlen_fn if fa4 else _no_varlen, decode_kernel="triton")
    print(
        f"{torch.cuda.get_device_name()}, {_sms()} SMs; heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}"
    )
    rows, fa4_spent, begin = [], 0.0, time.perf_counter()
    for page in args.pages:
        for context in args.contexts:
            for batch in args.batches:
                use_fa4 = fa4 if fa4_spent < args.fa4_budget_s else None
                row = run_row(args, page, batch, context, use_fa4, triton)
                fa4_spent += row.get("fa4_s", 0.0)
                rows.append(row)
                print(format_row(row), flush=True)
    print(
        f"\n{time.perf_counter() - begin:.0f} s. TB/s: K+V bytes read / time per call (graph replay of "
        "`calls` calls over disjoint pages); err vs FA4: max |FA4 - Triton|; err vs ref: max |Triton - "
        "fp32 torch| on the first 4 sequences; '-': FA4 off or over its --fa4-budget-s\n"
    )
    print_table(rows)


if __name__ == "__main__":
    main()
