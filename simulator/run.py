"""One simulation from a trace and a configuration to tables, a summary and files on disk.

`run_simulation` picks the latency model (a fitted profile, else the roofline), sizes the KV cache
from the GPU's memory with the engine's pure functions (a profile's calibration cache is recorded,
never used as the size), runs `simulator.sim.simulate`, and returns a `SimResult`.
"""

from __future__ import annotations

import ctypes
import gc
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from simulator.config import SimConfig, kv_blocks_per_replica
from simulator.latency.base import LatencyModel
from simulator.latency.gpus import get_gpu
from simulator.latency.profile import load_latency_model
from simulator.metrics import SLO, add_latencies, summarize
from simulator.sim import SimRun, rows_frame, simulate

# A simulation allocates millions of short-lived objects (events, token lists) next to a large,
# long-lived trace: at Python's default threshold (700) the collector runs thousands of times and
# each full pass walks the trace. Measured on azure_conv_2023: a third of the CPU time at block 256.
SIM_GC_THRESHOLDS = (50_000, 20, 100)


@contextmanager
def relaxed_gc(thresholds: tuple[int, int, int] = SIM_GC_THRESHOLDS) -> Iterator[None]:
    """Collect less often while a simulation runs: what exists now is frozen (never walked), and the
    young generation collects every `thresholds[0]` allocations. Restores both on exit (process-wide
    settings: do not run simulations in threads of one process). Where something froze objects
    before (an `LLM` of the same process: `freeze_gc`), the exit leaves everything frozen, since
    Python cannot unfreeze only what this froze."""
    old = gc.get_threshold()
    was_frozen = gc.get_freeze_count() > 0
    gc.freeze()
    gc.set_threshold(*thresholds)
    try:
        yield
    finally:
        gc.set_threshold(*old)
        if not was_frozen:
            gc.unfreeze()


@dataclass
class SimResult:
    config: SimConfig
    requests: pd.DataFrame
    timeline: pd.DataFrame
    summary: dict
    itl: tuple  # (inter-token gap bin centres, token counts), see metrics.ITLBins

    def save(self, out_dir: str | Path) -> Path:
        """Write requests.parquet, timeline.parquet and summary.json under `out_dir`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.requests.to_parquet(out / "requests.parquet", index=False)
        self.timeline.to_parquet(out / "timeline.parquet", index=False)
        (out / "summary.json").write_text(json.dumps(self.summary, indent=2, default=str) + "\n")
        return out


def config_dict(config: SimConfig) -> dict:
    d = asdict(config)
    d["model"] = config.model.name
    return d


def collect(run: SimRun, slo: SLO | None = None, release: bool = False) -> SimResult:
    """Turn a raw SimRun into per-request and timeline tables and the summary. With `release`, the
    run cannot be collected again: the replicas' schedulers and block managers (their queues and
    KV caches) go once their counters are read, and their per-request rows as the table takes them."""
    for replica in run.replicas:
        replica.itl.fold(replica.scheduler)
    itl = run.replicas[0].itl.merged([r.itl for r in run.replicas[1:]]).arrays()
    queried = sum(r.block_manager.num_prefix_queried_tokens for r in run.replicas)
    hits = sum(r.block_manager.num_prefix_hit_tokens for r in run.replicas)
    if release:
        for replica in run.replicas:
            replica.scheduler = replica.block_manager = None
        trim_heap()
    # a timeline row holds the blocks in use: its kv_usage is their share of num_kv_blocks
    timeline = rows_frame([r.timeline for r in run.replicas], scale={"kv_usage": run.num_kv_blocks})
    # sorted as it is built (no unsorted copy beside it), the latencies added in place: a million
    # requests' table is 140 MB
    records = rows_frame([r.records for r in run.replicas], order_by="request_id", release=release)
    requests = add_latencies(records, copy=False)
    summary = summarize(requests, itl, timeline, slo)
    steps = sum(r.counters.num_steps for r in run.replicas)
    ff_steps = sum(r.counters.num_fast_forward_steps for r in run.replicas)
    busy = sum(r.counters.busy_s for r in run.replicas)
    summary.update(
        prefix_hit_rate=hits / queried if queried else 0.0,
        gpu_busy_fraction=busy / (summary["duration_s"] * len(run.replicas)),
        num_kv_blocks_per_replica=run.num_kv_blocks,
        num_gpus=run.config.num_gpus,
        sim_steps=steps + ff_steps,
        sim_fast_forwarded_steps=ff_steps,
        sim_wall_s=run.wall_s,
        sim_speedup=summary["duration_s"] / run.wall_s if run.wall_s else float("inf"),
        trace=run.trace_name,
        **(
            {"sim_overlapped_steps": sum(r.counters.num_overlapped_steps for r in run.replicas)}
            if run.config.async_scheduling
            else {}
        ),
        config=config_dict(run.config),
        **run.extra,
    )
    outside = summary.get("steps_outside_fit")
    summary["steps_outside_fit_share"] = (
        outside / summary["sim_steps"] if outside is not None and steps + ff_steps else None
    )
    return SimResult(run.config, requests, timeline, summary, itl)


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system where the C library can (glibc's
    malloc_trim): a finished run's KV caches and queues free some 100 MB in many small pieces, which
    glibc would keep, while the tables built next take fresh memory for their large arrays."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def run_simulation(
    trace,
    config: SimConfig,
    profile: str | Path | None = None,
    latency: LatencyModel | None = None,
    slo: SLO | None = None,
    progress: bool = False,
    prompts: list[list[int]] | None = None,
) -> SimResult:
    """Simulate `trace` on `config`: latency from `latency`, else `profile` (fitted), else roofline.
    `prompts`: the trace's prompts already built (`simulator.sim.trace_prompts`), if any."""
    return collect(simulate_config(trace, config, profile, latency, progress, prompts), slo, release=True)


