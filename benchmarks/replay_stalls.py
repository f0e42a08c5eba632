"""Host stalls in the shipped real replays: steps whose GPU time (CUDA events around the step) is far
longer than any step of their size can compute, printed per replay with the step's shape.

A step of at most one token budget (8,192 tokens) takes at most ~35 ms on Qwen3-0.6B and ~0.22 s on
Qwen3-8B on the H200; a step above `--min-seconds` (default 0.25 s) is the host pausing between the
step's start event and its kernels. The simulator prices no such pause.

    python benchmarks/replay_stalls.py [--min-seconds 0.25] [--validation simulator/data/validation]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def stalls(steps: pd.DataFrame, min_seconds: float) -> pd.DataFrame:
    """The steps of a replay whose GPU time is at least `min_seconds`, with their start in the run."""
    idle = steps["idle_before_s"].fillna(0.0) if "idle_before_s" in steps else 0.0  # older records: none
    start = (steps["wall_time_s"] + idle).cumsum() - steps["wall_time_s"]
    steps = steps.assign(at_s=start)
    return steps[steps["gpu_time_s"] >= min_seconds]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-seconds", type=float, default=0.25)
    parser.add_argument("--validation", default=str(ROOT / "simulator" / "data" / "validation"))
    args = parser.parse_args()
    runs = sorted(p.parent for p in Path(args.validation).glob("*/steps.parquet"))
    if not runs:
        raise SystemExit(f"--validation {args.validation}: no replay folders with steps.parquet")
    print(f"{'replay':<46} {'served':<17} {'steps':>6}  stalls (GPU s at s into the run: step shape)")
    num_stalled = 0
    for run in runs:
        meta = json.loads((run / "run.json").read_text())
        steps = pd.read_parquet(run / "steps.parquet")
        found = stalls(steps, args.min_seconds)
        num_stalled += bool(len(found))
        cells = ", ".join(
            f"{r.gpu_time_s:.2f} s at {r.at_s:.1f} s: {r.kind} {int(r.num_seqs)} seqs "
            f"{int(r.total_num_scheduled_tokens)} tokens"
            for r in found.itertuples()
        )
        print(f"{run.name:<46} {meta.get('created', '')[:16]:<17} {len(steps):>6}  {cells or '-'}")
    print(f"\n{num_stalled} of {len(runs)} replays have a step of {args.min_seconds:g} s or more")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
