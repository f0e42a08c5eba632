"""Streamlit-side state for the pages: cached traces, the session's trace registry, the shared
simulation result store and the worker pool that runs what-if and plan simulations in parallel.

Caching and session bookkeeping only; what is computed lives in `dashboard.logic`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import sys
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import streamlit as st

import traces
from dashboard import logic
from simulator.defaults import DEFAULT_TRACE
from simulator.metrics import SLO
from simulator.run import SimResult
from traces import Trace

SHIPPED = "shipped:"
UPLOADED = "uploaded:"
GENERATED = "generated:"
_REGISTRY = "kvplan_traces"  # session_state: {trace key: (label, Trace)} for uploads and generated
ACTIVE_TRACE = "kvplan_active_trace"  # session_state: the key the Traffic page last showed
WORKERS_ENV = "KVPLAN_DASHBOARD_WORKERS"
WINDOW_ENV = "KVPLAN_DASHBOARD_WINDOW_S"
T = TypeVar("T")


@st.cache_resource(show_spinner="Loading trace…", max_entries=8)
def shipped_trace(name: str) -> Trace:
    return traces.load_shipped(name)


@st.cache_resource(show_spinner="Generating trace…", max_entries=16)
def generated_trace(spec_json: str) -> Trace:
    return traces.generate(json.loads(spec_json))


def _registry() -> dict[str, tuple[str, Trace]]:
    return st.session_state.setdefault(_REGISTRY, {})


def add_uploaded(data: bytes, filename: str) -> str:
    """Load an upload (ValueError with the loader's message if malformed); returns its trace key."""
    key = UPLOADED + hashlib.sha1(data).hexdigest()[:16]
    reg = _registry()
    if key not in reg:
        loaded = logic.load_trace_bytes(data, filename)
        reg[key] = (f"uploaded: {filename}", loaded.trace)
        st.session_state[f"{key}:report"] = (loaded.report, loaded.warnings)
    return key


def upload_report(key: str) -> tuple[str, tuple[str, ...]] | None:
    return st.session_state.get(f"{key}:report")


def add_generated(spec: dict[str, Any]) -> str:
    """Generate (cached by spec) and register a synthetic trace; returns its trace key."""
    spec_json = json.dumps(spec, sort_keys=True)
    key = GENERATED + hashlib.sha1(spec_json.encode()).hexdigest()[:16]
    _registry()[key] = (f"generated: {spec['name']}", generated_trace(spec_json))
    return key


def trace_options() -> dict[str, str]:
    """Trace key -> label: the shipped samples, then this session's uploads and generated traces."""
    out = {SHIPPED + name: name for name in traces.shipped_names()}
    out.update({key: label for key, (label, _) in _registry().items()})
    return out


def get_trace(key: str) -> Trace:
    if key.startswith(SHIPPED):
        return shipped_trace(key[len(SHIPPED) :])
    return _registry()[key][1]


def trace_picker(
    label: str, key: str, default: str | None = None, help: str | None = None
) -> tuple[str, Trace]:
    """A select box over `trace_options()`; defaults to the trace the Traffic page last showed."""
    options = trace_options()
    keys = list(options)
    if key in st.session_state and st.session_state[key] not in options:
        del st.session_state[key]  # a trace from another session or an expired upload
    preferred = st.session_state.get(ACTIVE_TRACE) or default or SHIPPED + DEFAULT_TRACE
    index = keys.index(preferred) if preferred in options else 0
    choice = st.selectbox(label, keys, index=index, format_func=options.__getitem__, key=key, help=help)
    return choice, get_trace(choice)


# ------------------------------------------------------------------------------- widget state across pages

# Streamlit forgets a widget's value at the end of a run that does not draw it (another page's run).
# Widgets with these key prefixes keep theirs: `keep_widget_state` writes each value back under its
# key at the start of every run, which makes it a value the session holds, not a widget's.
KEPT_PREFIXES = ("traffic_", "gen_", "wi_", "cap_", "val_", "prof_")
NOT_KEPT = frozenset({"traffic_upload", "prof_records", "prof_upload"})  # file uploaders: not settable
NOT_KEPT_SUFFIX = "_button"  # buttons' keys end so: a button's value cannot be set either


def keep_widget_state() -> None:
    """Keep the pages' widget values across page switches (call at the start of every run)."""
    for key in list(st.session_state):
        if (
            isinstance(key, str)
            and key.startswith(KEPT_PREFIXES)
            and key not in NOT_KEPT
            and not key.endswith(NOT_KEPT_SUFFIX)
        ):
            with contextlib.suppress(st.errors.StreamlitAPIException):  # a value that cannot be set
                st.session_state[key] = st.session_state[key]


# ------------------------------------------------------------------------------- simulations


@st.cache_resource
def result_store() -> logic.ResultStore:
    return logic.ResultStore(max_entries=96)


def default_window_s() -> float:
    """The what-if page's default replay window: $KVPLAN_DASHBOARD_WINDOW_S, else logic.DEFAULT_WINDOW_S."""
    try:
        return max(0.0, float(os.environ[WINDOW_ENV]))
    except (KeyError, ValueError):
        return logic.DEFAULT_WINDOW_S


def num_workers() -> int:
    """Worker processes for simulations: $KVPLAN_DASHBOARD_WORKERS, else min(4, CPUs)."""
    raw = os.environ.get(WORKERS_ENV)
    if raw:
        try:
            return max(1, int(raw))
        except ValueError:
            pass
    return max(1, min(4, os.cpu_count() or 1))


def _main_is_importable() -> bool:
    """Whether worker processes can re-import __main__ (forkserver does): a module run with -m,
    or a script file; not code read from stdin or a notebook."""
    main = sys.modules.get("__main__")
    if getattr(main, "__spec__", None) is not None:
        return True
    path = getattr(main, "__file__", None)
    return bool(path) and os.path.isfile(path)


@st.cache_resource
def executor() -> Executor | None:
    """A process pool (forkserver with the library preloaded) or None to simulate in-process."""
    workers = num_workers()
    if workers <= 1 or not _main_is_importable():
        return None
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["dashboard.logic"])
    return ProcessPoolExecutor(max_workers=workers, mp_context=ctx)


