"""Engine profile page: a latency model's step time against batch shape (decode batch size and
context, prefill chunk size), a fitted profile's coefficients and held-back error, and, with engine
step records, the measured steps over the curves and the fit's residuals.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from dashboard import figures, logic
from simulator import validate
from simulator.defaults import SHIPPED_PROFILE_DIR
from simulator.latency import FittedModel, LatencyProfile, RooflineModel, fit_step_records, get_gpu
from simulator.models import preset_names, resolve_model

UPLOAD = "upload a profile JSON…"
ROOFLINE = "roofline (no profile)…"
FIT = "fit on the uploaded step records"
BATCH_SIZES = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512]
CONTEXTS = [512, 2048, 8192]
TARGETS = {"wall_time_s": "wall time", "gpu_time_s": "GPU time"}
PREFILL_TOKENS = [16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


@st.cache_data(show_spinner=False, max_entries=8)
def read_records(data: bytes, name: str) -> pd.DataFrame:
    return logic.read_step_records(data, name)


@st.cache_resource(show_spinner="Fitting…", max_entries=8)
def fit_records(name: str, _records: pd.DataFrame, size: int) -> FittedModel:
    # as `kvplan fit` does by default; records do not say how a split-KV decode kernel split them,
    # so the longest_split feature stays out
    return fit_step_records(_records, loss="median")


def _index(options: list[str], preferred: str) -> int:
    return options.index(preferred) if preferred in options else 0


st.title("Engine profile")
st.caption("How long the latency model says a step takes, and how well it fits the engine's measured steps.")
shipped = {p.name: p for p in logic.profile_files(SHIPPED_PROFILE_DIR)}
c1, c2 = st.columns(2)
records_file = c2.file_uploader(
    "Engine step records (Parquet or CSV from `kvplan profile --records` or a replay's steps.parquet)",
    key="prof_records",
    max_upload_size=logic.UPLOAD_LIMIT_BYTES // 2**20,
)
records = None
if records_file is not None:
    try:
        records = read_records(records_file.getvalue(), records_file.name)
    except ValueError as e:
        c2.error(str(e))
choices = [*shipped, UPLOAD, ROOFLINE] + ([FIT] if records is not None else [])
default = next(iter(shipped), ROOFLINE)
seen = records_file.file_id if records_file is not None else None
if seen != st.session_state.get("prof_records_seen"):  # new records: show a fit on them first
    st.session_state["prof_records_seen"] = seen
    if records is not None:
        st.session_state["prof_source"] = FIT
if st.session_state.get("prof_source") not in choices:
    st.session_state["prof_source"] = default
source = c1.selectbox("Latency model", choices, key="prof_source")

model = None  # the LatencyModel to draw
profile = None  # its LatencyProfile, when it comes from one
label = ""
try:
    if source in shipped:
        profile = LatencyProfile.load(shipped[source])
    elif source == UPLOAD:
        up = c1.file_uploader("Profile JSON", type=["json"], key="prof_upload")
        if up is None:
            st.info("Upload a latency profile JSON (written by `kvplan profile`).")
            st.stop()
        profile = logic.read_profile_json(up.getvalue(), up.name)
    elif source == FIT:
        model = fit_records(records_file.name, records, len(records))
        label = f"fitted on {records_file.name} (median loss, no split-KV term)"
    else:
        models, gpus = preset_names(), logic.gpu_names()
        cm, cg, ct = c1.columns(3)
        name = cm.selectbox("Model", models, index=_index(models, "qwen3-8b"), key="prof_model")
        gpu = cg.selectbox("GPU", gpus, index=_index(gpus, "H200-SXM"), key="prof_gpu")
        tp = ct.selectbox("TP", [1, 2, 4, 8], key="prof_tp")
        model = RooflineModel(resolve_model(name), get_gpu(gpu), tp=tp)
        label = f"roofline: {name} on {gpu}, TP {tp}"
except (ValueError, KeyError) as e:
    st.error(f"Cannot use this latency model: {e}")
    st.stop()
if profile is not None:
    model = profile.to_latency_model()
    label = profile.describe()

st.subheader(label)
if profile is not None:
    m = st.columns(4)
    m[0].metric("Fitted on", f"{profile.num_records:,} steps")
    m[1].metric("Fitted to", TARGETS.get(profile.target, profile.target or "not recorded"))
    m[2].metric(
        "Held-back steps",
        f"{profile.decode.error.n_test + profile.prefill.error.n_test:,}"
        if profile.decode.error and profile.prefill.error
        else "not recorded",
    )
    graph = profile.max_graph_batch_size
    m[3].metric("Largest decode graph", f"{graph:,} sequences" if graph else "not recorded")
    cache = profile.calibration_num_kv_blocks
    st.caption(
        f"engine {profile.engine_version or 'not recorded'}, attention backend "
        f"{profile.attention_backend or 'not recorded'}, created {profile.created or 'not recorded'}; "
        + (f"calibrated on a cache of {cache:,} KV blocks" if cache else "calibration cache not recorded")
        + " (a condition of the calibration: simulations size their cache from the GPU's memory)"
    )
fits = profile if profile is not None else (model if hasattr(model, "decode") else None)
if fits is not None:
    c1, c2 = st.columns(2)
    c1.dataframe(
        logic.profile_coefficients(fits)
        .assign(coefficient=lambda f: f["coefficient"] * 1e6)
        .rename(columns={"coefficient": "µs per unit"})
        .style.format({"µs per unit": logic.plain_number}),
        hide_index=True,
        key="prof_coef",
    )
    errors = logic.profile_errors(fits)
    if not errors.empty:
        c2.dataframe(
            errors.style.format({c: "{:.1%}" for c in errors.columns if "error" in c}),
            hide_index=True,
            key="prof_err",
        )

residuals = None
if records is not None:
    try:
        residuals = logic.step_residuals(records, model)
    except (ValueError, KeyError) as e:
        st.error(f"Cannot compare the step records with this model: {e}")

c1, c2 = st.columns(2)
c1.plotly_chart(
    figures.decode_figure(logic.decode_curves(model, BATCH_SIZES, CONTEXTS), residuals),
    key="prof_decode",
    config=figures.CHART_CONFIG,
)
prefill = logic.prefill_curves(model, PREFILL_TOKENS, cached=(0, 4096))
c2.plotly_chart(figures.prefill_figure(prefill, residuals), key="prof_prefill", config=figures.CHART_CONFIG)
st.plotly_chart(figures.breakdown_figure(prefill), key="prof_breakdown", config=figures.CHART_CONFIG)

st.subheader("Residuals against the step records")
if residuals is None:
    st.info(
        "Upload step records (Parquet or CSV, the columns of docs/CONTRACT.md) to see the fit's residuals."
    )
elif residuals.empty:
    st.warning("The step records have no usable steps (all empty or compiling).")
else:
    st.dataframe(
        validate.step_error_by_kind(residuals).style.format(logic.RESIDUAL_FORMAT),
        hide_index=True,
        key="prof_residual_table",
    )
    st.plotly_chart(figures.residual_figure(residuals), key="prof_residuals", config=figures.CHART_CONFIG)
    st.caption(f"Measured column: {validate.measured_column(records, model)}; {Path(records_file.name).name}")
