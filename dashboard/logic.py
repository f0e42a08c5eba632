"""Pure helpers behind the dashboard pages: trace views, what-if comparisons, capacity plans,
sim-vs-real tables and latency-profile curves, as plain objects and DataFrames.
No streamlit here and no charts: pages call these (through `dashboard.state` caches) and hand the
frames to `dashboard.figures`. Unit tested in tests/dashboard/test_logic.py.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import tempfile
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Executor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import traces
from engine.model_spec import ModelSpec
from simulator import plan, sweep, validate
from simulator.config import SimConfig
from simulator.defaults import profile_of_engine
from simulator.latency import LatencyModel, LatencyProfile, StepShape, load_gpu_specs
from simulator.latency.profile import PROFILE_FORMAT
from simulator.load import NO_LOAD, Load, load_verdict, run_load
from simulator.metrics import SLO, add_latencies, summarize
from simulator.run import SimResult, run_simulation
from traces import Trace

UPLOAD_LIMIT_BYTES = 50 * 2**20
DEFAULT_WINDOW_S = 300.0  # what-if replay window: 4 configurations in < 10 s on 2 cores
LATENCY_AUTO = "auto"
LATENCY_ROOFLINE = "roofline"
LATENCY_METRICS = {"ttft_s": "TTFT", "tpot_s": "TPOT", "e2e_s": "E2E"}


# =============================================================================== traces


@dataclass(frozen=True)
class LoadedTrace:
    """A trace read from uploaded bytes, with the loader's report and warnings (as text)."""

    trace: Trace
    report: str
    warnings: tuple[str, ...] = ()


def load_trace_bytes(data: bytes, filename: str, limit_bytes: int = UPLOAD_LIMIT_BYTES) -> LoadedTrace:
    """Load an uploaded trace file (any format `traces.load` detects).

    Raises ValueError with the loader's message (naming `filename`, the line and the field) for a
    file that is too large, empty or malformed; never another exception type.
    """
    safe = Path(filename).name or "trace"
    if len(data) > limit_bytes:
        raise ValueError(
            f"{safe}: {len(data) / 2**20:.1f} MiB is over the upload limit of {limit_bytes / 2**20:.0f} MiB; "
            "cut the trace (e.g. `kvplan traces window`) or load it from disk"
        )
    with tempfile.TemporaryDirectory(prefix="kvplan-upload-") as tmp:
        path = Path(tmp) / safe

        def clean(text: str) -> str:
            return text.replace(str(path), safe).replace(tmp + "/", "")

        path.write_bytes(data)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trace = traces.load(path, name=Path(safe).stem.split(".")[0] or "trace")
        except (ValueError, FileNotFoundError) as e:  # TraceError is a ValueError
            raise ValueError(clean(str(e))) from None
        except Exception as e:  # a reader's own error on a corrupt file: still a message, not a traceback
            raise ValueError(
                f"{safe}: could not be read as a trace ({type(e).__name__}: {clean(str(e))})"
            ) from None
        report = clean(trace.load_report.summary()) if trace.load_report else f"{safe}: {len(trace)} rows"
        return LoadedTrace(trace, report, tuple(clean(str(w.message)) for w in caught))


def nice_step(raw: float) -> float:
    """The smallest of 1, 2, 5 x 10^k that is >= raw (raw > 0)."""
    if not raw > 0:
        return 1.0
    exp = math.floor(math.log10(raw))
    for m in (1.0, 2.0, 5.0, 10.0):
        step = m * 10.0**exp
        if step >= raw * (1 - 1e-12):
            return step
    return 10.0 ** (exp + 1)


def auto_bin_s(duration_s: float, target_bins: int = 120) -> float:
    """A round bin width that cuts `duration_s` into about `target_bins` bins."""
    return nice_step(max(duration_s, 1e-3) / max(target_bins, 1))


def arrival_rate(trace: Trace, bin_s: float | None = None) -> pd.DataFrame:
    """Requests per bin of arrival time: columns time_s (bin start), requests, rate_rps."""
    a = trace.df["arrival_s"].to_numpy(dtype=float)
    if len(a) == 0:
        return pd.DataFrame({"time_s": [], "requests": [], "rate_rps": []})
    bin_s = bin_s or auto_bin_s(float(a[-1]))
    edges = np.arange(0.0, float(a[-1]) + bin_s, bin_s)
    if len(edges) < 2:
        edges = np.array([0.0, bin_s])
    counts, _ = np.histogram(a, bins=edges)
    return pd.DataFrame({"time_s": edges[:-1], "requests": counts, "rate_rps": counts / bin_s})


