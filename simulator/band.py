"""A simulation's confidence band: the same run with every step time scaled by the latency model's
own held-back error, once optimistic (x (1 - e)) and once pessimistic (x (1 + e)).

For a fitted profile e is the p90 relative error its fits record on their held-back step records
(`LatencyProfile.decode.error` / `.prefill.error`): decode steps take the decode fit's, prefill and
mixed steps the prefill fit's. For the transferred model (simulator/latency/transfer.py) e is its
leave-one-out error: the largest p90 relative step-time error of a fit on one side of each
leave-one-out pair on the other side's sweeps, as its coefficients file records it. The roofline has
no band: its error was never measured against held-back records (a test only checks that it lands
within a factor of 1.5 of two measured steps).
A metric's band is the hull of the three runs' values (point, optimistic, pessimistic): near a
knee a metric need not move monotonically with the step times. No CLI or formatting of tables here.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from simulator.latency.base import LatencyModel
from simulator.latency.scaled import ScaledModel

SIDES = ("low", "high")  # low: every step (1 - e) times as long; high: (1 + e)
ROOFLINE_NO_BAND = "the roofline's error has not been measured against held-back step records"
_LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e", "queue")
_STATS = ("mean", "p50", "p90", "p99")
# Summary entries a band is given for (those a run's summary has).
BAND_KEYS = (
    *(f"{m}_{s}_s" for m in _LATENCY_METRICS for s in _STATS),
    "throughput_rps",
    "output_tok_s",
    "num_preemptions",
    "slo_attainment",
    "goodput_rps",
)


@dataclass(frozen=True)
class BandErrors:
    """The relative step-time error e of each fit: decode steps, and prefill with mixed steps."""

    decode: float
    prefill: float
    source: str  # what the figures are, e.g. "held-back p90 relative error of qwen3-0.6b_h200_tp1_bs16.json"

    def __post_init__(self) -> None:
        for name in ("decode", "prefill"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 <= value < 1):
                raise ValueError(f"BandErrors.{name}: must be in [0, 1), got {value!r}")

    def factors(self, side: str) -> tuple[float, float]:
        """(decode, prefill) step-time factors of one side: 'low' 1 - e, 'high' 1 + e."""
        if side not in SIDES:
            raise ValueError(f"side: {side!r} is not one of {list(SIDES)}")
        if side == "low":
            return 1.0 - self.decode, 1.0 - self.prefill
        return 1.0 + self.decode, 1.0 + self.prefill

    def describe(self) -> str:
        return (
            f"every step time x (1 -/+ e), e = decode {self.decode:.1%}, prefill/mixed {self.prefill:.1%} "
            f"({self.source})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {"decode": self.decode, "prefill": self.prefill, "source": self.source}


def band_errors(latency: LatencyModel, name: str | Path | None = None) -> BandErrors | None:
    """The band of `latency`: its fitted profile's p90 relative errors, held back where the fit held
    records back (else on its training records, and the source says so), or the errors the model
    gives itself (`band_errors()`: the transferred model's leave-one-out errors); None for a model
    without either (the roofline) or a profile without recorded errors. `name`: the profile's file."""
    if isinstance(latency, ScaledModel):
        latency = latency.model
    own = getattr(latency, "band_errors", None)
    if own is not None:
        errors = own()
        return BandErrors(*errors) if errors is not None else None
    profile = getattr(latency, "profile", None)
    return None if profile is None else _profile_errors(profile, name)


def profile_band_errors(path: str | Path | None) -> BandErrors | None:
    """`band_errors` of the profile file at `path` (None: the roofline, no band; a transferred
    model's file: its leave-one-out errors)."""
    if path is None:
        return None
    from simulator.latency.profile import LatencyProfile
    from simulator.latency.transfer import TransferCoefficients, is_transfer_file

    if is_transfer_file(path):
        loo = TransferCoefficients.load(path).leave_one_out
        if not loo:
            return None
        return BandErrors(float(loo["decode"]), float(loo["prefill"]), f"{loo['what']} of {Path(path).name}")

    return _profile_errors(LatencyProfile.load(path), path)


def _profile_errors(profile: Any, name: str | Path | None) -> BandErrors | None:
    decode = getattr(profile.decode, "error", None)
    prefill = getattr(profile.prefill, "error", None)
    if decode is None or prefill is None:
        return None
    what = "held-back" if decode.n_test > 0 and prefill.n_test > 0 else "training-record"
    label = Path(name).name if name else profile.describe()
    return BandErrors(decode.p90_rel_error, prefill.p90_rel_error, f"{what} p90 relative error of {label}")


def no_band_reason(latency: LatencyModel) -> str:
    """Why `latency` has no band."""
    if isinstance(latency, ScaledModel):
        latency = latency.model
    if getattr(latency, "band_errors", None) is not None:
        return "its coefficients file records no leave-one-out error"
    if getattr(latency, "profile", None) is None:
        return ROOFLINE_NO_BAND
    return "the profile records no fit error"


def scaled_model(latency: LatencyModel, errors: BandErrors, side: str) -> ScaledModel:
    """`latency` with its step times at one side of the band."""
    decode, prefill = errors.factors(side)
    return ScaledModel(latency, decode, prefill)


def band_ranges(point: Mapping[str, Any], *sides: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """(low, high) of each BAND_KEYS entry over the point's and the sides' summaries: the hull of
    their values (NaN where none has one)."""
    out: dict[str, tuple[float, float]] = {}
    for key in BAND_KEYS:
        if key not in point:
            continue
        values = [float(s[key]) for s in (point, *sides) if s.get(key) is not None]
        values = [v for v in values if not math.isnan(v)]
        out[key] = (min(values), max(values)) if values else (math.nan, math.nan)
    return out


@dataclass
class BandedResult:
    """A simulation and, where its latency model has one, the runs at both sides of its band."""

    result: Any  # SimResult of the point run
    errors: BandErrors | None
    low: Any = None  # the run with every step x (1 - e) (its summary: `SideRun`)
    high: Any = None  # the run with every step x (1 + e)
    note: str = ""  # why there is no band

    @property
    def ranges(self) -> dict[str, tuple[float, float]] | None:
        if self.low is None or self.high is None:
            return None
        return band_ranges(self.result.summary, self.low.summary, self.high.summary)

    def band_entry(self) -> dict[str, Any]:
        """The summary's `band` entry: the errors, each side's factors and each metric's range; or
        None with `band_note` saying why there is none."""
        ranges = self.ranges
        if ranges is None or self.errors is None:
            return {"band": None, "band_note": self.note}
        return {
            "band": {
                "errors": self.errors.as_dict(),
                "factors": {side: list(self.errors.factors(side)) for side in SIDES},
                "ranges": {k: list(v) for k, v in ranges.items()},
                "sim_wall_s": self.low.summary.get("sim_wall_s", 0.0)
                + self.high.summary.get("sim_wall_s", 0.0),
            }
        }


def run_with_band(
    trace,
    config,
    profile: str | Path | None = None,
    latency: LatencyModel | None = None,
    slo=None,
    progress: bool = False,
    band: bool = True,
) -> BandedResult:
    """`run_simulation` of `trace` on `config`, then (with `band`, where the model has one) the same
    run at each side of the band. The point run's summary gets the `band` entry."""
    from simulator.run import load_latency, run_simulation

    if latency is None:
        latency = load_latency(config, profile)
    errors = band_errors(latency, profile)
    if not band or errors is None:
        point = run_simulation(trace, config, profile=profile, latency=latency, slo=slo, progress=progress)
        note = "not run (--no-band)" if not band else f"none: {no_band_reason(latency)}"
        out = BandedResult(point, errors if not band else None, note=note)
        point.summary.update(out.band_entry())
        return out
    side_runs = [
        partial(_side_summary, trace, config, profile, scaled_model(latency, errors, side), slo)
        for side in SIDES
    ]
    forked = _start_forked(side_runs)  # beside the point run where the machine can fork
    point = run_simulation(trace, config, profile=profile, latency=latency, slo=slo, progress=progress)
    sides = _join_forked(forked) if forked is not None else [SideRun(run()) for run in side_runs]
    out = BandedResult(point, errors, sides[0], sides[1])
    point.summary.update(out.band_entry())
    return out


@dataclass(frozen=True)
class SideRun:
    """What a band needs of a run at one side: its summary."""

    summary: dict


def _side_summary(trace, config, profile, latency, slo) -> dict:
    from simulator.run import run_simulation

    return run_simulation(trace, config, profile=profile, latency=latency, slo=slo).summary


def _start_forked(runs: list) -> list | None:
    """Start each of `runs` (no-argument callables returning a summary) in a forked process with a
    pipe for its result; None where fork is not available or there is one core (run them inline)."""
    if "fork" not in multiprocessing.get_all_start_methods() or (os.cpu_count() or 1) < 2:
        return None
    ctx = multiprocessing.get_context("fork")
    started = []
    for run in runs:
        receive, send = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_send_result, args=(run, send), daemon=True)
        process.start()
        send.close()
        started.append((process, receive))
    return started


def _send_result(run, send) -> None:
    try:
        send.send(("ok", run()))
    except BaseException as e:  # the parent raises it, naming what failed
        send.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        send.close()


def _join_forked(started: list) -> list[SideRun]:
    out = []
    for process, receive in started:
        try:
            status, value = receive.recv()
        except EOFError:
            status, value = "error", f"the process exited with code {process.exitcode}"
        process.join()
        if status != "ok":
            raise RuntimeError(f"a band run failed: {value}")
        out.append(SideRun(value))
    return out


@dataclass(frozen=True)
class BandLatency:
    """`RunContext.latency` of a plan's or capacity search's band runs (picklable): each point's
    latency model, as the profile choice gives it for the point's GPU, TP, block size and
    scheduling, at one side of its band. A point whose model has no band fails with that reason."""

    profile: str  # 'auto', 'roofline' or a profile file
    model: str
    side: str

    def __call__(self, config) -> LatencyModel:
        from simulator.run import load_latency
        from simulator.sweep import profile_for

        path = profile_for(
            self.profile,
            self.model,
            config.gpu,
            config.block_size,
            config.tensor_parallel_size,
            config.async_scheduling,
        )
        latency = load_latency(config, path)
        errors = band_errors(latency, path)
        if errors is None:
            raise ValueError(f"no band: {no_band_reason(latency)}")
        return scaled_model(latency, errors, self.side)


# ---- containment: does a real run's figure fall inside the band? ------------------------------------------

CONTAINMENT_KEYS = ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s")


def replay_containment(run_dir: str | Path, profile: str | Path | None = "auto") -> list[dict[str, Any]]:
    """For a real replay folder (`kvplan replay`): its configuration simulated with the band (the
    shipped profile of its engine with 'auto'), and per CONTAINMENT_KEYS figure the real value, the
    point, the band and whether the real value lies inside it."""
    from simulator.metrics import summarize
    from simulator.validate import read_run, sim_config_for, validate_profile

    meta, trace, real, _ = read_run(run_dir)
    path = validate_profile("auto", run_dir) if profile == "auto" else profile
    banded = run_with_band(trace, sim_config_for(meta), profile=path)
    real_summary, summary, ranges = summarize(real), banded.result.summary, banded.ranges or {}
    rows = []
    for key in CONTAINMENT_KEYS:
        low, high = ranges.get(key, (math.nan, math.nan))
        value = float(real_summary[key])
        rows.append(
            {
                "run": Path(run_dir).name,
                "profile": Path(path).name if path else "roofline",
                "metric": key[:-2],
                "real": value,
                "sim": float(summary[key]),
                "low": low,
                "high": high,
                "inside": bool(low <= value <= high),
            }
        )
    return rows


def format_containment(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'replay':<46}{'metric':<10}{'real s':>9}{'sim s':>9}{'low':>9}{'high':>9}  inside"]
    for r in rows:
        lines.append(
            f"{r['run']:<46}{r['metric']:<10}{r['real']:>9.3f}{r['sim']:>9.3f}{r['low']:>9.3f}{r['high']:>9.3f}"
            f"  {'yes' if r['inside'] else 'NO'}"
        )
    inside = sum(r["inside"] for r in rows)
    lines.append(f"{inside} of {len(rows)} real figures inside the band")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m simulator.band RUN_DIR ...`: the containment table of real replays."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m simulator.band",
        description="Simulate real replays with the band (shipped profile of each replay's engine) and "
        "say which real TTFT/E2E p50/p99 fall inside it.",
    )
    parser.add_argument("runs", nargs="+", help="replay folders (e.g. simulator/data/validation/...)")
    args = parser.parse_args(argv)
    rows = [row for run in args.runs for row in replay_containment(run)]
    print(format_containment(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
