"""Tensor-parallel step timing: one seeded workload served at each TP degree with all-reduce
profiling on, for fitting the simulator's TP cost. Writes each run's step records as Parquet and
prints, per TP degree and step kind, median step time and median all-reduce time.

    PYTHONPATH=. python3 benchmarks/bench_tp.py --random qwen3-8b --tp 1 2 4 --out out/tp      # GPUs
    PYTHONPATH=. python3 benchmarks/bench_tp.py --random tiny --device cpu --tp 1 2 --num-seqs 8
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from random import Random

from engine.checkpoint import make_random_checkpoint
from engine.llm import LLM
from engine.sampling_params import SamplingParams

PRESET_ARCH = {"qwen3-0.6b": "qwen3", "qwen3-8b": "qwen3", "llama-3-8b": "llama", "tiny": "qwen3"}


def workload(num_seqs: int, max_input: int, max_output: int, vocab: int, seed: int = 0):
    rng = Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, max_input))] for _ in range(num_seqs)]
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(8, max_output))
        for _ in range(num_seqs)
    ]
    return prompts, params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF checkpoint folder")
    src.add_argument("--random", choices=sorted(PRESET_ARCH), help="random-weight checkpoint of this shape")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--max-input", type=int, default=1024)
    p.add_argument("--max-output", type=int, default=128)
    p.add_argument(
        "--graphs", action="store_true", help="keep decode CUDA graphs (their all-reduces go untimed)"
    )
    p.add_argument("--out", type=Path, default=None, help="folder for steps_tp{N}.parquet")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if args.random:
            model_dir = make_random_checkpoint(Path(tmp) / args.random, PRESET_ARCH[args.random], args.random)
        for tp in args.tp:
            with LLM(
                model_dir, tensor_parallel_size=tp, device=args.device, enforce_eager=not args.graphs,
                profile_allreduce=True, max_model_len=args.max_input + args.max_output,
            ) as llm:  # fmt: skip
                prompts, params = workload(
                    args.num_seqs, args.max_input, args.max_output, llm.spec.vocab_size
                )
                llm.recorder.reset()
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - t0
                df = llm.recorder.to_dataframe()
            df = df[~df["compiled"]]
            print(f"tp={tp}: {len(df)} steps in {elapsed:.2f} s")
            summary = df.groupby("kind")[["gpu_time_s", "allreduce_time_s"]].median() * 1e3
            print(summary.round(3).rename(columns=lambda c: c.replace("_s", "_ms_median")).to_string())
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                df.to_parquet(args.out / f"steps_tp{tp}.parquet", index=False)


if __name__ == "__main__":
    main()