def histogram(values: Sequence[float] | np.ndarray, bins: int = 60, log: bool = True) -> pd.DataFrame:
    """Counts of `values` in `bins` bins (log-spaced when `log` and all values > 0): columns
    left, right, center, count. Binned here so that figures carry bins, not every request."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return pd.DataFrame(columns=["left", "right", "center", "count"])
    lo, hi = float(v.min()), float(v.max())
    if hi <= lo:
        hi = lo + 1.0
    if log and lo > 0:
        edges = np.geomspace(lo, hi * (1 + 1e-9), bins + 1)
        centers = np.sqrt(edges[:-1] * edges[1:])
    else:
        edges = np.linspace(lo, hi * (1 + 1e-9) if hi > 0 else hi + 1e-9, bins + 1)
        centers = (edges[:-1] + edges[1:]) / 2
    counts, _ = np.histogram(v, bins=edges)
    return pd.DataFrame({"left": edges[:-1], "right": edges[1:], "center": centers, "count": counts})


def trace_summary(trace: Trace) -> dict[str, Any]:
    """Headline numbers of a trace (from `traces.trace_stats`) for metric tiles."""
    s = traces.trace_stats(trace)
    out = {
        "requests": s.rows,
        "duration_s": s.duration_s,
        "rate_rps": s.rate_rps,
        "interarrival_cv": s.interarrival_cv,
        "prompt_mean": s.prompt.mean,
        "prompt_p99": s.prompt.p99,
        "output_mean": s.output.mean,
        "output_p99": s.output.p99,
        "sessions": s.sessions,
        "block_reuse": s.prefix.block_reuse if s.prefix else None,
        "token_reuse": s.prefix.token_reuse if s.prefix else None,
    }
    return out


def prefix_reuse_curve(trace: Trace, points: int = 30) -> pd.DataFrame | None:
    """Cumulative prefix reuse (infinite cache, `traces.prefix_reuse`) over the trace's first k rows,
    at `points` arrival times: columns time_s, requests, block_reuse, token_reuse. None without prefix ids."""
    if not trace.has_prefix_ids or len(trace) == 0:
        return None
    n = len(trace)
    ks = np.unique(np.linspace(max(1, n // points), n, points).astype(int))
    a = trace.df["arrival_s"].to_numpy()
    rows = []
    for k in ks:
        head = trace.with_frame(trace.df.iloc[:k], validate=False)
        r = traces.prefix_reuse(head)
        rows.append((float(a[k - 1]), int(k), r.block_reuse, r.token_reuse))
    return pd.DataFrame(rows, columns=["time_s", "requests", "block_reuse", "token_reuse"])


def generator_spec(
    *,
    num_requests: int,
    rate: float,
    arrival: str = "poisson",
    cv: float = 2.0,
    prompt: str = "lognormal:1024,1.0",
    output: str = "lognormal:256,0.8",
    num_prefixes: int = 0,
    prefix_len: int = 1024,
    zipf: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """A `traces.generate` spec from the Traffic page's generator widgets (length specs as text).
    A length spec that cannot be read or sampled is a ValueError naming its field and its text."""
    spec: dict[str, Any] = {
        "name": f"generated-{arrival}-{rate:g}rps-seed{seed}",
        "seed": int(seed),
        "num_requests": int(num_requests),
        "arrival": arrival,
        "rate": float(rate),
        "prompt": length_spec("Prompt lengths", prompt),
        "output": length_spec("Output lengths", output),
    }
    if arrival == "gamma":
        spec["cv"] = float(cv)
    if num_prefixes > 0:
        spec["shared_prefix"] = {
            "num_prefixes": int(num_prefixes),
            "prefix_len": int(prefix_len),
            "zipf": zipf,
        }
    return spec


LENGTH_EXAMPLES = "a number (256), uniform:LOW,HIGH, lognormal:MEAN,SIGMA or empirical:azure_conv_2023"


def length_spec(field: str, text: str) -> dict[str, Any]:
    """`traces.parse_length_spec(text)`, checked by sampling two lengths from it; a ValueError that
    names `field`, the text and what is wrong (never Python's own wording) otherwise."""
    text = str(text).strip()

    def fail(why: str) -> ValueError:
        return ValueError(f"{field} {text!r}: {why}. Give {LENGTH_EXAMPLES}")

    try:
        spec = traces.parse_length_spec(text)
    except ValueError as e:
        message = str(e)
        if message.startswith("could not convert") or message.startswith("invalid literal"):
            bad = message.rsplit(":", 1)[-1].strip()
            raise fail(f"{bad} is not a number") from None
        if "too many values" in message:
            raise fail("too many values") from None
        raise fail("not a length spec" if message.startswith("cannot parse") else message) from None
    probe = {"name": "probe", "seed": 0, "num_requests": 2, "arrival": "constant", "rate": 1.0}
    try:
        traces.generate({**probe, "prompt": spec, "output": {"kind": "fixed", "value": 1}})
    except (ValueError, FileNotFoundError, KeyError, TypeError) as e:
        raise fail(str(e).strip("'\"")) from None
    return spec


def prepare_trace(trace: Trace, window_s: float | None = None, rate_scale: float = 1.0) -> Trace:
    """The trace a simulation replays: its first `window_s` seconds (None: all), `rate_scale` x faster."""
    out = trace
    if window_s is not None and window_s > 0 and len(trace) and window_s < trace.duration_s:
        out = traces.time_window(trace, 0.0, float(window_s))
    if rate_scale != 1.0:
        out = traces.scale_rate(out, factor=float(rate_scale))
    return out


DEFAULT_PLAN_REQUESTS = 5000  # capacity plan: requests each candidate simulates (after rescaling)
FEW_REQUESTS = 1000  # below this, a p99 rests on the 10 worst requests or fewer


def plan_trace(trace: Trace, num_requests: int | None) -> Trace:
    """The trace a capacity plan rescales to its target rate: the first `num_requests` requests
    (None or 0: all), as `kvplan plan --limit N` takes them. A fixed amount of traffic, so that a
    higher target rate simulates the same number of requests over a shorter time, not fewer."""
    if num_requests is not None and num_requests < 0:
        raise ValueError(f"requests to simulate: must be >= 0, got {num_requests}")
    if not num_requests or num_requests >= len(trace):
        return trace
    return trace.with_frame(trace.df.iloc[: int(num_requests)].reset_index(drop=True), validate=False)


def tail_note(num_requests: int, quantile: float = 0.99) -> str | None:
    """A warning when a `quantile` latency rests on few requests (fewer than FEW_REQUESTS)."""
    if num_requests >= FEW_REQUESTS:
        return None
    worst = max(1, math.ceil(num_requests * (1 - quantile)))
    rank = "the worst request" if worst == 1 else f"the {_ordinal(worst)}-worst request"
    return (
        f"Only {num_requests:,} requests per simulation: each p{quantile * 100:g} is {rank}, so one "
        f"slow request moves it. Simulate at least {FEW_REQUESTS:,} requests for a steadier answer."
    )


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


# =============================================================================== load: offered against served


def result_load(result: SimResult) -> Load:
    """`load_verdict` of a simulation, over the span of its requests' arrivals."""
    return run_load(result.summary)


# =============================================================================== what-if


@dataclass(frozen=True)
class ConfigSpec:
    """One column of the what-if comparison: the knobs a user varies (the rest are page-wide)."""

    label: str
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    tensor_parallel_size: int = 1
    num_replicas: int = 1

    def to_sim_config(self, model: ModelSpec, gpu: str, **common: Any) -> SimConfig:
        """The SimConfig (validated: ValueError names the field) for `model` on `gpu`."""
        return SimConfig(
            model=model,
            gpu=gpu,
            tensor_parallel_size=self.tensor_parallel_size,
            num_replicas=self.num_replicas,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            **common,
        )


DEFAULT_CONFIGS = (
    ConfigSpec("A: default"),
    ConfigSpec("B: block 256", block_size=256),  # shipped profiles exist at blocks 16 and 256
    ConfigSpec("C: small batch", max_num_seqs=64, max_num_batched_tokens=4096),
    ConfigSpec("D: 2 replicas", num_replicas=2),
)


def resolve_profile(
    choice: str, model_key: str, gpu: str, block_size: int, tp: int, async_scheduling: bool = False
) -> Path | None:
    """Latency profile for one configuration: `auto` = the shipped fitted profile for model, GPU,
    block size and TP if there is one (else roofline; with `async_scheduling` the one calibrated on
    an engine scheduling asynchronously, where shipped), `roofline` = None, otherwise a file path."""
    if choice in (LATENCY_AUTO, LATENCY_ROOFLINE):
        return sweep.profile_for(choice, model_key, gpu, block_size, tp, async_scheduling)
    path = Path(choice)
    if not path.is_file():
        raise ValueError(f"latency profile {path}: no such file")
    return path


@dataclass(frozen=True)
class SimJob:
    """One simulation to run: a configuration and its latency profile (None: roofline)."""

    config: SimConfig
    profile: Path | None = None

    @property
    def key(self) -> tuple[Hashable, ...]:
        return (self.config, str(self.profile) if self.profile else None)


def run_job(trace: Trace, job: SimJob) -> SimResult:
    """Run one simulation (module level so that a process pool can pickle it)."""
    return run_simulation(trace, job.config, profile=job.profile)


# The trace's prompts kept by a pool worker for its next jobs and points (the page's processes do
# not keep them: only the `_in_worker` functions, which the pools run, use it).
_WORKER_PROMPTS = sweep.PromptCache()


def run_job_in_worker(trace: Trace, job: SimJob) -> SimResult:
    """`run_job` in a pool worker: the trace's prompts are built once for the worker's jobs."""
    prompts = _WORKER_PROMPTS.get(trace, job.config)
    return run_simulation(trace, job.config, profile=job.profile, prompts=prompts)


def _outcome(fn: Callable[[], SimResult]) -> SimResult | Exception:
    try:
        return fn()
    except (ValueError, FileNotFoundError) as e:
        return e


Progress = Callable[[int, int], None]  # (simulations done, simulations in all)


def run_jobs(
    trace: Trace,
    jobs: Sequence[SimJob],
    executor: Executor | None = None,
    on_done: Progress | None = None,
) -> list[SimResult | Exception]:
    """Run `jobs` on `trace`, in parallel on `executor` if given, calling `on_done(done, total)` as
    each finishes. A job whose configuration is invalid yields its ValueError (with the library's
    message) in place of a result."""
    total = len(jobs)
    if executor is None or total <= 1:
        out = []
        for j in jobs:
            out.append(_outcome(lambda j=j: run_job(trace, j)))
            if on_done:
                on_done(len(out), total)
        return out
    futures = [executor.submit(run_job_in_worker, trace, j) for j in jobs]
    if on_done:
        for done, _ in enumerate(as_completed(futures), 1):
            on_done(done, total)
    return [_outcome(f.result) for f in futures]


class ResultStore:
    """A thread-safe LRU of simulation outcomes keyed by (trace key, job key)."""

    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        self._data: OrderedDict[Hashable, SimResult | Exception] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> SimResult | Exception | None:
        with self._lock:
            if key not in self._data:
                return None
            self._data.move_to_end(key)
            return self._data[key]

    def put(self, key: Hashable, value: SimResult | Exception) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)


