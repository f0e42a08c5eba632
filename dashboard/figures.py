"""Plotly figure builders for the dashboard pages, one function per chart.

Each takes the small frames that `dashboard.logic` returns and builds a figure; no computation of
metrics and no streamlit here, so figures are testable and reproducible from the same frames.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

PALETTE = px.colors.qualitative.D3
# st.plotly_chart(..., config=CHART_CONFIG): no modebar, which would cover the chart's title
CHART_CONFIG = {"displayModeBar": False, "displaylogo": False}
SLO_COLORS = {"meets SLO": "#2ca02c", "misses SLO": "#d62728"}
KIND_COLORS = {"decode": "#1f77b4", "prefill": "#ff7f0e", "mixed": "#9467bd"}
_LAYOUT = dict(
    margin=dict(l=10, r=10, t=40, b=10),
    legend=dict(title_text="", orientation="h", yanchor="top", y=-0.22, xanchor="left", x=0),
    height=360,
)


def color_map(labels: Sequence[str]) -> dict[str, str]:
    """One colour per configuration label, by its place in `labels`: pass every configuration of
    the form (those that failed too), so that a label keeps its colour from run to run."""
    return {label: PALETTE[i % len(PALETTE)] for i, label in enumerate(labels)}


def log_axis(fig: go.Figure, axis: str = "x", values: Sequence[float] | None = None, **kw: object) -> None:
    """A log axis labelled at powers of ten; with `values`, only when they span over a decade
    (a narrower range reads better on a linear axis)."""
    update = fig.update_xaxes if axis == "x" else fig.update_yaxes
    if values is not None:
        v = np.asarray(values, dtype=float)
        v = v[np.isfinite(v) & (v > 0)]
        if len(v) == 0 or v.max() / v.min() < 20:
            update(type="linear", **kw)
            return
    update(type="log", dtick=1, minor=dict(ticks="outside", ticklen=3, showgrid=False), **kw)


def legend_html(colors: dict[str, str]) -> str:
    """One colour key for a page whose charts share configuration colours (their legends are off)."""
    items = "".join(
        f'<span style="margin-right:1.2em;white-space:nowrap"><span style="display:inline-block;width:1.6em;'
        f'height:0.35em;vertical-align:middle;background:{c};margin-right:0.4em"></span>{label}</span>'
        for label, c in colors.items()
    )
    return f'<div style="font-size:0.9em">{items}</div>'


def _finish(fig: go.Figure, title: str, **layout: object) -> go.Figure:
    fig.update_layout(title=title, **{**_LAYOUT, **layout})
    return fig


def _note(fig: go.Figure, message: str) -> go.Figure:
    """A note across the top of a chart (e.g. why every value is zero)."""
    fig.add_annotation(
        text=message, showarrow=False, x=0.5, y=0.95, xref="paper", yref="paper", font=dict(color="gray")
    )
    return fig


def all_zero(values: Sequence[float] | pd.Series) -> bool:
    """True when every finite value is 0 (an all-zero chart then needs a note to read as data)."""
    v = np.asarray(pd.to_numeric(pd.Series(values), errors="coerce"), dtype=float)
    v = v[np.isfinite(v)]
    return len(v) > 0 and bool((v == 0).all())


def _empty(title: str, message: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _finish(fig, title)


# ------------------------------------------------------------------------------- traffic


def arrival_rate_figure(rate: pd.DataFrame, bin_s: float) -> go.Figure:
    fig = go.Figure(
        go.Scatter(x=rate["time_s"], y=rate["rate_rps"], mode="lines", line_shape="hv", name="rate")
    )
    fig.update_xaxes(title="time since trace start (s)")
    fig.update_yaxes(title=f"arrivals/s ({bin_s:g} s bins)", rangemode="tozero")
    return _finish(fig, "Arrival rate")


def histogram_figure(hist: pd.DataFrame, title: str, x_title: str, log_x: bool) -> go.Figure:
    if hist.empty:
        return _empty(title, "no data")
    fig = go.Figure(
        go.Bar(
            x=hist["center"],
            y=hist["count"],
            width=(hist["right"] - hist["left"]) * 0.98,
            customdata=np.stack([hist["left"], hist["right"]], axis=1),
            hovertemplate="%{customdata[0]:.0f}–%{customdata[1]:.0f}: %{y} requests<extra></extra>",
        )
    )
    if log_x:
        log_axis(fig, "x", title=x_title)
    else:
        fig.update_xaxes(title=x_title)
    fig.update_yaxes(title="requests")
    return _finish(fig, title, bargap=0)


def prefix_reuse_figure(curve: pd.DataFrame | None) -> go.Figure:
    title = "Prefix reuse (infinite cache, cumulative)"
    if curve is None or curve.empty:
        return _empty(title, "this trace has no prefix identity (prefix_block_ids)")
    fig = go.Figure()
    fig.add_scatter(x=curve["time_s"], y=curve["token_reuse"], mode="lines+markers", name="tokens reused")
    fig.add_scatter(x=curve["time_s"], y=curve["block_reuse"], mode="lines+markers", name="blocks reused")
    fig.update_xaxes(title="time since trace start (s)")
    fig.update_yaxes(title="share seen before", tickformat=".0%", range=[0, 1])
    return _finish(fig, title)


# ------------------------------------------------------------------------------- what-if


def cdf_figure(
    cdf: pd.DataFrame, metric: str, colors: dict[str, str], log_x: bool = False, legend: bool = True
) -> go.Figure:
    title = f"{metric} CDF"
    if cdf.empty:
        return _empty(title, "no finished requests")
    fig = go.Figure()
    for label, g in cdf.groupby("config", sort=False):
        fig.add_scatter(
            x=g["value_s"] * 1e3,
            y=g["quantile"],
            mode="lines",
            name=str(label),
            line_color=colors.get(label),
        )
    if log_x:
        log_axis(fig, "x", cdf["value_s"] * 1e3, title=f"{metric} (ms)")
    else:
        fig.update_xaxes(title=f"{metric} (ms)")
    fig.update_layout(showlegend=legend)
    fig.update_yaxes(title="share of requests", tickformat=".0%", range=[0, 1.01])
    fig.add_hline(
        y=0.99, line_dash="dot", line_color="gray", annotation_text="p99", annotation_position="top left"
    )
    return _finish(fig, title)


def timeline_figure(
    frame: pd.DataFrame,
    column: str,
    title: str,
    y_title: str,
    colors: dict[str, str],
    percent: bool = False,
    legend: bool = True,
) -> go.Figure:
    if frame.empty:
        return _empty(title, "no samples")
    fig = go.Figure()
    for label, g in frame.groupby("config", sort=False):
        fig.add_scatter(
            x=g["time_s"], y=g[column], mode="lines", name=str(label), line_color=colors.get(label)
        )
    fig.update_xaxes(title="simulated time (s)")
    fig.update_yaxes(title=y_title, rangemode="tozero", tickformat=".0%" if percent else None)
    fig.update_layout(showlegend=legend)
    if all_zero(frame[column]):
        _note(fig, "zero throughout, in every configuration")
    return _finish(fig, title)


def bar_figure(
    table: pd.DataFrame, column: str, title: str, colors: dict[str, str], percent: bool = False
) -> go.Figure:
    if table.empty or column not in table:
        return _empty(title, "no results")
    labels = [str(i) for i in table.index]
    fig = go.Figure(
        go.Bar(
            x=labels, y=table[column], marker_color=[colors.get(label) for label in labels], showlegend=False
        )
    )
    fig.update_yaxes(title=column, tickformat=".0%" if percent else None, rangemode="tozero")
    if all_zero(table[column]):
        _note(fig, f"{column}: zero in every configuration")
    return _finish(fig, title)


def load_curve_figure(
    curve: pd.DataFrame,
    knees: pd.DataFrame,
    metric: str,
    colors: dict[str, str],
    capacity: dict[str, float] | None = None,
) -> go.Figure:
    """p99 latency against offered rate, one line per configuration (`dashboard.logic.load_curve`):
    points that miss the SLO or fall behind as crosses, the knee (`logic.knees`) a star, and each
    configuration's `kvplan capacity` rate (`capacity`: label -> req/s) a dotted vertical line."""
    title = f"p99 {metric} against offered load"
    if curve.empty:
        return _empty(title, "no simulations")
    fig = go.Figure()
    for label, g in curve.groupby("config", sort=False):
        g = g.sort_values("offered_rps")
        color = colors.get(label)
        fig.add_scatter(
            x=g["offered_rps"],
            y=g["latency_ms"],
            mode="lines+markers",
            name=str(label),
            line_color=color,
            marker=dict(symbol=["circle" if q else "x" for q in g["qualifies"]], size=9, color=color),
            customdata=g["served_rps"],
            hovertemplate="offered %{x:,.1f} req/s, served %{customdata:,.1f}<br>p99 %{y:,.0f} ms<extra></extra>",
        )
    if not knees.empty:
        fig.add_scatter(
            x=knees["offered_rps"],
            y=knees["latency_ms"],
            mode="markers",
            name="knee (last point that meets the SLO and keeps up)",
            marker=dict(symbol="star", size=16, color=[colors.get(c) for c in knees["config"]], line_width=1),
        )
    for label, rate in (capacity or {}).items():
        fig.add_vline(x=rate, line_dash="dot", line_color=colors.get(label, "gray"))
    fig.update_xaxes(title="offered rate (req/s)", rangemode="tozero")
    log_axis(fig, "y", curve["latency_ms"], title=f"p99 {metric} (ms)")
    return _finish(fig, title, height=420)


