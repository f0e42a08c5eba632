"""The fidelity scoreboard: every replay of a suite re-simulated on the shipped profile of its engine.

A suite (JSON, `simulator/data/validation/suite.json`) lists replay folders by trace family, each
declared held-out or not before a profile it validates is fitted; a held-out replay whose results
were first seen (its `seen` time) before a profile was fitted is not held out for that profile, which
may have been designed with them in view. Per replay: the targets met, the signed error of E2E, TTFT
and TPOT at mean, p90 and p99 and their mean absolute error, and, where a repeat exists, the real
engine's own spread and the targets inside the band of the two real runs. Per family, SLO of the
suite (`slo`, one or a list) and engine configuration (the family's `base`, one replay or a list, one
per engine): the highest rate that meets it, simulated on the base's profile, against the real
replays of that engine on either side of it, and how the replays past it score.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import pandas as pd

from simulator.defaults import engine_choices
from simulator.plan import parse_objectives, search_max_scale, violations
from simulator.validate import TARGETS, read_run, sim_config_for, validate_run

MAX_KNEE = 256.0  # the highest rate scale a knee is searched to
SCORED = tuple(f"{m}_{s}_s" for m in ("e2e", "ttft", "tpot") for s in ("mean", "p90", "p99"))


@dataclass(frozen=True)
class SuiteReplay:
    run: Path
    family: str
    rate_scale: float
    load: str
    held_out: bool
    repeat: Path | None = None
    seen: datetime | None = None  # when its results were first compared with a simulation


@dataclass(frozen=True)
class Suite:
    path: Path
    slos: tuple[str, ...]  # each gives every family a knee; the first is the suite's own
    # family -> the replays whose trace (at rate scale 1) a knee is searched on: one per engine
    # configuration (`engine_key`), each bracketed by the family's real replays of its own engine
    families: dict[str, tuple[Path, ...]]
    replays: tuple[SuiteReplay, ...]

    @property
    def slo(self) -> str:
        return self.slos[0]


def load_suite(path: str | Path) -> Suite:
    """A suite file; replay folders are relative to it. Errors name the file and the entry."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
        root = path.parent
        replays = tuple(
            SuiteReplay(
                root / r["run"],
                r["family"],
                float(r["rate_scale"]),
                r["load"],
                bool(r["held_out"]),
                root / r["repeat"] if r.get("repeat") else None,
                datetime.fromisoformat(r["seen"]) if r.get("seen") else None,
            )
            for r in raw["replays"]
        )
        families = {name: _bases(root, f["base"]) for name, f in raw["families"].items()}
        slo = raw.get("slo", "ttft_p99=1s")
        suite = Suite(path, (slo,) if isinstance(slo, str) else tuple(slo), families, replays)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a scoreboard suite ({type(e).__name__}: {e})") from None
    for slo in suite.slos:
        try:
            parse_objectives(slo)
        except (ValueError, AttributeError, TypeError) as e:
            raise ValueError(f"{path}: 'slo' {slo!r}: {e}") from None
    if not suite.slos:
        raise ValueError(f"{path}: 'slo' lists no objective")
    for r in replays:
        if r.seen is not None and r.seen.tzinfo is None:
            raise ValueError(f"{path}: replay {r.run.name}: 'seen' needs a UTC offset, e.g. +00:00")
        if r.family not in families:
            raise ValueError(f"{path}: replay {r.run.name}: family {r.family!r} is not in 'families'")
    return suite


def _bases(root: Path, base: str | list[str]) -> tuple[Path, ...]:
    """A family's `base`: one replay folder, or a list of them (one per engine configuration)."""
    names = [base] if isinstance(base, str) else list(base)
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"a family's 'base' is a replay folder or a list of them, got {base!r}")
    return tuple(root / n for n in names)


def held_out_for(replay: SuiteReplay, profile: Path | None) -> bool:
    """Whether `replay` is held out for `profile`: declared so, and not seen before the profile was
    fitted (its `created` time; a profile without one is not held out from it; the roofline, fitted
    on nothing, always is)."""
    if not replay.held_out or replay.seen is None or profile is None:
        return replay.held_out
    created = json.loads(Path(profile).read_text()).get("created")
    return created is not None and datetime.fromisoformat(created) < replay.seen