def run_jobs_cached(
    store: ResultStore,
    trace_key: Hashable,
    trace: Trace,
    jobs: Sequence[SimJob],
    executor: Executor | None = None,
    on_done: Progress | None = None,
) -> list[SimResult | Exception]:
    """`run_jobs`, reusing outcomes already in `store` and running only the missing jobs
    (`on_done(done, total)` counts those)."""
    keys = [(trace_key, j.key) for j in jobs]
    out: list[SimResult | Exception | None] = [store.get(k) for k in keys]
    missing: dict[Hashable, SimJob] = {}
    for key, job, o in zip(keys, jobs, out):
        if o is None:
            missing.setdefault(key, job)
    fresh = dict(zip(missing, run_jobs(trace, list(missing.values()), executor, on_done)))
    for key, value in fresh.items():
        store.put(key, value)
    out = [fresh[k] if o is None else o for k, o in zip(keys, out)]
    return out  # type: ignore[return-value]


def slo_attainment(requests: pd.DataFrame, slo: SLO | None) -> float | None:
    """Share of requests that finished and met every objective of `slo` (None without objectives)."""
    if slo is None or (slo.ttft_s is None and slo.tpot_s is None and slo.e2e_s is None) or not len(requests):
        return None
    return float(slo.met(requests).mean())


# Summary-table columns: (label, summary key, scale). Latencies in ms (TTFT, TPOT) or s (E2E).
SUMMARY_COLUMNS = (
    ("TTFT p50 (ms)", "ttft_p50_s", 1e3),
    ("TTFT p99 (ms)", "ttft_p99_s", 1e3),
    ("TPOT p50 (ms)", "tpot_p50_s", 1e3),
    ("TPOT p99 (ms)", "tpot_p99_s", 1e3),
    ("E2E p50 (ms)", "e2e_p50_s", 1e3),
    ("E2E p99 (ms)", "e2e_p99_s", 1e3),
    ("throughput (req/s)", "throughput_rps", 1.0),
    ("output tok/s", "output_tok_s", 1.0),
    ("preemptions", "num_preemptions", 1),
    ("prefix hit rate", "prefix_hit_rate", 1.0),
    ("KV usage max", "kv_usage_max", 1.0),
    ("queue max", "queue_len_max", 1),
    ("finished", "num_finished", 1),
    ("rejected", "num_rejected", 1),
    ("steps outside fit", "steps_outside_fit_share", 1.0),  # share priced beyond the profile's records
)
# Objective name -> (column, True if larger is better).
OBJECTIVES = {
    "lowest p99 TTFT": ("TTFT p99 (ms)", False),
    "lowest p99 TPOT": ("TPOT p99 (ms)", False),
    "lowest p99 E2E": ("E2E p99 (ms)", False),
    "highest output tok/s": ("output tok/s", True),
    "lowest $ per M output tokens": ("$/M output tokens", False),
    "highest SLO attainment": ("SLO attainment", True),
}


def summary_table(results: Mapping[str, SimResult], slo: SLO | None = None) -> pd.DataFrame:
    """One row per configuration label: shape, latency percentiles, throughput, KV, queue, cost."""
    rows = []
    for label, r in results.items():
        s, c = r.summary, r.config
        row: dict[str, Any] = {"config": label, "GPUs": c.num_gpus}
        for name, key, scale in SUMMARY_COLUMNS:
            value = s.get(key)
            row[name] = float("nan") if value is None else value * scale
        row["$/h"] = plan.cost_per_hour(c.gpu, c.num_gpus)
        row["$/M output tokens"] = plan.cost_per_million_tokens(c.gpu, c.num_gpus, s.get("output_tok_s", 0.0))
        att = slo_attainment(r.requests, slo)
        row["SLO attainment"] = float("nan") if att is None else att
        load = result_load(r)
        row["offered (req/s)"], row["served (req/s)"] = load.offered_rps, load.served_rps
        row["status"], row["why"] = config_status(s, load, slo_objectives(slo))
        row.update(
            {
                "TP": c.tensor_parallel_size,
                "replicas": c.num_replicas,
                "block": c.block_size,
                "max seqs": c.max_num_seqs,
                "max batched tokens": c.max_num_batched_tokens,
                "KV blocks/replica": s.get("num_kv_blocks_per_replica"),
                "latency model": plan.row_latency(s),
            }
        )
        rows.append(row)
    if not rows:
        return pd.DataFrame()
    table = pd.DataFrame(rows).set_index("config")
    lead = [c for c in LEAD_COLUMNS if c in table]
    return table[lead + [c for c in table.columns if c not in lead]]


# The what-if table's first columns: what decides between the configurations.
LEAD_COLUMNS = (
    "status",
    "$/h",
    "$/M output tokens",
    "SLO attainment",
    "why",
    "latency model",
    "offered (req/s)",
    "served (req/s)",
    "GPUs",
)
MEETS, KEEPS = "meets SLO", "keeps up"
QUALIFIED = (f"{MEETS}, {KEEPS}", KEEPS)  # statuses of a configuration that may be called best


def slo_objectives(slo: SLO | None) -> tuple[plan.Objective, ...]:
    """The p99 objectives of `slo`'s limits: meeting the SLO means every p99 within its limit and
    every request served, as `kvplan plan` counts it."""
    if slo is None:
        return ()
    limits = (("ttft", slo.ttft_s), ("tpot", slo.tpot_s), ("e2e", slo.e2e_s))
    return tuple(plan.Objective(m, "p99", float(v)) for m, v in limits if v)


MISSING = "–"  # what a table shows for a value it does not have


def with_missing_shown(
    frame: pd.DataFrame, formats: Mapping[str, Any]
) -> tuple[pd.DataFrame, dict[str, str]]:
    """`frame` for st.dataframe, which draws a missing value as `None` whatever a Styler says: each
    column with a missing value becomes text (its `formats` entry applied, MISSING where missing);
    returns the frame and the formats left for the columns still numeric."""
    out = frame.copy()
    left: dict[str, Any] = {}
    for column in out.columns:
        fmt = formats.get(column)
        missing = out[column].isna()
        if missing.any():
            out[column] = [MISSING if m else _formatted(fmt, v) for v, m in zip(out[column], missing)]
        elif fmt:
            left[column] = fmt
    return out, left


def _formatted(fmt: Any, value: Any) -> str:
    if fmt is None:
        return str(value)
    return fmt(value) if callable(fmt) else fmt.format(value)


def table_style(frame: pd.DataFrame, formats: Mapping[str, Any]) -> Any:
    """`frame.style` with `formats`, missing values shown as MISSING (`with_missing_shown`)."""
    shown, left = with_missing_shown(frame, {k: v for k, v in formats.items() if k in frame})
    return shown.style.format(left)


def plain_number(value: float, digits: int = 4) -> str:
    """`value` to `digits` significant digits without scientific notation: 1,148, 9.914, 0.0002940."""
    v = float(value)
    if not math.isfinite(v):
        return "–"
    if v == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(v))))
    return f"{v:,.{decimals}f}"


def format_ms(seconds: float) -> str:
    """A latency in ms: `1,234 ms`, `80.5 ms`, `0.52 ms`."""
    ms = float(seconds) * 1e3
    if not math.isfinite(ms):
        return "n/a"
    return f"{ms:,.0f} ms" if abs(ms) >= 100 else f"{ms:.1f} ms" if abs(ms) >= 1 else f"{ms:.2f} ms"


def describe_miss(v: plan.Violation) -> str:
    """A missed objective in words and ms: `p99 TTFT 3,210 ms > 2,000 ms`; a run that falls behind
    as `config_status` says it: `overloaded: serves 6.7 of 10.1 req/s offered`."""
    if v.load is not None:
        return f"{v.load.verdict}: {_serves(v.load)}"
    if v.objective is None:
        return f"{v.unserved:,} of {v.num_requests:,} requests not served"
    o = v.objective
    return f"{o.stat} {o.metric.upper()} {format_ms(v.value)} > {format_ms(o.limit_s)}"


