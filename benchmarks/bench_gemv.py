"""Small-batch projections on the GPU: cuBLAS (F.linear) against engine/layers/gemv.py's Triton kernel
at the weight shapes of Qwen3-0.6B and Qwen3-8B, for 1–8 rows, plus the fused prologues.

Each timing replays a CUDA graph of one call per layer over distinct weights (28 or 36 copies, more
than the L2 holds), as a decode step reads them; prints µs per call and the weight bytes per second.
`--sweep` also tries other tile shapes for the Triton kernel (to tune `gemv.block_sizes`).

    PYTHONPATH=. python3 benchmarks/bench_gemv.py [--rows 1,2,4,8] [--sweep]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from engine.layers import gemv

SHAPES = {  # name: (out_features, in_features, layers)
    "0.6b qkv": (4096, 1024, 28),
    "0.6b o": (1024, 2048, 28),
    "0.6b gate_up": (6144, 1024, 28),
    "0.6b down": (1024, 3072, 28),
    "0.6b lm_head": (151936, 1024, 1),
    "8b qkv": (6144, 4096, 36),
    "8b o": (4096, 4096, 36),
    "8b gate_up": (24576, 4096, 36),
    "8b down": (4096, 12288, 36),
}


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one fn() call (run once on a side stream first, so it compiles outside)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph(fn, repeats: int = 20) -> float:
    """Seconds per replay of a CUDA graph of fn() (median of `repeats`)."""
    graph = capture_graph(fn)
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return sorted(times)[len(times) // 2]


def candidates(rows: int, k: int) -> list[tuple[int, int, int]]:
    """(BLOCK_N, BLOCK_K, warps) with tiles of 2k–8k products."""
    out = []
    for block_n in (2, 4):
        for tile in (2048, 4096, 8192):
            block_k = min(triton.next_power_of_2(k), tile // (block_n * triton.next_power_of_2(rows)))
            if block_k >= 64:
                out += [(block_n, block_k, warps) for warps in (2, 4)]
    return sorted(set(out))


def bench_shape(name: str, n: int, k: int, layers: int, rows: int, sweep: bool) -> list[str]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(layers)]
    x = torch.randn(rows, k, device=dev, dtype=dt)
    gbytes = n * k * 2 * layers / 1e9
    t_cublas = time_graph(lambda: [F.linear(x, w) for w in ws]) / layers
    t_triton = time_graph(lambda: [gemv.linear(x, w) for w in ws]) / layers
    torch.testing.assert_close(gemv.linear(x, ws[0]), F.linear(x, ws[0]), rtol=2e-2, atol=2e-2)
    best = ""
    if sweep:
        results = []
        for cfg in candidates(rows, k):
            try:
                t = time_graph(lambda cfg=cfg: [gemv.linear(x, w, tiles=cfg) for w in ws], repeats=8) / layers
            except Exception as exc:  # a tile the compiler refuses: skip it
                print(f"  {name} {cfg}: {type(exc).__name__}")
                continue
            results.append((t, cfg))
        t_best, cfg = min(results)
        best = f" | best {cfg} {t_best * 1e6:6.2f} µs"
    per = gbytes / layers
    return [
        f"{name:<13} rows {rows}: cuBLAS {t_cublas * 1e6:7.2f} µs ({per / t_cublas:5.2f} GB/s)"
        f"  triton {t_triton * 1e6:7.2f} µs ({per / t_triton:5.2f} GB/s)"
        f" {gemv.block_sizes(rows, n, k) if gemv.serves(x, ws[0]) else 'cuBLAS'}{best}"
    ]


def bench_fused(rows: int) -> list[str]:
    """Norm + qkv and SiLU + down of Qwen3-0.6B: the fused kernel against the two launches it replaces."""
    from engine.layers import triton_ops

    dev, dt = torch.device("cuda"), torch.bfloat16
    lines = []
    x, r = (torch.randn(rows, 1024, device=dev, dtype=dt) for _ in range(2))
    g = torch.ones(1024, device=dev, dtype=dt)
    ws = [torch.randn(4096, 1024, device=dev, dtype=dt) * 0.02 for _ in range(28)]
    t_two = time_graph(lambda: [gemv.linear(triton_ops.add_rms_norm(x, r, g, 1e-6)[0], w) for w in ws]) / 28
    t_one = time_graph(lambda: [gemv.norm_linear(x, r, g, 1e-6, w)[0] for w in ws]) / 28
    lines.append(
        f"add+norm, qkv   rows {rows}: two launches {t_two * 1e6:6.2f} µs, fused {t_one * 1e6:6.2f} µs"
    )
    gu = torch.randn(rows, 6144, device=dev, dtype=dt)
    wd = [torch.randn(1024, 3072, device=dev, dtype=dt) * 0.02 for _ in range(28)]
    t_two = time_graph(lambda: [gemv.linear(triton_ops.silu_and_mul(gu), w) for w in wd]) / 28
    t_one = time_graph(lambda: [gemv.silu_linear(gu, w) for w in wd]) / 28
    lines.append(
        f"silu*up, down   rows {rows}: two launches {t_two * 1e6:6.2f} µs, fused {t_one * 1e6:6.2f} µs"
    )
    ref = F.linear(triton_ops.silu_and_mul(gu), wd[0])
    torch.testing.assert_close(gemv.silu_linear(gu, wd[0]), ref, rtol=2e-2, atol=2e-2)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--sweep", action="store_true", help="also try other tile shapes")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names from SHAPES")
    args = ap.parse_args()
    lines = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name in args.shapes.split(","):
            n, k, layers = SHAPES[name]
            line = bench_shape(name, n, k, layers, rows, args.sweep and name != "0.6b lm_head")
            print(*line, flush=True)
            lines += line
        lines += bench_fused(rows)
        print(*lines[-2:], sep="\n", flush=True)
    print("\n".join(["", "summary:", *lines]))


if __name__ == "__main__":
    main()
