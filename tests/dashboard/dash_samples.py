"""Test data for the dashboard tests: small traces, synthetic engine step records, and validation
runs (a real/sim request-table pair and a replay folder) built on the CPU from the simulator with
two different roofline efficiencies standing in for "real" and "simulated". Not a test module.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd

import traces
from simulator.config import SimConfig
from simulator.latency import RooflineEfficiency, RooflineModel, StepShape, fit_profile
from simulator.models import resolve_model
from simulator.run import run_simulation

MODEL = "qwen3-8b"
GPU = "H200-SXM"
# The stand-in for the real engine: a little slower than the default roofline.
REAL_EFFICIENCY = RooflineEfficiency(weight_bandwidth=0.7, kv_bandwidth=0.7, step_overhead_s=2.6e-3)


def small_trace(n: int = 300, rate_scale: float = 4.0) -> traces.Trace:
    """The first `n` requests of azure_conv_2023, replayed `rate_scale` x faster."""
    t = traces.load_shipped("azure_conv_2023")
    t = t.with_frame(t.df.iloc[:n].reset_index(drop=True), validate=False)
    return traces.scale_rate(t, factor=rate_scale)


def step_records(
    n: int = 600, seed: int = 0, efficiency: RooflineEfficiency = REAL_EFFICIENCY
) -> pd.DataFrame:
    """Engine-like step records (CONTRACT.md columns): random decode / prefill / mixed shapes timed by
    a roofline of `efficiency` with 3% noise."""
    rng = np.random.default_rng(seed)
    model = resolve_model(MODEL)
    truth = RooflineModel(model, GPU, efficiency=efficiency)
    rows = []
    for step in range(n):
        kind = rng.choice(["decode", "decode", "prefill", "mixed"])
        if kind == "decode":
            seqs = int(rng.integers(1, 257))
            ctx = int(seqs * rng.integers(64, 4096))
            shape = StepShape.decode(seqs, ctx, ctx // seqs + 1)
            prefill_seqs, new = 0, seqs
        else:
            prefill_seqs = int(rng.integers(1, 5))
            seqs = prefill_seqs + (int(rng.integers(1, 64)) if kind == "mixed" else 0)
            chunk = int(rng.integers(16, 4096))
            new = chunk + (seqs - prefill_seqs)
            ctx = int(rng.integers(0, 8192)) * (seqs - prefill_seqs)
            work = prefill_seqs * (chunk / prefill_seqs) * ((chunk / prefill_seqs + 1) / 2)
            shape = StepShape(kind, seqs, prefill_seqs, new, chunk, ctx, chunk + 1, work, 0)
        t = truth.predict(shape).total * float(rng.normal(1.0, 0.03))
        rows.append(
            {
                "step": step,
                "kind": kind,
                "num_seqs": shape.num_seqs,
                "num_prefill_seqs": shape.num_prefill_seqs,
                "num_decode_seqs": shape.num_decode_seqs,
                "total_num_scheduled_tokens": shape.total_num_scheduled_tokens,
                "num_prefill_tokens": shape.num_prefill_tokens,
                "total_num_cached_tokens": 0,
                "num_context_tokens": shape.num_context_tokens,
                "max_seq_len": shape.max_seq_len,
                "prefill_attn_work": shape.prefill_attn_work,
                "num_kv_blocks_used": 0,
                "graph_batch_size": 0,
                "tp": 1,
                "block_size": 16,
                "gpu_time_s": t,
                "wall_time_s": t * 1.05,
                "compiled": step == 0,
            }
        )
    return pd.DataFrame(rows)


def write_profile(path: Path, records: pd.DataFrame) -> Path:
    profile = fit_profile(
        records,
        model=resolve_model(MODEL),
        gpu=GPU,
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        attention_backend="synthetic",
        engine_version="test",
        created="2026-01-01T00:00:00+00:00",
    )
    return profile.save(path)


def _config() -> SimConfig:
    return SimConfig(model=resolve_model(MODEL), gpu=GPU, num_kv_blocks=4000, max_model_len=16384)


def _real_and_sim(trace: traces.Trace) -> tuple[pd.DataFrame, pd.DataFrame]:
    config = _config()
    real = run_simulation(trace, config, latency=RooflineModel(config.model, GPU, efficiency=REAL_EFFICIENCY))
    sim = run_simulation(trace, config, latency=RooflineModel(config.model, GPU))
    return real.requests, sim.requests


def write_pair_run(folder: Path, num_requests: int = 200) -> Path:
    """real_requests.parquet + sim_requests.parquet + steps.parquet + profile.json."""
    folder.mkdir(parents=True, exist_ok=True)
    real, sim = _real_and_sim(small_trace(num_requests))
    real.to_parquet(folder / "real_requests.parquet", index=False)
    sim.to_parquet(folder / "sim_requests.parquet", index=False)
    records = step_records(400)
    records.to_parquet(folder / "steps.parquet", index=False)
    write_profile(folder / "profile.json", records)
    return folder


def write_replay_run(folder: Path, num_requests: int = 150) -> Path:
    """A `kvplan replay`-shaped folder: run.json, trace.parquet, requests.parquet, steps.parquet."""
    folder.mkdir(parents=True, exist_ok=True)
    trace = small_trace(num_requests)
    config = _config()
    real, _ = _real_and_sim(trace)
    meta = {
        "model": dataclasses.asdict(config.model),
        "gpu": GPU,
        "tensor_parallel_size": 1,
        "block_size": config.block_size,
        "num_kv_blocks": config.num_kv_blocks,
        "enable_prefix_caching": True,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_model_len": config.resolved_max_model_len,
        "policy": config.policy,
        "trace": trace.name,
        "num_requests": len(trace),
    }
    (folder / "run.json").write_text(json.dumps(meta, indent=2))
    trace.to_parquet(folder / "trace.parquet")
    real.to_parquet(folder / "requests.parquet", index=False)
    step_records(300).to_parquet(folder / "steps.parquet", index=False)
    return folder


def write_repeat_run(replay: Path, folder: Path, delay_s: float = 0.01) -> Path:
    """`replay` served again: the same run.json and trace, every first token and finish `delay_s` later."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("run.json", "trace.parquet", "steps.parquet"):
        (folder / name).write_bytes((replay / name).read_bytes())
    real = pd.read_parquet(replay / "requests.parquet")
    real[["first_token_s", "finish_s"]] += delay_s
    real.to_parquet(folder / "requests.parquet", index=False)
    return folder


def write_report_run(replay: Path) -> Path:
    """What `kvplan validate --real REPLAY` writes: REPLAY/validation/ (validation.json, sim_requests.parquet)."""
    from simulator.validate import validate_run, write_report

    return write_report(validate_run(replay, None), replay / "validation")
