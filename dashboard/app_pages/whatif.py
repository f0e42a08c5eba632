"""What-if page: replay one trace on several serving configurations side by side (block size, batch
limits, TP x replicas) and compare latency CDFs, throughput, KV usage, queues, preemptions and
prefix hits, with a summary table that highlights the best configuration for a chosen objective.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pandas as pd
import streamlit as st
from pandas.io.formats.style import Styler
from streamlit.delta_generator import DeltaGenerator

from dashboard import figures, logic, state
from simulator.models import preset_names, resolve_model

BLOCK_SIZES = [8, 16, 32, 64, 128, 256]
TPS = [1, 2, 4, 8]
MAX_CONFIGS = 6
VIEWS = ("Latency CDFs", "Throughput, KV and queues", "Preemptions and prefix hits", "Latency against load")
LOAD_METRICS = {"TTFT": "ttft_p99_s", "TPOT": "tpot_p99_s", "E2E": "e2e_p99_s"}
FORMATS = {
    "TTFT p50 (ms)": "{:,.1f}",
    "TTFT p99 (ms)": "{:,.1f}",
    "TPOT p50 (ms)": "{:,.2f}",
    "TPOT p99 (ms)": "{:,.2f}",
    "E2E p50 (ms)": "{:,.0f}",
    "E2E p99 (ms)": "{:,.0f}",
    "offered (req/s)": "{:,.1f}",
    "served (req/s)": "{:,.1f}",
    "throughput (req/s)": "{:,.2f}",
    "output tok/s": "{:,.0f}",
    "prefix hit rate": "{:.1%}",
    "KV usage max": "{:.1%}",
    "steps outside fit": "{:.1%}",
    "$/h": "${:,.2f}",
    "$/M output tokens": "${:,.2f}",
    "SLO attainment": "{:.1%}",
}


def config_column(i: int, default: logic.ConfigSpec, container: DeltaGenerator) -> logic.ConfigSpec:
    """Widgets of configuration `i` in its own column."""
    c = container
    label = c.text_input("Name", default.label, key=f"wi_label_{i}")
    block = c.selectbox(
        "Block size", BLOCK_SIZES, index=BLOCK_SIZES.index(default.block_size), key=f"wi_block_{i}"
    )
    seqs = c.number_input(
        "Max sequences per batch", 1, 4096, default.max_num_seqs, key=f"wi_seqs_{i}", help="max_num_seqs"
    )
    tokens = c.number_input(
        "Max tokens per step",
        16,
        1_048_576,
        default.max_num_batched_tokens,
        step=1024,
        key=f"wi_tokens_{i}",
        help="max_num_batched_tokens",
    )
    tp = c.selectbox("TP", TPS, index=TPS.index(default.tensor_parallel_size), key=f"wi_tp_{i}")
    replicas = c.number_input("Replicas", 1, 64, default.num_replicas, key=f"wi_replicas_{i}")
    return logic.ConfigSpec(
        label.strip() or f"config {i + 1}", int(block), int(seqs), int(tokens), int(tp), int(replicas)
    )


@st.cache_resource
def capacity_store() -> logic.ResultStore:
    """`kvplan capacity` answers already found, by (trace, configuration, objectives)."""
    return logic.ResultStore(max_entries=64)


def unique_labels(specs: list[logic.ConfigSpec]) -> list[logic.ConfigSpec]:
    seen: dict[str, int] = {}
    out = []
    for s in specs:
        n = seen.get(s.label, 0)
        seen[s.label] = n + 1
        out.append(s if n == 0 else replace(s, label=f"{s.label} ({n + 1})"))
    return out


def _index(options: list[str], preferred: str) -> int:
    return options.index(preferred) if preferred in options else 0


def styled(table: pd.DataFrame, best: str | None) -> Styler:
    def highlight(row: pd.Series) -> list[str]:
        style = "background-color: rgba(46, 160, 67, 0.25); font-weight: bold" if row.name == best else ""
        return [style] * len(row)

    return logic.table_style(table, FORMATS).apply(highlight, axis=1)


st.title("What-if: compare configurations")
n = st.number_input(
    "Configurations",
    1,
    MAX_CONFIGS,
    len(logic.DEFAULT_CONFIGS),
    key="wi_n",
    help="How many configurations to compare side by side",
)
with st.form("wi_configs", border=True):  # nothing is simulated until Compare is pressed
    top = st.columns([2, 1, 1, 2])
    with top[0]:
        trace_key, full_trace = state.trace_picker(
            "Trace", "wi_trace", help="Pick, upload or generate on the Traffic page"
        )
    models, gpus = preset_names(), logic.gpu_names()
    model_key = top[1].selectbox("Model", models, index=_index(models, "qwen3-8b"), key="wi_model")
    gpu = top[2].selectbox("GPU", gpus, index=_index(gpus, "H200-SXM"), key="wi_gpu")
    with top[3]:
        latency_choice = state.latency_input("wi")

    row = st.columns(4)
    window = row[0].number_input(
        "Replay window (s, 0 = whole trace)",
        0.0,
        1e7,
        state.default_window_s(),
        step=60.0,
        key="wi_window",
        help="Only the trace's first seconds are simulated, to keep the page interactive.",
    )
    rate_scale = row[1].number_input(
        "Rate scale (x faster)",
        0.01,
        1000.0,
        4.0,
        step=0.5,
        key="wi_rate",
        help="Replay the trace this many times faster.",
    )
    policy = row[2].selectbox("Scheduler policy", ["chunked", "prefill_first"], key="wi_policy")
    prefix_caching = row[3].toggle("Prefix caching", value=True, key="wi_prefix")
    async_scheduling = row[3].toggle(
        "Async scheduling",
        value=False,
        key="wi_async",
        help="The engine schedules each decode step while the one before it runs (kvplan replay "
        "--async-scheduling): decode steps scheduled ahead skip the host's time, and a request that "
        "arrives during a decode step waits one step more. Auto latency takes the profile calibrated with "
        "async scheduling where one is shipped (Qwen3-0.6B, block 16).",
    )
    cols = st.columns(int(n))
    specs = []
    for i in range(int(n)):
        default = (
            logic.DEFAULT_CONFIGS[i]
            if i < len(logic.DEFAULT_CONFIGS)
            else logic.ConfigSpec(f"config {i + 1}")
        )
        specs.append(config_column(i, default, cols[i]))
    st.form_submit_button("Compare", type="primary")
specs = unique_labels(specs)
trace = logic.prepare_trace(full_trace, window or None, rate_scale)
if window and window < full_trace.duration_s:
    st.caption(
        f"Simulating the first {window:,.0f} s of {full_trace.name} ({len(trace):,} of {len(full_trace):,} requests) "
        f"at {rate_scale:g}x; the whole trace ({full_trace.duration_s:,.0f} s) takes about "
        f"{full_trace.duration_s / max(window, 1):.0f}x longer per configuration. Set the window to 0 for all of it."
    )
else:
    st.caption(
        f"Simulating all of {full_trace.name} ({len(trace):,} requests) at {rate_scale:g}x"
        + (": expect tens of seconds per configuration." if len(trace) > 5000 else ".")
    )

progress_area = st.empty()  # the top of the results: a progress bar while configurations simulate

model = resolve_model(model_key)
jobs: list[logic.SimJob | None] = []
errors: dict[str, str] = {}
common = {"policy": policy, "enable_prefix_caching": prefix_caching, "async_scheduling": async_scheduling}
for spec in specs:
    try:
        config = spec.to_sim_config(model, gpu, **common)
        profile = logic.resolve_profile(
            latency_choice, model_key, gpu, spec.block_size, spec.tensor_parallel_size, async_scheduling
        )
        jobs.append(logic.SimJob(config, profile))
    except ValueError as e:
        errors[spec.label] = str(e)
        jobs.append(None)

trace_id = (trace_key, window or None, rate_scale)
todo = [j for j in jobs if j is not None]
t0 = time.perf_counter()
bar = None


def on_done(done: int, total: int) -> None:
    global bar
    text = f"Simulated {done} of {total} configurations on {len(trace):,} requests ({time.perf_counter() - t0:.0f} s)…"
    if bar is None:
        bar = progress_area.progress(0.0, text=text)
    bar.progress(done / total, text=text)


progress_area.progress(0.0, text=f"Simulating {len(todo)} configurations on {len(trace):,} requests…")
outcomes = state.run_jobs(trace_id, trace, todo, on_done)
wall = time.perf_counter() - t0
progress_area.empty()
results = {}
it = iter(outcomes)
for spec, job in zip(specs, jobs):
    if job is None:
        continue
    out = next(it)
    if isinstance(out, Exception):
        errors[spec.label] = str(out)
    else:
        results[spec.label] = out
for label, message in errors.items():
    st.error(f"{label}: {message}")
if not results:
    st.stop()

st.caption(f"{len(results)} configurations on {len(trace):,} requests in {wall:.1f} s (results are cached).")
c1, c2 = st.columns([1, 3])
objective = c1.selectbox("Best configuration by", list(logic.OBJECTIVES), key="wi_objective")
with c2:
    slo = state.slo_inputs("wi")
table = logic.summary_table(results, slo)
best = logic.best_config(table, objective)
qualified = table["status"].isin(logic.QUALIFIED)
if best:
    st.success(
        f"Best by {objective}: **{best}** (of the {int(qualified.sum())} that meet the SLO and keep up)"
    )
elif not qualified.any():
    offered = table["offered (req/s)"].max()
    st.warning(
        f"No configuration meets the SLO and keeps up with the {offered:,.1f} req/s offered, so none is "
        "called best: see the status and why columns."
    )
else:
    st.warning(f"No configuration that meets the SLO and keeps up has a value for {objective}.")
mixed = logic.mixed_latency_warning(results)
if mixed:
    st.warning(
        "These configurations use different latency models (a fitted profile for some, the roofline for "
        "others: see the latency model column), so part of their difference comes from the models. Pick "
        "one latency model, or configurations with a shipped profile each (blocks 16 and 256 on the H200), "
        "to compare like with like."
    )
st.dataframe(
    styled(table, best),
    key="wi_table",
    column_config={
        "why": st.column_config.TextColumn(width="large"),
        "status": st.column_config.TextColumn(width="medium"),
    },
)
state.glossary()

colors = figures.color_map([s.label for s in specs])  # by form column: a label keeps its colour
# One view at a time: drawing every chart at once makes the page slower to render than to simulate.
c1, c2 = st.columns([3, 1])
view = c1.radio("Charts", VIEWS, horizontal=True, key="wi_view")
if view != VIEWS[2]:
    st.markdown(figures.legend_html(colors), unsafe_allow_html=True)
if view == VIEWS[0]:
    log_x = c2.toggle("Log time axis", value=True, key="wi_log")
    cols = st.columns(3)
    for col, (metric, label) in zip(cols, logic.LATENCY_METRICS.items()):
        col.plotly_chart(
            figures.cdf_figure(logic.latency_cdfs(results, metric), label, colors, log_x, legend=False),
            key=f"wi_cdf_{metric}",
            config=figures.CHART_CONFIG,
        )
elif view == VIEWS[1]:
    timeline = logic.cluster_timeline(results)
    c1, c2 = st.columns(2)
    c1.plotly_chart(
        figures.timeline_figure(
            logic.token_throughput(results),
            "output_tok_s",
            "Output throughput",
            "output tokens/s",
            colors,
            legend=False,
        ),
        key="wi_tput",
        config=figures.CHART_CONFIG,
    )
    c2.plotly_chart(
        figures.timeline_figure(
            timeline, "kv_usage", "KV cache usage (mean over replicas)", "KV usage", colors, True, False
        ),
        key="wi_kv",
        config=figures.CHART_CONFIG,
    )
    c1, c2 = st.columns(2)
    c1.plotly_chart(
        figures.timeline_figure(
            timeline, "num_waiting", "Queue length (waiting requests)", "requests", colors, legend=False
        ),
        key="wi_queue",
        config=figures.CHART_CONFIG,
    )
    c2.plotly_chart(
        figures.timeline_figure(
            timeline, "num_running", "Running requests", "requests", colors, legend=False
        ),
        key="wi_running",
        config=figures.CHART_CONFIG,
    )
elif view == VIEWS[2]:
    c1, c2 = st.columns(2)
    c1.plotly_chart(
        figures.bar_figure(table, "preemptions", "Preemptions", colors),
        key="wi_preempt",
        config=figures.CHART_CONFIG,
    )
    c2.plotly_chart(
        figures.bar_figure(table, "prefix hit rate", "Prefix hit rate", colors, True),
        key="wi_hits",
        config=figures.CHART_CONFIG,
    )
else:
    metric = c2.selectbox("Latency", list(LOAD_METRICS), key="wi_load_metric")
    labelled = [(spec.label, job) for spec, job in zip(specs, jobs) if job is not None]
    draw_key = (trace_id, tuple(j.key for _, j in labelled), slo)
    st.caption(
        f"Each configuration simulated at {', '.join(f'{m:g}' for m in logic.LOAD_MULTIPLIERS)} times the "
        f"page's rate ({len(labelled) * len(logic.LOAD_MULTIPLIERS)} simulations): its p99 against the rate "
        "offered. A cross misses the SLO or falls behind; the star is the knee, the last point before the "
        "first that does; a dotted line is kvplan capacity's highest rate meeting the SLO."
    )
    if st.button("Draw the load curves", key="wi_load_button"):
        st.session_state["wi_load_drawn"] = draw_key
    if st.session_state.get("wi_load_drawn") != draw_key:
        st.info("Press **Draw the load curves** to simulate every configuration at several rates.")
        st.stop()
    runs: dict[float, dict] = {}
    total, done_before = len(labelled) * len(logic.LOAD_MULTIPLIERS), 0
    load_bar = progress_area.progress(0.0, text="Simulating the load curves…")
    for mult in logic.LOAD_MULTIPLIERS:
        scale = rate_scale * mult
        trace_m = logic.prepare_trace(full_trace, window or None, scale)

        def on_load(done: int, n: int, base: int = done_before) -> None:
            load_bar.progress((base + done) / total, text=f"Simulated {base + done} of {total} load points…")

        outs = state.run_jobs((trace_key, window or None, scale), trace_m, [j for _, j in labelled], on_load)
        runs[mult] = {label: o for (label, _), o in zip(labelled, outs) if not isinstance(o, Exception)}
        done_before += len(labelled)
    curve = logic.load_curve(runs, slo, LOAD_METRICS[metric])
    knees = logic.knees(curve)
    objectives = logic.slo_objectives(slo)
    capacity: dict[str, float] = {}
    rows = []
    for i, (label, job) in enumerate(labelled):
        load_bar.progress(1.0, text=f"kvplan capacity for {label} ({i + 1} of {len(labelled)})…")
        answer = None
        if objectives:
            key = (trace_id, job.key, objectives)
            answer = capacity_store().get(key)
            if answer is None:
                try:
                    answer = state.with_pool(
                        lambda pool, job=job: logic.capacity_answer(
                            trace, model_key, latency_choice, job.config, objectives, pool
                        )
                    )
                except ValueError as e:
                    answer = e
                capacity_store().put(key, answer)
        rate_ok = getattr(answer, "max_rate", None)
        if rate_ok is not None:
            capacity[label] = rate_ok
        knee = knees[knees["config"] == label]
        rows.append(
            {
                "config": label,
                "knee (req/s)": float(knee["offered_rps"].iloc[0]) if len(knee) else None,
                "kvplan capacity (req/s)": rate_ok,
                "note": str(answer)
                if isinstance(answer, Exception)
                else ("set an SLO objective" if not objectives else ""),
            }
        )
    load_bar.empty()
    st.plotly_chart(
        figures.load_curve_figure(curve, knees, metric, colors, capacity),
        key="wi_load_curve",
        config=figures.CHART_CONFIG,
    )
    st.dataframe(
        logic.table_style(
            pd.DataFrame(rows), {"knee (req/s)": "{:,.1f}", "kvplan capacity (req/s)": "{:,.1f}"}
        ),
        hide_index=True,
        key="wi_load_table",
    )
