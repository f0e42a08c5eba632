"""Capacity plan page: latency SLOs and a target request rate in, the cheapest configuration out
(`simulator.plan.find_plan`), with its cost per hour and per million tokens, the alternatives and
why they lose, and a Pareto chart of cost against p99 latency over every simulated point.
Each candidate simulates a fixed number of requests (the trace's first N, rescaled to the rate, as
`kvplan plan --limit N`); the plan runs only when Plan is pressed and stays on the page until the next.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Executor

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
    "offered (req/s)": "{:,.1f}",
    "served (req/s)": "{:,.1f}",
    "TTFT p99 (ms)": "{:,.0f}",
    "TPOT p99 (ms)": "{:,.1f}",
    "E2E p99 (ms)": "{:,.0f}",
    "steps outside fit": "{:.1%}",
}
RESULT = "cap_result"  # session_state: the last plan shown (its parameters, outcome and wall time)


@st.cache_resource
def plan_store() -> logic.ResultStore:
    """Plans already run in this server, by their parameters (Plan again with the same form: instant)."""
    return logic.ResultStore(max_entries=16)


def run_plan(
    _trace: Trace,
    _executor: Executor | None,
    on_point,
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
    """`logic.run_plan` with the page's arguments; `on_point(row, done)` as each simulation ends."""
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
        on_point=on_point,
    )


def _index(options: list[str], preferred: str) -> int:
    return options.index(preferred) if preferred in options else 0


