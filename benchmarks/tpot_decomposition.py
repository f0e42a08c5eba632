"""Where a replay's mean-TPOT error comes from: the profile's price of the real steps, or the
simulated run's own step stream.

For each request of a real replay (CPU, no GPU): its real TPOT; the real steps that ended inside its
decode interval (first token to finish; the engine stamps a token at its step's end, so the step
timeline is aligned on the last finish); the profile's prediction of those same steps; and the
simulated request's TPOT. Prints the means over all requests and by output length.

    python benchmarks/tpot_decomposition.py RUN [RUN ...] [--profile PROFILE]

RUN a replay folder (simulator/data/validation/... or simulator/data/diagnostic/...); PROFILE
defaults to the shipped profile of the replay's engine (`kvplan validate`'s 'auto').
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simulator.run import run_simulation  # noqa: E402
from simulator.validate import (  # noqa: E402
    load_latency_model,
    read_run,
    sim_config_for,
    step_residuals,
    validate_profile,
)

# (label, output tokens from, to before): the requests each row of the report averages
ROWS = (
    ("all", 2, None),
    ("2-3 output tokens", 2, 4),
    ("4-32 output tokens", 4, 33),
    ("33+ output tokens", 33, None),
)
STAMP_SLACK_S = 2e-5  # a token stamp lies this close to its step's end, or later


def decode_intervals(requests: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Per request with two or more output tokens: real TPOT, and the real steps' summed wall time and
    predicted time inside its decode interval, per output token."""
    idle = steps["idle_before_s"].fillna(0.0).to_numpy()
    ends = np.cumsum(idle + steps["wall_time_s"].to_numpy())
    ends += requests["finish_s"].max() - ends[-1]  # the last step ends at the last finish
    sums = {
        c: np.concatenate([[0.0], np.cumsum(steps[c].to_numpy())]) for c in ("wall_time_s", "predicted_s")
    }
    q = requests[requests["num_output_tokens"] > 1]
    first = np.searchsorted(ends, q["first_token_s"].to_numpy() - STAMP_SLACK_S) + 1
    last = np.searchsorted(ends, q["finish_s"].to_numpy() - STAMP_SLACK_S) + 1
    n = q["num_output_tokens"].to_numpy() - 1
    return pd.DataFrame(
        {
            "request_id": q["request_id"].to_numpy(),
            "num_output_tokens": q["num_output_tokens"].to_numpy(),
            "real": (q["finish_s"] - q["first_token_s"]).to_numpy() / n,
            "steps_wall": (sums["wall_time_s"][last] - sums["wall_time_s"][first]) / n,
            "predicted": (sums["predicted_s"][last] - sums["predicted_s"][first]) / n,
        }
    )


def decompose(run: Path, profile: Path | None) -> pd.DataFrame:
    """`decode_intervals` of `run` with the simulated TPOT of each request on `profile`."""
    meta, trace, requests, steps = read_run(run)
    if steps is None or not len(steps):
        raise SystemExit(f"{run}: no steps.parquet: the real steps are what this compares")
    config = sim_config_for(meta)
    latency = load_latency_model(
        profile, config.model, config.gpu, config.tensor_parallel_size, config.block_size
    )
    priced = step_residuals(steps, latency).reset_index(drop=True)
    out = decode_intervals(requests, priced)
    sim = run_simulation(trace, config, profile=profile, latency=latency).requests
    return out.merge(sim[["request_id", "tpot_s"]].rename(columns={"tpot_s": "simulated"}), on="request_id")


def report(run: Path, profile: Path | None, frame: pd.DataFrame) -> list[str]:
    name = "roofline" if profile is None else Path(profile).name
    lines = [f"{run.name} on {name}: mean TPOT, ms (error against the real TPOT)"]
    head = f"  {'requests':<24}{'n':>5}{'real':>9}{'steps':>9}{'predicted':>18}{'simulated':>18}"
    lines.append(head)
    for label, lo, hi in ROWS:
        tokens = frame["num_output_tokens"]
        part = frame[(tokens >= lo) & (tokens < (hi or np.inf))]
        real = part["real"].mean()
        cells = [
            f"{part[c].mean() * 1e3:8.3f} ({part[c].mean() / real - 1:+6.1%})"
            for c in ("predicted", "simulated")
        ]
        lines.append(
            f"  {label:<24}{len(part):>5}{real * 1e3:>9.3f}{part['steps_wall'].mean() * 1e3:>9.3f}"
            + "".join(f"{c:>18}" for c in cells)
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="replay folders")
    p.add_argument(
        "--profile", default="auto", help="a profile JSON, or 'auto' (default) for the shipped one"
    )
    args = p.parse_args(argv)
    for run in args.runs:
        profile = validate_profile(args.profile, run)
        print("\n".join(report(run, profile, decompose(run, profile))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
