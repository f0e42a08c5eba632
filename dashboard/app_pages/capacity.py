"""Capacity plan page: latency SLOs and a target request rate in, the cheapest configuration out
(`simulator.plan.find_plan`), with its cost per hour and per million tokens, the alternatives and
why they lose, and a Pareto chart of cost against p99 latency over every simulated point.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Executor

import pandas as pd
import streamlit as st

from dashboard import figures, logic, state
from simulator.models import preset_names
from simulator.plan import row_latency
from traces import Trace

TPS = [1, 2, 4, 8]
BLOCK_SIZES = [8, 16, 32, 64, 128, 256]
PARETO_METRICS = {"E2E": "e2e_p99_s", "TTFT": "ttft_p99_s", "TPOT": "tpot_p99_s"}
CANDIDATE_FORMATS = {
    "$/h": "${:,.2f}",
    "$/M output tokens": "${:,.3f}",
    "TTFT p99 (s)": "{:,.3f}",
    "TPOT p99 (ms)": "{:,.1f}",
    "E2E p99 (s)": "{:,.2f}",
    "steps outside fit": "{:.1%}",
}


@st.cache_data(show_spinner=False, max_entries=16)
def cached_plan(
    trace_id: tuple,
    _trace: Trace,
    _executor: Executor | None,
    model_key: str,
    latency: str,
    limits: tuple[float | None, float | None, float | None],
    rate: float,
    gpus: tuple[str, ...],
    tps: tuple[int, ...],
    block_sizes: tuple[int, ...],
    seqs: tuple[int, ...],
    tokens: tuple[int, ...],
    max_gpus: int,
    router: str,
    mix_latency_models: bool,
) -> logic.PlanOutcome:
    """`logic.run_plan`, cached on everything but the trace object and the worker pool."""
    objectives = logic.plan_objectives(*limits)
    return logic.run_plan(
        _trace,
        model_key,
        latency,
        objectives,
        rate,
        gpus,
        tps,
        block_sizes,
        seqs,
        tokens,
        max_gpus,
        {"router": router},
        _executor,
        mix_latency_models=mix_latency_models,
    )


def _index(options: list[str], preferred: str) -> int:
    return options.index(preferred) if preferred in options else 0


st.title("Capacity plan")
st.caption(
    "The cheapest cluster that serves the trace, rescaled to a target rate, within p99 latency objectives. "
    "Prices per GPU-hour come from simulator/data/gpus.json."
)
with st.form("cap_form"):
    c = st.columns([2, 1, 2])
    with c[0]:
        trace_key, full_trace = state.trace_picker("Trace", "cap_trace")
    models = preset_names()
    model_key = c[1].selectbox("Model", models, index=_index(models, "qwen3-8b"), key="cap_model")
    with c[2]:
        latency = st.selectbox(
            "Latency model",
            [logic.LATENCY_AUTO, logic.LATENCY_ROOFLINE],
            format_func=lambda o: {
                "auto": "auto: shipped fitted profile where one matches, else roofline"
            }.get(o, "roofline (analytic)"),
            key="cap_latency",
        )
        mix = st.toggle(
            "Mix latency models",
            value=False,
            key="cap_mix",
            help="Simulate each option on the shipped fitted profile where there is one and on the roofline "
            "elsewhere. Off (kvplan plan's default): when only some options have a profile, every option "
            "runs on the roofline, so the ranking compares like with like.",
        )
    c = st.columns(4)
    rate = c[0].number_input("Target rate (req/s)", 0.01, 100_000.0, 60.0, key="cap_rate")
    window = c[1].number_input(
        "Replay window (s, 0 = whole trace)",
        0.0,
        1e7,
        120.0,
        step=30.0,
        key="cap_window",
        help="Each candidate replays this many seconds of the trace (before rescaling): shorter is faster.",
    )
    max_gpus = c[2].number_input("GPU budget", 1, 1024, 16, key="cap_max_gpus")
    router = c[3].selectbox("Router", ["least_outstanding", "round_robin", "prefix_aware"], key="cap_router")
    c = st.columns(3)
    ttft = c[0].number_input("p99 TTFT objective (s)", 0.0, 600.0, 2.0, 0.1, key="cap_ttft", help="0 = none")
    tpot = c[1].number_input(
        "p99 TPOT objective (ms)", 0.0, 10_000.0, 80.0, 5.0, key="cap_tpot", help="0 = none"
    )
    e2e = c[2].number_input("p99 E2E objective (s)", 0.0, 3600.0, 0.0, 1.0, key="cap_e2e", help="0 = none")
    gpus_all = logic.gpu_names()
    c = st.columns(2)
    gpus = c[0].multiselect(
        "GPU types", gpus_all, default=[g for g in ("H100-SXM", "H200-SXM") if g in gpus_all], key="cap_gpus"
    )
    tps = c[1].multiselect("TP degrees", TPS, default=[1, 2], key="cap_tps")
    with st.expander("Batch limits and block sizes to consider"):
        c = st.columns(3)
        block_sizes = c[0].multiselect("Block sizes", BLOCK_SIZES, default=[16], key="cap_blocks")
        seqs_text = c[1].text_input("max_num_seqs (comma-separated)", "256", key="cap_seqs")
        tokens_text = c[2].text_input("max_num_batched_tokens (comma-separated)", "16384", key="cap_tokens")
    submitted = st.form_submit_button("Plan", type="primary")

if submitted:
    st.session_state["cap_planned"] = True
if not st.session_state.get("cap_planned"):
    st.info(
        "Set the objectives and the target rate, then press **Plan**. Each candidate configuration is "
        "simulated; the replica count of every GPU type and TP degree is searched (about 10–60 s)."
    )
    st.stop()

try:
    seqs = tuple(int(x) for x in seqs_text.split(",") if x.strip())
    tokens = tuple(int(x) for x in tokens_text.split(",") if x.strip())
    limits = (ttft or None, tpot / 1e3 if tpot else None, e2e or None)
    logic.plan_objectives(*limits)
    if not (gpus and tps and block_sizes and seqs and tokens):
        raise ValueError("choose at least one GPU type, TP degree, block size and batch limit")
except ValueError as e:
    st.error(f"Cannot plan: {e}")
    st.stop()

trace = logic.prepare_trace(full_trace, window or None)
t0 = time.perf_counter()
with st.spinner(f"Planning on {len(trace):,} requests at {rate:g} req/s…"):
    try:
        outcome = state.with_pool(
            lambda pool: cached_plan(
                (trace_key, window or None),
                trace,
                pool,
                model_key,
                latency,
                limits,
                float(rate),
                tuple(gpus),
                tuple(int(t) for t in tps),
                tuple(int(b) for b in block_sizes),
                seqs,
                tokens,
                int(max_gpus),
                router,
                bool(mix),
            )
        )
    except ValueError as e:
        st.error(f"Cannot plan: {e}")
        st.stop()
result = outcome.result
st.caption(
    f"{result.num_simulations} simulations of {outcome.num_requests:,} requests "
    f"(window {window:g} s of {full_trace.name} at {rate:g} req/s) in {time.perf_counter() - t0:.1f} s; cached."
)

if outcome.latency_note:
    st.info(outcome.latency_note)
mixed = logic.plan_latency_warning(result)
if mixed:
    st.warning(
        "The candidates were simulated on different latency models (a fitted profile for some, the "
        "roofline for others: see the latency model column), so the ranking partly compares the models. "
        "Pick the roofline for all, or GPUs, TP degrees and block sizes with a shipped profile each."
    )
best = result.best
if best is not None:
    row = best.row or {}
    st.success(
        f"**Recommended: {best.replicas} x {best.option.gpu} at TP {best.option.tp}** "
        f"({best.num_gpus} GPUs, block {best.option.block_size}, max_num_seqs {best.option.max_num_seqs}, "
        f"max_num_batched_tokens {best.option.max_num_batched_tokens}; latency {row_latency(row)})"
    )
    m = st.columns(5)
    m[0].metric("Cost per hour", f"${best.cost_per_hour:,.2f}")
    per_m = row.get("cost_per_million_output_tokens_usd", math.inf)
    m[1].metric("Per M output tokens", "n/a" if not math.isfinite(per_m) else f"${per_m:,.3f}")
    m[2].metric("p99 TTFT", f"{row.get('ttft_p99_s', math.nan):.3f} s")
    m[3].metric("p99 TPOT", f"{row.get('tpot_p99_s', math.nan) * 1e3:.1f} ms")
    m[4].metric("p99 E2E", f"{row.get('e2e_p99_s', math.nan):.2f} s")
else:
    msg = f"No configuration meets the objectives within {result.max_gpus} GPUs."
    if result.closest is not None:
        c = result.closest
        msg += f" Closest: {c.replicas} x {c.option.gpu} TP {c.option.tp}, which misses: " + "; ".join(
            str(v) for v in c.failed
        )
    st.warning(msg)

cands = logic.plan_candidates(result)
st.subheader("Candidates")
st.dataframe(
    cands.style.format({k: v for k, v in CANDIDATE_FORMATS.items() if k in cands}, na_rep="–"),
    hide_index=True,
    key="cap_candidates",
)

points = outcome.points
metric = st.radio("Pareto latency", list(PARETO_METRICS), horizontal=True, key="cap_pareto_metric")
column = PARETO_METRICS[metric]
if not points.empty:
    points = points.assign(pareto=logic.pareto_mask(points["cost_per_hour_usd"], points[column]))
    rec = None
    if best is not None:
        match = points[
            (points["gpu"] == best.option.gpu)
            & (points["tp"] == best.option.tp)
            & (points["replicas"] == best.replicas)
            & (points["block_size"] == best.option.block_size)
            & (points["max_num_seqs"] == best.option.max_num_seqs)
            & (points["max_num_batched_tokens"] == best.option.max_num_batched_tokens)
        ]
        rec = int(match.index[0]) if len(match) else None
    st.plotly_chart(figures.pareto_figure(points, column, metric, rec), key="cap_pareto")
    with st.expander(f"All {len(points)} simulated points"):
        cols = ["label", "latency model", "meets_slo", "cost_per_hour_usd"]
        cols += ["cost_per_million_output_tokens_usd", "ttft_p99_s", "tpot_p99_s", "e2e_p99_s"]
        cols += ["output_tok_s", "num_preemptions", "failed"]
        st.dataframe(pd.DataFrame(points[[c for c in cols if c in points]]), hide_index=True)
else:
    st.warning("No configuration could be simulated: see the candidates' reasons above.")