st.title("Capacity plan")
st.caption(
    "The cheapest cluster that serves the trace, rescaled to a target rate, within p99 latency objectives "
    "and keeping up with that rate. Prices per GPU-hour come from simulator/data/gpus.json."
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
    num_requests = c[1].number_input(
        "Requests to simulate",
        0,
        10_000_000,
        logic.DEFAULT_PLAN_REQUESTS,
        step=500,
        key="cap_requests",
        help="Each candidate simulates the trace's first this many requests, rescaled to the target rate "
        "(kvplan plan --limit): the same traffic at any rate. 0 = the whole trace. More is slower and "
        "steadier; below 1,000 a p99 rests on the 10 worst requests or fewer.",
    )
    max_gpus = c[2].number_input("GPU budget", 1, 1024, 16, key="cap_max_gpus")
    router = c[3].selectbox("Router", ["least_outstanding", "round_robin", "prefix_aware"], key="cap_router")
    c = st.columns(3)
    ttft = c[0].number_input(
        "p99 TTFT objective (ms)", 0.0, 600_000.0, 2000.0, 100.0, key="cap_ttft", help="0 = none"
    )
    tpot = c[1].number_input(
        "p99 TPOT objective (ms)", 0.0, 10_000.0, 80.0, 5.0, key="cap_tpot", help="0 = none"
    )
    e2e = c[2].number_input(
        "p99 E2E objective (ms)", 0.0, 3_600_000.0, 0.0, 1000.0, key="cap_e2e", help="0 = none"
    )
    gpus_all = logic.gpu_names()
    c = st.columns(2)
    gpus = c[0].multiselect(
        "GPU types", gpus_all, default=[g for g in ("H100-SXM", "H200-SXM") if g in gpus_all], key="cap_gpus"
    )
    tps = c[1].multiselect("TP degrees", TPS, default=[1, 2], key="cap_tps")
    with st.expander("Batch limits and block sizes to consider"):
        c = st.columns(3)
        block_sizes = c[0].multiselect("Block sizes", BLOCK_SIZES, default=[16], key="cap_blocks")
        seqs_text = c[1].text_input("Max sequences per batch (comma-separated)", "256", key="cap_seqs")
        tokens_text = c[2].text_input("Max tokens per step (comma-separated)", "16384", key="cap_tokens")
    submitted = st.form_submit_button("Plan", type="primary")

progress_area = st.empty()  # the top of the results: a progress bar while a plan runs
shown = st.session_state.get(RESULT)
if not submitted and shown is None:
    st.info(
        "Set the objectives and the target rate, then press **Plan**. Each candidate configuration is "
        "simulated; the replica count of every GPU type and TP degree is searched (about 10–60 s)."
    )
    st.stop()

if submitted:
    try:
        seqs = logic.parse_int_list(seqs_text, "Max sequences per batch")
        tokens = logic.parse_int_list(tokens_text, "Max tokens per step")
        limits = (ttft / 1e3 or None, tpot / 1e3 or None, e2e / 1e3 or None)
        logic.plan_objectives(*limits)
        if not (gpus and tps and block_sizes and seqs and tokens):
            raise ValueError("choose at least one GPU type, TP degree, block size and batch limit")
    except ValueError as e:
        st.error(f"Cannot plan: {e}")
        st.stop()
    trace = logic.plan_trace(full_trace, int(num_requests))
    params = (
        (trace_key, int(num_requests)),
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
    t0 = time.perf_counter()
    outcome = plan_store().get(params)
    if outcome is None:
        estimate = logic.plan_simulations_estimate(
            len(gpus) * len(tps) * len(block_sizes) * len(seqs) * len(tokens),
            int(max_gpus),
            min(int(t) for t in tps),
        )
        bar = progress_area.progress(0.0, text=f"Planning on {len(trace):,} requests at {rate:g} req/s…")

        def on_point(row: dict, done: int) -> None:
            what = f"{row.get('replicas')} x {row.get('gpu')} TP{row.get('tp')}"
            bar.progress(
                min(done / max(estimate, done + 1), 0.99),
                text=f"Simulated {done} configurations (latest: {what}) in {time.perf_counter() - t0:.0f} s…",
            )

        try:
            outcome = state.with_pool(lambda pool: run_plan(trace, pool, on_point, *params[1:]))
        except ValueError as e:
            progress_area.empty()
            st.error(f"Cannot plan: {e}")
            st.stop()
        plan_store().put(params, outcome)
    shown = {
        "params": params,
        "outcome": outcome,
        "wall": time.perf_counter() - t0,
        "trace": full_trace.name,
        "requests": len(trace),
        "of": len(full_trace),
        "rate": float(rate),
    }
    st.session_state[RESULT] = shown

outcome, result = shown["outcome"], shown["outcome"].result
progress_area.progress(
    1.0,
    text=f"{result.num_simulations} simulations in {shown['wall']:.1f} s (plans are kept: Plan again is instant)",
)
n = outcome.num_requests
st.caption(
    f"Each candidate simulated {n:,} requests: the first {n:,} of {shown['trace']}"
    + (f" ({shown['of']:,} in all)" if shown["of"] > n else " (all of it)")
    + f", rescaled to {shown['rate']:g} req/s, {outcome.duration_s:,.1f} s of arrivals. "
    "Press Plan to plan again with the form's settings."
)
note = logic.tail_note(n)
if note:
    st.warning(note)

if outcome.latency_note:
    st.info(outcome.latency_note)
mixed = logic.plan_latency_warning(result)
if mixed:
    st.warning(
        "The candidates were simulated on different latency models (a fitted profile for some, the "
        "roofline for others: see the latency model column), so the ranking partly compares the models. "
        "Pick the roofline for all, or GPUs, TP degrees and block sizes with a shipped profile each."
    )
best, overloaded = logic.plan_pick(result, outcome.duration_s)
if overloaded:
    st.warning(overloaded)
if best is not None:
    row = best.row or {}
    load = logic.load_verdict(row, outcome.duration_s)
    st.success(
        f"**Recommended: {best.replicas} x {best.option.gpu} at TP {best.option.tp}** "
        f"({best.num_gpus} GPUs, block {best.option.block_size}, at most {best.option.max_num_seqs} sequences "
        f"and {best.option.max_num_batched_tokens:,} tokens per step; latency {row_latency(row)}; "
        f"serves {load.served_rps:,.1f} of {load.offered_rps:,.1f} req/s offered)"
    )
    m = st.columns(5)
    m[0].metric("Cost per hour", f"${best.cost_per_hour:,.2f}")
    per_m = row.get("cost_per_million_output_tokens_usd", math.inf)
    m[1].metric("Per M output tokens", "n/a" if not math.isfinite(per_m) else f"${per_m:,.3f}")
    m[2].metric("p99 TTFT", logic.format_ms(row.get("ttft_p99_s", math.nan)))
    m[3].metric("p99 TPOT", logic.format_ms(row.get("tpot_p99_s", math.nan)))
    m[4].metric("p99 E2E", logic.format_ms(row.get("e2e_p99_s", math.nan)))
elif result.best is None:
    msg = f"No configuration meets the objectives within {result.max_gpus} GPUs."
    if result.closest is not None:
        c = result.closest
        msg += f" Closest: {c.replicas} x {c.option.gpu} TP {c.option.tp}, which misses: " + "; ".join(
            logic.describe_miss(v) for v in c.failed
        )
    st.warning(msg)

cands = logic.plan_candidates(result, outcome.duration_s)
st.subheader("Candidates")
st.dataframe(
    logic.table_style(cands, CANDIDATE_FORMATS),
    hide_index=True,
    key="cap_candidates",
    column_config={"why": st.column_config.TextColumn(width="large")},
)
state.glossary()

params = shown["params"]
(trace_key_shown, requests_shown), *rest = params
shipped = trace_key_shown[len(state.SHIPPED) :] if trace_key_shown.startswith(state.SHIPPED) else None
with st.expander("Export this plan: the kvplan plan command and the candidates as CSV"):
    model_shown, latency_shown, limits_shown, rate_shown, *axes, max_gpus_shown, router_shown, mix_shown = (
        rest
    )
    st.code(
        logic.plan_command(
            shipped,
            requests_shown,
            model_shown,
            latency_shown,
            logic.plan_objectives(*limits_shown),
            rate_shown,
            *axes,
            max_gpus_shown,
            router_shown,
            mix_shown,
        ),
        language="bash",
    )
    if shipped is None:
        st.caption("This trace lives only in this session: save it to a file and give its path as --trace.")
    st.download_button(
        "Candidates as CSV", cands.to_csv(index=False), file_name="kvplan-plan.csv", mime="text/csv"
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
    st.plotly_chart(
        figures.pareto_figure(points, column, metric, rec), key="cap_pareto", config=figures.CHART_CONFIG
    )
    with st.expander(f"All {len(points)} simulated points"):
        st.dataframe(logic.table_style(logic.points_table(points), logic.POINT_FORMATS), hide_index=True)
else:
    st.warning("No configuration could be simulated: see the candidates' reasons above.")