# ------------------------------------------------------------------------------- capacity plan


def pareto_figure(
    points: pd.DataFrame, latency_column: str, latency_label: str, recommended: int | None
) -> go.Figure:
    """Cost per hour against a p99 latency for every simulated point (columns label, meets_slo,
    cost_per_hour_usd, pareto and `latency_column`); the front dashed, the recommendation a star."""
    title = f"Cost against p99 {latency_label}"
    if points.empty:
        return _empty(title, "no candidates simulated")
    fig = go.Figure()
    for ok, name, symbol in ((True, "meets SLO", "circle"), (False, "misses SLO", "x")):
        g = points[points["meets_slo"] == ok]
        if len(g):
            fig.add_scatter(
                x=g[latency_column] * 1e3,
                y=g["cost_per_hour_usd"],
                mode="markers",
                name=name,
                marker=dict(symbol=symbol, size=10, color=SLO_COLORS[name]),
                text=g["label"],
                hovertemplate="%{text}<br>p99 %{x:,.1f} ms<br>$%{y:.2f}/h<extra></extra>",
            )
    front = points[points["pareto"]].sort_values(latency_column) if "pareto" in points else points.iloc[:0]
    if len(front) > 1:
        fig.add_scatter(
            x=front[latency_column] * 1e3,
            y=front["cost_per_hour_usd"],
            mode="lines",
            name="Pareto front",
            line=dict(dash="dash", color="gray"),
        )
    if recommended is not None and recommended in points.index:
        r = points.loc[recommended]
        fig.add_scatter(
            x=[r[latency_column] * 1e3],
            y=[r["cost_per_hour_usd"]],
            mode="markers",
            name="recommended",
            text=[r["label"]],
            marker=dict(size=18, symbol="star", color="gold", line=dict(color="black", width=1)),
        )
    log_axis(fig, "x", points[latency_column] * 1e3, title=f"p99 {latency_label} (ms)")
    fig.update_yaxes(title="$ per hour", rangemode="tozero")
    return _finish(fig, title, height=420)


