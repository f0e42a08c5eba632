"""Simulated against real: re-simulate a real engine replay and report how far the metrics differ.

A replay folder (written by `kvplan replay`) holds run.json (the configuration), trace.parquet (the
requests as replayed), requests.parquet (per-request real timings) and steps.parquet (the engine's
step records). `validate_run` simulates the same trace on the same configuration with a profile;
given a second real run of the same trace and configuration (`repeat_dir`) it also reports how far
the real system differs from itself, the floor under any simulator's error on that traffic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import numpy as np
import pandas as pd

from engine.model_spec import ModelSpec
from simulator.config import SimConfig
from simulator.defaults import default_latency_file, profile_of_engine
from simulator.latency.base import StepShape
from simulator.latency.profile import check_profile_file, load_latency_model
from simulator.metrics import add_latencies, summarize
from simulator.run import SimResult, run_simulation

# metric -> allowed |relative error| (the calibration issue's targets)
TARGETS = {
    "throughput_rps": 0.03,
    "output_tok_s": 0.03,
    "tpot_mean_s": 0.03,
    "e2e_p50_s": 0.05,
    "e2e_p99_s": 0.05,
    "ttft_p50_s": 0.10,
    "ttft_p99_s": 0.10,
}
REPORTED = (
    *TARGETS,
    "ttft_mean_s",
    "ttft_p90_s",
    "tpot_p50_s",
    "tpot_p90_s",
    "tpot_p99_s",
    "e2e_mean_s",
    "e2e_p90_s",
)
REQUIRED_FILES = ("run.json", "trace.parquet", "requests.parquet")
# run.json fields a repeat must share with the run it repeats (besides the trace itself)
REPEAT_FIELDS = (
    "model",
    "block_size",
    "num_kv_blocks",
    "enable_prefix_caching",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "policy",
)


@dataclass
class Validation:
    run_dir: Path
    table: pd.DataFrame  # metric, real, sim, rel_error, target, ok (+ repeat, repeat_error)
    real: pd.DataFrame  # per-request real timings
    sim: SimResult
    steps: pd.DataFrame | None  # real step records with predicted_s and residual columns

    @property
    def passed(self) -> bool:
        return bool(self.table["ok"].dropna().all())


def read_run(run_dir: str | Path) -> tuple[dict, object, pd.DataFrame, pd.DataFrame | None]:
    """(run.json, trace, per-request frame, step records or None) of a replay folder."""
    import traces

    root = Path(run_dir)
    missing = [f for f in REQUIRED_FILES if not (root / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{root}: not a replay folder, missing {', '.join(missing)}")
    meta = json.loads((root / "run.json").read_text())
    trace = traces.Trace.from_parquet(root / "trace.parquet")
    requests = add_latencies(pd.read_parquet(root / "requests.parquet"))
    steps = pd.read_parquet(root / "steps.parquet") if (root / "steps.parquet").is_file() else None
    return meta, trace, requests, steps


def sim_config_for(meta: dict) -> SimConfig:
    """The simulated twin of a real run's configuration (same KV blocks the engine had)."""
    try:
        return SimConfig(
            model=ModelSpec(**meta["model"]),
            gpu=meta.get("gpu", "H200"),
            tensor_parallel_size=int(meta.get("tensor_parallel_size", 1)),
            block_size=int(meta["block_size"]),
            num_kv_blocks=int(meta["num_kv_blocks"]),
            enable_prefix_caching=bool(meta["enable_prefix_caching"]),
            max_num_seqs=int(meta["max_num_seqs"]),
            max_num_batched_tokens=int(meta["max_num_batched_tokens"]),
            max_model_len=int(meta["max_model_len"]),
            policy=meta["policy"],
            async_scheduling=bool(meta.get("async_scheduling", False)),
        )
    except KeyError as e:
        raise ValueError(f"run.json: missing field {e.args[0]!r}") from None


def compare(real: dict, sim: dict) -> pd.DataFrame:
    rows = []
    for metric in REPORTED:
        r, s = real.get(metric, np.nan), sim.get(metric, np.nan)
        err = (s - r) / r if r else np.nan
        target = TARGETS.get(metric)
        ok = None if target is None or np.isnan(err) else bool(abs(err) <= target)
        rows.append({"metric": metric, "real": r, "sim": s, "rel_error": err, "target": target, "ok": ok})
    return pd.DataFrame(rows)


