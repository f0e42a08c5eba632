"""Held-back error of the fitted latency model's prefill and mixed steps, with and without the
prefix-hit term (`kvplan fit --prefix-hit-term`: c x total_num_cached_tokens, the host's time of a
step's prefix-cache hits), on the profiling sweeps' step records (simulator/profiles/records/; never
a replay).

Each records file is refitted as `kvplan fit --records R --like P` refits it (P its shipped profile:
loss median, wall_time_s, its split rule, host floors, table and span terms), once without the term
and once with the term, on the same 25 % of each kind's steps held back. Printed per fit: the held-back
prefill+mixed steps' median / p90 relative error against wall time and against attributed time
(`simulator.latency.fitted.attributed_times`), the same for the steps the host queued without
waiting, and the summed error of the held-back steps against attributed time (sum predicted / sum
measured - 1: what a simulated run adds up). Attributed time: a chunk of a long prompt that samples
no token is queued by the host without waiting, so its wall time (5-10 ms for 8,192 tokens) holds
none of its GPU work and the step that next waits holds all of it (140-260 ms); attributed time
charges it its GPU time and the steps that waited that much less, the same total.

    python benchmarks/prefill_fit.py [--records FILE ...]
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
from simulator.latency.base import StepShape  # noqa: E402
from simulator.latency.profile import LatencyProfile, refit_like  # noqa: E402

PROFILES = ROOT / "simulator" / "profiles"
SEED, HOLDOUT = 0, 0.25


def _err(predicted: np.ndarray, measured: np.ndarray) -> str:
    if not len(measured):
        return "   -   /   -  "
    rel = np.abs(predicted - measured) / measured
    return f"{np.median(rel):6.1%} / {np.quantile(rel, 0.9):5.1%}"


def refit(
    records: pd.DataFrame, like: LatencyProfile, prefix_hits: bool, span: bool = False
) -> LatencyProfile:
    """`records` refitted as `kvplan fit --records R --like P` refits them, the terms as given."""
    has_table = F.TABLE_FEATURES[0] in like.decode.features
    return refit_like(
        records,
        like,
        target="wall_time_s",
        loss="median",
        split_kv=like.split_kv,
        host_table=has_table,
        prefix_hits=prefix_hits,
        span=span,
    )


def _held_back_prefill(records: pd.DataFrame) -> pd.DataFrame:
    """The held-back prefill+mixed rows of a fit, in its order, with both measured times."""
    frame = records.reset_index(drop=True).assign(attributed_s=F.attributed_times(records))
    compiled = frame["compiled"].fillna(False).astype(bool) if "compiled" in frame else False
    used = frame[~compiled & (frame["kind"] != "empty")].reset_index(drop=True)
    pre = used[used["kind"] != "decode"].reset_index(drop=True)
    test, _ = F._holdout_split(len(pre), SEED, HOLDOUT)
    out = pre.iloc[test].copy()
    out["queued"] = (out["gpu_time_s"] - out["wall_time_s"]) > np.maximum(
        F._QUEUED_MIN_S, F._QUEUED_SHARE * out["wall_time_s"]
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--records", nargs="*", default=None, help="records files (default: every shipped one)"
    )
    args = parser.parse_args(argv)
    files = (
        [Path(f) for f in args.records]
        if args.records
        else sorted((PROFILES / "records").glob("steps_*.parquet"))
    )
    print(
        f"{'records':<46} {'fit':<18} {'vs wall':>15} {'vs attributed':>15} {'queued vs attr.':>20}  summed  term"
    )
    for path in files:
        stem = path.stem.removeprefix("steps_")
        like = LatencyProfile.load(PROFILES / f"{stem}.json")
        records = pd.read_parquet(path)
        held = _held_back_prefill(records)
        for prefix_hits in (False, True):
            profile = refit(records, like, prefix_hits, F.SPAN_FEATURES[0] in like.prefill.features)
            model = profile.to_latency_model()
            term = dict(zip(profile.prefill.features, profile.prefill.coefficients)).get(F.PREFIX_FEATURES[0])
            predicted = np.array([model.predict(StepShape.of(r)).total for r in held.itertuples(index=False)])
            wall, attributed = held["wall_time_s"].to_numpy(), held["attributed_s"].to_numpy()
            q = held["queued"].to_numpy()
            summed = predicted.sum() / attributed.sum() - 1
            label = "+ prefix-hit term" if prefix_hits else "without the term"
            print(
                f"{path.name:<46} {label:<18} {_err(predicted, wall):>15} {_err(predicted, attributed):>15} "
                f"{_err(predicted[q], attributed[q]):>15} ({int(q.sum()):>2})  {summed:+6.1%}  "
                + ("-" if term is None else f"{term * 1e9:.1f} ns/token")
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