# ------------------------------------------------------------------------------- sim vs real


def error_figure(table: pd.DataFrame) -> go.Figure:
    """Relative error per summary metric (`simulator.validate.compare` rows), with the targets."""
    title = "Relative error per metric (simulated - real) / real"
    if table.empty:
        return _empty(title, "no metrics")
    ok = table["ok"].map({True: "within target", False: "outside target"}).fillna("no target")
    colors = {"within target": "#2ca02c", "outside target": "#d62728", "no target": "#7f7f7f"}
    fig = go.Figure()
    for status, color in colors.items():
        g = table[ok == status]
        if len(g):
            fig.add_bar(x=g["metric"], y=g["rel_error"], name=status, marker_color=color)
    t = table.dropna(subset=["target"])
    if len(t):
        for sign in (1, -1):
            fig.add_scatter(
                x=t["metric"],
                y=sign * t["target"],
                mode="markers",
                marker=dict(symbol="line-ew-open", size=24, color="black"),
                name="target" if sign > 0 else None,
                showlegend=sign > 0,
            )
    fig.update_yaxes(title="relative error", tickformat=".0%")
    fig.update_xaxes(title="", categoryorder="array", categoryarray=list(table["metric"]))
    return _finish(fig, title)


def scatter_figure(paired: pd.DataFrame, metric: str, label: str, max_points: int = 5000) -> go.Figure:
    title = f"{label}: simulated against real, per request"
    x, y = paired[f"{metric}_real"], paired[f"{metric}_sim"]
    ok = x.notna() & y.notna()
    frame = paired[ok]
    if frame.empty:
        return _empty(title, "no requests in both runs")
    if len(frame) > max_points:
        frame = frame.sample(max_points, random_state=0)
    real_ms, sim_ms = frame[f"{metric}_real"] * 1e3, frame[f"{metric}_sim"] * 1e3
    fig = go.Figure(
        go.Scattergl(
            x=real_ms,
            y=sim_ms,
            mode="markers",
            marker=dict(size=4, opacity=0.5, color=PALETTE[0]),
            text=frame["request_id"],
            hovertemplate="request %{text}<br>real %{x:,.1f} ms<br>sim %{y:,.1f} ms<extra></extra>",
            name="requests",
        )
    )
    lo = float(min(real_ms.min(), sim_ms.min()))
    hi = float(max(real_ms.max(), sim_ms.max()))
    fig.add_scatter(
        x=[lo, hi], y=[lo, hi], mode="lines", name="sim = real", line=dict(dash="dash", color="gray")
    )
    fig.update_xaxes(title=f"real {label} (ms)")
    fig.update_yaxes(title=f"simulated {label} (ms)")
    return _finish(fig, title, height=400)


