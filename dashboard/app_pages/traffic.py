"""Traffic page: pick a shipped trace, upload one or generate one, and look at it: arrival rate over
time, prompt and output length histograms, prefix reuse. The trace shown becomes the default of the
other pages. Widgets -> `traces` / `dashboard.logic` -> `dashboard.figures`.
"""

from __future__ import annotations

import streamlit as st

import traces
from dashboard import figures, logic, state
from simulator.defaults import DEFAULT_TRACE
from traces import Trace

SOURCES = ("Shipped sample", "Upload a file", "Generate")


@st.cache_data(show_spinner=False, max_entries=32)
def trace_views(key: str, _trace: Trace, bin_choice: str) -> dict:
    """Summary, arrival rate, length histograms and prefix reuse of one trace (cached by its key)."""
    bin_s = logic.auto_bin_s(_trace.duration_s) if bin_choice == "auto" else float(bin_choice)
    df = _trace.df
    return {
        "summary": logic.trace_summary(_trace),
        "bin_s": bin_s,
        "rate": logic.arrival_rate(_trace, bin_s),
        "prompt": logic.histogram(df["prompt_len"].to_numpy(), log=True),
        "output": logic.histogram(df["output_len"].to_numpy(), log=True),
        "prompt_lin": logic.histogram(df["prompt_len"].to_numpy(), log=False),
        "output_lin": logic.histogram(df["output_len"].to_numpy(), log=False),
        "reuse": logic.prefix_reuse_curve(_trace),
    }


def pick_trace() -> str | None:
    source = st.radio("Source", SOURCES, horizontal=True, key="traffic_source")
    if source == SOURCES[0]:
        names = traces.shipped_names()
        default = names.index(DEFAULT_TRACE) if DEFAULT_TRACE in names else 0
        name = st.selectbox("Shipped trace", names, index=default, key="traffic_shipped")
        return state.SHIPPED + name
    if source == SOURCES[1]:
        limit_mib = logic.UPLOAD_LIMIT_BYTES // 2**20
        upload = st.file_uploader(
            f"Trace file: Azure, BurstGPT or Mooncake format, or CSV / JSON Lines / Parquet with columns "
            f"arrival_s, prompt_len, output_len (format detected from content; at most {limit_mib} MiB)",
            key="traffic_upload",
            max_upload_size=limit_mib,
        )
        if upload is None:
            st.info("Upload a trace file to see it here; it is then offered on the other pages too.")
            return None
        try:
            key = state.add_uploaded(upload.getvalue(), upload.name)
        except ValueError as e:
            st.error(f"Could not load this trace: {e}")
            return None
        report = state.upload_report(key)
        if report:
            st.caption(report[0])
            for w in report[1]:
                st.warning(w)
        return key
    with st.form("traffic_generate"):
        c1, c2, c3, c4 = st.columns(4)
        arrival = c1.selectbox("Arrivals", ["poisson", "gamma", "constant"], key="gen_arrival")
        rate = c2.number_input("Rate (req/s)", 0.01, 10_000.0, 5.0, key="gen_rate")
        num = c3.number_input("Requests", 1, 200_000, 2000, step=100, key="gen_num")
        cv = c4.number_input("Burstiness CV (gamma)", 0.0, 20.0, 2.0, key="gen_cv")
        c1, c2, c3, c4 = st.columns(4)
        prompt = c1.text_input("Prompt lengths", "lognormal:1024,1.0", key="gen_prompt", help=_LENGTH_HELP)
        output = c2.text_input("Output lengths", "lognormal:256,0.8", key="gen_output", help=_LENGTH_HELP)
        prefixes = c3.number_input("Shared system prompts", 0, 10_000, 8, key="gen_prefixes", help="0 = none")
        prefix_len = c4.number_input("System prompt tokens", 1, 100_000, 1024, key="gen_prefix_len")
        seed = st.number_input("Seed", 0, 2**31 - 1, 0, key="gen_seed")
        submitted = st.form_submit_button("Generate")
    if submitted:
        try:
            spec = logic.generator_spec(
                num_requests=int(num),
                rate=float(rate),
                arrival=arrival,
                cv=float(cv),
                prompt=prompt,
                output=output,
                num_prefixes=int(prefixes),
                prefix_len=int(prefix_len),
                seed=int(seed),
            )
            st.session_state["traffic_generated"] = state.add_generated(spec)
        except (ValueError, TypeError, FileNotFoundError) as e:
            st.error(f"Could not generate this trace: {e}")
            return None
    key = st.session_state.get("traffic_generated")
    if key is None or key not in state.trace_options():
        st.info("Set the generator's parameters and press Generate.")
        return None
    return key


