"""Tune the one-row decode graph's Triton tiles where they run: inside the engine's own CUDA graph, with
PDL and the GEMV's weight prefetch, rather than one kernel at a time (benchmarks/bench_gemv.py).

Random Qwen3-0.6B (made on the spot), block 16, one greedy request decoding (128-token prompt, as
bench_throughput's single stream). The one-row graph is recaptured for each candidate and its replay
timed by CUDA events over `--repeats` back-to-back replays. Coordinate descent: each projection's
(BLOCK_N, BLOCK_K, warps) in turn (QKV with its RMSNorm, o_proj, gate/up with its RMSNorm, down with
SiLU-and-multiply), the others at their best so far; then the split-KV decode kernel's warps and
stages. Every candidate's output is checked against the engine's graph (within 5 % of its largest value). Prints each
trial, then the engine's tiles against the best, alternating.

    PYTHONPATH=. python3 benchmarks/tune_decode_tiles.py [--repeats 300] [--budget-s 300]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from diag_single_stream import per_repeat_us, steady_one_row

from engine.attention import triton_decode
from engine.attention.metadata import build_step_inputs, set_forward_context
from engine.checkpoint import make_random_checkpoint
from engine.layers import gemv
from engine.llm import LLM

PROJECTIONS = {  # name: (prologue, N, K) of Qwen3-0.6B at TP 1
    "qkv": (gemv.PROLOGUE_NORM, 4096, 1024),
    "o_proj": (gemv.PROLOGUE_NONE, 1024, 2048),
    "gate_up": (gemv.PROLOGUE_NORM, 6144, 1024),
    "down": (gemv.PROLOGUE_SILU, 1024, 3072),
}


def candidates(k: int) -> list[tuple[int, int, int]]:
    """(BLOCK_N, BLOCK_K, warps) with 2k-16k products a tile."""
    out = []
    for block_n in (2, 4, 8, 16):
        for block_k in (256, 512, 1024, 2048, 4096):
            if block_k <= gemv._next_power_of_2(k) and 2048 <= block_n * block_k <= 16384:
                out += [(block_n, block_k, w) for w in (2, 4, 8)]
    return out


class GraphTimer:
    """Recaptures the runner's one-row decode graph under patched tiles and times its replay."""

    def __init__(self, llm: LLM, repeats: int) -> None:
        self.runner, self.repeats = llm.runner, repeats
        self.engine_block_sizes = gemv.block_sizes
        self.reference = self.runner.graph_outputs[1].clone()

    def time(self, tiles: dict[tuple[int, int, int], tuple[int, int, int]], warps: int, stages: int):
        """(µs per replay, max |output - engine's| / max |engine's|) of a graph captured with `tiles`
        for the projections they name and the split-KV kernel at `warps`, `stages`."""
        runner, buf = self.runner, self.runner.graph_buffers

        def patched(rows, n, k, prologue=gemv.PROLOGUE_NONE):
            return tiles.get((prologue, n, k)) or self.engine_block_sizes(rows, n, k, prologue)

        gemv.block_sizes = patched
        saved = triton_decode.NUM_WARPS, triton_decode.NUM_STAGES
        triton_decode.NUM_WARPS, triton_decode.NUM_STAGES = warps, stages
        try:
            with torch.inference_mode(), set_forward_context(buf.metadata(1, runner.max_model_len)):
                runner.model(buf.input_ids[:1], buf.positions[:1])  # compile outside the capture
                graph, out, _ = runner._capture(1, buf, None)
        finally:
            gemv.block_sizes = self.engine_block_sizes
            triton_decode.NUM_WARPS, triton_decode.NUM_STAGES = saved
        us = per_repeat_us(graph.replay, self.repeats)
        scale = float(self.reference.float().abs().max())
        diff = float((out.float() - self.reference.float()).abs().max()) / max(scale, 1e-6)
        del graph
        return us, diff


def load_one_row(llm: LLM) -> None:
    """Leave a steady one-row decode step's inputs in the graph buffers, and its output in the graph's."""
    runner = llm.runner
    batch = steady_one_row(llm, max_tokens=200)
    inputs = build_step_inputs(batch, runner.block_size, runner.device, runner._stagings[0])
    runner._copy_graph_inputs(inputs, 1)
    runner.graphs[1].replay()
    torch.cuda.synchronize()


def tune(timer: GraphTimer, budget_s: float) -> tuple[dict, int, int]:
    deadline = time.monotonic() + budget_s
    best: dict = {}
    warps, stages = triton_decode.NUM_WARPS, triton_decode.NUM_STAGES
    best_us, diff = timer.time(best, warps, stages)
    print(f"engine tiles: {best_us:.1f} µs (diff {diff:.3g})", flush=True)
    for name, key in PROJECTIONS.items():
        engine_tiles = gemv.block_sizes(1, key[1], key[2], key[0])
        for tiles in candidates(key[2]):
            if tiles == engine_tiles or time.monotonic() > deadline:
                continue
            us, diff = timer.time({**best, key: tiles}, warps, stages)
            flag = "" if diff < 0.05 else "  OUTPUT DIFFERS"
            print(f"  {name:<8}{str(tiles):<18}{us:8.1f} µs  diff {diff:.3g}{flag}", flush=True)
            if us < best_us and diff < 0.05:
                best_us, best = us, {**best, key: tiles}
        print(f"{name}: best {best.get(key, engine_tiles)} -> {best_us:.1f} µs", flush=True)
    for w in (1, 2, 4, 8):
        for s in (1, 2, 3):
            if (w, s) == (warps, stages) or time.monotonic() > deadline:
                continue
            us, diff = timer.time(best, w, s)
            print(f"  split-KV warps {w} stages {s}: {us:8.1f} µs  diff {diff:.3g}", flush=True)
            if us < best_us and diff < 0.05:
                best_us, warps, stages = us, w, s
    return best, warps, stages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--budget-s", type=float, default=300, help="stop trying candidates after this")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_random_checkpoint(
            Path(tmp) / "qwen3-0.6b", "qwen3", "qwen3-0.6b", seed=0, device="cuda"
        )
        llm = LLM(model_dir, block_size=16, max_model_len=4096)
        llm.async_scheduling = True
        load_one_row(llm)
        timer = GraphTimer(llm, args.repeats)
        best, warps, stages = tune(timer, args.budget_s)
        engine = ({}, triton_decode.NUM_WARPS, triton_decode.NUM_STAGES)
        print("\nengine against best, alternating (µs per replay):")
        for name, cfg in (("engine", engine), ("best", (best, warps, stages))) * 3:
            print(f"  {name:<8}{timer.time(*cfg)[0]:8.1f}", flush=True)
        names = {key: name for name, key in PROJECTIONS.items()}
        print("best:", {names[k]: v for k, v in best.items()}, f"split-KV warps {warps} stages {stages}")
        llm.close()


if __name__ == "__main__":
    main()
