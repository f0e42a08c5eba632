"""Serve a trace on the real engine in real time, and write a replay folder for `kvplan validate`.

Arrivals are honoured by the wall clock: the loop admits each request once its arrival time has
passed (at a step boundary, exactly where the simulator admits it) and sleeps when idle. The folder
holds run.json, trace.parquet, requests.parquet (the simulator's per-request columns) and steps.parquet.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
from tqdm import tqdm

from engine.core.sequence import SequenceStatus
from engine.records import REQUEST_FIELDS, request_record
from engine.sampling_params import SamplingParams
from traces.schema import synthetic_vocab_size


def replay_trace(llm, trace, progress: bool = True, max_wall_s: float | None = None) -> pd.DataFrame:
    """Serve `trace` on `llm` in real time; per-request timings in seconds from the replay start.

    Requests carry the trace's synthetic token ids (as the simulator does), greedy sampling, EOS
    ignored and `max_tokens` = the trace's output length. `max_wall_s` aborts a run that overruns.
    """
    df = trace.df
    arrivals = df["arrival_s"].to_numpy(dtype=float).tolist()
    output_lens = df["output_len"].to_numpy().tolist()
    request_ids = df["request_id"].to_numpy().tolist()
    vocab = synthetic_vocab_size(llm.spec.vocab_size, llm.block_manager.block_size)  # as the simulator
    prompts = [trace.token_ids(i, vocab) for i in range(len(df))]  # before the clock starts
    records: list[tuple] = []
    owner: dict[int, tuple[int, int]] = {}
    bar = tqdm(total=len(df), desc="replaying", unit="req", disable=not progress)
    t0 = time.perf_counter()
    i = 0
    while i < len(arrivals) or llm.has_unfinished():
        now = time.perf_counter()
        while i < len(arrivals) and t0 + arrivals[i] <= now:
            params = SamplingParams(temperature=0.0, max_tokens=output_lens[i], ignore_eos=True)
            seq = llm.add_request(prompts[i], params, arrival_time=t0 + arrivals[i])
            owner[seq.seq_id] = (request_ids[i], output_lens[i])
            if seq.status is SequenceStatus.REJECTED:
                records.append(request_record(seq, request_ids[i], output_lens[i], 0, t0))
                bar.update(1)
            i += 1
        if llm.has_unfinished():
            for seq in llm.step():
                rid, out_len = owner.pop(seq.seq_id)
                records.append(request_record(seq, rid, out_len, 0, t0))
                bar.update(1)
        elif i < len(arrivals):
            time.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        if max_wall_s is not None and time.perf_counter() - t0 > max_wall_s:
            raise TimeoutError(
                f"replay: still running after {max_wall_s:.0f} s ({i} of {len(arrivals)} arrived)"
            )
    bar.close()
    return pd.DataFrame.from_records(records, columns=list(REQUEST_FIELDS)).sort_values("request_id")


def replay_fresh(
    llm, trace, out_dir: str | Path, extra: dict, max_wall_s: float | None = None
) -> pd.DataFrame:
    """Serve `trace` on an `llm` that served others before, from an empty prefix cache and step
    recorder (as its simulated twin starts), and write its replay folder; its per-request frame."""
    llm.recorder.reset()
    llm.block_manager.reset_prefix_cache()
    requests = replay_trace(llm, trace, progress=False, max_wall_s=max_wall_s)
    write_replay(llm, trace, requests, out_dir, extra)
    return requests


def gpu_name(device_name: str) -> str:
    """'NVIDIA H200' -> 'H200' (the name the GPU spec table knows)."""
    for known in ("H200", "H100", "A100", "B200", "L40S"):
        if known in device_name.upper():
            return known
    return device_name


def write_replay(llm, trace, requests: pd.DataFrame, out_dir: str | Path, extra: dict | None = None) -> Path:
    """run.json, trace.parquet, requests.parquet and steps.parquet under `out_dir`."""
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sched, cache = llm.scheduler_config, llm.cache_config
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta = {
        "model": asdict(llm.spec),
        "model_dir": str(llm.model_dir),
        "gpu": gpu_name(device),
        "device": device,
        "tensor_parallel_size": llm.parallel_config.tensor_parallel_size,
        "attention_backend": llm.attention_backend,
        **llm.kernel_choices(),
        "freeze_gc": llm.freeze_gc,
        "block_size": cache.block_size,
        "num_kv_blocks": cache.num_blocks,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_model_len": sched.max_model_len,
        "policy": sched.policy,
        "trace": getattr(trace, "name", ""),
        "num_requests": len(trace),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **(extra or {}),
    }
    (out / "run.json").write_text(json.dumps(meta, indent=2) + "\n")
    trace.to_parquet(out / "trace.parquet")
    requests.to_parquet(out / "requests.parquet", index=False)
    if llm.recorder is not None:
        llm.recorder.save(out / "steps.parquet")
    return out