def residual_figure(
    res: pd.DataFrame, x: str = "total_num_scheduled_tokens", max_points: int = 5000
) -> go.Figure:
    title = "Step-time residuals (predicted - measured)"
    if res.empty:
        return _empty(title, "no step records")
    frame = res.sample(max_points, random_state=0) if len(res) > max_points else res
    fig = px.scatter(
        frame,
        x=x,
        y="residual",
        color="kind",
        color_discrete_map=KIND_COLORS,
        opacity=0.6,
        hover_data=["num_seqs", "measured_s", "predicted_s"],
        render_mode="webgl",
    )
    fig.add_hline(y=0, line_dash="dash", line_color="gray")
    fig.update_yaxes(title="relative residual", tickformat=".0%")
    log_axis(fig, "x", frame[x], title=x.replace("_", " "))
    return _finish(fig, title, height=400)


# ------------------------------------------------------------------------------- engine profile


def decode_figure(curves: pd.DataFrame, records: pd.DataFrame | None = None) -> go.Figure:
    fig = go.Figure()
    for ctx, g in curves.groupby("context_len", sort=True):
        fig.add_scatter(x=g["num_seqs"], y=g["step_ms"], mode="lines", name=f"model, context {ctx:,}/seq")
    if records is not None and not records.empty:
        dec = records[records["kind"].astype(str) == "decode"]
        if len(dec):
            dec = dec.sample(5000, random_state=0) if len(dec) > 5000 else dec
            fig.add_scatter(
                x=dec["num_seqs"],
                y=dec["measured_s"] * 1e3,
                mode="markers",
                name="measured steps",
                marker=dict(size=5, opacity=0.5, color="black"),
                customdata=dec["num_context_tokens"],
                hovertemplate="%{x} seqs, %{customdata:,} context tokens: %{y:.3f} ms<extra></extra>",
            )
    log_axis(fig, "x", title="sequences in the decode step")
    fig.update_yaxes(title="step time (ms)", rangemode="tozero")
    return _finish(fig, "Decode step time against batch size", height=400)


def prefill_figure(curves: pd.DataFrame, records: pd.DataFrame | None = None) -> go.Figure:
    fig = go.Figure()
    for cached, g in curves.groupby("cached_tokens", sort=True):
        fig.add_scatter(x=g["new_tokens"], y=g["step_ms"], mode="lines", name=f"model, {cached:,} cached")
    if records is not None and not records.empty:
        pre = records[records["kind"].astype(str).isin(["prefill", "mixed"])]
        if len(pre):
            pre = pre.sample(5000, random_state=0) if len(pre) > 5000 else pre
            fig.add_scatter(
                x=pre["total_num_scheduled_tokens"],
                y=pre["measured_s"] * 1e3,
                mode="markers",
                name="measured steps",
                marker=dict(size=5, opacity=0.5, color="black"),
                customdata=np.stack([pre["kind"].astype(str), pre["num_seqs"]], axis=1),
                hovertemplate="%{customdata[0]}, %{customdata[1]} seqs, %{x:,} tokens: %{y:.3f} ms<extra></extra>",
            )
    log_axis(fig, "x", title="tokens scheduled in the step")
    fig.update_yaxes(title="step time (ms)", rangemode="tozero")
    return _finish(fig, "Prefill / mixed step time against new tokens", height=400)


def breakdown_figure(curves: pd.DataFrame) -> go.Figure:
    """Stacked parts of a single-sequence prefill step (no cached tokens)."""
    g = curves[curves["cached_tokens"] == curves["cached_tokens"].min()]
    fig = go.Figure()
    for part in ("linear", "attention", "communication", "overhead"):
        fig.add_bar(x=g["new_tokens"].astype(str), y=g[f"{part}_ms"], name=part)
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title="new tokens (one sequence)", type="category")
    fig.update_yaxes(title="ms")
    return _finish(fig, "Where a prefill step's time goes")
