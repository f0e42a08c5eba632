"""Leave one out: does the transferred latency model (simulator/latency/transfer.py) carry to what it
was not fitted on? Per pair of `transfer.LEAVE_ONE_OUT` (Qwen3-0.6B -> Qwen3-8B, block 16 -> 256,
sync -> async): fit on the training side's profiling sweeps only (simulator/profiles/records/, never a
replay), then simulate every shipped real replay of the other side (simulator/data/validation/) on
that fit and compare with what the engine measured.

Per replay: mean TPOT and p50 E2E error, the targets (10 %) counted below the knee only (the real
replay's TTFT p99 within the SLO, ttft_p99=1s); the roofline's errors beside them. Per trace window
with real replays on both sides of the SLO: the simulated knee (the highest rate scale meeting it)
against the real bracket, within 10 % of it or not. The decode kernel's split rule and CUDA graphs of
each replay are those of the engine that served it (as its configuration's shipped profile records
them; none of that profile's fitted coefficients is used).

    python benchmarks/leave_one_out.py [--validation DIR] [--pairs 0,1,2] [--no-knee] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET = 0.10  # TPOT mean, E2E p50 (below the knee) and capacity
SLO = "ttft_p99=1s"
OLDER_DECODE = ("fa4decode",)  # replays of the first engine (FlashAttention-4 decode): no split rule


@dataclass(frozen=True)
class Replay:
    path: Path
    meta: dict
    family: str | None = None  # the scoreboard suite's trace family, where the suite lists it
    rate_scale: float | None = None  # the suite's rate scale of the family's window, where listed

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def scale(self) -> float:
        """Rate scale of its trace window: the suite's (its replays may be served from traces already
        rescaled), else run.json's."""
        return self.rate_scale if self.rate_scale is not None else float(self.meta.get("rate_scale", 1.0))

    @property
    def window_key(self) -> tuple:
        """Replays of one trace window on one engine build: the name without its load suffix, and
        the suite's family (else the trace and the window)."""
        where = (
            (self.family,) if self.family else (str(self.meta.get("source")), str(self.meta.get("window")))
        )
        return (self.name.rsplit("_", 1)[0], *where)

    def axis(self, axis: str):
        if axis == "model":
            return self.meta["model"]["name"]
        if axis == "block_size":
            return int(self.meta["block_size"])
        return bool(self.meta.get("async_scheduling", False))


def replays(folder: Path) -> list[Replay]:
    """Every replay folder under `folder` but the first engine's, with its suite entry (suite.json)."""
    suite_path = folder / "suite.json"
    listed = {}
    if suite_path.is_file():
        listed = {r["run"]: r for r in json.loads(suite_path.read_text())["replays"]}
    out = []
    for run in sorted(p for p in folder.iterdir() if (p / "run.json").is_file()):
        if any(tag in run.name for tag in OLDER_DECODE):
            continue
        entry = listed.get(run.name, {})
        scale = float(entry["rate_scale"]) if "rate_scale" in entry else None
        out.append(Replay(run, json.loads((run / "run.json").read_text()), entry.get("family"), scale))
    return out


def engine_kernel(config):
    """(split rule, largest decode graph) of the engine that served a configuration: its shipped
    profile's description of the engine."""
    from simulator.defaults import default_profile
    from simulator.latency.profile import LatencyProfile

    path = default_profile(
        config.model.name, config.gpu, config.block_size, config.tensor_parallel_size, config.async_scheduling
    )
    if path is None:
        return None, None
    profile = LatencyProfile.load(path)
    return profile.split_kv, profile.max_graph_batch_size


def transferred(fit, config):
    from simulator.latency.transfer import TransferredModel

    split_kv, graphs = engine_kernel(config)
    return TransferredModel(
        fit, config.model, config.gpu, config.tensor_parallel_size, config.block_size, split_kv, graphs
    )


def score(replay: Replay, fit) -> dict:
    """One replay simulated on the transferred model and on the roofline, against the real run."""
    from simulator.latency.roofline import RooflineModel
    from simulator.metrics import summarize
    from simulator.run import run_simulation
    from simulator.validate import read_run, sim_config_for

    meta, trace, real, _ = read_run(replay.path)
    config = sim_config_for(meta)
    real_summary = summarize(real)
    row = {"replay": replay.name, "real_ttft_p99_s": float(real_summary["ttft_p99_s"])}
    for label, latency in (
        ("transfer", transferred(fit, config)),
        ("roofline", RooflineModel(config.model, config.gpu, config.tensor_parallel_size)),
    ):
        sim = run_simulation(trace, config, latency=latency).summary
        for metric in ("tpot_mean_s", "e2e_p50_s"):
            row[f"{label}_{metric}"] = (sim[metric] - real_summary[metric]) / real_summary[metric]
    row["below_knee"] = row["real_ttft_p99_s"] <= 1.0
    return row


def simulated_knee(replay: Replay, fit) -> float | None:
    """The highest rate scale of a replay's window (its arrivals at scale 1) whose simulation on the
    transferred model meets the SLO, on the replay's configuration."""
    from simulator.plan import parse_objectives, search_max_scale, violations
    from simulator.run import run_simulation
    from simulator.scoreboard import base_trace
    from simulator.validate import sim_config_for
    from traces.transforms import scale_rate

    meta, trace = base_trace(replay.path, replay.scale)
    config = sim_config_for(meta)
    latency = transferred(fit, config)
    objectives = parse_objectives(SLO)

    def feasible(scales: list[float]) -> list[bool]:
        return [
            not violations(run_simulation(scale_rate(trace, x), config, latency=latency).summary, objectives)
            for x in scales
        ]

    return search_max_scale(feasible, start=replay.scale, tolerance=0.02, max_scale=256.0).lo


