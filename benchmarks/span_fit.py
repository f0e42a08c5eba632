"""The attention-span term (`kvplan fit --span-term`) scored as the fit rule of 2026-12-03 07:47 UTC
states it, on CPU: held-back error of each sweep refitted with and without it, and diagnostic replays.

Each shipped Qwen3-0.6B sweep (simulator/profiles/records/) is refitted as `kvplan fit --records R
--like P` refits it (P: its superseded or shipped profile, the records' seed, loss and 25 % held
back), once without and once with the term. Printed per fit: the summed error (sum predicted / sum
attributed - 1) of the held-back prefill, mixed and decode steps apart. Then, for the block-16 async
sweep, the summed error of every step of the diagnostic replays (simulator/data/diagnostic/) on both
fits, decode steps scheduled ahead priced on the model without its sync terms, as the simulator does.

    python benchmarks/span_fit.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from prefill_fit import refit  # noqa: E402  (benchmarks/, this script's folder)

from simulator.calibration import step_seconds  # noqa: E402
from simulator.latency import fitted as F  # noqa: E402
from simulator.latency.profile import LatencyProfile  # noqa: E402

PROFILES = ROOT / "simulator" / "profiles"
DIAGNOSTIC = ROOT / "simulator" / "data" / "diagnostic"
SEED, HOLDOUT = 0, 0.25
# records stem -> the profile whose options the refits take (the fit the rule compared against)
SWEEPS = {
    "qwen3-0.6b_h200_tp1_bs16_async": "superseded/qwen3-0.6b_h200_tp1_bs16_async_2026-12-02_1746.json",
    "qwen3-0.6b_h200_tp1_bs16": "superseded/qwen3-0.6b_h200_tp1_bs16_2026-12-02_1744.json",
    "qwen3-0.6b_h200_tp1_bs256": "superseded/qwen3-0.6b_h200_tp1_bs256_2026-12-02_2142.json",
    "qwen3-0.6b_h200_tp1_bs256_async": "superseded/qwen3-0.6b_h200_tp1_bs256_async_2026-12-02_1806.json",
}


def held_back(records: pd.DataFrame) -> pd.DataFrame:
    """The steps each kind's fit held back (seed 0, 25 %), with their attributed times."""
    frame = records.reset_index(drop=True).assign(attributed_s=F.attributed_times(records))
    used = frame[~frame["compiled"].fillna(False).astype(bool) & (frame["kind"] != "empty")]
    parts = []
    for decode in (True, False):
        part = used[(used["kind"] == "decode") == decode].reset_index(drop=True)
        test, _ = F._holdout_split(len(part), SEED, HOLDOUT)
        parts.append(part.iloc[test])
    return pd.concat(parts)


def summed(steps: pd.DataFrame, profile: LatencyProfile, kinds: tuple[str, ...]) -> list[float]:
    predicted = step_seconds(steps, profile.to_latency_model())
    measured = steps["attributed_s"].to_numpy()
    kind = steps["kind"].to_numpy()
    return [predicted[kind == k].sum() / measured[kind == k].sum() - 1 if k != "all"
            else predicted.sum() / measured.sum() - 1 for k in kinds]  # fmt: skip


def main() -> int:
    print(f"{'sweep':<34} {'fit':<13} {'prefill':>8} {'mixed':>8} {'decode':>8}  span (ns a key)")
    fits = {}
    for stem, like_name in SWEEPS.items():
        records = pd.read_parquet(PROFILES / "records" / f"steps_{stem}.parquet")
        like = LatencyProfile.load(PROFILES / like_name)
        held = held_back(records)
        for span in (False, True):
            profile = refit(records, like, F.PREFIX_FEATURES[0] in like.prefill.features, span)
            fits[stem, span] = profile
            errors = summed(held, profile, ("prefill", "mixed", "decode"))
            coef = profile.prefill.as_dict().get(F.SPAN_FEATURES[0])
            print(f"{stem:<34} {'with term' if span else 'without':<13} "
                  + " ".join(f"{e:>+8.2%}" for e in errors) + ("" if coef is None else f"  {coef * 1e9:.0f}"))  # fmt: skip
    runs = sorted(DIAGNOSTIC.glob("h200_*"))
    if runs:
        steps = pd.concat(
            [
                (s := pd.read_parquet(run / "steps.parquet"))
                .loc[s["kind"] != "empty"]
                .reset_index(drop=True)
                .pipe(lambda f: f.assign(attributed_s=F.attributed_times(f)))
                for run in runs
            ]
        )
        print(f"\ndiagnostic replays ({', '.join(r.name for r in runs)}), every step, summed error:")
        for span in (False, True):
            errors = summed(
                steps, fits["qwen3-0.6b_h200_tp1_bs16_async", span], ("prefill", "mixed", "decode", "all")
            )
            print(f"  block-16 async {'with term' if span else 'without':<10} "
                  + "  ".join(f"{k} {e:+.2%}" for k, e in zip(("prefill", "mixed", "decode", "all"), errors)))  # fmt: skip
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