_LENGTH_HELP = (
    "A number (fixed), `uniform:LOW,HIGH`, `lognormal:MEAN,SIGMA`, `fixed:N` or "
    "`empirical:azure_conv_2023` (sampled from a shipped trace)."
)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


st.title("Traffic")
st.caption("The request trace that the what-if and capacity pages replay.")
key = pick_trace()
if key is not None:
    trace = state.get_trace(key)
    st.session_state[state.ACTIVE_TRACE] = key
    c1, c2 = st.columns([3, 1])
    bin_choice = c2.selectbox("Rate bin (s)", ["auto", "1", "10", "60", "300"], key="traffic_bin")
    log_x = c2.toggle("Log length axis", value=True, key="traffic_log")
    views = trace_views(key, trace, bin_choice)
    s = views["summary"]
    m = c1.columns(4)
    m[0].metric("Requests", f"{s['requests']:,}")
    m[1].metric("Duration", f"{s['duration_s']:,.0f} s")
    m[2].metric("Mean rate", f"{_fmt(s['rate_rps'], '.2f')} req/s")
    m[3].metric("Inter-arrival CV", _fmt(s["interarrival_cv"], ".2f"))
    m = c1.columns(4)
    m[0].metric("Prompt tokens, mean", f"{s['prompt_mean']:,.0f}")
    m[1].metric("Prompt tokens, p99", f"{s['prompt_p99']:,.0f}")
    m[2].metric("Output tokens, mean", f"{s['output_mean']:,.0f}")
    m[3].metric("Output tokens, p99", f"{s['output_p99']:,.0f}")
    if s["token_reuse"] is not None or s["sessions"] is not None:
        m = c1.columns(4)
        m[0].metric("Prefix token reuse", "n/a" if s["token_reuse"] is None else f"{s['token_reuse']:.1%}")
        m[1].metric("Prefix block reuse", "n/a" if s["block_reuse"] is None else f"{s['block_reuse']:.1%}")
        m[2].metric("Sessions", "n/a" if s["sessions"] is None else f"{s['sessions']:,}")

    st.plotly_chart(
        figures.arrival_rate_figure(views["rate"], views["bin_s"]),
        key="traffic_rate_chart",
        config=figures.CHART_CONFIG,
    )
    c1, c2 = st.columns(2)
    suffix = "" if log_x else "_lin"
    c1.plotly_chart(
        figures.histogram_figure(views["prompt" + suffix], "Prompt lengths", "prompt tokens", log_x),
        key="traffic_prompt_chart",
        config=figures.CHART_CONFIG,
    )
    c2.plotly_chart(
        figures.histogram_figure(views["output" + suffix], "Output lengths", "output tokens", log_x),
        key="traffic_output_chart",
        config=figures.CHART_CONFIG,
    )
    if views["reuse"] is None:
        st.caption("Prefix reuse: n/a, this trace carries no prefix identity (prefix_block_ids).")
    else:
        st.plotly_chart(
            figures.prefix_reuse_figure(views["reuse"]),
            key="traffic_reuse_chart",
            config=figures.CHART_CONFIG,
        )
    with st.expander("First rows"):
        cols = [c for c in trace.df.columns if c not in ("prefix_block_ids", "prompt_token_ids")]
        st.dataframe(trace.df[cols].head(200), hide_index=True)
