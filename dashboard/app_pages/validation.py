"""Sim vs real page: validation runs (a `kvplan replay` folder, re-simulated here; a `kvplan validate`
report; or a folder with real_requests.parquet + sim_requests.parquet) -> per-metric error table
against the calibration targets (with, for a replay, another real run of the same trace beside it),
per-request scatter, and step-time residuals.
"""

from __future__ import annotations

import os
from pathlib import Path

import streamlit as st

import simulator
from dashboard import figures, logic
from simulator import validate
from simulator.defaults import SHIPPED_PROFILE_DIR

ROOT_ENV = "KVPLAN_VALIDATION_DIR"
NO_PROFILE = "roofline / none"  # the latency profile choice that is no profile
NO_REPEAT = "none"  # the repeat choice that is no repeat
KIND_NAMES = {
    logic.REPLAY: "replay folder (re-simulated here)",
    logic.REPORT: "kvplan validate report",
    logic.PAIR: "real + simulated request tables",
}
NONE_FOUND = """
**No validation runs found under `{root}`.**

A validation run is one of these folders (searched up to three levels down):

1. a **replay folder** written on a GPU by `kvplan replay`: `run.json`, `trace.parquet`,
   `requests.parquet` and `steps.parquet`. This page re-simulates its trace on its configuration.
   ```
   kvplan replay --model /path/to/checkpoint --trace azure_conv_2023 --limit 500 --out {root}/replay-1
   ```
2. the **report folder** of `kvplan validate --real {root}/replay-1 --profile PROFILE.json`
   (`validation.json` + `sim_requests.parquet`);
3. any folder with **`real_requests.parquet`** and **`sim_requests.parquet`** (per-request tables in
   the simulator's `requests.parquet` columns) and optionally **`steps.parquet`** (engine step
   records, with a `predicted_s` column or a `profile.json` beside them for the residuals).

Point the box above at another folder, or set `${env}` before `kvplan dashboard`.
"""


def _mtime(folder: Path) -> float:
    return max((p.stat().st_mtime for p in folder.iterdir() if p.is_file()), default=0.0)


@st.cache_data(show_spinner="Loading the validation run…", max_entries=16)
def cached_view(
    folder: str, kind: str, profile: str | None, repeat: str | None, mtime: float
) -> logic.ValidationView:
    """`logic.load_validation`, cached on the folder, its files' newest mtime, the profile and the
    repeat run."""
    return logic.load_validation(folder, kind, Path(profile) if profile else None, repeat)


st.title("Simulated against real")
SHIPPED_RUNS = Path(simulator.__file__).parent / "data" / "validation"
root = st.text_input(
    "Folder with validation runs",
    os.environ.get(ROOT_ENV) or ("runs" if Path("runs").is_dir() else str(SHIPPED_RUNS)),
    key="val_root",
    help=f"Default: ${ROOT_ENV}, else ./runs, else the H200 replays shipped in {SHIPPED_RUNS}",
)
runs = logic.find_validation_runs(root)
if not runs:
    st.info(NONE_FOUND.format(root=root, env=ROOT_ENV))
    st.stop()

labels = {str(p): f"{p.relative_to(root) if p != Path(root) else p.name} — {KIND_NAMES[k]}" for p, k in runs}
kinds = {str(p): k for p, k in runs}
c1, c2 = st.columns([2, 1])
folder = c1.selectbox("Run", list(labels), format_func=labels.__getitem__, key="val_run")
kind = kinds[folder]
profiles = [
    str(p)
    for p in logic.profile_files(
        SHIPPED_PROFILE_DIR, SHIPPED_PROFILE_DIR / "superseded", *(p for p, _ in runs)
    )
]
if st.session_state.get("val_profile_run") != folder:  # a new run: its own engine's shipped profile
    st.session_state["val_profile_run"] = folder
    match = logic.matching_profile(folder, kind)
    st.session_state["val_profile"] = (
        str(match) if match is not None and str(match) in profiles else NO_PROFILE
    )
if st.session_state.get("val_profile") not in (NO_PROFILE, *profiles):
    st.session_state["val_profile"] = NO_PROFILE
choice = c2.selectbox(
    "Latency profile (re-simulation and step residuals)",
    [NO_PROFILE, *profiles],
    format_func=lambda p: p if p == NO_PROFILE else Path(p).name,
    key="val_profile",
    help="Chosen for a replay whose engine a shipped profile describes (model, GPU, TP, block size, "
    "decode kernel, async scheduling); otherwise the roofline.",
)
profile = None if choice == NO_PROFILE else choice
repeats = [str(p) for p in logic.repeat_candidates(folder, runs)] if kind == logic.REPLAY else []
if st.session_state.get("val_repeat") not in (NO_REPEAT, *repeats):
    st.session_state["val_repeat"] = NO_REPEAT  # a repeat of the run shown before
repeat = None
if repeats:
    picked = st.selectbox(
        "Repeat run (real against real)",
        [NO_REPEAT, *repeats],
        format_func=lambda p: p if p == NO_REPEAT else labels[p],
        key="val_repeat",
        help="Another replay of the same trace and configuration: its metrics and its difference from "
        "this run join the table, the real system's own run-to-run spread beside the simulator's error.",
    )
    repeat = None if picked == NO_REPEAT else picked
view = None
if repeat is not None:
    try:
        view = cached_view(folder, kind, profile, repeat, _mtime(Path(folder)))
    except (ValueError, FileNotFoundError, KeyError) as e:
        st.error(f"Cannot compare with this repeat run, shown without it: {e}")
if view is None:
    try:
        view = cached_view(folder, kind, profile, None, _mtime(Path(folder)))
    except (ValueError, FileNotFoundError, KeyError) as e:
        st.error(f"Cannot load this validation run: {e}")
        st.stop()
if view.note:
    st.caption(view.note)

table = view.table
ok = table["ok"].dropna()
if len(ok):
    passed = int(ok.astype(bool).sum())
    (st.success if passed == len(ok) else st.warning)(
        f"{passed} of {len(ok)} targeted metrics are within their targets "
        f"({len(view.real):,} real and {len(view.sim):,} simulated requests)."
    )
st.subheader("Per-metric error")
shown = logic.validation_table(table)
st.dataframe(
    logic.table_style(shown, logic.VALIDATION_FORMATS),
    hide_index=True,
    key="val_table",
)
st.plotly_chart(
    figures.error_figure(table.assign(metric=shown["metric"])), key="val_errors", config=figures.CHART_CONFIG
)

st.subheader("Per request")
metric_label = st.radio("Metric", list(logic.LATENCY_METRICS.values()), horizontal=True, key="val_metric")
metric = {v: k for k, v in logic.LATENCY_METRICS.items()}[metric_label]
paired = logic.paired_requests(view.real, view.sim)
st.plotly_chart(
    figures.scatter_figure(paired, metric, metric_label), key="val_scatter", config=figures.CHART_CONFIG
)

st.subheader("Step-time residuals")
if view.steps is None or view.steps.empty:
    st.info(
        "No step records with predictions: add steps.parquet to the run and choose a latency profile "
        "(or give the records a predicted_s column)."
    )
else:
    st.dataframe(
        validate.step_error_by_kind(view.steps).style.format(logic.RESIDUAL_FORMAT),
        hide_index=True,
        key="val_residual_table",
    )
    st.plotly_chart(figures.residual_figure(view.steps), key="val_residuals", config=figures.CHART_CONFIG)
