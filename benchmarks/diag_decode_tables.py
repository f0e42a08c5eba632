"""Why serving's large decode steps run slower than the calibration sweep's of the same shape.

One process, random-weight Qwen3-0.6B served as calibrate.py serves it (8,192 KV blocks of 16,
chunked). Times 40 decode steps of ~96 sequences over a nearly full cache under four suspects: the
block tables (contiguous, as after a prefix-cache reset, or scattered: the free list shuffled), the
lengths (the sweep's geometric spread, or a serving-like lognormal draw of the same sum), the
decode graph's padding (96 sequences in the 96 graph, or 100 in the 112 graph), and what ran
before (nothing, or a heavy replay: a hot GPU and tables fragmented by serving). Prints medians.
It found the lengths (2026-11-30: one split per sequence at large batches); KVPLAN_DECODE_BALANCE=0
runs the kernel as it was before its splits were balanced.

    PYTHONPATH=. python3 benchmarks/diag_decode_tables.py [--out DIR] [--replay 600:660@8]
    python benchmarks/diag_decode_tables.py --preset tiny --device cpu --shrink 64 --max-model-len 4096 \
        --replay 600:603@1  # a dry run on CPU
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from engine.checkpoint import make_random_checkpoint
from engine.llm import LLM
from engine.profiling import DECODE_STEPS, fill_shortest, spread_lengths
from engine.replay import replay_trace
from engine.sampling_params import SamplingParams
from traces.cli import load_trace_arg

NUM_BLOCKS, BLOCK_SIZE = 8192, 16
VOCAB = 100_000


def sweep_lengths(num_seqs: int = 96, longest: int = 4096) -> list[int]:
    """The lengths of the sweep's full-cache decode workload (`engine.profiling.full_cache_workloads`)."""
    budget = int(0.9 * NUM_BLOCKS * BLOCK_SIZE) - num_seqs * (DECODE_STEPS + BLOCK_SIZE)
    return spread_lengths(num_seqs, longest, fill_shortest(num_seqs, longest, budget))


def serving_lengths(num_seqs: int, total: int, seed: int = 1) -> list[int]:
    """A lognormal draw (median ~900, as the trace's conversations) scaled to sum to about `total`,
    clipped to 6,500 tokens before the last rescale (so a few may end slightly above), in random
    order. Kept as measured on 2026-11-30; the sweep's `engine.profiling.serving_lengths` clips last."""
    rng = np.random.default_rng(seed)
    x = np.clip(rng.lognormal(np.log(900), 0.9, num_seqs), 16, None)
    x = np.clip(x * total / x.sum(), 16, 6500)
    return [int(v) for v in np.round(x * total / x.sum())]


def contiguity(seqs) -> float:
    """Share of a block table's neighbouring entries that are consecutive block ids."""
    pairs = same = 0
    for s in seqs:
        t = s.block_table
        pairs += max(0, len(t) - 1)
        same += sum(b == a + 1 for a, b in zip(t, t[1:]))
    return same / pairs if pairs else float("nan")


def run_variant(llm: LLM, name: str, lengths: list[int], shuffle: bool, reset: bool, seed: int) -> dict:
    """Prefill `lengths` (fresh random prompts), then DECODE_STEPS decode steps; the decode medians."""
    bm = llm.block_manager
    if reset:
        bm.reset_prefix_cache()
    if shuffle:
        random.Random(seed).shuffle(bm.free_uncached)
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS, ignore_eos=True)
    vocab = min(VOCAB, llm.spec.vocab_size)
    seqs = [llm.add_request(rng.integers(0, vocab, n).tolist(), params) for n in lengths]
    llm.recorder.reset()
    sched = llm.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        llm.step()
    contig = contiguity(seqs)
    while llm.has_unfinished():
        llm.step()
    df = llm.recorder.to_dataframe()
    dec = df[(df["kind"] == "decode") & (df["num_seqs"] == len(lengths))]
    return {
        "variant": name,
        "seqs": len(lengths),
        "graph": int(dec["graph_batch_size"].median()),
        "ctx_k": round(float(dec["num_context_tokens"].median()) / 1e3, 1),
        "max_len": int(dec["max_seq_len"].median()),
        "contig": round(contig, 3),
        "steps": len(dec),
        "gpu_ms": round(float(dec["gpu_time_s"].median()) * 1e3, 3),
        "wall_ms": round(float(dec["wall_time_s"].median()) * 1e3, 3),
        "ns_per_tok": round(float((dec["gpu_time_s"] / dec["num_context_tokens"]).median()) * 1e9, 2),
        "t": time.strftime("%H:%M:%S", time.gmtime()),
    }, dec.assign(variant=name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--replay", default="600:660@8", help="WINDOW@SCALE of azure_conv_2023 ('' for none)")
    p.add_argument(
        "--preset", default="qwen3-0.6b", help="checkpoint shape ('tiny' with --device cpu: a dry run)"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--shrink", type=int, default=1, help="divide every length by this (dry runs)")
    args = p.parse_args()
    sweep = [max(16, n // args.shrink) for n in sweep_lengths()]
    serve96 = serving_lengths(96, sum(sweep))
    serve100 = serving_lengths(100, round(sum(sweep) * 100 / 96), seed=2)
    plan = [
        ("sweep/contig", sweep, False),
        ("sweep/shuffled", sweep, True),
        ("serve96/contig", serve96, False),
        ("serve96/shuffled", serve96, True),
        ("serve100/contig", serve100, False),
        ("serve100/shuffled", serve100, True),
    ]
    rows, steps = [], []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_random_checkpoint(Path(tmp) / "m", "qwen3", args.preset, device=args.device)
        llm = LLM(
            ckpt,
            block_size=BLOCK_SIZE,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            max_model_len=args.max_model_len,
            num_kv_blocks=NUM_BLOCKS,
            device=args.device,
        )
        seed = 0
        for order in (plan, plan[::-1]):
            for name, lengths, shuffle in order:
                seed += 1
                row, dec = run_variant(llm, name, lengths, shuffle, True, seed)
                rows.append(row)
                steps.append(dec)
                print(row, flush=True)
        if args.replay:
            window, scale = args.replay.split("@")
            llm.block_manager.reset_prefix_cache()
            trace = load_trace_arg("azure_conv_2023", float(scale), None, window)
            t0 = time.perf_counter()
            replay_trace(llm, trace, progress=False, max_wall_s=150)
            print(f"replay {args.replay}: {time.perf_counter() - t0:.0f} s", flush=True)
            for name, lengths, _ in plan[::2]:
                seed += 1
                row, dec = run_variant(llm, f"{name.split('/')[0]}/after-replay", lengths, False, False, seed)
                rows.append(row)
                steps.append(dec)
                print(row, flush=True)
            for name, lengths, shuffle in plan[:2]:
                seed += 1
                row, dec = run_variant(llm, name + "/again", lengths, shuffle, True, seed)
                rows.append(row)
                steps.append(dec)
                print(row, flush=True)
        llm.close()
    table = pd.DataFrame(rows)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        pd.concat(steps, ignore_index=True).to_parquet(Path(args.out) / "decode_steps.parquet")
        table.to_csv(Path(args.out) / "summary.csv", index=False)
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
