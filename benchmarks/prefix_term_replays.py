"""The shipped profiles that take the prefix-hit term against the fits they replace, on the suite's
replays that are held out for both: targets met and errors per replay, and the totals.

A replay is held out for a profile when suite.json declares it so and it was first seen after that
profile was fitted (`simulator.scoreboard.held_out_for`). The replaced fits are in
simulator/profiles/superseded/ (`--replaced` names them); nothing here is used to choose a profile.

    python benchmarks/prefix_term_replays.py [--suite simulator/data/validation/suite.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from simulator.scoreboard import held_out_for, load_suite, score_replay  # noqa: E402
from simulator.validate import validate_profile  # noqa: E402

SUPERSEDED = ROOT / "simulator" / "profiles" / "superseded"
REPLACED = {
    "qwen3-0.6b_h200_tp1_bs16_async.json": "qwen3-0.6b_h200_tp1_bs16_async_2026-12-02_0709.json",
    "qwen3-0.6b_h200_tp1_bs16.json": "qwen3-0.6b_h200_tp1_bs16_2026-12-02_0721.json",
    "qwen3-0.6b_h200_tp1_bs256_async.json": "qwen3-0.6b_h200_tp1_bs256_async_2026-12-02_0721.json",
}


def _cells(row: dict) -> str:
    return (
        f"{row['targets_met']}/7 {row['mape']:6.1%} {row['e2e_mean_s']:+7.1%} {row['ttft_mean_s']:+7.1%} "
        f"{row['tpot_mean_s']:+7.1%}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default=str(ROOT / "simulator/data/validation/suite.json"))
    args = parser.parse_args()
    suite = load_suite(args.suite)
    totals = {"term": 0, "replaced": 0, "replays": 0}
    head = f"{'replay':<46} {'with the term: met MAPE E2E TTFT TPOT (means)':<46} replaced fit"
    print(head)
    for replay in suite.replays:
        profile = validate_profile("auto", replay.run)
        if profile is None or profile.name not in REPLACED:
            continue
        old = SUPERSEDED / REPLACED[profile.name]
        if not (held_out_for(replay, profile) and held_out_for(replay, old)):
            continue
        new_row, old_row = score_replay(replay, profile), score_replay(replay, old)
        print(f"{replay.run.name:<46} {_cells(new_row):<46} {_cells(old_row)}")
        totals["term"] += new_row["targets_met"]
        totals["replaced"] += old_row["targets_met"]
        totals["replays"] += 1
    n = totals["replays"]
    print(
        f"\nwith the term: {totals['term']} of {7 * n} targets; the replaced fits: {totals['replaced']} of {7 * n}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
