"""Simulator speed: the standard speed runs of BENCHMARKS.md, and a million-request memory run.

Replays azure_conv_2023 and azure_code_2023 at their native rates on one replica (H200, shipped
Qwen3-0.6B profiles, block 16 and 256) and prints wall seconds and "x real time". With --million,
also simulates a 1,000,000-request synthetic trace on 8 replicas and reports peak memory (RSS).

    python benchmarks/bench_simulator.py [--million] [--block-sizes 16,256]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import traces  # noqa: E402
from simulator.cli import default_profile  # noqa: E402
from simulator.config import SimConfig  # noqa: E402
from simulator.models import resolve_model  # noqa: E402
from simulator.run import run_simulation  # noqa: E402


def one(trace, block_size: int, replicas: int = 1) -> tuple[float, float, dict]:
    config = SimConfig(
        model=resolve_model("qwen3-0.6b"),
        block_size=block_size,
        num_replicas=replicas,
        router="least_outstanding",
    )
    profile = default_profile("qwen3-0.6b", "H200", block_size, 1)
    t0, c0 = time.perf_counter(), time.process_time()
    result = run_simulation(trace, config, profile=profile)
    return time.perf_counter() - t0, time.process_time() - c0, result.summary


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--block-sizes", default="16,256")
    p.add_argument("--million", action="store_true", help="also the 1e6-request, 8-replica memory run")
    p.add_argument("--million-only", action="store_true", help="only the 1e6-request run")
    args = p.parse_args()
    rows = []
    for name in () if args.million_only else ("azure_conv_2023", "azure_code_2023"):
        trace = traces.load_shipped(name)
        for bs in (int(b) for b in args.block_sizes.split(",")):
            wall, cpu, s = one(trace, bs)
            rows.append((f"{name} block {bs}", len(trace), wall, cpu, s["duration_s"] / wall, s["sim_steps"]))
    if args.million or args.million_only:
        trace = traces.generate(
            num_requests=1_000_000,
            rate=60.0,
            seed=1,
            name="synthetic-1m",
            prompt={"kind": "lognormal", "p50": 1000, "p90": 2700, "max": 8000},
            output={"kind": "lognormal", "p50": 130, "p90": 420, "max": 1000},
        )
        wall, cpu, s = one(trace, 16, replicas=8)
        rows.append(
            (
                "synthetic 1M, 8 replicas, block 16",
                len(trace),
                wall,
                cpu,
                s["duration_s"] / wall,
                s["sim_steps"],
            )
        )
    print(f"{'run':<38}{'requests':>10}{'wall s':>9}{'cpu s':>9}{'x real':>9}{'steps':>12}")
    for name, n, wall, cpu, speed, steps in rows:
        print(f"{name:<38}{n:>10,}{wall:>9.2f}{cpu:>9.2f}{speed:>9,.0f}{steps:>12,}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {peak:.2f} GiB")


if __name__ == "__main__":
    main()