def simulate_config(
    trace,
    config: SimConfig,
    profile: str | Path | None = None,
    latency: LatencyModel | None = None,
    progress: bool = False,
    prompts: list[list[int]] | None = None,
) -> SimRun:
    """`run_simulation` before `collect`: the raw run (its `latency` holds the model used)."""
    get_gpu(config.gpu)  # an unknown GPU fails here, whatever else is given
    if latency is None:
        latency = load_latency(config, profile)
    num_blocks = kv_blocks_for(config)
    counting = counting_model(latency)
    with relaxed_gc():
        run = simulate(trace, config, counting or latency, num_blocks, progress=progress, prompts=prompts)
    run.extra.update(latency_provenance(latency, profile))
    run.extra.update(extrapolation(counting))
    run.extra["kv_blocks_source"] = "config" if config.num_kv_blocks is not None else "gpu_memory"
    run.latency = latency
    return run


def counting_model(latency: LatencyModel):
    """`latency` wrapped to count the steps priced outside its profile's fit ranges
    (`simulator.latency.ranges`), or None when it is no fitted profile or its ranges are unknown."""
    from simulator.latency.base import LatencyModelBase
    from simulator.latency.ranges import CountingModel, profile_fit_ranges

    prof = getattr(latency, "profile", None)
    if prof is None or not isinstance(latency, LatencyModelBase):
        return None
    ranges = profile_fit_ranges(prof)
    return CountingModel(latency, ranges) if ranges is not None else None


def extrapolation(counting) -> dict:
    """Summary entries of a run's steps outside the profile's fit ranges (None: not checked)."""
    if counting is None:
        return {"steps_outside_fit": None, "fit_ranges": None}
    count = counting.count
    return {
        "steps_outside_fit": count.total,
        "decode_steps_outside_fit": count.decode,
        "prefill_steps_outside_fit": count.prefill,
        "fit_ranges": f"{counting.ranges.source}: {counting.ranges.describe()}",
    }


def latency_kind(latency: LatencyModel) -> str:
    """'fitted', 'transferred' or 'roofline' (another model: its class name; a `ScaledModel`: the
    model it scales)."""
    from simulator.latency.fitted import FittedModel
    from simulator.latency.roofline import RooflineModel
    from simulator.latency.scaled import ScaledModel
    from simulator.latency.transfer import TransferredModel

    while isinstance(latency, ScaledModel):
        latency = latency.model
    if isinstance(latency, FittedModel):
        return "fitted"
    if isinstance(latency, TransferredModel):
        return "transferred"
    if isinstance(latency, RooflineModel):
        return "roofline"
    return type(latency).__name__


def latency_provenance(latency: LatencyModel, profile: str | Path | None = None) -> dict:
    """The summary entries naming the latency model behind a run: `latency_model` (its kind),
    `profile` (the fitted profile's file name, None for the roofline), `profile_path`, and the
    calibration's own KV cache (`profile_num_kv_blocks`: a fact of the profile, not the run's) and
    whether its engine ran small prefill and mixed steps as whole-step graphs (`profile_step_graphs`;
    None without a fitted profile); for a `ScaledModel` (a band's run) also its factors, `step_time_scale_decode` / `_prefill`."""
    from simulator.latency.scaled import ScaledModel

    prof = getattr(latency, "profile", None)
    calibrated = getattr(prof, "calibration_num_kv_blocks", None)
    out = {
        "latency_model": latency_kind(latency),
        "profile": Path(profile).name if profile else None,
        "profile_path": str(profile) if profile else None,
        "profile_num_kv_blocks": calibrated,
        "profile_step_graphs": None if prof is None else bool(prof.extra.get("step_graphs")),
    }
    if isinstance(latency, ScaledModel):
        out["step_time_scale_decode"] = latency.decode
        out["step_time_scale_prefill"] = latency.prefill
    return out


def latency_label(latency_model: str | None, profile: str | None = None) -> str:
    """How a table names the latency model of a row: 'fitted qwen3-0.6b_h200_tp1_bs16.json',
    'transferred transfer_h200.json', 'roofline'."""
    kind = latency_model or "?"
    return f"{kind} {Path(profile).name}" if profile else kind


def load_latency(config: SimConfig, profile: str | Path | None = None) -> LatencyModel:
    """The latency model of `config`: the fitted `profile` (or the transferred model of a
    transferred model's file), else the roofline of its GPU."""
    gpu = get_gpu(config.gpu)
    return load_latency_model(profile, config.model, gpu, config.tensor_parallel_size, config.block_size)


def kv_blocks_for(config: SimConfig) -> int:
    """KV blocks per replica: the config's own count, else what the engine's sizing gives on the
    config's GPU. A profile's cache is a condition of its calibration and never the default."""
    return kv_blocks_per_replica(config)
