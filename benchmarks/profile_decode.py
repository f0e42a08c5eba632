"""Where a decode step's time goes on the GPU: kernels by GPU time, and the host time around them.

Random-weight Qwen3-0.6B (made on the spot), CUDA graphs as in serving. For one request alone and for
a batch of 128 (1,000-token prompts), runs a few decode steps under torch.profiler and prints, per
step: wall time, GPU time of the kernels, the host-only remainder, and the top kernels.

    PYTHONPATH=. python3 benchmarks/profile_decode.py [--block-size 16] [--steps 20]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine.checkpoint import make_random_checkpoint
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def decode_until_steady(llm: LLM, num_seqs: int, prompt_len: int, max_tokens: int) -> None:
    """Admit `num_seqs` requests and step until every one is decoding."""
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens)
    for i in range(num_seqs):
        llm.add_request([(7 * i + j) % 10000 for j in range(prompt_len)], params)
    while llm.scheduler.num_waiting or any(
        s.num_tokens - s.num_computed_tokens > 1 for s in llm.scheduler.running
    ):
        llm.step()
    for _ in range(3):
        llm.step()


def profile_steps(llm: LLM, steps: int) -> tuple[float, float, list[tuple[str, float, int]]]:
    """(wall ms per step, kernel GPU ms per step, [(kernel, µs per step, launches per step)])."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps * 1e3
    rows = kernel_table(prof, steps)
    return wall, sum(r[1] for r in rows) / 1e3, rows


def profile_host(llm: LLM, steps: int, top: int) -> None:
    """cProfile of `steps` plain decode steps of one greedy request (what single-stream decode runs):
    host functions by their own time."""
    import cProfile
    import pstats

    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=steps + 50)
    llm.add_request(list(range(1, 129)), params)
    for _ in range(10):
        llm.step()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        llm.step()
    prof.disable()
    print(
        f"\n== host profile, batch 1: {(time.perf_counter() - t0) / steps * 1e3:.3f} ms/step under cProfile"
    )
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
    while llm.has_unfinished():
        llm.step()


def random_llm(block_size: int, **llm_kwargs) -> LLM:
    """An LLM over a random-weight Qwen3-0.6B made on the spot (CUDA graphs as in serving)."""
    ckpt = make_random_checkpoint(
        Path(tempfile.mkdtemp()) / "qwen3-0.6b", "qwen3", "qwen3-0.6b", seed=0, device="cuda"
    )
    return LLM(ckpt, block_size=block_size, max_num_seqs=256, max_model_len=4096, **llm_kwargs)


def kernel_table(prof, steps: int) -> list[tuple[str, float, float]]:
    """[(kernel, µs per step, launches per step)] of a torch.profiler run over `steps` steps,
    longest first."""
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[evt.name[:70]]
            k[0] += evt.device_time_total if hasattr(evt, "device_time_total") else evt.cuda_time_total
            k[1] += 1
    return sorted(((n, t / steps, c / steps) for n, (t, c) in kernels.items()), key=lambda r: -r[1])


def print_kernels(rows: list[tuple[str, float, float]], top: int) -> None:
    print(f"{'kernel':<72} {'µs/step':>8} {'n/step':>7}")
    for name, us, n in rows[:top]:
        print(f"{name:<72} {us:>8.1f} {n:>7.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--host", action="store_true", help="also cProfile the host side of batch-1 steps")
    args = ap.parse_args()
    llm = random_llm(args.block_size)
    if args.host:
        profile_host(llm, steps=200, top=args.top * 2)
    summary = []
    for num_seqs, prompt_len in ((1, 512), (128, 1000)):
        decode_until_steady(llm, num_seqs, prompt_len, max_tokens=args.steps + 40)
        wall, gpu, rows = profile_steps(llm, args.steps)
        while llm.has_unfinished():
            llm.step()
        print(f"\n== batch {num_seqs}, prompts of {prompt_len}: {wall:.3f} ms/step wall, "
              f"{gpu:.3f} ms kernels, {sum(r[2] for r in rows):.0f} launches/step")  # fmt: skip
        print_kernels(rows, args.top)
        summary.append((num_seqs, wall, gpu))
    llm.close()
    print(f"\n{'batch':>5} {'wall ms/step':>12} {'kernel ms/step':>14} {'host-only ms':>12}")
    for b, wall, gpu in summary:
        print(f"{b:>5} {wall:>12.3f} {gpu:>14.3f} {wall - gpu:>12.3f}")


if __name__ == "__main__":
    main()
