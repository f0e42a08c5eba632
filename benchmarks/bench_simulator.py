"""Simulator speed: the shipped traces at their native rates and synthetic traces of growing size,
each simulated in a process of its own so that its whole-process time and peak memory are its own.

Shipped traces (azure_conv_2023, azure_code_2023, mooncake_synthetic): one H200 replica, Qwen3-0.6B,
the shipped profile of each block size, `kvplan simulate`'s defaults. Synthetic traces of 10,000 and
100,000 requests (and 1,000,000 with --million): Poisson 60 req/s, 8 replicas, least-outstanding
router, block 16. Per run: wall seconds of the whole process (interpreter start to exit: imports, the
trace, the simulation, the summary) and of the loop (`run_simulation`), each with its CPU seconds
(steadier than wall time on a shared machine), x real time and requests per second of the loop,
peak RSS; then the exponent b of a least-squares fit cost = a * requests^b over the synthetic runs
(1.0: linear). With --replica-cost, the 100,000-request trace also on one replica at an eighth of the
rate (the same load a replica), and the loop CPU a request of the 8 replicas over that of one. With
--counts, each case runs once more with its loop's events counted (not timed), a request: decode-run
segments (a held run priced on past another replica's possible arrival is one more), held runs
priced on, SimPy timeouts (the arrival process's too) and route-ahead refreshes.
To time an older build against this one, copy this file into a worktree of that build and run it
there with --profile-dir naming this tree's simulator/profiles (the same profiles), alternating.

    python benchmarks/bench_simulator.py [--async-scheduling] [--block-sizes 16,256] [--traces A,B] [--repeat N]
        [--million | --million-only] [--no-synthetic] [--replica-cost] [--counts] [--profile-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("azure_conv_2023", "azure_code_2023", "mooncake_synthetic")
SYNTHETIC_SIZES = (10_000, 100_000)
MILLION = 1_000_000
SYNTHETIC = {  # traces.generate keywords of the synthetic runs (with num_requests)
    "rate": 60.0,
    "seed": 1,
    "prompt": {"kind": "lognormal", "p50": 1000, "p90": 2700, "max": 8000},
    "output": {"kind": "lognormal", "p50": 130, "p90": 420, "max": 1000},
}
SYNTHETIC_REPLICAS = 8


@dataclass(frozen=True)
class Case:
    """One simulation: a shipped trace by name, or a synthetic one of `num_requests`."""

    label: str
    trace: str | None = None
    num_requests: int = 0
    block_size: int = 16
    num_replicas: int = 1
    async_scheduling: bool = False
    rate: float = SYNTHETIC["rate"]  # of a synthetic trace
    profile_dir: str | None = None  # take the shipped profile's file of the same name from here
    count_events: bool = False  # count the loop's events (`EVENTS`) instead of timing it alone

    def as_json(self) -> str:
        return json.dumps(self.__dict__)


@dataclass(frozen=True)
class Measured:
    """What one child process reported, and its whole-process wall time and peak RSS."""

    case: Case
    requests: int
    duration_s: float
    loop_s: float
    loop_cpu_s: float
    steps: int
    process_s: float
    process_cpu_s: float
    peak_rss_bytes: int
    counts: dict | None = None  # --counts: the loop's events


# What --counts counts: (name, module, class, method, whether a call counts only when it ran steps)
EVENTS = (
    ("run segments", "simulator.fast_forward", "FastForwardScheduler", "fast_forward", True),
    ("run segments", "simulator.fast_forward", "FastForwardScheduler", "postprocess_and_fast_forward", True),
    ("held runs priced on", "simulator.fast_forward", "FastForwardScheduler", "_extend_held", False),
    ("SimPy timeouts", "simpy.core", "Environment", "timeout", False),
    ("route-ahead refreshes", "simulator.sim", "RouteAhead", "refresh", False),
)


def count_events() -> dict[str, int]:
    """Wrap the methods of `EVENTS` to count their calls; the counts, filled as the loop runs."""
    import importlib

    counts = dict.fromkeys((name for name, *_ in EVENTS), 0)

    def counted(name: str, method, ran_steps: bool):
        def call(*args, **kwargs):
            out = method(*args, **kwargs)
            if not ran_steps or out[0]:
                counts[name] += 1
            return out

        return call

    for name, module, cls, attr, ran_steps in EVENTS:
        owner = getattr(importlib.import_module(module), cls)
        setattr(owner, attr, counted(name, getattr(owner, attr), ran_steps))
    return counts


# ---- the child: one simulation, as `kvplan simulate --quiet` runs it -------------------------------
def run_child(case: Case) -> dict:
    """Simulate `case` in this process; the loop's figures as a dict."""
    sys.path.insert(0, str(ROOT))
    import traces
    from simulator.config import SimConfig

    try:
        from simulator.defaults import default_profile
    except ImportError:  # a tree before simulator/defaults.py (timed against this one)
        from simulator.cli import default_profile
    from simulator.models import resolve_model
    from simulator.report import format_summary
    from simulator.run import run_simulation

    if case.trace is not None:
        trace = traces.load_shipped(case.trace)
    else:
        trace = traces.generate(
            num_requests=case.num_requests, name=case.label, **{**SYNTHETIC, "rate": case.rate}
        )
    config = SimConfig(
        model=resolve_model("qwen3-0.6b"),
        block_size=case.block_size,
        num_replicas=case.num_replicas,
        router="least_outstanding" if case.num_replicas > 1 else "round_robin",
        async_scheduling=case.async_scheduling,
    )
    profile = default_profile("qwen3-0.6b", "H200", case.block_size, 1, case.async_scheduling)
    if profile is not None and case.profile_dir is not None:
        profile = Path(case.profile_dir) / profile.name
    counts = count_events() if case.count_events else None
    t0, c0 = time.perf_counter(), time.process_time()
    result = run_simulation(trace, config, profile=profile)
    loop_s, loop_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    format_summary(result.summary)  # what the command prints, not shown here
    s = result.summary
    return {
        "requests": len(trace),
        "duration_s": s["duration_s"],
        "loop_s": loop_s,
        "loop_cpu_s": loop_cpu_s,
        "steps": s["sim_steps"],
        **({"counts": counts} if counts is not None else {}),
    }