def knee_rows(group: list[Replay], rows: dict[str, dict], fit) -> dict | None:
    """A window's real bracket (highest scale within the SLO, lowest beyond it) and simulated knee;
    None unless both sides have a replay."""
    passed = [r.scale for r in group if rows[r.name]["below_knee"]]
    failed = [r.scale for r in group if not rows[r.name]["below_knee"]]
    if not passed or not failed or max(passed) >= min(failed):
        return None
    lo, hi = max(passed), min(failed)
    base = next(r for r in group if r.scale == lo)
    knee = simulated_knee(base, fit)
    if knee is None:
        err = math.nan
    elif knee < lo:
        err = (knee - lo) / lo
    elif knee > hi:
        err = (knee - hi) / hi
    else:
        err = 0.0
    return {"window": base.window_key[0], "real_lo": lo, "real_hi": hi, "sim_knee": knee, "err": err}


def pct(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.1%}"


def main(argv: list[str] | None = None) -> int:
    from simulator.latency.transfer import LEAVE_ONE_OUT, fit_transfer, shipped_record_sets

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--validation", default=str(ROOT / "simulator" / "data" / "validation"))
    parser.add_argument("--pairs", default=",".join(str(i) for i in range(len(LEAVE_ONE_OUT))))
    parser.add_argument("--no-knee", action="store_true", help="skip the knee searches")
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    sets = shipped_record_sets()
    shipped = replays(Path(args.validation))
    lines = [
        f"Leave one out, transferred model (targets: TPOT mean and E2E p50 within {TARGET:.0%} below the knee, "
        f"capacity within {TARGET:.0%}; knee = {SLO})",
        "",
        f"{'pair':<24}{'replay':<44}{'real ttft p99':>14}{'knee':>7}{'TPOT err':>10}{'E2E p50 err':>13}"
        f"{'met':>5}{'roofline TPOT':>15}{'roofline E2E':>14}",
    ]
    out = {"pairs": []}
    totals = {"met": 0, "scored": 0, "knee_met": 0, "knees": 0}
    per_pair = []
    for index in (int(i) for i in args.pairs.split(",")):
        before = dict(totals)
        pair = LEAVE_ONE_OUT[index]
        train = [rs for rs in sets if pair.of(rs) == "train"]
        fit = fit_transfer(train)
        mine = [r for r in shipped if pair.side(r.axis(pair.axis)) == "test"]
        rows = {}
        for r in mine:
            print(f"{pair.name}: {r.name}", file=sys.stderr)
            rows[r.name] = score(r, fit)
        for r in mine:
            row = rows[r.name]
            tp, e2e = row["transfer_tpot_mean_s"], row["transfer_e2e_p50_s"]
            ok = abs(tp) <= TARGET and abs(e2e) <= TARGET
            if row["below_knee"]:
                totals["scored"] += 2
                totals["met"] += int(abs(tp) <= TARGET) + int(abs(e2e) <= TARGET)
            met = ("yes" if ok else "NO") if row["below_knee"] else "-"
            lines.append(
                f"{pair.name:<24}{r.name:<44}{row['real_ttft_p99_s']:>13.3f}s{'below' if row['below_knee'] else 'above':>7}"
                f"{pct(tp):>10}{pct(e2e):>13}{met:>5}{pct(row['roofline_tpot_mean_s']):>15}{pct(row['roofline_e2e_p50_s']):>14}"
            )
        knees = []
        if not args.no_knee:
            groups: dict[tuple, list[Replay]] = {}
            for r in mine:
                groups.setdefault(r.window_key, []).append(r)
            for group in groups.values():
                print(f"{pair.name}: knee of {group[0].window_key[0]}", file=sys.stderr)
                k = knee_rows(group, rows, fit)
                if k is not None:
                    knees.append(k)
        for k in knees:
            ok = not math.isnan(k["err"]) and abs(k["err"]) <= TARGET
            totals["knees"] += 1
            totals["knee_met"] += int(ok)
            sim = "none found" if k["sim_knee"] is None else f"{k['sim_knee']:.3g}x"
            lines.append(
                f"{pair.name:<24}capacity {k['window']:<35} real knee in ({k['real_lo']:g}x, {k['real_hi']:g}x), "
                f"simulated {sim}: error {pct(k['err'])} {'met' if ok else 'MISSED'}"
            )
        done = {k: totals[k] - before[k] for k in totals}
        per_pair.append(
            f"  {pair.name:<24}{done['met']} of {done['scored']} below-knee targets, "
            + (
                f"{done['knee_met']} of {done['knees']} knees: "
                if done["knees"]
                else "no real knee bracketed: "
            )
            + ("met" if done["met"] == done["scored"] and done["knee_met"] == done["knees"] else "MISSED")
        )
        out["pairs"].append(
            {
                "pair": pair.name,
                "fitted_on": [rs.name for rs in train],
                "replays": list(rows.values()),
                "knees": knees,
            }
        )
    lines += [
        "",
        *per_pair,
        f"below the knee: {totals['met']} of {totals['scored']} TPOT/E2E targets met; "
        f"capacity: {totals['knee_met']} of {totals['knees']} knees within {TARGET:.0%} of the real bracket",
        f"({time.perf_counter() - started:.0f} s)",
    ]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2, default=float) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