def warm_pool() -> None:
    """Start the worker processes now (without waiting), so the first comparison does not pay for it."""
    pool = executor()
    if pool is not None and not st.session_state.get("_kvplan_pool_warm"):
        st.session_state["_kvplan_pool_warm"] = True
        for _ in range(num_workers()):
            pool.submit(logic.nice_step, 1.0)


def with_pool(fn: Callable[[Executor | None], T]) -> T:
    """`fn(pool)`; if the pool broke (a worker died), drop it and run `fn(None)` in-process."""
    try:
        return fn(executor())
    except BrokenProcessPool:
        executor.clear()
        return fn(None)


def run_jobs(
    trace_key: Hashable,
    trace: Trace,
    jobs: Sequence[logic.SimJob],
    on_done: logic.Progress | None = None,
) -> list[SimResult | Exception]:
    """Simulate `jobs`, reusing results cached under (trace key, job); `on_done(done, total)` as each
    job that was not cached finishes."""
    return with_pool(
        lambda pool: logic.run_jobs_cached(result_store(), trace_key, trace, jobs, pool, on_done)
    )


# ------------------------------------------------------------------------------- shared widgets


def latency_input(prefix: str) -> str:
    """Latency model choice: auto (shipped fitted profile where one matches), roofline, or a profile."""
    from simulator.defaults import SHIPPED_PROFILE_DIR

    options = [
        logic.LATENCY_AUTO,
        logic.LATENCY_ROOFLINE,
        *map(str, logic.profile_files(SHIPPED_PROFILE_DIR)),
    ]
    names = {
        logic.LATENCY_AUTO: "auto: shipped fitted profile if one matches, else roofline",
        logic.LATENCY_ROOFLINE: "roofline (analytic, from the GPU spec table)",
    }
    return st.selectbox(
        "Latency model",
        options,
        format_func=lambda o: names.get(o, f"profile: {os.path.basename(o)}"),
        key=f"{prefix}_latency",
        help="A fitted profile applies only to its own model, GPU, TP and block size; "
        "configurations that differ from it are reported as errors.",
    )


def slo_inputs(prefix: str, ttft_ms: float = 2000.0, tpot_ms: float = 80.0, e2e_ms: float = 0.0) -> SLO:
    """SLO objectives in ms (0 = unconstrained) as an SLO: a configuration meets it when every p99 is
    within its limit and every request is served."""
    c1, c2, c3 = st.columns(3)
    ttft = c1.number_input(
        "p99 TTFT objective (ms)", 0.0, 600_000.0, ttft_ms, 100.0, key=f"{prefix}_slo_ttft", help=HELP["TTFT"]
    )
    tpot = c2.number_input(
        "p99 TPOT objective (ms)", 0.0, 10_000.0, tpot_ms, 5.0, key=f"{prefix}_slo_tpot", help=HELP["TPOT"]
    )
    e2e = c3.number_input(
        "p99 E2E objective (ms)", 0.0, 3_600_000.0, e2e_ms, 1000.0, key=f"{prefix}_slo_e2e", help=HELP["E2E"]
    )
    return SLO(
        ttft_s=ttft / 1e3 if ttft else None,
        tpot_s=tpot / 1e3 if tpot else None,
        e2e_s=e2e / 1e3 if e2e else None,
    )


# Plain-language help for the terms the pages use (widget help and captions).
HELP = {
    "TTFT": "Time to first token: from a request's arrival to its first output token (queueing and "
    "prefill). 0 = no objective.",
    "TPOT": "Time per output token: a request's mean time between output tokens after the first "
    "(decode speed). 0 = no objective.",
    "E2E": "End to end: from a request's arrival to its last token. 0 = no objective.",
}
GLOSSARY = {
    "TTFT": "time to first token: from a request's arrival to its first output token (queueing and prefill).",
    "TPOT": "time per output token: a request's mean time between output tokens after the first (decode).",
    "E2E": "end to end: from a request's arrival to its last output token.",
    "p50, p99": "percentiles: 99 % of requests did at least as well as the p99 and 1 % did worse. Of 1,000 "
    "requests the p99 is the 10th-worst; of 100, the worst.",
    "meets SLO": "every p99 within its objective and every request served (as kvplan plan counts it). "
    "SLO attainment is the share of requests that met every objective.",
    "offered, served, load": "offered is the rate requests arrive at; served the rate the configuration "
    "takes them in (from how long they queue). Keeps up: served is at least 95 % of offered; near "
    "saturation: 80-95 %; overloaded: below 80 %, its queue grows for as long as the traffic lasts.",
    "preemptions": "times a running request was pushed out of the KV cache to make room, to be recomputed "
    "later: a sign that the cache is small for the batch.",
    "prefix hit rate": "share of prompt tokens already in the KV cache (a shared system prompt, an earlier "
    "turn), whose prefill is skipped.",
    "rejected": "requests a configuration cannot take at all: a prompt longer than the model's context or "
    "than the whole KV cache.",
    "steps outside fit": "share of simulated steps that a fitted profile priced outside the shapes it was "
    "measured on (an extrapolation).",
}


def glossary() -> None:
    """An expander that says, in plain words, what the pages' numbers mean."""
    with st.expander("What these numbers mean"):
        st.markdown("\n".join(f"- **{term}**: {text}" for term, text in GLOSSARY.items()))