def score_replay(replay: SuiteReplay, profile: Path | None) -> dict:
    """One replay's row: targets met, signed errors of `SCORED`, their mean absolute error, and where a
    repeat exists the largest real run-to-run difference of the targeted metrics and the targets
    inside the band of the two real runs (`in_band`; NaN without a repeat)."""
    v = validate_run(replay.run, profile, replay.repeat)
    table = v.table.set_index("metric")
    err = table["rel_error"]
    row = {
        "family": replay.family,
        "run": replay.run.name,
        "load": replay.load,
        "rate_scale": replay.rate_scale,
        "held_out": held_out_for(replay, profile),
        "targets_met": int(table.loc[list(TARGETS), "ok"].astype(bool).sum()),
        **{m: float(err.get(m, np.nan)) for m in SCORED},
    }
    row["mape"] = float(np.nanmean(np.abs([row[m] for m in SCORED])))
    repeated = "repeat_error" in table
    row["repeat_spread"] = float(table.loc[list(TARGETS), "repeat_error"].abs().max()) if repeated else np.nan
    row["band_met"] = float(table.loc[list(TARGETS), "in_band"].astype(bool).sum()) if repeated else np.nan
    row.update({f"real_{m}": float(table.loc[m, "real"]) for m in table.index})
    return row


def base_trace(run_dir: Path, rate_scale: float):
    """A replay's trace at rate scale 1: its arrivals stretched back by the scale it was served at."""
    meta, trace, _, _ = read_run(run_dir)
    df = trace.df.copy()
    df["arrival_s"] = df["arrival_s"] * rate_scale
    return meta, trace.with_frame(df)


def knee_search(base_run: Path, base_scale: float, profile: Path | None, slo: str):
    """The search (`plan.ScaleSearch`) for the highest rate scale of `base_run`'s trace (at scale 1)
    whose simulation meets `slo`, on the replay's own configuration (its KV blocks included): the
    knee is its `lo`; `hi` is None where no scale up to MAX_KNEE missed."""
    from simulator.run import run_simulation
    from traces.transforms import scale_rate

    meta, trace = base_trace(base_run, base_scale)
    config = sim_config_for(meta)
    objectives = parse_objectives(slo)

    def feasible(scales: list[float]) -> list[bool]:
        out = []
        for x in scales:
            summary = run_simulation(scale_rate(trace, x), config, profile=profile).summary
            out.append(not violations(summary, objectives))
        return out

    return search_max_scale(feasible, start=base_scale, tolerance=0.02, max_scale=MAX_KNEE)


def engine_key(run_dir: Path) -> tuple:
    """What a replay's capacity depends on besides its traffic: model, GPU, TP, scheduling, KV cache
    and engine choices (its run.json; `engine_choices`). Only replays of one key bracket a knee."""
    meta = json.loads((run_dir / "run.json").read_text())
    return (meta["model"]["name"], *(str(meta.get(k)) for k in _ENGINE_KEY), *map(str, engine_choices(meta)))


_ENGINE_KEY = (
    "gpu", "tensor_parallel_size", "block_size", "num_kv_blocks", "enable_prefix_caching", "max_num_seqs",
    "max_num_batched_tokens", "max_model_len", "policy", "async_scheduling",
)  # fmt: skip


def family_rows(
    suite: Suite, rows: pd.DataFrame, profiles: dict[str, Path | None], searches: dict
) -> pd.DataFrame:
    """Per family and SLO of the suite (`slos`): the simulated knee (rate scale of its base window)
    and the real replays' bracket: the highest served scale whose real run met the SLO and the lowest
    that did not, among the family's replays of the base's model and engine configuration
    (`engine_key`); and those replays past the simulated knee: how many, their targets met, and for
    the ones with a repeat the targets inside the band of the two real runs. `searches`: each knee's
    `knee_search`, by (slo, base replay's name)."""
    out = []
    for slo, family, base_replay in knee_bases(suite):
        search = searches[(slo, base_replay.run.name)]
        out.append({"slo": slo, **_family_knee(suite, family, base_replay, slo, rows, profiles, search)})
    return pd.DataFrame(out)