def measured_column(steps: pd.DataFrame, latency=None) -> str:
    """The measured step time that `latency` predicts: the column its profile was fitted on, when it
    has one and the records carry it (shipped profiles fit wall_time_s), else gpu_time_s when present,
    else wall_time_s."""
    fitted_on = (
        getattr(getattr(latency, "profile", None), "target", None)
        or getattr(getattr(latency, "summary", None), "target", None)
        or getattr(latency, "target", None)
    )
    for column in (fitted_on, "gpu_time_s", "wall_time_s"):
        if column and column in steps.columns and steps[column].notna().any():
            return column
    raise ValueError("step records: no gpu_time_s or wall_time_s column")


def step_residuals(steps: pd.DataFrame, latency) -> pd.DataFrame:
    """Real step records with the latency model's prediction and relative residual per step, against
    the measured time the model predicts (`measured_column`). Steps the records mark `overlapped`
    (async scheduling) are predicted by the model's overlapped view, where it has one."""
    df = steps.copy()
    target = measured_column(df, latency)
    view = getattr(latency, "overlapped_model", None)
    ahead = view() if view is not None else latency
    overlapped = df["overlapped"].fillna(False).astype(bool) if "overlapped" in df else [False] * len(df)
    df["predicted_s"] = [
        (ahead if o else latency).predict(StepShape.of(row)).total
        for row, o in zip(df.itertuples(index=False), overlapped)
    ]
    df["measured_s"] = df[target]
    df["residual"] = (df["predicted_s"] - df["measured_s"]) / df["measured_s"]
    return df


STEP_ERROR_COLUMNS = ("kind", "steps", "median |rel. error|", "p90 |rel. error|", "bias", "summed error")


def step_error_by_kind(steps: pd.DataFrame | None) -> pd.DataFrame:
    """Per step kind of `step_residuals` rows: steps, median and p90 |relative residual|, the mean
    relative residual (bias), and the summed error sum(predicted) / sum(measured) - 1: the share of
    its measured time that the kind gains or loses in a simulated run."""
    if steps is None or steps.empty:
        return pd.DataFrame(columns=list(STEP_ERROR_COLUMNS))
    g = steps.assign(abs_rel=steps["residual"].abs()).groupby("kind")
    out = pd.DataFrame(
        {
            "steps": g.size(),
            "median |rel. error|": g["abs_rel"].median(),
            "p90 |rel. error|": g["abs_rel"].quantile(0.9),
            "bias": g["residual"].mean(),
            "summed error": g["predicted_s"].sum() / g["measured_s"].sum() - 1.0,
        }
    ).reset_index()
    return out[list(STEP_ERROR_COLUMNS)]


def validate_run(
    run_dir: str | Path, profile: str | Path | None, repeat_dir: str | Path | None = None
) -> Validation:
    meta, trace, real, steps = read_run(run_dir)
    repeat = read_repeat(repeat_dir, meta, trace) if repeat_dir is not None else None  # before simulating
    config = sim_config_for(meta)
    latency = load_latency_model(
        profile, config.model, config.gpu, config.tensor_parallel_size, config.block_size
    )
    sim = run_simulation(trace, config, profile=profile, latency=latency)  # profile: named in its summary
    real_summary = summarize(real)
    table = compare(real_summary, sim.summary)
    if repeat is not None:
        table = add_repeat(table, real_summary, repeat)
    residuals = step_residuals(steps, latency) if steps is not None and len(steps) else None
    return Validation(Path(run_dir), table, real, sim, residuals)


def read_repeat(repeat_dir: str | Path, meta: dict, trace) -> dict:
    """The summary of another real run of the same trace and configuration; a clear error naming
    the folder and what differs when it is not one."""
    repeat_meta, repeat_trace, repeat_real, _ = read_run(repeat_dir)
    for field in REPEAT_FIELDS:
        if repeat_meta.get(field) != meta.get(field):
            raise ValueError(
                f"{Path(repeat_dir) / 'run.json'}: {field} is {repeat_meta.get(field)!r}, the run it "
                f"repeats has {meta.get(field)!r}"
            )
    ours, theirs = trace.df, repeat_trace.df
    same = len(ours) == len(theirs) and all(
        np.array_equal(ours[c].to_numpy(), theirs[c].to_numpy())
        for c in ("request_id", "arrival_s", "prompt_len", "output_len")
    )
    if not same:
        raise ValueError(f"{Path(repeat_dir) / 'trace.parquet'}: not the trace of the run it repeats")
    return summarize(repeat_real)


