"""Micro-benchmark of the torch-free control plane: µs per scheduler step in decode steady state.

Measures `schedule()` + `postprocess()` with 256 running sequences (block size 16), prefix caching on
and off, and `fast_forward()` per collapsed decode step. Not a test: it prints a table. Wall time is
reported next to this thread's CPU time, which leaves out time spent descheduled on a busy machine.

    python benchmarks/bench_scheduler.py [--seqs 256] [--block-size 16] [--steps 500] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.core.block_manager import BlockManager  # noqa: E402
from engine.core.config import SchedulerConfig, cdiv  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from simulator.fast_forward import FastForwardScheduler as Scheduler  # noqa: E402
from simulator.fast_forward import accumulate_decode_times  # noqa: E402
from simulator.lazy_blocks import LazyBlockManager  # noqa: E402

TARGET_US = 150.0  # schedule + postprocess per step at 256 running sequences
PROMPT_LEN = 128


def decode_step_time(num_seqs: int, num_context_tokens: int, max_seq_len: int) -> float:
    return 1e-3 + 1e-6 * num_seqs + 3e-9 * num_context_tokens + 1e-7 * max_seq_len


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def steady_state(
    num_seqs: int, block_size: int, caching: bool, max_steps: int, manager: type[BlockManager] = BlockManager
) -> tuple[Scheduler, Clock]:
    """A scheduler whose `num_seqs` requests are all past their prefill and decoding, over a block
    manager of class `manager` (the engine's core, or the simulator's LazyBlockManager)."""
    rng = random.Random(0)
    tokens_per_seq = PROMPT_LEN + max_steps + 64
    bm = manager(num_seqs * cdiv(tokens_per_seq, block_size) + 16, block_size, caching)
    config = SchedulerConfig(
        max_num_seqs=num_seqs, max_num_batched_tokens=8192, max_model_len=1 << 24, policy="chunked"
    )
    clock = Clock()
    sched = Scheduler(config, bm, clock=clock)
    params = SamplingParams(max_tokens=max_steps + 64, ignore_eos=True)
    for _ in range(num_seqs):
        sched.add_request([rng.randrange(1, 32000) for _ in range(PROMPT_LEN)], params)
    while sched.num_waiting or any(s.num_tokens - s.num_computed_tokens > 1 for s in sched.running):
        batch = sched.schedule()
        clock.t += 0.01
        sched.postprocess(batch, [0] * batch.num_seqs)
    for _ in range(8):  # a few decode steps to settle
        batch = sched.schedule()
        clock.t += 0.001
        sched.postprocess(batch, [0] * batch.num_seqs)
    assert sched.num_running == num_seqs
    return sched, clock


def bench_steps(num_seqs: int, block_size: int, caching: bool, steps: int, repeats: int) -> dict[str, float]:
    """Best-of-`repeats` µs per step, wall and CPU, of schedule(), postprocess() and both."""
    sched, clock = steady_state(num_seqs, block_size, caching, steps * repeats)
    sampled = [0] * num_seqs
    keys = ("schedule", "postprocess", "cpu_schedule", "cpu_postprocess")
    best = dict.fromkeys((*keys, "step", "cpu_step"), math.inf)
    wall, cpu = time.perf_counter_ns, time.thread_time_ns
    gc.disable()
    try:
        for _ in range(repeats):
            tot = dict.fromkeys(keys, 0)
            for _ in range(steps):
                w0, c0 = wall(), cpu()
                batch = sched.schedule()
                w1, c1 = wall(), cpu()
                clock.t += 0.001
                sched.postprocess(batch, sampled)
                w2, c2 = wall(), cpu()
                tot["schedule"] += w1 - w0
                tot["postprocess"] += w2 - w1
                tot["cpu_schedule"] += c1 - c0
                tot["cpu_postprocess"] += c2 - c1
            assert batch.kind == "decode" and batch.num_seqs == num_seqs
            tot["step"] = tot["schedule"] + tot["postprocess"]
            tot["cpu_step"] = tot["cpu_schedule"] + tot["cpu_postprocess"]
            for key, ns in tot.items():
                best[key] = min(best[key], ns / steps / 1e3)
    finally:
        gc.enable()
    return best


def bench_fast_forward(
    num_seqs: int, block_size: int, caching: bool, steps: int, repeats: int
) -> tuple[float, float]:
    """Best-of-`repeats` µs (wall, CPU) per decode step collapsed by a fast_forward call of `steps`,
    over the simulator's LazyBlockManager."""
    sched, clock = steady_state(num_seqs, block_size, caching, steps * repeats, LazyBlockManager)
    decode_times = partial(accumulate_decode_times, decode_step_time)
    best_wall = best_cpu = math.inf
    gc.disable()
    try:
        for _ in range(repeats):
            w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            k, end, finished = sched.fast_forward(decode_times, clock.t, math.inf, max_steps=steps)
            w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            assert k == steps and not finished
            clock.t = end
            best_wall = min(best_wall, (w1 - w0) / k / 1e3)
            best_cpu = min(best_cpu, (c1 - c0) / k / 1e3)
    finally:
        gc.enable()
    return best_wall, best_cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256, help="running sequences (default 256)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    ap.add_argument("--steps", type=int, default=500, help="steps per repeat (default 500)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats; the best is reported (default 5)")
    ap.add_argument("--ff-steps", type=int, default=1000, help="steps per fast_forward call (default 1000)")
    args = ap.parse_args(argv)

    print(
        f"control plane, decode steady state: {args.seqs} running sequences, block size {args.block_size}, "
        f"prompts of {PROMPT_LEN} tokens; best of {args.repeats}"
    )
    print(f"{'operation':<32} {'caching':>7} {'wall µs/step':>12} {'CPU µs/step':>11} {'CPU µs/seq':>10}")

    def row(name: str, caching: bool, wall_us: float, cpu_us: float) -> None:
        on = "on" if caching else "off"
        print(f"{name:<32} {on:>7} {wall_us:>12.1f} {cpu_us:>11.1f} {cpu_us / args.seqs:>10.3f}")

    worst = 0.0
    for caching in (True, False):
        r = bench_steps(args.seqs, args.block_size, caching, args.steps, args.repeats)
        worst = max(worst, r["cpu_step"])
        for name, key in (
            ("schedule()", "schedule"),
            ("postprocess()", "postprocess"),
            ("schedule + postprocess", "step"),
        ):
            row(name, caching, r[key], r["cpu_" + key])
    for caching in (True, False):
        wall_us, cpu_us = bench_fast_forward(args.seqs, args.block_size, caching, args.ff_steps, args.repeats)
        row(f"fast_forward, {args.ff_steps} steps/call", caching, wall_us, cpu_us)
    verdict = "within" if worst <= TARGET_US else "OVER"
    print(f"schedule + postprocess: worst {worst:.1f} CPU µs/step, {verdict} the {TARGET_US:.0f} µs target")
    return 0


if __name__ == "__main__":
    sys.exit(main())