def config_status(
    summary: Mapping[str, Any], load: Load, objectives: Sequence[plan.Objective]
) -> tuple[str, str]:
    """(status, why) of one configuration: `meets SLO, keeps up` (or `keeps up` without objectives)
    when it may be called best, else what it misses: the SLO (which objective, by how much) and/or the
    offered rate (served against offered)."""
    misses = [describe_miss(v) for v in plan.violations(summary, objectives)]
    parts, why = [], list(misses)
    if objectives:
        parts.append(MEETS if not misses else "misses SLO")
    elif misses:
        parts.append("misses SLO")
    if load.verdict == NO_LOAD:
        parts.append("load n/a")
        why.append("too few requests to tell the load")
    else:
        parts.append(load.verdict)
        if load.falls_behind:
            why.append(_serves(load))
    return ", ".join(parts), "; ".join(why)


def _serves(load: Load) -> str:
    return f"serves {load.served_rps:,.1f} of {load.offered_rps:,.1f} req/s offered"


def mixed_latency_warning(results: Mapping[str, SimResult]) -> str | None:
    """A banner when the compared results come from different kinds of latency model (fitted and
    roofline): part of their difference then comes from the models (None when they share one)."""
    return plan.mixed_latency_warning([r.summary for r in results.values()])


def best_config(table: pd.DataFrame, objective: str) -> str | None:
    """Label of the best row for `objective` among those that meet the SLO and keep up with the
    offered rate (`status` in QUALIFIED, where the table has a status; ties: fewer GPUs, then the
    first); None if no such row has a finite value (e.g. SLO attainment without objectives)."""
    column, larger = OBJECTIVES[objective]
    if table.empty or column not in table:
        return None
    values = pd.to_numeric(table[column], errors="coerce")
    ok = np.isfinite(values.to_numpy(dtype=float))
    if "status" in table:
        ok &= table["status"].isin(QUALIFIED).to_numpy()
    if not ok.any():
        return None
    frame = pd.DataFrame({"v": -values if larger else values, "gpus": table["GPUs"]})[ok]
    frame["order"] = range(len(frame))
    return str(frame.sort_values(["v", "gpus", "order"], kind="stable").index[0])


def latency_cdfs(results: Mapping[str, SimResult], metric: str, points: int = 300) -> pd.DataFrame:
    """Empirical CDF of a per-request latency column for each config, at `points` quantiles
    (so the plot stays small): columns config, value_s, quantile."""
    frames = []
    q = np.linspace(0.0, 1.0, points)
    for label, r in results.items():
        v = r.requests[metric].dropna().to_numpy(dtype=float)
        if len(v) == 0:
            continue
        frames.append(pd.DataFrame({"config": label, "value_s": np.quantile(v, q), "quantile": q}))
    return (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(columns=["config", "value_s", "quantile"])
    )


def cluster_timeline(results: Mapping[str, SimResult]) -> pd.DataFrame:
    """Per config and sample time: KV usage (mean over replicas), running and waiting (summed)."""
    frames = []
    for label, r in results.items():
        t = r.timeline
        if t.empty:
            continue
        g = t.groupby("time_s", sort=True).agg(
            kv_usage=("kv_usage", "mean"),
            num_running=("num_running", "sum"),
            num_waiting=("num_waiting", "sum"),
        )
        frames.append(g.reset_index().assign(config=label))
    cols = ["config", "time_s", "kv_usage", "num_running", "num_waiting"]
    return pd.concat(frames, ignore_index=True)[cols] if frames else pd.DataFrame(columns=cols)


def token_throughput(results: Mapping[str, SimResult], bins: int = 150) -> pd.DataFrame:
    """Output tokens per second over time for each config; a request's tokens are spread evenly
    from its first token to its finish. Columns config, time_s (bin start), output_tok_s."""
    frames = []
    for label, r in results.items():
        df = r.requests.dropna(subset=["first_token_s", "finish_s"])
        if df.empty:
            continue
        first = df["first_token_s"].to_numpy(float)
        fin = df["finish_s"].to_numpy(float)
        n = df["num_output_tokens"].to_numpy(float)
        end = float(fin.max())
        bin_s = auto_bin_s(end, bins)
        edges = np.arange(0.0, end + bin_s, bin_s)
        span = np.maximum(fin - first, 1e-12)
        done = (edges[None, :] >= first[:, None]) + np.clip(
            (edges[None, :] - first[:, None]) / span[:, None], 0.0, 1.0
        ) * np.maximum(n - 1, 0)[:, None]
        tokens = np.diff(done.sum(axis=0))
        frames.append(pd.DataFrame({"config": label, "time_s": edges[:-1], "output_tok_s": tokens / bin_s}))
    cols = ["config", "time_s", "output_tok_s"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)


# =============================================================================== latency against load

LOAD_MULTIPLIERS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0)  # of the page's rate: the points of a load curve


def load_curve(
    runs: Mapping[float, Mapping[str, SimResult]], slo: SLO | None, metric: str = "ttft_p99_s"
) -> pd.DataFrame:
    """One row per configuration and rate multiplier: offered and served rate, the p99 `metric` in
    ms, and `qualifies` (meets the SLO and keeps up, `config_status`)."""
    objectives = slo_objectives(slo)
    rows = []
    for mult, results in sorted(runs.items()):
        for label, r in results.items():
            load = result_load(r)
            status, _ = config_status(r.summary, load, objectives)
            value = r.summary.get(metric)
            rows.append(
                {
                    "config": label,
                    "multiplier": float(mult),
                    "offered_rps": load.offered_rps,
                    "served_rps": load.served_rps,
                    "latency_ms": math.nan if value is None else float(value) * 1e3,
                    "qualifies": status in QUALIFIED,
                }
            )
    cols = ["config", "multiplier", "offered_rps", "served_rps", "latency_ms", "qualifies"]
    return pd.DataFrame(rows, columns=cols)


def knees(curve: pd.DataFrame) -> pd.DataFrame:
    """Per configuration, the knee of its load curve: the highest offered rate up to which every
    point meets the SLO and keeps up (no row for a configuration whose lightest point fails)."""
    rows = []
    for _, g in curve.sort_values("offered_rps").groupby("config", sort=False):
        ok = g["qualifies"].to_numpy(bool)
        n = len(ok) if ok.all() else int(np.argmin(ok))
        if n:
            rows.append(g.iloc[n - 1])
    return pd.DataFrame(rows, columns=curve.columns).reset_index(drop=True)


def capacity_point(config: SimConfig) -> dict[str, Any]:
    """The sweep point (`simulator.sweep.point_config` axes) of a what-if configuration."""
    return {
        "gpu": config.gpu,
        "tp": config.tensor_parallel_size,
        "replicas": config.num_replicas,
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "policy": config.policy,
        "prefix_caching": config.enable_prefix_caching,
        **({"async_scheduling": True} if config.async_scheduling else {}),
    }


def capacity_answer(
    trace: Trace,
    model_key: str,
    latency_choice: str,
    config: SimConfig,
    objectives: Sequence[plan.Objective],
    executor: Executor | None = None,
    tolerance: float = 0.1,
) -> Any:
    """`kvplan capacity`'s search (`simulator.plan.find_capacity`) for one configuration on `trace`:
    the highest rate at which it meets `objectives` (CapacityResult; max_rate None if none)."""
    if len(trace) < 2 or trace.duration_s <= 0:
        raise ValueError("the trace needs at least two distinct arrival times")
    ctx = sweep.RunContext(trace, model_key, latency_choice, objectives_text(objectives), trace.name)
    evaluate, _ = point_evaluator(ctx, executor)
    parallel = getattr(executor, "_max_workers", 1) if executor is not None else 1
    return plan.find_capacity(
        evaluate,
        capacity_point(config),
        objectives,
        len(trace) / trace.duration_s,
        tolerance=tolerance,
        parallel=parallel,
        max_scale=64.0,
    )


