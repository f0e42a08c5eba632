"""Where a prefill or mixed step's time goes: host Python (cProfile) and GPU kernels (torch.profiler).

Random-weight Qwen3-0.6B (made on the spot), eager prefill as in serving. Three step shapes: one
fresh 1,024-token prefill, eight 1,024-token prefills in one step, and a mixed step (4 running
decodes + a 1,000-token prefill). For each: wall ms per step, kernel GPU ms, launches, the top
kernels, and the host functions that take the most time (cProfile, own time per step).

    PYTHONPATH=. python3 benchmarks/profile_prefill.py [--block-size 16] [--steps 8]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time

import torch
from profile_decode import kernel_table, print_kernels, random_llm  # benchmarks/ is the script's folder
from torch.profiler import ProfilerActivity, profile

from engine.llm import LLM
from engine.sampling_params import SamplingParams

ONE_TOKEN = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)


def fresh_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 150_000) for _ in range(n)]


def add_step_requests(llm: LLM, rng: random.Random, shape: str) -> None:
    """Queue the prefills of one step of `shape` (each finishes after its prefill)."""
    if shape == "prefill_8x1024":
        for _ in range(8):
            llm.add_request(fresh_prompt(rng, 1024), ONE_TOKEN)
    else:
        llm.add_request(fresh_prompt(rng, 1000 if shape == "mixed_4+1000" else 1024), ONE_TOKEN)


def run_steps(llm: LLM, rng: random.Random, shape: str, steps: int) -> float:
    """Run `steps` steps of `shape`; returns wall ms per step (synchronized at the end)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        add_step_requests(llm, rng, shape)
        llm.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def host_table(stats: pstats.Stats, steps: int, top: int) -> str:
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("tottime").print_stats(top)
    return f"(cProfile, {steps} steps)\n" + out.getvalue().split("\n", 6)[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    llm = random_llm(args.block_size)
    rng = random.Random(0)
    decode = SamplingParams(temperature=0, ignore_eos=True, max_tokens=100_000)
    summary = []
    for shape in ("prefill_1024", "prefill_8x1024", "mixed_4+1000"):
        if shape == "mixed_4+1000":
            for _ in range(4):
                llm.add_request(fresh_prompt(rng, 200), decode)
            llm.step()
        run_steps(llm, rng, shape, 3)  # warm
        wall = run_steps(llm, rng, shape, args.steps)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_steps(llm, rng, shape, args.steps)
        rows = kernel_table(prof, args.steps)
        gpu = sum(r[1] for r in rows) / 1e3
        cp = cProfile.Profile()
        cp.enable()
        run_steps(llm, rng, shape, args.steps)
        cp.disable()
        print(f"\n== {shape}: {wall:.2f} ms/step wall, {gpu:.2f} ms kernels, "
              f"{sum(r[2] for r in rows):.0f} launches/step")  # fmt: skip
        print_kernels(rows, args.top)
        print(host_table(pstats.Stats(cp), args.steps, 25))
        summary.append((shape, wall, gpu))
    llm.close()
    print(f"\n{'step':<16} {'wall ms':>9} {'kernel ms':>10} {'host-only ms':>13}")
    for shape, wall, gpu in summary:
        print(f"{shape:<16} {wall:>9.2f} {gpu:>10.2f} {wall - gpu:>13.2f}")


if __name__ == "__main__":
    main()