def add_repeat(table: pd.DataFrame, real: dict, repeat: dict) -> pd.DataFrame:
    """`table` with each metric of the repeat run, its relative difference from the real run, and
    `in_band`: a targeted metric met, or simulated within its target of the repeat or between them."""
    out = table.copy()
    out["repeat"] = [repeat.get(m, np.nan) for m in out["metric"]]
    base = out["real"].replace(0, np.nan)
    out["repeat_error"] = (out["repeat"] - base) / base
    out["in_band"] = [in_band(r.real, r.repeat, r.sim, r.target) for r in out.itertuples(index=False)]
    return out


def in_band(real: float, repeat: float, sim: float, target: float | None) -> bool | None:
    """Whether `sim` is inside the band two real runs of one configuration span (`real` and `repeat`,
    either end widened by `target`, relative); None for a metric without a target or a value."""
    if target is None or pd.isna(target) or not all(np.isfinite([real, repeat, sim])):
        return None
    lo, hi = min(real, repeat), max(real, repeat)
    return bool(lo - abs(lo) * target <= sim <= hi + abs(hi) * target)


def format_table(v: Validation) -> str:
    from simulator.run import latency_label

    repeat = "repeat_error" in v.table.columns
    s = v.sim.summary
    lines = [f"latency: {latency_label(s.get('latency_model'), s.get('profile'))}"]
    head = f"{'metric':<16}{'real':>12}{'sim':>12}{'error':>9}{'target':>8}  ok"
    lines.append(head + (f"  {'repeat':>10}{'real vs real':>14}  band" if repeat else ""))
    for r in v.table.itertuples(index=False):
        target = f"{r.target:.0%}" if pd.notna(r.target) else "-"
        ok = "-" if r.ok is None or pd.isna(r.ok) else ("yes" if r.ok else "NO")
        line = f"{r.metric:<16}{r.real:>12.4g}{r.sim:>12.4g}{r.rel_error:>+9.1%}{target:>8}  {ok:<3}"
        if repeat:
            band = "-" if r.in_band is None or pd.isna(r.in_band) else ("yes" if r.in_band else "NO")
            line += f"{r.repeat:>10.4g}{r.repeat_error:>+14.1%}  {band}"
        lines.append(line.rstrip())
    if v.steps is not None:
        res = v.steps["residual"].abs()
        lines.append(
            f"\nstep-time error: median {res.median():.1%}, p90 {res.quantile(0.9):.1%} over {len(res)} steps"
        )
        for r in step_error_by_kind(v.steps).itertuples(index=False):
            lines.append(
                f"  {r.kind:<8}{r.steps:>7} steps  median {r[2]:.1%}, p90 {r[3]:.1%}, "
                f"summed {r[5]:+.1%} of their measured time"
            )
    ahead = overlapped_steps(v)
    if ahead is not None:
        lines.append(
            f"decode steps scheduled ahead (async scheduling): real {ahead['real']:,}, "
            f"simulated {ahead['sim']:,}"
        )
    return "\n".join(lines)


def overlapped_steps(v: Validation) -> dict[str, int] | None:
    """Decode steps scheduled while the step before them ran, {real, sim}: for an async-scheduling
    replay whose step records mark them (None otherwise)."""
    simulated = v.sim.summary.get("sim_overlapped_steps")
    if simulated is None or v.steps is None or "overlapped" not in v.steps.columns:
        return None
    return {"real": int(v.steps["overlapped"].fillna(False).astype(bool).sum()), "sim": int(simulated)}