# =============================================================================== capacity plan


def gpu_names() -> list[str]:
    return list(load_gpu_specs())


def pareto_mask(cost: Sequence[float], latency: Sequence[float]) -> np.ndarray:
    """True for points that no other point beats on both axes (lower cost and lower latency)."""
    c = np.asarray(cost, dtype=float)
    lat = np.asarray(latency, dtype=float)
    keep = np.isfinite(c) & np.isfinite(lat)
    out = np.zeros(len(c), dtype=bool)
    for i in np.flatnonzero(keep):
        dominated = keep & (c <= c[i]) & (lat <= lat[i]) & ((c < c[i]) | (lat < lat[i]))
        out[i] = not dominated.any()
    return out


def plan_objectives(
    ttft_s: float | None, tpot_s: float | None, e2e_s: float | None, stat: str = "p99"
) -> tuple[plan.Objective, ...]:
    """`simulator.plan.Objective`s from the page's limits in seconds (None or 0: unconstrained)."""
    objectives = tuple(
        plan.Objective(metric, stat, float(limit))
        for metric, limit in (("ttft", ttft_s), ("tpot", tpot_s), ("e2e", e2e_s))
        if limit
    )
    if not objectives:
        raise ValueError("SLO: set at least one latency objective")
    return objectives


def objectives_text(objectives: Sequence[plan.Objective]) -> str:
    """`ttft_p99=2.0s,...`: the SLO string RunContext / parse_objectives read."""
    return ",".join(f"{o.name}={o.limit_s!r}s" for o in objectives)


def _simulate_point(ctx: sweep.RunContext, point: dict[str, Any]) -> dict[str, Any]:
    return sweep.simulate_point(ctx, point)


def _simulate_point_in_worker(ctx: sweep.RunContext, point: dict[str, Any]) -> dict[str, Any]:
    return sweep.simulate_point(ctx, point, _WORKER_PROMPTS)