# ---- the parent: one process per run ----------------------------------------------------------------
def measure(case: Case) -> Measured:
    """Run `case` in a fresh interpreter: its report, wall time from start to exit, peak RSS."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", case.as_json()]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=ROOT)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    process_s = time.perf_counter() - t0
    proc.stdout.close()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{case.label}: the simulation process exited with {code}")
    report = json.loads(out.decode().strip().splitlines()[-1])
    cpu_s = usage.ru_utime + usage.ru_stime
    return Measured(
        case, process_s=process_s, process_cpu_s=cpu_s, peak_rss_bytes=usage.ru_maxrss * 1024, **report
    )


def best_of(case: Case, repeat: int) -> Measured:
    """The run with the least loop time of `repeat` (the machine's noise only adds time)."""
    return min((measure(case) for _ in range(repeat)), key=lambda m: m.loop_s)


def fitted_exponent(requests: list[int], costs: list[float]) -> float:
    """b of the least-squares fit log(cost) = log(a) + b * log(requests)."""
    xs, ys = [math.log(r) for r in requests], [math.log(c) for c in costs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def cases(args: argparse.Namespace) -> list[Case]:
    async_ = args.async_scheduling
    tag = ", async" if async_ else ""
    out: list[Case] = []
    if not args.million_only:
        for name in args.traces.split(",") if args.traces else SHIPPED:
            for bs in (int(b) for b in args.block_sizes.split(",")):
                out.append(
                    Case(f"{name} block {bs}{tag}", trace=name, block_size=bs, async_scheduling=async_)
                )
    sizes = () if args.no_synthetic else SYNTHETIC_SIZES
    sizes = (MILLION,) if args.million_only else sizes + ((MILLION,) if args.million else ())
    for n in sizes:
        label = f"synthetic {n:,}, {SYNTHETIC_REPLICAS} replicas{tag}"
        out.append(Case(label, num_requests=n, num_replicas=SYNTHETIC_REPLICAS, async_scheduling=async_))
    if args.replica_cost:
        n, rate = SYNTHETIC_SIZES[-1], SYNTHETIC["rate"] / SYNTHETIC_REPLICAS
        label = f"synthetic {n:,}, 1 replica, {rate:g} req/s{tag}"
        out.append(Case(label, num_requests=n, async_scheduling=async_, rate=rate))
    if args.profile_dir:
        out = [replace(c, profile_dir=str(Path(args.profile_dir).resolve())) for c in out]
    return out


def print_table(rows: list[Measured]) -> None:
    print(
        f"{'run':<42}{'requests':>10}{'process s':>11}{'(cpu)':>7}{'loop s':>8}{'(cpu)':>7}"
        f"{'x real':>8}{'req/s':>8}{'steps':>12}{'peak RSS':>11}"
    )
    for m in rows:
        print(
            f"{m.case.label:<42}{m.requests:>10,}{m.process_s:>11.2f}{m.process_cpu_s:>7.2f}"
            f"{m.loop_s:>8.2f}{m.loop_cpu_s:>7.2f}{m.duration_s / m.loop_s:>8,.0f}"
            f"{m.requests / m.loop_s:>8,.0f}{m.steps:>12,}{m.peak_rss_bytes / 2**30:>7.2f} GiB"
        )


def print_counts(rows: list[Measured]) -> None:
    """The loop's events a request, per case (--counts)."""
    names = list(dict.fromkeys(name for name, *_ in EVENTS))
    print(f"{'events a request':<42}" + "".join(f"{n:>23}" for n in names))
    for m in rows:
        print(f"{m.case.label:<42}" + "".join(f"{m.counts[n] / m.requests:>23.3f}" for n in names))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-sizes", default="16", help="block sizes of the shipped-trace runs")
    p.add_argument(
        "--traces",
        default=None,
        help=f"shipped traces to run, comma-separated (default: {','.join(SHIPPED)})",
    )
    p.add_argument("--async-scheduling", action="store_true", help="simulate async scheduling")
    p.add_argument("--repeat", type=int, default=1, help="runs of each case; the fastest loop is shown")
    p.add_argument("--million", action="store_true", help="also the 1,000,000-request run (minutes)")
    p.add_argument("--million-only", action="store_true", help="only the 1,000,000-request run")
    p.add_argument("--no-synthetic", action="store_true", help="only the shipped traces")
    p.add_argument(
        "--replica-cost",
        action="store_true",
        help="also the 100,000-request trace on one replica at the same load a replica",
    )
    p.add_argument(
        "--profile-dir",
        default=None,
        help="the shipped profiles' files of the same name from this folder (e.g. this tree's "
        "simulator/profiles, with the script copied into an older tree's worktree to time that build)",
    )
    p.add_argument(
        "--counts",
        action="store_true",
        help="also run each case once with its loop's events counted: run segments, held runs priced on, "
        "SimPy timeouts and route-ahead refreshes a request",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_child(Case(**json.loads(args.child)))))
        return
    rows = []
    for case in cases(args):
        rows.append(best_of(case, args.repeat))
        print(f"  {case.label}: loop {rows[-1].loop_s:.2f} s", file=sys.stderr, flush=True)
    print_table(rows)
    one = [m for m in rows if m.case.trace is None and m.case.num_replicas == 1]
    synthetic = [m for m in rows if m.case.trace is None and m.case.num_replicas > 1]
    for single in one:
        many = [m for m in synthetic if m.requests == single.requests]
        if many:
            per_many, per_one = many[0].loop_cpu_s / many[0].requests, single.loop_cpu_s / single.requests
            print(
                f"loop CPU a request, {many[0].case.num_replicas} replicas against 1 at the same load: "
                f"{per_many * 1e6:.0f} us / {per_one * 1e6:.0f} us = {per_many / per_one:.2f}x"
            )
    if args.counts:
        print_counts([measure(replace(case, count_events=True)) for case in cases(args)])
    if len(synthetic) >= 2:
        n = [m.requests for m in synthetic]
        loop = fitted_exponent(n, [m.loop_s for m in synthetic])
        process = fitted_exponent(n, [m.process_s for m in synthetic])
        print(
            f"cost ~ requests^b over the synthetic runs: loop b = {loop:.3f}, whole process b = {process:.3f}"
        )


if __name__ == "__main__":
    main()
