"""Held-back error of the fitted latency model with and without the block-table host term, on the
profiling sweeps' step records (simulator/profiles/records/; never a replay).

Each records file is refitted as `kvplan fit --records R --like P` refits it (P its shipped profile:
loss median, wall_time_s, its split rule and CUDA graphs, host floors), once without the decode fit's
`sync_x_table_entries` (`--no-host-table`, the fit of the shipped profiles) and once with it (the
default), on the same 25 % of each kind's steps held back. Printed per file: decode (all, and the
steps not scheduled ahead apart), prefill+mixed, median / p90 relative error, and the table term.

Then two forms of a table term for prefill and mixed steps, scored the same way and not part of
the fit (`--prefill-forms`): an additive feature (c x table entries in the linear fit) and a floor
that grows with the table (max(floor_kind + c_kind x entries, linear), c by a grid, the floor the
exact minimiser at each c).

    python benchmarks/host_table_fit.py [--records FILE ...] [--prefill-forms]
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

from simulator.latency import fitted as F  # noqa: E402
from simulator.latency.profile import LatencyProfile, refit_like  # noqa: E402

PROFILES = ROOT / "simulator" / "profiles"
SEED, HOLDOUT = 0, 0.25


def _used(records: pd.DataFrame) -> pd.DataFrame:
    """The rows a fit uses, in its order (not compiled, not empty)."""
    compiled = records["compiled"].fillna(False).astype(bool) if "compiled" in records else False
    return records[~compiled & (records["kind"] != "empty")].reset_index(drop=True)


def _err(predicted: np.ndarray, measured: np.ndarray) -> tuple[float, float]:
    rel = np.abs(predicted - measured) / measured
    return (float(np.median(rel)), float(np.quantile(rel, 0.9))) if len(rel) else (np.nan, np.nan)


def _fmt(e: tuple[float, float]) -> str:
    return "   -   /   -  " if np.isnan(e[0]) else f"{e[0]:6.1%} / {e[1]:5.1%}"


def _refit(records: pd.DataFrame, like: LatencyProfile, host_table: bool) -> LatencyProfile:
    return refit_like(
        records, like, target="wall_time_s", loss="median", split_kv=like.split_kv, host_table=host_table
    )


def _decode_errors(profile: LatencyProfile, used: pd.DataFrame) -> tuple[tuple, tuple]:
    """(all held-back decode steps, those not scheduled ahead) of `profile`."""
    model = profile.to_latency_model()
    ahead = model.overlapped_model()
    dec = used[used["kind"] == "decode"].reset_index(drop=True)
    test, _ = F._holdout_split(len(dec), SEED, HOLDOUT)
    overlapped = dec["overlapped"].fillna(False).astype(bool).to_numpy() if "overlapped" in dec else None
    rows = dec.iloc[test]
    flags = overlapped[test] if overlapped is not None else np.zeros(len(test), bool)
    shape = zip(rows["num_seqs"], rows["num_context_tokens"], rows["max_seq_len"], flags)
    predicted = np.array(
        [(ahead if o else model).decode_step_time(int(n), int(c), int(m)) for n, c, m, o in shape]
    )
    measured = rows["wall_time_s"].to_numpy()
    sync = ~flags if overlapped is not None else np.zeros(len(test), bool)
    return _err(predicted, measured), _err(predicted[sync], measured[sync])


def _prefill_forms(used: pd.DataFrame, block_size: int) -> list[str]:
    pre = used[used["kind"] != "decode"].reset_index(drop=True)
    y, kinds = pre["wall_time_s"].to_numpy(), pre["kind"].to_numpy()
    entries = F.table_entries(pre["num_seqs"].to_numpy(), pre["max_seq_len"].to_numpy(), block_size).astype(
        float
    )
    x = F.prefill_features(pre)
    test, train = F._holdout_split(len(pre), SEED, HOLDOUT)
    grid = np.concatenate([[0.0], np.geomspace(1e-9, 1e-5, 200)])
    lines = []
    for label, design in (("floors (shipped form)", x), ("+ table entries", np.column_stack([x, entries]))):
        coef = F._least_absolute_nnls(design[train], y[train])
        linear = design @ coef
        for sloped in (False, True):
            predicted, parts = linear.copy(), []
            for kind in ("prefill", "mixed"):
                rows, mine = train[kinds[train] == kind], kinds == kind
                if not sloped:
                    floor, c = F.fit_floor(linear[rows], y[rows], "median"), 0.0
                else:
                    best = None
                    for c in grid:  # max(f + c w, p) - y = max(f, p - c w) - (y - c w)
                        f = max(
                            F._absolute_floor(linear[rows] - c * entries[rows], y[rows] - c * entries[rows]),
                            0.0,
                        )
                        loss = np.abs(np.maximum(f + c * entries[rows], linear[rows]) - y[rows]).sum()
                        if best is None or loss < best[0]:
                            best = (loss, f, c)
                    floor, c = best[1], best[2]
                predicted[mine] = np.maximum(linear[mine], floor + c * entries[mine])
                parts.append(f"{kind} {floor * 1e3:.2f} ms + {c * 1e9:.0f} ns/entry")
            extra = f", {coef[-1] * 1e9:.1f} ns/entry in the fit" if design.shape[1] > x.shape[1] else ""
            name = f"{label}{', floor + c x entries' if sloped else ''}"
            lines.append(
                f"    {name:<45} {_fmt(_err(predicted[test], y[test]))}   ({'; '.join(parts)}{extra})"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--records", nargs="*", default=None, help="records files (default: every shipped one)"
    )
    parser.add_argument(
        "--prefill-forms", action="store_true", help="also score table terms of prefill/mixed steps"
    )
    args = parser.parse_args(argv)
    files = (
        [Path(f) for f in args.records]
        if args.records
        else sorted((PROFILES / "records").glob("steps_*.parquet"))
    )
    print(f"{'records':<42} {'fit':<13} {'decode':>15} {'not ahead':>15} {'prefill+mixed':>15}  table term")
    for path in files:
        stem = path.stem.removeprefix("steps_")
        # a dated records file (a sweep since superseded) goes with the superseded profile of its name
        shipped = PROFILES / f"{stem}.json"
        like = LatencyProfile.load(shipped if shipped.is_file() else PROFILES / "superseded" / f"{stem}.json")
        records = pd.read_parquet(path)
        used = _used(records)
        for host_table in (False, True):
            profile = _refit(records, like, host_table)
            decode, sync = _decode_errors(profile, used)
            pre = profile.prefill.error
            coefs = dict(zip(profile.decode.features, profile.decode.coefficients))
            term = coefs.get(F.TABLE_FEATURES[0])
            label = "with table" if host_table else "without"
            print(
                f"{path.name:<42} {label:<13} {_fmt(decode):>15} {_fmt(sync):>15} "
                f"{_fmt((pre.median_rel_error, pre.p90_rel_error)):>15}  "
                + ("-" if term is None else f"{term * 1e9:.1f} ns/entry")
            )
        if args.prefill_forms:
            print("\n".join(_prefill_forms(used, like.block_size)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
