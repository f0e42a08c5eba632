"""The LM head plus greedy argmax of a one-row step: cuBLAS then engine/layers/argmax.py's two launches,
against engine/layers/head_argmax.py's fused pass, at Qwen3's head shape (151,936 x 1,024, bf16).

Each timing replays a CUDA graph of one call `--repeats` times back to back (the head's 311 MB are
more than the L2 holds) and prints µs per call and the weight's bytes per second. Also checks, over
`--rows` random hidden rows, that the fused token equals the argmax of the fused kernel's own logits
rounding (float32 reference rounded to bf16) and counts how often it equals the cuBLAS path's.
`--sweep` tries other tiles (to tune head_argmax.TILES).

    PYTHONPATH=. python3 benchmarks/bench_head_argmax.py [--sweep] [--vocab 151936] [--hidden 1024]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_gemv import capture_graph
from diag_single_stream import per_repeat_us

from engine.layers import argmax, head_argmax


def per_call_us(fn, repeats: int) -> float:
    """Device µs per call of fn, from a CUDA graph of one call replayed `repeats` times back to back."""
    return per_repeat_us(capture_graph(fn).replay, repeats)


def check(weight: torch.Tensor, rows: int) -> tuple[int, int]:
    """(rows whose fused token equals the float32 reference's rounded argmax, rows equal to cuBLAS's)."""
    exact = same = 0
    for _ in range(rows):
        x = torch.randn(1, weight.shape[1], device=weight.device).to(weight.dtype)
        token = int(head_argmax.head_argmax(x, weight))
        ref = (x.float() @ weight.float().T).to(weight.dtype).float().argmax(-1)
        exact += token == int(ref)
        same += token == int(F.linear(x, weight).float().argmax(-1))
    return exact, same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--rows", type=int, default=200, help="random rows for the token check")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    weight = torch.randn(args.vocab, args.hidden, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, args.hidden, device=dev, dtype=torch.bfloat16)
    gbytes = weight.numel() * weight.element_size() / 1e9
    rows = [
        ("cuBLAS head", per_call_us(lambda: F.linear(x, weight), args.repeats)),
        ("cuBLAS + torch argmax", per_call_us(lambda: F.linear(x, weight).float().argmax(-1), args.repeats)),
        ("cuBLAS + triton argmax", per_call_us(lambda: argmax.argmax(F.linear(x, weight)), args.repeats)),
        (f"fused {head_argmax.TILES}", per_call_us(lambda: head_argmax.head_argmax(x, weight), args.repeats)),
    ]
    if args.sweep:
        for block_n in (8, 16, 32, 64):
            for block_k in (128, 256, 512, 1024):
                for warps in (4, 8):
                    if block_n * block_k > 32768 or block_n * block_k < 1024:
                        continue
                    tiles = (block_n, block_k, warps)
                    us = per_call_us(lambda t=tiles: head_argmax.head_argmax(x, weight, t), args.repeats // 4)
                    rows.append((f"fused {tiles}", us))
                    print(f"  {tiles}: {us:.2f} µs", flush=True)
    exact, same = check(weight, args.rows)
    print(
        f"\nfused token = float32 reference rounded: {exact}/{args.rows}; = cuBLAS path: {same}/{args.rows}"
    )
    best = min(rows[3:], key=lambda r: r[1])
    print(f"{'path':<34}{'us':>9}{'TB/s':>7}")
    for name, us in rows[:4] + ([best] if args.sweep else []):
        print(f"{name:<34}{us:>9.2f}{gbytes / us * 1e3:>7.2f}")


if __name__ == "__main__":
    main()
