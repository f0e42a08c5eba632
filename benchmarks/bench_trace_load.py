"""Benchmark traces.load on large generated files: a 1,000,000-row Azure CSV and Mooncake JSONL.

The files are written to a temporary directory from the shipped samples' length distributions (they are
not shipped). Targets on a 2-core machine: <= 3 s for the CSV, <= 10 s for the JSONL.
Run: python benchmarks/bench_trace_load.py [--rows N] [--repeat R] [--dir DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import traces  # noqa: E402


def write_azure_csv(path: Path, rows: int, seed: int = 0) -> None:
    """Azure 2023 format: TIMESTAMP with 7 fractional digits, ContextTokens, GeneratedTokens."""
    rng = np.random.default_rng(seed)
    src = traces.load_shipped("azure_conv_2023").df
    pick = rng.integers(0, len(src), rows)
    gaps_ns = rng.exponential(1e9 / 280.0, rows).astype(np.int64) // 100 * 100
    ts = np.datetime64("2023-11-16T18:15:46.680590000", "ns") + np.cumsum(gaps_ns).astype("timedelta64[ns]")
    text = pd.Series(np.datetime_as_string(ts, unit="ns")).str.slice(0, -2).str.replace("T", " ", regex=False)
    pd.DataFrame(
        {
            "TIMESTAMP": text,
            "ContextTokens": src["prompt_len"].to_numpy()[pick],
            "GeneratedTokens": src["output_len"].to_numpy()[pick],
        }
    ).to_csv(path, index=False)


def write_mooncake_jsonl(path: Path, rows: int, seed: int = 0) -> None:
    """Mooncake format: timestamp (ms), input_length, output_length, hash_ids (512-token blocks)."""
    rng = np.random.default_rng(seed)
    src = traces.load_shipped("mooncake_synthetic")
    tails = []
    for i, (p, o) in enumerate(zip(src.df["prompt_len"].tolist(), src.df["output_len"].tolist())):
        ids = ", ".join(map(str, src.prefix_ids(i).tolist()))
        tails.append(f'"input_length": {p}, "output_length": {o}, "hash_ids": [{ids}]}}\n')
    pick = rng.integers(0, len(src), rows)
    ts = np.cumsum(rng.exponential(1000.0 / 1000.0, rows)).astype(np.int64)
    with open(path, "w") as f:
        f.writelines(f'{{"timestamp": {t}, {tails[k]}' for t, k in zip(ts.tolist(), pick.tolist()))


def timed_load(path: Path, repeat: int) -> tuple[list[float], traces.Trace]:
    times = []
    trace = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        trace = traces.load(path)
        times.append(time.perf_counter() - t0)
    return times, trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3, help="best of R loads")
    ap.add_argument("--dir", default=None, help="write the files here (default: a temporary directory)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(args.dir or tmp)
        d.mkdir(parents=True, exist_ok=True)
        cases = [
            ("azure csv", d / "azure_1m.csv", write_azure_csv, 3.0),
            ("mooncake jsonl", d / "mooncake_1m.jsonl", write_mooncake_jsonl, 10.0),
        ]
        for label, path, writer, target in cases:
            t0 = time.perf_counter()
            writer(path, args.rows)
            t_write = time.perf_counter() - t0
            times, trace = timed_load(path, args.repeat)
            secs = min(times)
            size_mb = path.stat().st_size / 1e6
            ok = "ok" if secs <= target else "SLOW"
            runs = ", ".join(f"{x:.2f}" for x in times)
            print(
                f"{label:<15} {len(trace):>9,} rows {size_mb:7.1f} MB  load best {secs:5.2f} s (runs: {runs}) "
                f"{len(trace) / secs / 1e6:.2f} M rows/s; target <= {target:.0f} s: {ok}  [file written in {t_write:.1f} s]"
            )


if __name__ == "__main__":
    main()
