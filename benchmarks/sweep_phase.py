"""Run some phases of the profiling sweep on the real engine and write their step records, or price
recorded steps on a shipped profile: the summed error of mixed and decode steps by running decodes.

    PYTHONPATH=. python3 benchmarks/sweep_phase.py run --random qwen3-0.6b --phases mixed_serving \
        --max-model-len 32768 --max-num-batched-tokens 8192 --records OUT/steps.parquet   # GPU
    PYTHONPATH=. python benchmarks/sweep_phase.py price --records OUT/steps.parquet \
        --profile simulator/profiles/qwen3-0.6b_h200_tp1_bs16.json                         # CPU

`run` serves the `long` phase's corpus prefill first (so document prefixes are prefix hits, as in
the sweep) and then every workload of the named phases, in the sweep's order; it fits nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

DECODE_BINS = [0, 16, 48, 96, 160, 256]


def run(args: argparse.Namespace) -> int:
    from engine.launch import open_llm
    from engine.profiling import PHASES, SweepLimits, run_sweep, sweep

    workloads = [phase for phase in PHASES if phase != "serving"]  # serving: replays, not workloads
    unknown = sorted(set(args.phases) - set(workloads))
    if unknown:
        raise SystemExit(f"--phases: {unknown} are not workload phases of the sweep ({', '.join(workloads)})")
    with tempfile.TemporaryDirectory() as tmp, open_llm(args, tmp) as llm:
        limits = SweepLimits.of_llm(llm)
        work = sweep(limits)
        corpus = [w for w in work if w.phase == "long"][:1]  # the documents' prefill
        work = corpus + [w for w in work if w.phase in args.phases]
        llm.recorder.reset()
        t0 = time.perf_counter()
        steps = run_sweep(llm, work, limits, progress=False, serving=False)
        print(f"{len(work)} workloads, {len(steps)} steps in {time.perf_counter() - t0:.1f} s")
    Path(args.records).parent.mkdir(parents=True, exist_ok=True)
    steps.to_parquet(args.records)
    print(f"wrote {args.records}")
    return 0


def price(args: argparse.Namespace) -> int:
    import pandas as pd

    from simulator.latency.profile import LatencyProfile
    from simulator.validate import step_residuals

    model = LatencyProfile.load(args.profile).to_latency_model()
    steps = step_residuals(pd.read_parquet(args.records), model)
    steps = steps[steps["kind"].isin(["mixed", "decode"])]
    steps = steps.assign(decodes=pd.cut(steps["num_decode_seqs"], DECODE_BINS))
    table = steps.groupby(["kind", "decodes"], observed=True).agg(
        steps=("measured_s", "size"),
        measured_ms=("measured_s", lambda x: 1e3 * x.median()),
        predicted_ms=("predicted_s", lambda x: 1e3 * x.median()),
        predicted_s=("predicted_s", "sum"),
        measured_s=("measured_s", "sum"),
    )
    table["summed error"] = (table["predicted_s"] / table["measured_s"] - 1).map("{:+.1%}".format)
    print(f"{args.records} on {Path(args.profile).name} (medians in ms; summed: predicted / measured - 1)")
    print(table.drop(columns=["predicted_s", "measured_s"]).round(2).to_string())
    return 0


def main(argv: list[str] | None = None) -> int:
    from engine.launch import engine_arguments

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run sweep phases on the engine (GPU) and write their step records")
    engine_arguments(r)
    r.add_argument("--phases", nargs="+", required=True, help="sweep phases to run (engine.profiling.PHASES)")
    r.add_argument("--records", required=True, help="step records to write (.parquet)")
    q = sub.add_parser("price", help="price recorded steps on a profile, by kind and running decodes")
    q.add_argument("--records", required=True, help="step records (.parquet)")
    q.add_argument("--profile", required=True, help="a profile JSON")
    args = p.parse_args(argv)
    return run(args) if args.command == "run" else price(args)


if __name__ == "__main__":
    sys.exit(main())