def write_report(v: Validation, out_dir: str | Path) -> Path:
    """validation.json, sim_requests.parquet and report.html (plotly) under `out_dir`."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    v.sim.requests.to_parquet(out / "sim_requests.parquet", index=False)
    by_kind = step_error_by_kind(v.steps)
    payload = {
        "run_dir": str(v.run_dir),
        "passed": v.passed,
        "metrics": v.table.to_dict(orient="records"),
        "step_error_by_kind": by_kind.to_dict(orient="records"),
        **({"overlapped_steps": ahead} if (ahead := overlapped_steps(v)) is not None else {}),
    }
    (out / "validation.json").write_text(json.dumps(payload, indent=2, default=float) + "\n")
    merged = v.real.merge(v.sim.requests, on="request_id", suffixes=("_real", "_sim"))
    fig = make_subplots(rows=1, cols=3, subplot_titles=("TTFT (s)", "E2E (s)", "step time residual"))
    for col, name in ((1, "ttft_s"), (2, "e2e_s")):
        fig.add_trace(
            go.Scattergl(x=merged[f"{name}_real"], y=merged[f"{name}_sim"], mode="markers", name=name), 1, col
        )
    if v.steps is not None:
        fig.add_trace(go.Histogram(x=v.steps["residual"], name="residual", nbinsx=60), 1, 3)
    fig.update_layout(title=f"simulated vs real: {v.run_dir.name}", height=450)
    table_html = v.table.to_html(index=False, float_format=lambda x: f"{x:.4g}")
    if not by_kind.empty:
        table_html += "<h3>step-time error by kind</h3>" + by_kind.to_html(
            index=False, float_format=lambda x: f"{x:.3g}"
        )
    (out / "report.html").write_text(
        f"<html><body><h2>kvplan validate</h2>{table_html}{fig.to_html(full_html=False, include_plotlyjs=True)}</body></html>"
    )
    return out


# ---- several runs x several profiles: which profile predicts the real runs best --------------------

MATRIX_SUMMARY = ("tpot_mean_s", "ttft_p50_s")  # median signed error per profile under the table


def validation_matrix(
    runs: list[str | Path], profiles: list[str | Path | None], progress: bool = True
) -> pd.DataFrame:
    """`validate_run` of every run with every profile (None: roofline): one row per pair with the
    targets it meets (of `TARGETS`), each target's relative error and the median |step error|."""
    from tqdm import tqdm

    pairs = list(product(zip(profiles, path_labels(profiles)), zip(runs, path_labels(runs))))
    rows = []
    for (profile, profile_label), (run, run_label) in tqdm(
        pairs, desc="validating", unit="run", disable=not progress
    ):
        v = validate_run(run, profile)
        table = v.table.set_index("metric")
        row = {"run": run_label, "profile": profile_label}
        row["targets_met"] = int(table.loc[list(TARGETS), "ok"].astype(bool).sum())
        row.update({m: float(table.loc[m, "rel_error"]) for m in TARGETS})
        row["step_error_median"] = (
            float(v.steps["residual"].abs().median()) if v.steps is not None else np.nan
        )
        rows.append(row)
    return pd.DataFrame(rows)


def path_labels(paths: list[str | Path | None]) -> list[str]:
    """Short distinct names: each path's last part, with as many of its parent folders as it takes to
    tell it from every other path (None is 'roofline'; a path given twice keeps its full form)."""
    parts = [Path(p).resolve().parts if p is not None else ("roofline",) for p in paths]
    labels = []
    for i, mine in enumerate(parts):
        others = [x for j, x in enumerate(parts) if j != i]
        depth = 1
        while depth < len(mine) and any(x[-depth:] == mine[-depth:] for x in others):
            depth += 1
        labels.append("/".join(mine[-depth:]))
    return labels


def format_matrix(matrix: pd.DataFrame) -> str:
    """Targets met per run (rows) and profile (columns), the totals, and each profile's median error
    of the `MATRIX_SUMMARY` metrics over the runs."""
    met = matrix.pivot(index="run", columns="profile", values="targets_met")
    met = met.loc[list(dict.fromkeys(matrix["run"])), list(dict.fromkeys(matrix["profile"]))]
    width = max(12, *(len(c) + 2 for c in met.columns))
    first = max(24, *(len(r) + 2 for r in met.index))
    lines = [f"{f'targets met (of {len(TARGETS)})':<{first}}" + "".join(f"{c:>{width}}" for c in met.columns)]
    lines += [f"{r:<{first}}" + "".join(f"{int(v):>{width}}" for v in met.loc[r]) for r in met.index]
    lines.append(
        f"{f'total (of {len(TARGETS) * len(met)})':<{first}}"
        + "".join(f"{int(v):>{width}}" for v in met.sum())
    )
    for metric in MATRIX_SUMMARY:
        medians = matrix.groupby("profile", sort=False)[metric].median()
        label = f"median error {metric}"
        lines.append(f"{label:<{first}}" + "".join(f"{medians[c]:>+{width}.1%}" for c in met.columns))
    return "\n".join(lines)


def validate_profile(name: str | None, run_dir: str | Path) -> Path | None:
    """A validate --profile: a file, 'roofline' (also the default) or 'auto' (the shipped profile
    of the replay's model, GPU, TP, block size and scheduling, recorded on an engine of the replay's
    choices (`profile_of_engine`: a superseded one where the engine has changed since), else the
    transferred model's file)."""
    if name in (None, "roofline"):
        return None
    if name == "auto":
        meta = read_run(run_dir)[0]
        config = sim_config_for(meta)
        path = default_latency_file(
            config.model.name,
            config.gpu,
            config.block_size,
            config.tensor_parallel_size,
            config.async_scheduling,
        )
        return profile_of_engine(path, meta)
    return check_profile_file(name)