def point_evaluator(
    ctx: sweep.RunContext,
    executor: Executor | None = None,
    on_wave: Callable[[int, int], None] | None = None,
    on_point: Callable[[dict[str, Any], int], None] | None = None,
) -> tuple[Callable[[list[dict[str, Any]]], list[dict[str, Any]]], list[dict[str, Any]]]:
    """An `evaluate(points) -> rows` for `simulator.plan` (on `executor` if given) and the list it
    appends every evaluated row to (for the Pareto chart). `on_wave(wave, points)` before each wave,
    `on_point(row, simulated so far)` as each point's simulation finishes."""
    rows: list[dict[str, Any]] = []
    waves = [0]

    def evaluate(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
        waves[0] += 1
        if on_wave:
            on_wave(waves[0], len(points))
        if executor is None or len(points) <= 1:
            got = []
            for p in points:
                got.append(_simulate_point(ctx, p))
                if on_point:
                    on_point(got[-1], len(rows) + len(got))
        else:
            futures = [executor.submit(_simulate_point_in_worker, ctx, p) for p in points]
            if on_point:
                for done, f in enumerate(as_completed(futures), 1):
                    on_point(f.result(), len(rows) + done)
            got = [f.result() for f in futures]
        rows.extend(got)
        return got

    return evaluate, rows


@dataclass
class PlanOutcome:
    """`simulator.plan.find_plan`'s result, every simulated point, and the planned trace's size."""

    result: Any  # simulator.plan.PlanResult
    points: pd.DataFrame
    num_requests: int
    latency_note: str | None = None  # why every option ran on the roofline (None: they did not need to)
    duration_s: float = math.nan  # the span of the simulated arrivals, after rescaling to the rate


def run_plan(
    trace: Trace,
    model_key: str,
    latency_choice: str,
    objectives: Sequence[Any],
    rate: float,
    gpus: Sequence[str],
    tps: Sequence[int],
    block_sizes: Sequence[int],
    max_num_seqs: Sequence[int],
    max_num_batched_tokens: Sequence[int],
    max_gpus: int,
    base: Mapping[str, Any] | None = None,
    executor: Executor | None = None,
    on_wave: Callable[[int, int], None] | None = None,
    mix_latency_models: bool = False,
    on_point: Callable[[dict[str, Any], int], None] | None = None,
) -> PlanOutcome:
    """Cheapest configuration serving `trace` rescaled to `rate` req/s within `objectives`
    (`simulator.plan.find_plan` over `plan_options`), plus a table of every point it simulated.
    Like `kvplan plan`, it compares like with like (`simulator.plan.like_with_like`): when only
    some options have a fitted profile, all run on the transferred model (the roofline where that is
    the choice) unless `mix_latency_models`."""
    scaled = traces.scale_rate(trace, target_rate=rate)
    options = plan.plan_options(gpus, tps, block_sizes, max_num_seqs, max_num_batched_tokens)
    async_scheduling = bool((base or {}).get("async_scheduling", False))
    choice, note = plan.like_with_like(
        options, latency_choice, model_key, async_scheduling, mix_latency_models
    )
    if note is not None and not mix_latency_models:
        labels = plan.option_latency(options, latency_choice, model_key, async_scheduling)
        fitted = [f"{o} ({label})" for o, label in labels.items() if label.startswith("fitted")]
        common = "the roofline" if choice == LATENCY_ROOFLINE else "the transferred model"
        note = (
            f"Only {len(fitted)} of {len(labels)} options have a shipped fitted profile ({'; '.join(fitted)}): "
            f"every option was simulated on {common}, to compare like with like. Turn on Mix latency "
            "models to keep the profiles."
        )
    else:
        note = None  # a mix is shown by the rows' own banner (plan_latency_warning)
    ctx = sweep.RunContext(scaled, model_key, choice, objectives_text(objectives), trace.name)
    evaluate, rows = point_evaluator(ctx, executor, on_wave, on_point)
    result = plan.find_plan(evaluate, options, objectives, max_gpus, rate, dict(base or {}))
    points = plan_points(rows, objectives, scaled.duration_s)
    return PlanOutcome(result, points, len(scaled), note, scaled.duration_s)


def plan_points(
    rows: Sequence[Mapping[str, Any]], objectives: Sequence[Any], arrival_span_s: float = math.nan
) -> pd.DataFrame:
    """Simulated plan points that ran: config, GPUs, cost, p99s, `meets_slo`, `failed` (why not),
    and `load` (`load_verdict` over `arrival_span_s`)."""
    ok_rows = [r for r in rows if r.get("error") is None]
    if not ok_rows:
        return pd.DataFrame()
    df = pd.DataFrame.from_records(ok_rows)
    failed = [plan.violations(r, objectives) for r in ok_rows]
    df["meets_slo"] = [not f for f in failed]
    df["failed"] = ["; ".join(describe_miss(v) for v in f) for f in failed]
    df["load"] = [load_verdict(r, arrival_span_s).verdict for r in ok_rows]
    df["num_gpus"] = df["tp"] * df["replicas"]
    df["latency model"] = [plan.row_latency(r) for r in ok_rows]
    df["label"] = [
        f"{r.replicas} x {r.gpu} TP{r.tp} (block {r.block_size}, seqs {r.max_num_seqs})"
        for r in df.itertuples(index=False)
    ]
    return df.drop_duplicates("label").reset_index(drop=True)


# The All simulated points table: plan_points' columns under the names the page shows, latencies in ms.
POINT_COLUMNS = {
    "label": "configuration",
    "meets_slo": "meets SLO",
    "load": "load",
    "cost_per_hour_usd": "$/h",
    "cost_per_million_output_tokens_usd": "$/M output tokens",
    "latency model": "latency model",
    "failed": "misses",
    "ttft_p99_s": "TTFT p99 (ms)",
    "tpot_p99_s": "TPOT p99 (ms)",
    "e2e_p99_s": "E2E p99 (ms)",
    "output_tok_s": "output tok/s",
    "num_preemptions": "preemptions",
}
POINT_FORMATS = {
    "$/h": "${:,.2f}",
    "$/M output tokens": "${:,.3f}",
    "TTFT p99 (ms)": "{:,.0f}",
    "TPOT p99 (ms)": "{:,.1f}",
    "E2E p99 (ms)": "{:,.0f}",
    "output tok/s": "{:,.0f}",
}


def points_table(points: pd.DataFrame) -> pd.DataFrame:
    """`plan_points` as the page shows it: POINT_COLUMNS' names, latencies in ms, `yes`/`no`."""
    cols = [c for c in POINT_COLUMNS if c in points]
    out = points[cols].copy()
    for c in ("ttft_p99_s", "tpot_p99_s", "e2e_p99_s"):
        if c in out:
            out[c] = out[c] * 1e3
    if "meets_slo" in out:
        out["meets_slo"] = out["meets_slo"].map({True: "yes", False: "no"})
    return out.rename(columns=POINT_COLUMNS).reset_index(drop=True)


def plan_simulations_estimate(num_options: int, max_gpus: int, min_tp: int = 1) -> int:
    """About how many simulations a plan takes at most (for a progress bar): each option gallops
    1, 2, 4, ... replicas up to the budget, then bisects."""
    cap = max(1, int(max_gpus) // max(1, int(min_tp)))
    return max(1, int(num_options) * (math.ceil(math.log2(cap)) + 2))


def parse_int_list(text: str, name: str) -> tuple[int, ...]:
    """`128, 256` -> (128, 256); a ValueError naming the field and the item otherwise."""
    out = []
    for item in (x.strip() for x in str(text).split(",")):
        if not item:
            continue
        try:
            value = int(item.replace("_", ""))
        except ValueError:
            raise ValueError(
                f"{name}: {item!r} is not a whole number (give comma-separated numbers, e.g. 128,256)"
            ) from None
        if value <= 0:
            raise ValueError(f"{name}: {value} must be a positive number")
        out.append(value)
    return tuple(out)


def plan_command(
    trace: str | None,
    num_requests: int,
    model_key: str,
    latency: str,
    objectives: Sequence[plan.Objective],
    rate: float,
    gpus: Sequence[str],
    tps: Sequence[int],
    block_sizes: Sequence[int],
    max_num_seqs: Sequence[int],
    max_num_batched_tokens: Sequence[int],
    max_gpus: int,
    router: str,
    mix_latency_models: bool = False,
) -> str:
    """The `kvplan plan` command line that plans what the page planned (`trace`: a shipped trace's
    name or a file path; None: a trace only this session holds, shown as TRACE_FILE)."""
    slo = ",".join(f"{o.name}={o.limit_s * 1e3:g}ms" for o in objectives)
    parts = ["kvplan plan", f"--trace {trace or 'TRACE_FILE'}"]
    if num_requests:
        parts.append(f"--limit {int(num_requests)}")
    parts += [
        f"--rate {rate:g}",
        f"--slo {slo}",
        f"--model {model_key}",
        f"--gpus {','.join(gpus)}",
        f"--tp {','.join(map(str, tps))}",
        f"--max-gpus {int(max_gpus)}",
        f"--block-sizes {','.join(map(str, block_sizes))}",
        f"--max-num-seqs {','.join(map(str, max_num_seqs))}",
        f"--max-num-batched-tokens {','.join(map(str, max_num_batched_tokens))}",
        f"--router {router}",
        f"--profile {latency}",
    ]
    if mix_latency_models:
        parts.append("--mix-latency-models")
    return " ".join(parts)


def plan_latency_warning(result: Any) -> str | None:
    """A banner when a PlanResult's candidates were simulated on different kinds of latency model."""
    return plan.mixed_latency_warning([c.row for c in result.candidates])


# The candidate table's first columns: what decides between the options.
CANDIDATE_LEAD = (
    "status",
    "configuration",
    "$/h",
    "$/M output tokens",
    "load",
    "why",
    "latency model",
    "offered (req/s)",
    "served (req/s)",
    "GPUs",
)


def plan_candidates(result: Any, arrival_span_s: float = math.nan) -> pd.DataFrame:
    """One row per option of a PlanResult: status, cost, load (offered against served over
    `arrival_span_s`, `load_verdict`), latency model, the reason, p99s in ms and the shape."""
    rows = []
    for c in result.candidates:
        row = c.row or {}
        o = c.option
        load = load_verdict(row, arrival_span_s) if c.row else Load(math.nan, math.nan, NO_LOAD)
        size = f"{c.replicas} x " if c.replicas else ""
        rows.append(
            {
                "status": c.status,
                "configuration": f"{size}{o.gpu} TP{o.tp}",
                "load": load.verdict if c.row else None,
                "offered (req/s)": load.offered_rps,
                "served (req/s)": load.served_rps,
                "GPU": o.gpu,
                "TP": o.tp,
                "block": o.block_size,
                "max seqs": o.max_num_seqs,
                "max batched tokens": o.max_num_batched_tokens,
                "replicas": c.replicas,
                "GPUs": c.num_gpus,
                "$/h": c.cost_per_hour,
                "$/M output tokens": row.get("cost_per_million_output_tokens_usd"),
                "TTFT p99 (ms)": row["ttft_p99_s"] * 1e3 if row.get("ttft_p99_s") is not None else None,
                "TPOT p99 (ms)": row["tpot_p99_s"] * 1e3 if row.get("tpot_p99_s") is not None else None,
                "E2E p99 (ms)": row["e2e_p99_s"] * 1e3 if row.get("e2e_p99_s") is not None else None,
                "latency model": plan.row_latency(row) if c.row else None,
                "steps outside fit": row.get("steps_outside_fit_share"),
                "why": candidate_reason(c),
            }
        )
    table = pd.DataFrame(rows)
    lead = [c for c in CANDIDATE_LEAD if c in table]
    return table[lead + [c for c in table.columns if c not in lead]]


def candidate_reason(c: Any) -> str:
    """A plan Candidate's reason in the pages' words: missed objectives as `describe_miss` says them
    (in ms), `TP 2` and `the GPU budget of 8` for the search's parameter names."""
    reason = c.reason
    if c.failed:
        reason = reason.replace(
            plan.describe_violations(c.failed), "; ".join(describe_miss(v) for v in c.failed)
        )
    return reason.replace("max_gpus=", "the GPU budget of ").replace("tp=", "TP ")


def plan_pick(result: Any, arrival_span_s: float) -> tuple[Any, str | None]:
    """The configuration to recommend from a PlanResult and, when it is not `result.best`, why:
    the best meets the SLOs but falls behind the offered rate over `arrival_span_s`
    (`Load.falls_behind`, the rule `find_plan` itself applies over each run's own arrivals, so a
    plan's best falls behind only when the span differs), so the cheapest feasible candidate that
    keeps up is recommended (None if there is none)."""
    best = result.best
    if best is None:
        return None, None
    load = load_verdict(best.row or {}, arrival_span_s)
    if not load.falls_behind:
        return best, None
    why = (
        f"The cheapest configuration meeting the latency objectives, {best.replicas} x {best.option.gpu} "
        f"TP {best.option.tp}, is {load.verdict}: it serves {load.served_rps:,.1f} of "
        f"{load.offered_rps:,.1f} req/s offered, so its latencies would keep growing with more traffic."
    )
    for c in result.candidates:
        if c.status in ("best", "feasible") and load_verdict(c.row or {}, arrival_span_s).keeps_up:
            return c, why
    return (
        None,
        why + " No other feasible candidate keeps up: simulate more requests or raise the GPU budget.",
    )


# =============================================================================== sim vs real

# Folder kinds: `kvplan replay` output (re-simulated here), `kvplan validate` report output (its
# sim_requests.parquet against the replay's requests.parquet), or a plain pair of request tables.
REPLAY, REPORT, PAIR = "replay", "report", "pair"
REAL_FILE = "real_requests.parquet"
SIM_FILE = "sim_requests.parquet"
STEPS_FILE = "steps.parquet"
PROFILE_FILE = "profile.json"


def validation_kind(folder: Path) -> str | None:
    """REPLAY, REPORT or PAIR when `folder` holds that kind of validation run, else None."""
    if all((folder / f).is_file() for f in validate.REQUIRED_FILES):
        return REPLAY
    if (folder / "validation.json").is_file() and (folder / SIM_FILE).is_file():
        return REPORT
    if (folder / REAL_FILE).is_file() and (folder / SIM_FILE).is_file():
        return PAIR
    return None


def find_validation_runs(root: str | Path, max_depth: int = 3) -> list[tuple[Path, str]]:
    """(folder, kind) of every validation run under `root` (itself included, `max_depth` levels down)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    level = [root]
    for _ in range(max_depth + 1):
        nxt = []
        for d in level:
            kind = validation_kind(d)
            if kind:
                found.append((d, kind))
            try:
                nxt.extend(sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")))
            except OSError:
                continue
        level = nxt
    return sorted(found)


@dataclass
class ValidationView:
    """What the Sim vs real page shows of one run."""

    name: str
    kind: str
    table: pd.DataFrame  # simulator.validate.compare: metric, real, sim, rel_error, target, ok
    real: pd.DataFrame  # per-request frames with ttft_s, tpot_s, e2e_s
    sim: pd.DataFrame
    steps: pd.DataFrame | None  # step records with predicted_s, measured_s, residual (relative)
    note: str = ""


def _read_parquet(path: Path) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise ValueError(f"{path}: cannot read Parquet ({type(e).__name__}: {e})") from None


def _requests(path: Path) -> pd.DataFrame:
    df = _read_parquet(path)
    needed = ("request_id", "arrival_s", "first_token_s", "finish_s", "num_output_tokens", "finish_reason")
    missing = [c for c in needed if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: not a per-request table; missing column(s) {missing}")
    return add_latencies(df)


def _compare(real: pd.DataFrame, sim: pd.DataFrame) -> pd.DataFrame:
    return validate.compare(summarize(real), summarize(sim))


def load_validation(
    folder: str | Path, kind: str, profile: Path | None = None, repeat: str | Path | None = None
) -> ValidationView:
    """Load (for REPLAY: re-simulate with `profile`, None = roofline) one validation run.

    Step residuals use the records' own `predicted_s` when present, else `profile` (or the folder's
    profile.json). `repeat`: another REPLAY folder of the same trace and configuration, whose metrics
    join the table (`repeat`, `repeat_error`: the real system against itself). ValueError /
    FileNotFoundError name the file at fault."""
    folder = Path(folder)
    if kind == REPLAY:
        v = validate.validate_run(folder, profile, repeat)
        steps = None if v.steps is None else _usable_steps(v.steps)
        return ValidationView(folder.name, kind, v.table, v.real, v.sim.requests, steps)
    sim = _requests(folder / SIM_FILE)
    if kind == REPORT:
        meta = json.loads((folder / "validation.json").read_text())
        run_dir = Path(meta.get("run_dir", ""))
        if not (run_dir / "requests.parquet").is_file():
            raise FileNotFoundError(
                f"{folder / 'validation.json'}: run_dir {run_dir} has no requests.parquet"
            )
        real = _requests(run_dir / "requests.parquet")
        steps_path = run_dir / STEPS_FILE
    elif kind == PAIR:
        real = _requests(folder / REAL_FILE)
        steps_path = folder / STEPS_FILE
    else:
        raise ValueError(f"{folder}: unknown validation kind {kind!r}")
    steps, note = None, ""
    if steps_path.is_file():
        records = _read_parquet(steps_path)
        profile = profile or (folder / PROFILE_FILE if (folder / PROFILE_FILE).is_file() else None)
        if "predicted_s" in records.columns:
            steps = _usable_steps(records.assign(measured_s=records[validate.measured_column(records)]))
            steps["residual"] = (steps["predicted_s"] - steps["measured_s"]) / steps["measured_s"]
        elif profile is not None:
            steps = step_residuals(records, LatencyProfile.load(profile).to_latency_model())
        else:
            note = f"{steps_path.name} has no predicted_s column and no profile was given: no step residuals"
    return ValidationView(folder.name, kind, _compare(real, sim), real, sim, steps, note)


def matching_profile(folder: str | Path, kind: str) -> Path | None:
    """The shipped profile of the engine that served a replay folder: its run.json's model, GPU, TP,
    block size and async scheduling, the same decode kernel, and its engine choices
    (`simulator.defaults.profile_of_engine`: a superseded profile for a replay of an older engine). None for other kinds of run, runs
    whose run.json does not say which decode kernel served them (older ones), or no such profile."""
    if kind != REPLAY:
        return None
    try:
        meta = json.loads((Path(folder) / "run.json").read_text())
        name, kernel = meta["model"]["name"], meta["decode_kernel"]
        async_scheduling = bool(meta.get("async_scheduling", False))
        path = sweep.profile_for(
            LATENCY_AUTO,
            name,
            meta["gpu"],
            int(meta["block_size"]),
            int(meta.get("tensor_parallel_size", 1)),
            async_scheduling,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if path is None:
        return None
    path = profile_of_engine(path, meta)  # the engine's own: superseded where the engine changed since
    extra = LatencyProfile.load(path).extra
    same = extra.get("decode_kernel") == kernel and bool(extra.get("async_scheduling")) == async_scheduling
    return path if same else None


_REPEAT_TRACE_COLUMNS = ("request_id", "arrival_s", "prompt_len", "output_len")


@functools.lru_cache(maxsize=256)
def _replay_signature(folder: str, mtimes: tuple[float, ...]) -> str | None:
    try:
        meta = json.loads((Path(folder) / "run.json").read_text())
        df = pd.read_parquet(Path(folder) / "trace.parquet", columns=list(_REPEAT_TRACE_COLUMNS))
    except Exception:  # unreadable: offered as a repeat of nothing
        return None
    h = hashlib.sha1(json.dumps([meta.get(f) for f in validate.REPEAT_FIELDS], default=str).encode())
    for c in _REPEAT_TRACE_COLUMNS:
        h.update(np.ascontiguousarray(df[c].to_numpy()).tobytes())
    return h.hexdigest()


def replay_signature(folder: str | Path) -> str | None:
    """What a repeat shares with the replay it repeats: the run.json fields that
    `simulator.validate.read_repeat` checks and the trace's requests (None when unreadable)."""
    folder = Path(folder)
    try:
        mtimes = tuple((folder / f).stat().st_mtime for f in ("run.json", "trace.parquet"))
    except OSError:
        return None
    return _replay_signature(str(folder), mtimes)


def repeat_candidates(folder: str | Path, runs: list[tuple[Path, str]]) -> list[Path]:
    """The other replay folders among `runs` that serve the same trace on the same configuration as
    `folder`: the runs that can repeat it."""
    own = replay_signature(folder)
    if own is None:
        return []
    return [p for p, kind in runs if kind == REPLAY and p != Path(folder) and replay_signature(p) == own]


# How the Sim vs real page names the compared metrics: (label, scale); times in ms.
_METRIC_NAMES = {"throughput_rps": ("throughput (req/s)", 1.0), "output_tok_s": ("output tok/s", 1.0)}


def metric_label(metric: str) -> tuple[str, float]:
    """`ttft_p50_s` -> (`TTFT p50 (ms)`, 1000): a summary key as the pages name it, and its scale."""
    if metric in _METRIC_NAMES:
        return _METRIC_NAMES[metric]
    name, _, stat = metric.removesuffix("_s").partition("_")
    return f"{name.upper()} {stat} (ms)", 1e3


def validation_table(table: pd.DataFrame) -> pd.DataFrame:
    """`simulator.validate.compare`'s table as the page shows it: metrics named as elsewhere, times in
    ms, columns `simulated`, `error`, `target`, `within target` (yes / no / blank) and, with a repeat,
    `repeat` and `real vs real`."""
    labels = [metric_label(m) for m in table["metric"]]
    scale = np.array([x for _, x in labels])
    out = pd.DataFrame({"metric": [n for n, _ in labels], "real": table["real"].to_numpy(float) * scale})
    out["simulated"] = table["sim"].to_numpy(float) * scale
    out["error"] = table["rel_error"].to_numpy(float)
    out["target"] = table["target"].to_numpy(float)  # NaN: no target
    out["within target"] = table["ok"].map({True: "yes", False: "no"}).fillna("").to_numpy()
    if "repeat" in table:
        out["repeat"] = table["repeat"].to_numpy(float) * scale
        out["real vs real"] = table["repeat_error"].to_numpy(float)
    return out


VALIDATION_FORMATS = {
    "real": "{:,.2f}",
    "simulated": "{:,.2f}",
    "error": "{:+.1%}",
    "target": "±{:.0%}",
    "repeat": "{:,.2f}",
    "real vs real": "{:+.1%}",
}


def paired_requests(real: pd.DataFrame, sim: pd.DataFrame) -> pd.DataFrame:
    """Requests present in both runs, joined on request_id: columns `<metric>_real`, `<metric>_sim`."""
    cols = ["request_id", *LATENCY_METRICS]
    return real[cols].merge(sim[cols], on="request_id", suffixes=("_real", "_sim"))


def _usable_steps(records: pd.DataFrame) -> pd.DataFrame:
    """Records a residual means something for: not empty, not compiling, positive measured time."""
    keep = records["kind"].astype(str) != "empty"
    if "compiled" in records.columns:
        keep &= ~records["compiled"].fillna(False).astype(bool)
    if "measured_s" in records.columns:
        keep &= pd.to_numeric(records["measured_s"], errors="coerce") > 0
    return records[keep].reset_index(drop=True)


def step_residuals(records: pd.DataFrame, model: LatencyModel) -> pd.DataFrame:
    """`simulator.validate.step_residuals` on the usable records: predicted_s, measured_s and the
    relative residual (predicted - measured) / measured."""
    usable = _usable_steps(records)
    usable = usable[
        pd.to_numeric(usable[validate.measured_column(usable, model)], errors="coerce") > 0
    ].reset_index(drop=True)
    if usable.empty:
        return usable.assign(predicted_s=[], measured_s=[], residual=[])
    return validate.step_residuals(usable, model)


# How the pages format `validate.step_error_by_kind` tables
RESIDUAL_FORMAT = {
    "median |rel. error|": "{:.1%}",
    "p90 |rel. error|": "{:.1%}",
    "bias": "{:+.1%}",
    "summed error": "{:+.1%}",
}


def read_step_records(data: bytes, filename: str) -> pd.DataFrame:
    """Step records from uploaded Parquet or CSV bytes (ValueError naming the file when unreadable)."""
    safe = Path(filename).name
    try:
        if data[:4] == b"PAR1":
            df = pd.read_parquet(io.BytesIO(data))
        else:
            df = pd.read_csv(io.BytesIO(data))
    except Exception as e:
        raise ValueError(f"{safe}: cannot read step records ({type(e).__name__}: {e})") from None
    missing = [c for c in ("kind", "num_seqs", "total_num_scheduled_tokens") if c not in df.columns]
    if missing:
        raise ValueError(f"{safe}: not step records; missing column(s) {missing}")
    return df


# =============================================================================== latency profiles


def profile_files(*dirs: str | Path) -> list[Path]:
    """Latency profile JSON files (format kvplan.latency_profile) in `dirs`, sorted; missing folders
    and other JSON files (run.json, validation.json) are skipped."""
    out: list[Path] = []
    for d in dirs:
        p = Path(d)
        if not p.is_dir():
            continue
        for f in sorted(p.glob("*.json")):
            try:
                if json.loads(f.read_text()).get("format") == PROFILE_FORMAT:
                    out.append(f)
            except (OSError, ValueError, AttributeError):
                continue
    return out


def read_profile_json(data: bytes, filename: str) -> LatencyProfile:
    """A latency profile from uploaded JSON bytes; a ValueError naming the file for bytes that are not
    JSON, JSON that is not an object (a list, a number) or an object that is not a profile."""
    safe = Path(filename).name
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{safe}: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(
            f"{safe}: a latency profile is a JSON object (written by kvplan profile); this file holds "
            f"a {type(raw).__name__ if raw is not None else 'null'}"
        )
    try:
        return LatencyProfile.from_dict(raw, where=safe)
    except ValueError:
        raise
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{safe}: not a latency profile ({type(e).__name__}: {e})") from None


def profile_coefficients(profile: Any) -> pd.DataFrame:
    """A LatencyProfile's fits as rows: fit (decode / prefill), feature, coefficient; then its host
    floors in seconds (features floor_decode_s, floor_prefill_s, floor_mixed_s), where it has them."""
    rows = []
    for kind in ("decode", "prefill"):
        fit = getattr(profile, kind)
        for feature, coef in zip(fit.features, fit.coefficients):
            rows.append({"fit": kind, "feature": feature, "coefficient": coef})
    floors = getattr(profile, "floors", None)
    if floors is not None:
        for kind, fit in (("decode", "decode"), ("prefill", "prefill"), ("mixed", "prefill")):
            rows.append({"fit": fit, "feature": f"floor_{kind}_s", "coefficient": getattr(floors, kind)})
    return pd.DataFrame(rows)


def profile_errors(profile: Any) -> pd.DataFrame:
    """A LatencyProfile's held-back error per fit (empty where the fit has none)."""
    rows = []
    for kind in ("decode", "prefill"):
        err = getattr(profile, kind).error
        if err is not None:
            rows.append(
                {
                    "fit": kind,
                    "train steps": err.n_train,
                    "held-back steps": err.n_test,
                    "median rel. error": err.median_rel_error,
                    "p90 rel. error": err.p90_rel_error,
                    "max rel. error": err.max_rel_error,
                }
            )
    return pd.DataFrame(rows)


def decode_curves(
    model: LatencyModel, batch_sizes: Sequence[int], context_lens: Sequence[int]
) -> pd.DataFrame:
    """Decode step time against batch size, one curve per context length per sequence:
    columns num_seqs, context_len, step_ms."""
    rows = []
    for ctx in context_lens:
        for b in batch_sizes:
            t = model.decode_step_time(int(b), int(b) * int(ctx), int(ctx) + 1)
            rows.append({"num_seqs": int(b), "context_len": int(ctx), "step_ms": t * 1e3})
    return pd.DataFrame(rows)


def prefill_curves(
    model: LatencyModel, token_counts: Sequence[int], cached: Sequence[int] = (0,)
) -> pd.DataFrame:
    """Step time of one sequence's prefill chunk of n new tokens after `cached` tokens already in
    the KV cache: columns new_tokens, cached_tokens, step_ms, and the StepTime parts in ms."""
    rows = []
    for c in cached:
        for n in token_counts:
            n, c = int(n), int(c)
            shape = StepShape("prefill", 1, 1, n, n, c, c + n, n * (c + (n + 1) / 2), c)
            t = model.predict(shape)
            rows.append(
                {
                    "new_tokens": n,
                    "cached_tokens": c,
                    "step_ms": t.total * 1e3,
                    "linear_ms": t.linear * 1e3,
                    "attention_ms": t.attention * 1e3,
                    "communication_ms": t.communication * 1e3,
                    "overhead_ms": t.overhead * 1e3,
                }
            )
    return pd.DataFrame(rows)