def knee_bases(suite: Suite) -> list[tuple[str, str, SuiteReplay]]:
    """(slo, family, base replay) of each knee the suite asks for, in the order the table lists them."""
    out = []
    for slo in suite.slos:
        for family, bases in suite.families.items():
            mine = [r for r in suite.replays if r.family == family]
            for base in bases:
                base_replay = next((r for r in mine if r.run == base), None)
                if base_replay is None:
                    raise ValueError(
                        f"{suite.path}: family {family}: base {base.name!r} is not one of its replays"
                    )
                out.append((slo, family, base_replay))
    return out


def _family_knee(
    suite: Suite, family: str, base_replay: SuiteReplay, slo: str, rows: pd.DataFrame, profiles, search
) -> dict:
    key = engine_key(base_replay.run)
    mine = [r for r in suite.replays if r.family == family and engine_key(r.run) == key]
    knee = search.lo
    served = rows.set_index("run").loc[[r.run.name for r in mine]]
    scales = pd.Series({r.run.name: r.rate_scale for r in mine})
    met = np.logical_and.reduce([served[f"real_{o.key}"] <= o.limit_s for o in parse_objectives(slo)])
    passed, failed = scales[met], scales[~met]
    past = served[scales > knee] if knee is not None else served.iloc[:0]
    repeated = past[past["band_met"].notna()]
    return {
        "family": family,
        "base": base_replay.run.name,
        "base_profile": _name(profiles[base_replay.run.name]),
        "simulated_knee": knee,
        "knee_found": search.hi is not None,  # else no scale up to MAX_KNEE missed
        "real_passes_at": float(passed.max()) if len(passed) else np.nan,
        "real_fails_at": float(failed.min()) if len(failed) else np.nan,
        "num_bracketing": len(mine),
        "num_past_knee": len(past),
        "past_knee_met": int(past["targets_met"].sum()),
        "num_past_knee_repeated": len(repeated),
        "past_knee_band_met": int(repeated["band_met"].sum()),
    }


def run_suite(
    suite: Suite, profile_for, progress: bool = True, workers: int = 1
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per-replay rows, per-family rows); `profile_for(run_dir)` names each replay's profile. With
    `workers` > 1 the replays' scores and the knee searches run in a pool of that many processes
    (the same rows: every simulation is deterministic)."""
    from tqdm import tqdm

    if workers < 1:
        raise ValueError(f"workers: must be a positive integer, got {workers}")
    profiles = {r.run.name: profile_for(r.run) for r in suite.replays}
    bases = knee_bases(suite)
    # the knee searches (the longest) first, then every replay's score
    tasks = [(knee_search, (b.run, b.rate_scale, profiles[b.run.name], slo)) for slo, _, b in bases]
    tasks += [(score_replay, (r, profiles[r.run.name])) for r in suite.replays]
    with tqdm(total=len(tasks), desc="scoring", unit="sim", disable=not progress) as bar:
        results = _run_tasks(tasks, workers, bar)
    searches = {(slo, b.run.name): s for (slo, _, b), s in zip(bases, results)}
    rows = pd.DataFrame(
        [
            {**s, "profile": _name(profiles[r.run.name]), "shipped": is_shipped(profiles[r.run.name])}
            for r, s in zip(suite.replays, results[len(bases) :])
        ]
    )
    return rows, family_rows(suite, rows, profiles, searches)


def _run_tasks(tasks: list, workers: int, bar) -> list:
    """Each (function, args)'s result, in order: in this process (workers=1) or in a process pool."""
    if workers == 1:
        results = []
        for fn, args in tasks:
            results.append(fn(*args))
            bar.update()
        return results
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from simulator.sweep import pool_start_method

    pool = ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context(pool_start_method())
    )
    try:
        futures = [pool.submit(fn, *args) for fn, args in tasks]
        for future in futures:
            future.add_done_callback(lambda _: bar.update())
        return [f.result() for f in futures]
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)  # a bad replay or Ctrl-C: drop what is pending
        raise
    finally:
        pool.shutdown(wait=True)


def is_shipped(profile: Path | None) -> bool:
    """Whether a replay is scored on a profile that ships today (the roofline included), not on a
    superseded one kept for the replays of the engine it was fitted on."""
    return profile is None or Path(profile).parent.name != "superseded"


