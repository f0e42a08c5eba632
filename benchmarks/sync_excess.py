"""What a decode step not scheduled ahead costs beyond the same step run ahead, by block-table width
and by context tokens, on a sweep's step records: wall time less the profile's overlapped prediction
(`overlapped_model()`, which leaves every host term out), median per bin, for the steps not run ahead
and, as the reference, for those run ahead; for the steps not run ahead also how much of it is in
their GPU time (`gpu_time_s` less the prediction: on an idle GPU the step's start event fires at once,
so this holds the host's build of its inputs too) and outside it (wall less GPU time). Table entries (rows x the longest sequence's blocks) are
what the profile's table term reads; the blocks the rows actually hold grow with the context tokens.
CPU only; reads shipped records, never a replay.

    python benchmarks/sync_excess.py [RECORDS PROFILE ...]   # default: the block-16 async sweeps
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from simulator.latency.fitted import table_entries  # noqa: E402
from simulator.latency.profile import LatencyProfile  # noqa: E402

PROFILES = ROOT / "simulator" / "profiles"
# the block-16 Qwen3-0.6B async sweep of the engine that rebuilt each step's table, then of the one
# that keeps its rows (each with the profile fitted on it)
DEFAULT_PAIRS = [
    (
        "records/steps_qwen3-0.6b_h200_tp1_bs16_async_2026-12-02_1746.parquet",
        "superseded/qwen3-0.6b_h200_tp1_bs16_async_2026-12-03_1453.json",
    ),
    ("records/steps_qwen3-0.6b_h200_tp1_bs16_async.parquet", "qwen3-0.6b_h200_tp1_bs16_async.json"),
]
BINS = {
    "entries": [0, 5_000, 20_000, 60_000, 150_000, 300_000, np.inf],
    "num_context_tokens": [0, 50_000, 200_000, 500_000, 800_000, np.inf],
}


def excess_table(records: pd.DataFrame, profile: LatencyProfile, by: str) -> pd.DataFrame:
    """Per bin of `by` (a key of BINS): steps and median excess (ms) of decode steps not run ahead
    and run ahead (records not compiled); bins without steps left out."""
    df = records[(records["kind"] == "decode") & ~records["compiled"].fillna(False).astype(bool)]
    model = profile.to_latency_model().overlapped_model()
    shapes = zip(df["num_seqs"], df["num_context_tokens"], df["max_seq_len"])
    predicted = np.array([model.decode_step_time(int(n), int(c), int(m)) for n, c, m in shapes])
    df = df.assign(
        excess_ms=(df["wall_time_s"].to_numpy() - predicted) * 1e3,
        gpu_ms=(df["gpu_time_s"].to_numpy() - predicted) * 1e3,
        host_ms=(df["wall_time_s"] - df["gpu_time_s"]).to_numpy() * 1e3,
        entries=table_entries(df["num_seqs"].to_numpy(), df["max_seq_len"].to_numpy(), profile.block_size),
    )
    bins = pd.cut(df[by], BINS[by])
    out = {}
    for ahead, label in ((False, "not ahead"), (True, "ahead")):
        part = df[df["overlapped"].astype(bool) == ahead]
        grouped = part.groupby(bins[part.index], observed=False)
        out[(label, "steps")] = grouped.size()
        out[(label, "median ms")] = grouped["excess_ms"].median()
        if not ahead:
            out[(label, "GPU ms")] = grouped["gpu_ms"].median()
            out[(label, "host ms")] = grouped["host_ms"].median()
    table = pd.DataFrame(out)
    return table[table[("not ahead", "steps")] + table[("ahead", "steps")] > 0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "pairs", nargs="*", help="RECORDS PROFILE pairs (paths; default: the block-16 async sweeps)"
    )
    args = p.parse_args(argv)
    if len(args.pairs) % 2:
        p.error("give RECORDS PROFILE pairs")
    pairs = list(zip(args.pairs[::2], args.pairs[1::2])) or [
        (PROFILES / r, PROFILES / f) for r, f in DEFAULT_PAIRS
    ]
    for records, profile in pairs:
        steps, fitted = pd.read_parquet(records), LatencyProfile.load(profile)
        print(
            f"{Path(records).name} on {Path(profile).name}: wall less the overlapped prediction, decode steps"
        )
        for by in BINS:
            print(excess_table(steps, fitted, by).round(3).to_string(), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
