"""Benchmark a 100-point sweep over the full azure_conv_2023 trace at its native rate (19,366 requests).

Grid: 5 GPU types x 2 block sizes x 2 max_num_seqs x 5 max_num_batched_tokens, roofline latency, local
process pool. Target on a 2-core machine: <= 2 minutes. Prints wall time, how many simulations ran (a
run stands for the points that differ only in capacity limits it never reached) and their times.
With --spec, a sweep spec file's own grid instead (e.g. docs/sweep-example.yaml), as `kvplan sweep`
runs it; --repeat times it that many times (the fastest is the figure).
Run: python benchmarks/bench_sweep.py [--workers N] [--points N] [--limit N] [--out FILE]
     python benchmarks/bench_sweep.py --spec docs/sweep-example.yaml [--workers N] [--repeat N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulator.sweep import SweepSpec, run_sweep  # noqa: E402

TARGET_S = 120.0
GRID = {
    "gpu": ["H100", "H200", "A100", "L40S", "B200"],
    "block_size": [16, 32],
    "max_num_seqs": [64, 256],
    "max_num_batched_tokens": [2048, 4096, 8192, 16384, 32768],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=None, help="local worker processes (default: all cores)")
    ap.add_argument("--points", type=int, default=100, help="a smaller sub-grid of at most N points")
    ap.add_argument("--limit", type=int, default=None, help="only the first N requests (default: full trace)")
    ap.add_argument("--out", default=None, help="results Parquet (default: a fresh temporary file)")
    ap.add_argument("--spec", default=None, help="a sweep spec file to run instead of the grid above")
    ap.add_argument("--repeat", type=int, default=1, help="--spec: runs of the sweep (each from scratch)")
    args = ap.parse_args()
    if args.spec:
        return spec_main(args)

    trace = {"source": "azure_conv_2023", **({"limit": args.limit} if args.limit else {})}
    spec = SweepSpec.from_dict({"trace": trace, "model": "qwen3-0.6b", "profile": "roofline", "grid": GRID})
    grid_spec = _sub_grid(spec, args.points)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out) if args.out else Path(tmp) / "bench.parquet"
        t0 = time.perf_counter()
        report = run_sweep(grid_spec, out, workers=args.workers, progress=True)
        wall = time.perf_counter() - t0
        import pandas as pd

        df = pd.read_parquet(out)
    n = report.num_run
    print(report.format())
    what = f"limit {args.limit}" if args.limit else "full trace, native rate"
    print(f"bench_sweep: {n} points over azure_conv_2023 ({what}), {report.num_errors} with errors")
    print(
        f"  wall {wall:.1f} s (target <= {TARGET_S:.0f} s on 2 cores: {'met' if wall <= TARGET_S else 'NOT met'})"
    )
    runs = df.loc[~df["shared_run"].astype(bool)]
    print(
        f"  {len(runs)} simulations; the other {n - len(runs)} points' rows came from a run that stands "
        "for them (limits it never reached)"
    )
    print(
        f"  per simulation (worker wall): median {runs['wall_s'].median():.2f} s, min {runs['wall_s'].min():.2f} s, "
        f"max {runs['wall_s'].max():.2f} s; {runs['sim_steps'].sum():,.0f} simulated steps"
    )
    print(f"  {n / wall:.2f} points/s; {runs['num_requests'].sum() / wall:,.0f} simulated requests/s")
    return 0


def spec_main(args: argparse.Namespace) -> int:
    """Time `args.spec`'s sweep, every point run afresh (a new output file each time)."""
    import pandas as pd

    spec = SweepSpec.load(args.spec)
    walls = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "bench.parquet"
            t0 = time.perf_counter()
            report = run_sweep(spec, out, workers=args.workers, progress=False)
            walls.append(time.perf_counter() - t0)
            df = pd.read_parquet(out)
    runs = df.loc[~df["shared_run"].astype(bool)]
    print(report.format())
    print(
        f"bench_sweep {args.spec}: {len(df)} points ({len(runs)} simulations, {report.num_errors} with errors); "
        f"wall {', '.join(f'{w:.2f}' for w in walls)} s, best {min(walls):.2f} s; per simulation (worker wall) "
        f"median {runs['wall_s'].median():.2f} s"
    )
    return 0


def _sub_grid(spec: SweepSpec, n: int) -> SweepSpec:
    """The spec with values dropped from its last axes until it has at most n points."""
    grid = dict(spec.grid)
    for axis in reversed(list(grid)):
        while len(grid[axis]) > 1 and _product(grid) > n:
            grid[axis] = grid[axis][:-1]
    return SweepSpec(spec.trace, spec.model, spec.profile, spec.slo, grid)


def _product(grid: dict) -> int:
    out = 1
    for v in grid.values():
        out *= len(v)
    return out


if __name__ == "__main__":
    sys.exit(main())