def _name(profile: Path | None) -> str:
    return "roofline" if profile is None else Path(profile).name


def _pct(x: float) -> str:
    return "-" if np.isnan(x) else f"{x:+.1%}"


def format_scoreboard(suite: Suite, rows: pd.DataFrame, families: pd.DataFrame) -> str:
    """The scoreboard as text: replays by family, the held-out totals, then each family's knee."""
    lines = [f"Fidelity scoreboard: {suite.path.name} (targets: {_targets()})", ""]
    head = f"{'family / replay':<44} {'load':<32} {'held':>4} {'met':>5}"
    head += (
        "".join(f" {m.removesuffix('_s'):>10}" for m in SCORED)
        + f" {'MAPE':>6} {'spread':>7} {'band':>5}  profile"
    )
    lines.append(head)
    for family, group in rows.groupby("family", sort=False):
        lines.append(family)
        for _, r in group.iterrows():
            line = f"  {r['run']:<42} {r['load'][:32]:<32} {'yes' if r['held_out'] else 'no':>4}"
            line += f" {r['targets_met']:>3}/{len(TARGETS)}" + "".join(f" {_pct(r[m]):>10}" for m in SCORED)
            band = "-" if np.isnan(r["band_met"]) else f"{int(r['band_met'])}/{len(TARGETS)}"
            line += f" {r['mape']:>6.1%} {_pct(r['repeat_spread']):>7} {band:>5}  {r['profile'].removesuffix('.json')}"
            lines.append(line)
    held = rows[rows["held_out"]]
    lines += ["", _total("held-out", held), _total("  on the shipped profiles", held[held["shipped"]])]
    if held["profile"].nunique() > 1:
        lines += [_total(f"  {name.removesuffix('.json')}", group) for name, group in held.groupby("profile")]
    lines += [_total("not held-out", rows[~rows["held_out"]]), ""]
    for i, (slo, group) in enumerate(families.groupby("slo", sort=False)):
        lines += [""] * (i > 0) + _knee_lines(slo, group)
    return "\n".join(lines)


def _knee_lines(slo: str, families: pd.DataFrame) -> list[str]:
    lines = [f"Knee ({slo}), as rate scales of each family's window:"]
    several = families["family"].duplicated(keep=False)  # a family with a base per engine
    for (_, f), named in zip(families.iterrows(), several):
        sim = _knee(f["simulated_knee"], f["knee_found"])
        engine = f"; on {f['base_profile'].removesuffix('.json')}" if named else ""
        lines.append(
            f"  {f['family']:<20} simulated {sim:<10} real: met at {_scale(f['real_passes_at'])}, "
            f"missed at {_scale(f['real_fails_at'])} ({f['num_bracketing']} real replays of its base's engine{engine})"
        )
        if f["num_past_knee"]:
            lines.append(_past_knee(f))
    return lines


def _knee(knee: float | None, found: bool) -> str:
    if knee is None:
        return "none found"
    return f"{knee:.3g}x" if found else f"over {knee:.3g}x"


def _past_knee(f: pd.Series) -> str:
    n, k = int(f["num_past_knee"]), len(TARGETS)
    line = f"  {'':<20} past it: {n} real {'replay meets' if n == 1 else 'replays meet'} {f['past_knee_met']} of {n * k} targets"
    if f["num_past_knee_repeated"]:
        r = int(f["num_past_knee_repeated"])
        line += f"; the {r} with a repeat {f['past_knee_band_met']} of {r * k} inside the band of their two real runs"
    return line


def _total(label: str, rows: pd.DataFrame) -> str:
    if not len(rows):
        return f"{label}: no replays"
    met, total = int(rows["targets_met"].sum()), len(rows) * len(TARGETS)
    return (
        f"{label}: {met} of {total} targets on {len(rows)} replays of {rows['family'].nunique()} families; "
        f"MAPE median {rows['mape'].median():.1%}"
    )


def _scale(x: float) -> str:
    return "no replay" if np.isnan(x) else f"{x:g}x"


def _targets() -> str:
    return ", ".join(f"{m.removesuffix('_s')} {t:.0%}" for m, t in TARGETS.items())
