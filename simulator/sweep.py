"""Parameter sweeps: a YAML spec, its grid of simulation points, and their execution to Parquet.

A point is one `SimConfig` over one trace; `simulate_point` turns it into one flat row (config
columns, metrics, cost, wall time, error). `PointRunner` runs points inline, in a local process pool
or as Ray tasks, one simulation for all the points that differ only in capacity limits its run never
reached (`SharePlan`, simulator/share.py: the same rows); `run_sweep` adds resume and atomic
incremental writes. No search logic here (plan.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from simulator import share
from simulator.config import ROUTERS, SimConfig
from simulator.defaults import default_latency_file
from simulator.latency.base import LatencyModel
from simulator.latency.gpus import get_gpu
from simulator.metrics import SLO
from simulator.plan import (
    cost_per_hour,
    cost_per_million_tokens,
    describe_violations,
    mixed_latency_warning,
    parse_objectives,
    violations,
)
from simulator.run import collect, kv_blocks_for, simulate_config
from simulator.sim import trace_prompts

# 2: a point's default KV cache is sized from its GPU's memory, never from a profile's calibration
# cache, so rows of version 1 are not results of the same point.
KEY_VERSION = 2
# Prompts a process keeps for the points it runs (`PromptCache`): tokens of the small synthetic
# vocabulary only (shared int objects, 8 bytes a token), up to this many (256 MB).
PROMPT_CACHE_MAX_TOKENS = 32_000_000
PROFILE_CHOICES = ("auto", "roofline")
# Error types that a re-run would give again (a bad configuration); other failures are retried on resume.
DETERMINISTIC_ERRORS = frozenset({"ValueError", "TraceError", "FileNotFoundError"})
# Summary entries that are not per-run metrics (the row has its own trace column).
_SUMMARY_SKIP = frozenset({"config", "trace"})

# Grid axes: spec name -> SimConfig field. Defaults are SimConfig's own.
AXES: dict[str, str] = {
    "gpu": "gpu",
    "tp": "tensor_parallel_size",
    "replicas": "num_replicas",
    "block_size": "block_size",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "policy": "policy",
    "prefix_caching": "enable_prefix_caching",
    "router": "router",
    "gpu_memory_utilization": "gpu_memory_utilization",
    "max_model_len": "max_model_len",
    "num_kv_blocks": "num_kv_blocks",
    "async_scheduling": "async_scheduling",
}
# Axes added after sweeps were written: a point holds them only when the grid names them, so the
# points (and resume keys) of every earlier spec stay as they were.
OPTIONAL_AXES = frozenset({"async_scheduling"})
_AXIS_TYPES: dict[str, tuple[type, ...]] = {
    "gpu": (str,),
    "tp": (int,),
    "replicas": (int,),
    "block_size": (int,),
    "max_num_seqs": (int,),
    "max_num_batched_tokens": (int,),
    "policy": (str,),
    "prefix_caching": (bool,),
    "router": (str,),
    "gpu_memory_utilization": (float, int),
    "max_model_len": (int, type(None)),
    "num_kv_blocks": (int, type(None)),
    "async_scheduling": (bool,),
}
_SIM_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SimConfig)}
AXIS_DEFAULTS: dict[str, Any] = {
    axis: _SIM_DEFAULTS[name] for axis, name in AXES.items() if axis not in OPTIONAL_AXES
}

SPEC_KEYS = ("trace", "model", "profile", "slo", "grid")
TRACE_KEYS = ("source", "generate", "rate_scale", "limit", "window_s")


def _unknown(where: str, given: Mapping[str, Any], allowed: Sequence[str]) -> None:
    extra = [k for k in given if k not in allowed]
    if extra:
        raise ValueError(f"{where}: unknown key(s) {extra}; allowed: {list(allowed)}")


# ---- the spec ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceSpec:
    """Where a sweep's requests come from: a shipped trace or file (`source`) or a generator spec,
    then a time window [start, end) in seconds, the first `limit` requests, and a rate scale."""

    source: str | None = None
    generate: Mapping[str, Any] | None = None
    rate_scale: float | None = None
    limit: int | None = None
    window_s: tuple[float, float | None] | None = None

    def __post_init__(self) -> None:
        if (self.source is None) == (self.generate is None):
            raise ValueError("trace: give exactly one of 'source' (shipped name or file) and 'generate'")
        if self.rate_scale is not None and not (_is_number(self.rate_scale) and self.rate_scale > 0):
            raise ValueError(f"trace.rate_scale: must be a positive number, got {self.rate_scale!r}")
        if self.limit is not None and not (_is_int(self.limit) and self.limit > 0):
            raise ValueError(f"trace.limit: must be a positive number of requests, got {self.limit!r}")
        if self.window_s is not None:
            w = self.window_s
            if len(w) != 2 or not _is_number(w[0]) or not (w[1] is None or _is_number(w[1])):
                raise ValueError(
                    f"trace.window_s: must be [start, end] in seconds (end may be null), got {w!r}"
                )
        if self.generate is not None:
            import traces

            # Unknown or bad generator keys fail now: one request is enough to check the whole spec.
            probe = {k: v for k, v in self.generate.items() if k != "duration_s"}
            try:
                traces.generate({**probe, "num_requests": 1})
            except ValueError as e:
                raise ValueError(f"trace.generate: {e}") from None

    @classmethod
    def from_value(cls, value: Any, base_dir: Path | None = None) -> TraceSpec:
        """A shipped name or path string, or a mapping with TRACE_KEYS."""
        if isinstance(value, str):
            value = {"source": value}
        if not isinstance(value, Mapping):
            raise ValueError(f"trace: must be a shipped name, a file path or a mapping, got {value!r}")
        _unknown("trace", value, TRACE_KEYS)
        source = value.get("source")
        if source is not None:
            source = _resolve_source(str(source), base_dir)
        generate = value.get("generate")
        if generate is not None and not isinstance(generate, Mapping):
            raise ValueError(f"trace.generate: must be a mapping of traces.generate keys, got {generate!r}")
        window = value.get("window_s")
        return cls(
            source=source,
            generate=dict(generate) if generate is not None else None,
            rate_scale=value.get("rate_scale"),
            limit=value.get("limit"),
            window_s=tuple(window) if isinstance(window, (list, tuple)) else window,
        )

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["generate"] = dict(self.generate) if self.generate is not None else None
        d["window_s"] = list(self.window_s) if self.window_s is not None else None
        return {k: v for k, v in d.items() if v is not None}

    @property
    def label(self) -> str:
        if self.source is not None:
            return Path(self.source).stem if os.sep in self.source else self.source
        return str((self.generate or {}).get("name", "synthetic"))

    def load(self):
        """The Trace: loaded or generated, windowed, cut to `limit` rows, rate-scaled."""
        import traces

        if self.generate is not None:
            trace = traces.generate(dict(self.generate))
        elif self.source in traces.shipped_names():
            trace = traces.load_shipped(self.source)
        else:
            trace = traces.load(self.source)
        if self.window_s is not None:
            trace = traces.time_window(trace, float(self.window_s[0]), self.window_s[1])
        if self.limit is not None:
            trace = trace.with_frame(trace.df.iloc[: self.limit].reset_index(drop=True), validate=False)
        if self.rate_scale is not None:
            trace = traces.scale_rate(trace, factor=float(self.rate_scale))
        if len(trace) == 0:
            raise ValueError(f"trace {self.label}: no requests left after window/limit")
        return trace


def _resolve_source(source: str, base_dir: Path | None) -> str:
    import traces

    if source in traces.shipped_names():
        return source
    path = Path(source).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.exists():
        raise FileNotFoundError(
            f"trace.source: {source!r} is neither a shipped trace {traces.shipped_names()} nor a file ({path})"
        )
    return str(path)


@dataclass(frozen=True)
class SweepSpec:
    """A sweep: one trace, one model and latency profile, an optional SLO, and a grid of axes."""

    trace: TraceSpec
    model: str = "qwen3-0.6b"
    profile: str = "auto"
    slo: str | None = None
    grid: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _unknown("grid", self.grid, list(AXES))
        from simulator.models import resolve_model

        resolve_model(self.model)  # a clear error now rather than one per point
        if self.slo:
            parse_objectives(self.slo)
        for axis, values in self.grid.items():
            if not values:
                raise ValueError(f"grid.{axis}: needs at least one value")
            for v in values:
                _check_axis_value(axis, v)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], base_dir: Path | None = None) -> SweepSpec:
        if not isinstance(raw, Mapping):
            raise ValueError(f"sweep spec: must be a mapping with keys {list(SPEC_KEYS)}")
        _unknown("sweep spec", raw, SPEC_KEYS)
        if "trace" not in raw:
            raise ValueError("sweep spec: missing key 'trace'")
        grid_raw = raw.get("grid") or {}
        if not isinstance(grid_raw, Mapping):
            raise ValueError(f"grid: must be a mapping of axis -> list of values; axes: {list(AXES)}")
        _unknown("grid", grid_raw, list(AXES))
        grid = {k: tuple(v) if isinstance(v, (list, tuple)) else (v,) for k, v in grid_raw.items()}
        profile = str(raw.get("profile", "auto"))
        if profile not in PROFILE_CHOICES:
            path = Path(profile).expanduser()
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            if not path.is_file():
                raise FileNotFoundError(f"profile: {profile!r} is not 'auto', 'roofline' or a file ({path})")
            profile = str(path)
        slo = raw.get("slo")
        return cls(
            trace=TraceSpec.from_value(raw["trace"], base_dir),
            model=str(raw.get("model", "qwen3-0.6b")),
            profile=profile,
            slo=str(slo) if slo else None,
            grid=grid,
        )

    @classmethod
    def load(cls, path: str | Path) -> SweepSpec:
        import yaml

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no sweep spec here")
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML ({e})") from None
        try:
            return cls.from_dict(raw or {}, base_dir=path.resolve().parent)
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(f"{path}: {e}") from None

    def points(self) -> list[dict[str, Any]]:
        """The grid in a fixed order (product of the axes in AXES order); every axis in every point
        but OPTIONAL_AXES the grid does not name."""
        axes = [axis for axis in AXES if axis in self.grid or axis not in OPTIONAL_AXES]
        values = [self.grid[axis] if axis in self.grid else (AXIS_DEFAULTS[axis],) for axis in axes]
        return [dict(zip(axes, combo)) for combo in itertools.product(*values)]

    def context(self, latency: Callable[[SimConfig], LatencyModel] | None = None) -> RunContext:
        return RunContext(self.trace.load(), self.model, self.profile, self.slo, self.trace.label, latency)

    def point_key(self, point: Mapping[str, Any]) -> str:
        return point_key(
            {"trace": self.trace.as_dict(), "model": self.model, "profile": self.profile, "slo": self.slo},
            point,
        )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_axis_value(axis: str, v: Any) -> None:
    types = _AXIS_TYPES[axis]
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
    if not ok:
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ValueError(f"grid.{axis}: {v!r} is not a {names}")
    if axis == "gpu":
        get_gpu(v)
    elif axis == "router" and v not in ROUTERS:
        raise ValueError(f"grid.router: {v!r} is not one of {list(ROUTERS)}")
    elif axis == "policy":
        from engine.core.config import POLICIES

        if v not in POLICIES:
            raise ValueError(f"grid.policy: {v!r} is not one of {list(POLICIES)}")


def point_key(context: Mapping[str, Any], point: Mapping[str, Any]) -> str:
    """A stable id of (what is simulated, configuration): resume skips rows with a known key."""
    text = json.dumps({"v": KEY_VERSION, **context, **point}, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


# ---- one point --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunContext:
    """What every point of a run shares: the trace (already loaded), model, profile choice, SLO.

    `latency`, when given, builds the latency model for a config (stubs in tests); it must be a
    picklable top-level callable to run in a process pool or on Ray.
    """

    trace: Any
    model: str
    profile: str = "auto"
    slo: str | None = None
    trace_label: str = ""
    latency: Callable[[SimConfig], LatencyModel] | None = None


@lru_cache(maxsize=16)
def _model_spec(name: str):
    from simulator.models import resolve_model

    return resolve_model(name)


def point_config(model: str, point: Mapping[str, Any]) -> SimConfig:
    """The SimConfig of a point (axes missing from `point` take SimConfig's defaults)."""
    kwargs = {AXES[axis]: point[axis] for axis in AXES if axis in point}
    return SimConfig(model=_model_spec(model), **kwargs)


def profile_for(
    profile: str, model: str, gpu: str, block_size: int, tp: int, async_scheduling: bool = False
) -> Path | None:
    """The profile file a point uses: None for the roofline, for 'auto' the shipped fitted one (with
    `async_scheduling`, the one calibrated with it where there is one), else the transferred model's
    (`simulator.defaults.default_latency_file`)."""
    if profile == "roofline":
        return None
    if profile == "auto":
        return default_latency_file(model, gpu, block_size, tp, async_scheduling)
    return Path(profile)


class PromptCache:
    """The prompts of the trace a process simulates, built once for all its simulations of the same
    rows (a sweep's points, the dashboard's jobs). It keeps one trace's: found again by what they are
    made of (each row's request id and prompt length, the vocabulary size), or, for a trace with its
    own token or prefix ids, by the trace object itself. Only prompts of the small synthetic
    vocabulary (shared int objects) are kept, up to `max_tokens` tokens."""

    def __init__(self, max_tokens: int = PROMPT_CACHE_MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self._lock = threading.Lock()  # one process; a thread pool's workers may share it
        self._key: tuple | None = None
        self._trace: Any = None  # held while keyed by its id
        self._prompts: list[list[int]] | None = None

    def get(self, trace: Any, config: SimConfig) -> list[list[int]] | None:
        """The prompts of `trace` for `config`, or None when they are not kept."""
        from traces.schema import SMALL_TOKEN_VOCAB, synthetic_vocab_size

        vocab = synthetic_vocab_size(config.model.vocab_size, config.block_size)
        if vocab > SMALL_TOKEN_VOCAB:
            return None
        key = _prompt_key(trace, vocab)
        with self._lock:
            if key != self._key:
                if int(trace.df["prompt_len"].sum()) > self.max_tokens:
                    return None
                self._key, self._prompts = None, None  # the old ones go first
                self._prompts = trace_prompts(trace, vocab)
                self._key, self._trace = key, trace if key[0] == "object" else None
            return self._prompts


def _prompt_key(trace: Any, vocab: int) -> tuple:
    """What a trace's synthetic prompts are made of: the request ids and prompt lengths of its rows
    (see `Trace.token_ids_many`); a trace with token or prefix ids of its own is keyed by itself."""
    df = trace.df
    if trace.has_prefix_ids or "prompt_token_ids" in df.columns:
        return ("object", id(trace), vocab)
    ids, lens = df["request_id"].to_numpy(), df["prompt_len"].to_numpy()
    return ("rows", vocab, str(ids.dtype), ids.tobytes(), str(lens.dtype), lens.tobytes())


def simulate_point(
    ctx: RunContext, point: Mapping[str, Any], prompts: PromptCache | None = None
) -> dict[str, Any]:
    """Simulate one point; a configuration that cannot run becomes a row with `error` set.

    `point` holds axis values and optionally `rate_scale` (replay that many times faster).
    `prompts` keeps the trace's prompts between the points that one process runs.
    """
    return simulate_points(ctx, point, (), prompts)[0]


def simulate_points(
    ctx: RunContext,
    point: Mapping[str, Any],
    others: Sequence[Mapping[str, Any]] = (),
    prompts: PromptCache | None = None,
) -> list[dict[str, Any] | None]:
    """The row of `point` (as `simulate_point`), then for each of `others` its row where the run of
    `point` stands for it (simulator/share.py: it differs only in capacity limits that the run never
    met), else None. Those rows are the ones their own runs would give, but for `wall_s` (the time
    to derive one) and `shared_run` (True: derived from the run of another point)."""
    t0 = time.perf_counter()
    row = _row_start(ctx, point)
    row["shared_run"] = False
    rows: list[dict[str, Any] | None] = [row] + [None] * len(others)
    try:
        setup = _PointSetup.of(ctx, point, prompts)
        run = simulate_config(setup.trace, setup.config, setup.profile, setup.latency, prompts=setup.prompts)
        _fill_row(row, ctx, setup.config, setup.profile, collect(run, setup.slo).summary)
    except Exception as e:  # a point that cannot run is recorded, not fatal
        row["error"] = str(e) or type(e).__name__
        row["error_type"] = type(e).__name__
        row["wall_s"] = time.perf_counter() - t0
        return rows
    row["wall_s"] = time.perf_counter() - t0
    if others and ctx.latency is None:  # (a model built by `ctx.latency` may read any field)
        rows[1:] = _shared_rows(ctx, run, setup, point, others)
    return rows


@dataclass(frozen=True)
class _PointSetup:
    """What simulating a point takes: its config, trace (rate-scaled), profile, latency model (from
    `ctx.latency` only), SLO and the prompts a PromptCache keeps (or None)."""

    config: SimConfig
    trace: Any
    profile: Path | None
    latency: LatencyModel | None
    slo: SLO | None
    prompts: list[list[int]] | None

    @classmethod
    def of(cls, ctx: RunContext, point: Mapping[str, Any], prompts: PromptCache | None) -> _PointSetup:
        config = point_config(ctx.model, point)
        trace = ctx.trace
        scale = point.get("rate_scale")
        if scale is not None and scale != 1:
            import traces

            trace = traces.scale_rate(trace, factor=float(scale))
        profile = profile_for(
            ctx.profile,
            ctx.model,
            config.gpu,
            config.block_size,
            config.tensor_parallel_size,
            config.async_scheduling,
        )
        latency = ctx.latency(config) if ctx.latency is not None else None
        slo = SLO.parse(ctx.slo) if ctx.slo else None
        shared = prompts.get(ctx.trace, config) if prompts is not None else None
        return cls(config, trace, profile, latency, slo, shared)


def _row_start(ctx: RunContext, point: Mapping[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "trace": ctx.trace_label,
        "model": ctx.model,
        "profile_choice": ctx.profile,
        "slo": ctx.slo,
    }
    row.update(point)
    return row


def _fill_row(
    row: dict[str, Any], ctx: RunContext, config: SimConfig, profile: Path | None, summary: dict
) -> None:
    """A point's metrics, cost and SLO verdict from its simulation's summary, with the latency model
    behind them: `latency_model` (fitted or roofline) and `profile` (the fitted profile's file name,
    None for the roofline)."""
    row.update({k: v for k, v in summary.items() if k not in _SUMMARY_SKIP and _is_scalar(v)})
    row["profile_used"] = str(profile) if profile is not None else "roofline"
    row["cost_per_hour_usd"] = cost_per_hour(config.gpu, config.num_gpus)
    row["cost_per_million_output_tokens_usd"] = cost_per_million_tokens(
        config.gpu, config.num_gpus, summary["output_tok_s"]
    )
    if ctx.slo:
        failed = violations(summary, parse_objectives(ctx.slo))
        row["slo_met"] = not failed
        row["slo_failed"] = describe_violations(failed)
    row["error"] = None
    row["error_type"] = None


def _shared_rows(
    ctx: RunContext,
    run: Any,
    setup: _PointSetup,
    point: Mapping[str, Any],
    others: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any] | None]:
    """`simulate_points`' rows of `others` from the run of `point` (set up as `setup`)."""
    neutral: bool | None = None  # prefix_neutral of the prompts, once asked
    rows: list[dict[str, Any] | None] = []
    key = _group_key(point)
    for other in others:
        t0 = time.perf_counter()
        if _group_key(other) != key:  # another trace scale or axis the config does not show
            rows.append(None)
            continue
        try:
            config = point_config(ctx.model, other)
            num_blocks = kv_blocks_for(config)
        except Exception:  # run alone, it records its error
            rows.append(None)
            continue
        if neutral is None:
            neutral = setup.prompts is not None and share.prefix_neutral(setup.prompts, config.block_size)
        if not share.shares_run(run, config, num_blocks, neutral):
            rows.append(None)
            continue
        row = _row_start(ctx, other)
        row["shared_run"] = True
        _fill_row(row, ctx, config, setup.profile, share.derive(run, config, num_blocks, setup.slo).summary)
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
    return rows


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


# ---- execution --------------------------------------------------------------------------------------

_WORKER_CTX: RunContext | None = None
_WORKER_PROMPTS: PromptCache | None = None


# How often a pool worker checks that the process that started it still runs.
PARENT_CHECK_S = 0.5


def _init_worker(ctx: RunContext, parent_pid: int | None = None) -> None:
    global _WORKER_CTX, _WORKER_PROMPTS
    _WORKER_CTX, _WORKER_PROMPTS = ctx, PromptCache()
    if parent_pid is not None:
        _exit_with_parent(parent_pid)


def _exit_with_parent(parent_pid: int) -> None:
    """End this worker when its parent is gone (killed, even by SIGKILL): a daemon thread sees the
    process re-parented and exits at once, mid-simulation or idle. Ctrl-C is left to the parent,
    which terminates its workers (`PointRunner.close`)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="kvplan-parent-watch", daemon=True).start()


def pool_start_method() -> str:
    """How a local pool starts its workers: forked from this process on Linux (no interpreter
    start and imports per worker), spawned elsewhere (fork is unsafe on macOS, absent on Windows)."""
    import multiprocessing
    import sys

    return (
        "fork"
        if sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()
        else "spawn"
    )


def _pool_task(point: Mapping[str, Any], others: Sequence[Mapping[str, Any]]) -> list[dict[str, Any] | None]:
    assert _WORKER_CTX is not None, "worker not initialised"
    return simulate_points(_WORKER_CTX, point, others, _WORKER_PROMPTS)


def _ray_task(
    ctx: RunContext, point: Mapping[str, Any], others: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any] | None]:
    """`simulate_points` in a Ray worker, with the prompts that worker process keeps."""
    global _WORKER_PROMPTS
    if _WORKER_PROMPTS is None:
        _WORKER_PROMPTS = PromptCache()
    return simulate_points(ctx, point, others, _WORKER_PROMPTS)


def _group_key(point: Mapping[str, Any]) -> str:
    """A point's axes but its capacity limits: points of one key may share a run."""
    rest = {k: v for k, v in point.items() if k not in share.CAPACITY_FIELDS}
    return json.dumps(rest, sort_keys=True, default=repr)


def _limits(point: Mapping[str, Any]) -> tuple:
    """A point's capacity limits, loosest last: token budget, sequences, KV blocks (its count, or
    None, sized from memory: taken as the larger), memory share."""
    get = point.get
    blocks = get("num_kv_blocks", AXIS_DEFAULTS["num_kv_blocks"])
    return (
        get("max_num_batched_tokens", AXIS_DEFAULTS["max_num_batched_tokens"]),
        get("max_num_seqs", AXIS_DEFAULTS["max_num_seqs"]),
        blocks is None,
        blocks or 0,
        get("gpu_memory_utilization", AXIS_DEFAULTS["gpu_memory_utilization"]),
    )


class SharePlan:
    """The order points run in, so that one simulation serves every point it stands for
    (`simulate_points`): a task is (a point to run, the points its run may stand for).

    Points that differ only in capacity axes (share.CAPACITY_FIELDS) form a group. Each group first
    runs its point of loosest limits for all the others; those it does not stand for then run by
    token budget (the point of most sequences and blocks for the rest of its budget), and what is
    still left runs alone. Tasks are handed out as they become ready (`ready`, `done`)."""

    def __init__(self, points: Sequence[Mapping[str, Any]]) -> None:
        self.points = points
        groups: dict[str, list[int]] = {}
        for i, point in enumerate(points):
            groups.setdefault(_group_key(point), []).append(i)
        self.ready: list[tuple[int, list[int]]] = [self._task(g) for g in groups.values()]

    def _task(self, indices: list[int]) -> tuple[int, list[int]]:
        order = sorted(indices, key=lambda i: _limits(self.points[i]), reverse=True)
        return order[0], order[1:]

    def done(self, task: tuple[int, list[int]], rows: Sequence[dict[str, Any] | None]) -> None:
        """Note a task's rows (`simulate_points`'): the points left without one get tasks."""
        run, others = task
        left = [i for i, row in zip(others, rows[1:]) if row is None]
        budget = _limits(self.points[run])[0]
        if all(_limits(self.points[i])[0] == budget for i in others):  # a task of one budget
            self.ready += [(i, []) for i in left]
            return
        by_budget: dict[Any, list[int]] = {}
        for i in left:
            by_budget.setdefault(_limits(self.points[i])[0], []).append(i)
        self.ready += [self._task(g) for g in by_budget.values()]

    def take(self) -> list[tuple[int, list[int]]]:
        tasks, self.ready = self.ready, []
        return tasks


class PointRunner:
    """Runs points of one RunContext: inline (workers=1), a local process pool (default: one
    worker per core) or Ray tasks (`ray_address`: a cluster address, 'auto', or 'local' to start one;
    an already initialised Ray is used as it is). Use as a context manager."""

    def __init__(self, ctx: RunContext, workers: int | None = None, ray_address: str | None = None) -> None:
        if workers is not None and workers <= 0:
            raise ValueError(f"workers: must be a positive integer, got {workers}")
        self.ctx = ctx
        self.workers = workers or os.cpu_count() or 1
        self.ray_address = ray_address
        self._pool: ProcessPoolExecutor | None = None
        self._prompts = PromptCache()  # for points run inline
        self._ray_started = False
        self._ray_ctx = None
        self._ray_task = None

    @property
    def parallelism(self) -> int:
        if self.ray_address is not None:
            import ray

            self._ensure_ray()
            return max(1, int(ray.cluster_resources().get("CPU", 1)))
        return self.workers

    def __enter__(self) -> PointRunner:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(terminate=exc_type is not None)

    def close(self, terminate: bool = False) -> None:
        """Stop the pool: wait for its workers, or with `terminate` (an exception, Ctrl-C) drop
        what is pending and end the workers now, points in flight included."""
        if self._pool is not None:
            procs = list((getattr(self._pool, "_processes", None) or {}).values())
            self._pool.shutdown(wait=not terminate, cancel_futures=True)
            if terminate:
                for proc in procs:
                    proc.terminate()
                for proc in procs:
                    proc.join(5)
            self._pool = None
        if self._ray_started:
            import ray

            ray.shutdown()
            self._ray_started = False

    def map_unordered(self, points: Sequence[Mapping[str, Any]]) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield (index into points, row) as points finish."""
        if not points:
            return
        plan = SharePlan(points)
        if self.ray_address is not None:
            yield from self._ray(plan)
        elif self.workers == 1:
            while plan.ready:
                for task in plan.take():
                    yield from self._finish(plan, task, self._run_task(task, points))
        else:
            yield from self._local(plan)

    def _run_task(self, task: tuple[int, list[int]], points: Sequence[Mapping[str, Any]]) -> list:
        run, others = task
        return simulate_points(self.ctx, points[run], [points[i] for i in others], self._prompts)

    @staticmethod
    def _finish(
        plan: SharePlan, task: tuple[int, list[int]], rows: list[dict[str, Any] | None]
    ) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield a task's rows (index into the points, row); plan what it left."""
        plan.done(task, rows)
        for i, row in zip([task[0], *task[1]], rows):
            if row is not None:
                yield i, row

    def run(self, points: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Rows of `points`, in their order."""
        rows: list[dict[str, Any]] = [{} for _ in points]
        for i, row in self.map_unordered(points):
            rows[i] = row
        return rows

    def _local(self, plan: SharePlan) -> Iterator[tuple[int, dict[str, Any]]]:
        import multiprocessing

        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self.workers,
                mp_context=multiprocessing.get_context(pool_start_method()),
                initializer=_init_worker,
                initargs=(self.ctx, os.getpid()),
            )
        points = plan.points
        futures: dict[Any, tuple[int, list[int]]] = {}
        try:
            while plan.ready or futures:
                for task in plan.take():
                    run, others = task
                    fut = self._pool.submit(_pool_task, dict(points[run]), [dict(points[i]) for i in others])
                    futures[fut] = task
                done, _ = wait(set(futures), return_when=FIRST_COMPLETED)
                for fut in done:
                    yield from self._finish(plan, futures.pop(fut), fut.result())
        finally:
            for fut in futures:
                fut.cancel()

    def _ensure_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        if self.ray_address == "local":
            ray.init(include_dashboard=False, logging_level="WARNING")
        else:
            ray.init(address=self.ray_address, logging_level="WARNING")
        self._ray_started = True

    def _ray(self, plan: SharePlan) -> Iterator[tuple[int, dict[str, Any]]]:
        import ray

        self._ensure_ray()
        if self._ray_ctx is None:
            self._ray_ctx = ray.put(self.ctx)
            self._ray_task = ray.remote(num_cpus=1, max_retries=0)(_ray_task)
        points = plan.points
        refs: dict[Any, tuple[int, list[int]]] = {}
        try:
            while plan.ready or refs:
                for task in plan.take():
                    run, others = task
                    ref = self._ray_task.remote(
                        self._ray_ctx, dict(points[run]), [dict(points[i]) for i in others]
                    )
                    refs[ref] = task
                done, _ = ray.wait(list(refs), num_returns=1)
                for ref in done:
                    task = refs.pop(ref)
                    try:
                        rows = ray.get(ref)
                    except Exception as e:  # a lost worker: record it, retry on resume
                        error = {"error": f"ray task failed: {e}", "error_type": type(e).__name__}
                        rows = [{**points[i], **error} for i in [task[0], *task[1]]]
                    yield from self._finish(plan, task, rows)
        finally:
            for ref in refs:
                ray.cancel(ref)


# ---- a sweep to Parquet -------------------------------------------------------------------------------


@dataclass
class SweepReport:
    out: Path
    num_points: int
    num_skipped: int
    num_run: int
    num_errors: int
    wall_s: float
    errors: list[str] = field(default_factory=list)  # first few error messages of this run
    # set when the spec's rows come from different kinds of latency model (plan.mixed_latency_warning)
    latency_warning: str | None = None

    def format(self) -> str:
        lines = [
            f"{self.num_points} points: {self.num_skipped} already in {self.out}, {self.num_run} run "
            f"({self.num_errors} recorded with an error) in {self.wall_s:.1f} s"
        ]
        lines += [f"  error: {e}" for e in self.errors]
        return "\n".join(lines)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of an existing sweep output (empty when there is none)."""
    import pandas as pd

    if not path.exists():
        return []
    try:
        df = pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise ValueError(f"{path}: cannot read the existing sweep output ({e}); move it away") from None
    if "key" not in df.columns:
        raise ValueError(f"{path}: not a kvplan sweep output (no 'key' column); move it away")
    return df.to_dict("records")


def write_rows_atomic(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Write all rows to `path` through a temporary file and a rename: a reader (or a crash) never
    sees a half-written file."""
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pd.DataFrame.from_records(list(rows)).to_parquet(tmp, index=False)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _is_done(row: Mapping[str, Any]) -> bool:
    err = row.get("error_type")
    return err is None or (isinstance(err, float) and math.isnan(err)) or err in DETERMINISTIC_ERRORS


def run_sweep(
    spec: SweepSpec,
    out: str | Path,
    workers: int | None = None,
    ray_address: str | None = None,
    progress: bool = True,
    latency: Callable[[SimConfig], LatencyModel] | None = None,
) -> SweepReport:
    """Run every grid point whose key is not yet in `out` (Parquet); rows are rewritten atomically as
    points finish, so an interrupted sweep keeps everything done. Failed points other than invalid
    configurations are retried on the next run."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    out = Path(out)
    points = spec.points()
    keys = [spec.point_key(p) for p in points]
    if len(set(keys)) != len(keys):
        raise ValueError("grid: some points repeat (an axis lists the same value twice)")
    existing = {row["key"]: row for row in read_rows(out)}
    todo = [i for i, k in enumerate(keys) if not (k in existing and _is_done(existing[k]))]
    report = SweepReport(out, len(points), len(points) - len(todo), 0, 0, 0.0)
    if not todo:
        report.latency_warning = mixed_latency_warning([existing[k] for k in keys if k in existing])
        report.wall_s = time.perf_counter() - t0
        return report
    order = {k: i for i, k in enumerate(keys)}
    rows: dict[str, dict[str, Any]] = dict(existing)

    def flush() -> None:
        ordered = sorted(rows.values(), key=lambda r: order.get(r["key"], -1))  # other sweeps' rows first
        write_rows_atomic(ordered, out)

    ctx = spec.context(latency)
    last_flush, flush_cost, dirty = 0.0, 0.0, False
    bar = tqdm(total=len(todo), desc="sweep", unit="pt", disable=not progress, smoothing=0.1)
    try:
        with PointRunner(ctx, workers, ray_address) as runner:
            for j, row in runner.map_unordered([points[i] for i in todo]):
                key = keys[todo[j]]
                rows[key] = {"key": key, **row}
                report.num_run += 1
                dirty = True
                if row.get("error") is not None:
                    report.num_errors += 1
                    if len(report.errors) < 5:
                        report.errors.append(row["error"])
                bar.set_postfix(errors=report.num_errors, refresh=False)
                bar.update(1)
                # Rewrite after each point unless writing costs more than a tenth of the time between.
                now = time.perf_counter()
                if now - last_flush >= 10 * flush_cost:
                    flush()
                    flush_cost, last_flush, dirty = time.perf_counter() - now, time.perf_counter(), False
    finally:
        bar.close()
        if dirty:
            flush()
    report.latency_warning = mixed_latency_warning([rows[k] for k in keys if k in rows])
    report.wall_s = time.perf_counter() - t0
    return report
