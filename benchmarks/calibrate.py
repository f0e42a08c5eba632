"""Calibrate and prove on one GPU in one process: profile, then replay a light and a heavy window.

Makes a random-weight checkpoint of a real shape, serves it with one LLM (one warm-up), runs the
designed step-shape sweep (`engine.profiling`, docs/CALIBRATION.md: sized from the engine's KV
cache, its device time estimated on a shipped profile by `simulator.calibration` and held to
`--profile-budget` before it runs),
optionally serves `--fit-replays` windows whose step
records join the sweep's in the fit (pick windows that no validation replay uses), fits and saves the
profile, then replays the `--replays` windows of a shipped trace in real time and writes replay
folders for `kvplan validate`. Prints a table.
Usage (GPU): PYTHONPATH=. python3 benchmarks/calibrate.py --out DIR [--preset qwen3-0.6b] [--block-sizes 16,256]
Without a GPU, the sweep each block size would run and its estimated device time:
  PYTHONPATH=. python3 benchmarks/calibrate.py --plan-only --preset qwen3-8b --block-sizes 16,256 [--async-scheduling]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from engine.checkpoint import make_random_checkpoint
from engine.launch import PRESET_ARCH
from engine.llm import LLM
from engine.profiling import SweepLimits, envelope
from engine.replay import gpu_name, replay_fresh
from simulator.calibration import (
    estimator_profile,
    fit_llm_profile,
    format_estimate,
    plan_limits,
    plan_sweep,
    run_profile,
)
from simulator.latency.profile import profile_report
from traces.cli import load_trace_arg

# name=START:END@RATE_SCALE: light = native rate, heavy = near saturation with preemptions
DEFAULT_REPLAYS = "light=600:660@1,heavy=600:840@8"


def parse_replays(text: str) -> list[tuple[str, str, float]]:
    out = []
    for item in filter(None, text.split(",")):
        name, rest = item.split("=")
        window, scale = rest.split("@")
        out.append((name, window, float(scale)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="output folder (required unless --plan-only)")
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="no GPU: print each block size's sweep (its estimated device time and envelope) for the "
        "cache an H200 gives the preset (or --num-kv-tokens) and exit",
    )
    p.add_argument("--gpu", default="H200", help="with --plan-only: the GPU whose memory sizes the cache")
    p.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESET_ARCH))
    p.add_argument("--block-sizes", default="16", help="comma-separated; one checkpoint serves them all")
    p.add_argument(
        "--num-kv-tokens",
        type=int,
        default=None,
        help="KV cache size in tokens (default: what --gpu-memory-utilization leaves, as serving sizes it)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument(
        "--profile-budget",
        type=float,
        default=300.0,
        help="device seconds the sweep may take, estimated before it runs (over it: an error)",
    )
    p.add_argument(
        "--estimate-profile",
        default=None,
        help="profile JSON that prices the sweep's steps (default: the shipped one of the preset, GPU, block size)",
    )
    p.add_argument(
        "--no-serving-replays",
        action="store_true",
        help="the sweep without its two synthetic-traffic replays (28 s of real time)",
    )
    p.add_argument("--trace", default="azure_conv_2023")
    p.add_argument("--replays", default=DEFAULT_REPLAYS, help="name=START:END@SCALE,... ('' for none)")
    p.add_argument("--replay-block-sizes", default="16", help="block sizes that also run the replays")
    p.add_argument(
        "--fit-replays",
        default="",
        help="name=START:END@SCALE,...: windows served before the fit whose step records join the sweep's "
        "(on 2026-11-29 this fitted worse than the sweep alone: docs/archive/PERF-history.md)",
    )
    p.add_argument(
        "--async-scheduling", action="store_true", help="serve (profile and replays) with async scheduling"
    )
    args = p.parse_args()
    if args.plan_only:
        print_plans(args)
        return
    if not args.out:
        p.error("--out: required unless --plan-only")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    gpu = gpu_name(torch.cuda.get_device_name()) if cuda else "H200"  # a CPU run is a dry run only
    replay_sizes = {int(b) for b in filter(None, args.replay_block_sizes.split(","))}
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        device = "cuda" if cuda else "cpu"
        ckpt = make_random_checkpoint(
            Path(tmp) / args.preset, PRESET_ARCH[args.preset], args.preset, device=device
        )
        rows.append(("checkpoint", f"{time.perf_counter() - t0:.1f} s"))
        for block_size in (int(b) for b in args.block_sizes.split(",")):
            replays = parse_replays(args.replays) if block_size in replay_sizes else []
            rows += calibrate(args, ckpt, gpu, block_size, parse_replays(args.fit_replays), replays, out)
    (out / "calibrate.json").write_text(json.dumps(dict(rows), indent=2) + "\n")
    print("\n".join(f"{k:<44} {v}" for k, v in rows))


def print_plans(args) -> None:
    """The sweep of each block size without a GPU: the preset's cache on `args.gpu` as plans size it
    (engine.memory.default_num_kv_blocks; the engine's own sizing differs by a few blocks), planned on
    the control plane and priced on the shipped (or --estimate-profile) profile."""
    from engine.memory import default_num_kv_blocks
    from simulator.latency.gpus import get_gpu
    from simulator.models import resolve_model

    spec = resolve_model(args.preset)
    for block_size in (int(b) for b in args.block_sizes.split(",")):
        blocks = (
            args.num_kv_tokens // block_size
            if args.num_kv_tokens
            else default_num_kv_blocks(
                spec,
                block_size,
                get_gpu(args.gpu).usable_memory_bytes,
                gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
            )
        )
        limits = SweepLimits(
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.max_model_len,
            blocks * block_size,
            "chunked",
            block_size,
            args.async_scheduling,
        )
        model = args.estimate_profile or estimator_profile(
            args.preset, args.gpu, block_size, 1, args.async_scheduling
        )
        if model is None:
            raise SystemExit(
                f"--estimate-profile: no shipped profile of {args.preset} on {args.gpu}; pass one"
            )
        plan = plan_limits(limits, spec, model)
        print(f"{args.preset} block {block_size}: {blocks:,} KV blocks ({blocks * block_size:,} tokens)")
        print("  " + format_estimate(plan.estimate, plan.steps, plan.source))
        print("  envelope: " + json.dumps(envelope(plan.steps, block_size)))
        if plan.estimate["total"] > args.profile_budget:
            print(f"  over --profile-budget {args.profile_budget:.0f} s: a run would stop before the sweep")


def calibrate(
    args, ckpt: Path, gpu: str, block_size: int, fit_replays, replays, out: Path
) -> list[tuple[str, str]]:
    """Serve `ckpt` at `block_size`: profile, the fit replays, fit, save, then the replays. Returns
    table rows. The engine is closed however it ends (a sweep over its budget raises)."""
    blocks = args.num_kv_tokens // block_size if args.num_kv_tokens else None
    t0 = time.perf_counter()
    llm = LLM(
        ckpt,
        block_size=block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_kv_blocks=blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        async_scheduling=args.async_scheduling,
    )
    rows = [(f"bs{block_size}: engine ready (load + warm-up)", f"{time.perf_counter() - t0:.1f} s")]
    try:
        return rows + serve_block(args, llm, gpu, block_size, fit_replays, replays, out)
    finally:
        llm.close()


def serve_block(
    args, llm, gpu: str, block_size: int, fit_replays, replays, out: Path
) -> list[tuple[str, str]]:
    """`calibrate`'s work on its engine: profile, the fit replays, fit, save, then the replays."""
    rows = []
    t1 = time.perf_counter()
    serving = not args.no_serving_replays
    plan = plan_sweep(llm, args.estimate_profile, serving=serving, gpu=gpu)
    rows.append((f"bs{block_size}: sweep estimate", f"{plan.estimate['total']:.0f} s on {plan.source}"))
    records = run_profile(
        llm,
        time_budget_s=args.profile_budget,
        progress=False,
        serving=serving,
        plan=plan,
        budget_flag="--profile-budget",
    )
    tag = f"{args.preset}_{gpu.lower()}_tp1_bs{block_size}"
    records.to_parquet(out / f"steps_{tag}.parquet", index=False)
    rows.append((f"bs{block_size}: profile", f"{len(records)} steps in {time.perf_counter() - t1:.0f} s"))
    fit_records = [records]
    for name, window, scale in fit_replays:
        rows.append(serve_replay(args, llm, gpu, block_size, f"fit-{name}", window, scale, out))
        fit_records.append(llm.recorder.to_dataframe())
    profile = fit_llm_profile(
        pd.concat(fit_records, ignore_index=True),
        llm,
        gpu,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tp=1,
        block_size=block_size,
        target="wall_time_s",
        loss="median",
        extra={
            "model_name": args.preset,
            "policy": llm.scheduler_config.policy,
            **llm.kernel_choices(),
            "freeze_gc": llm.freeze_gc,
            "source": "benchmarks/calibrate.py",
            # the step records the fit saw, as written beside the profile (the fit ranges name them)
            **({} if fit_replays else {"records": f"steps_{tag}.parquet"}),
            "sweep_envelope": envelope(records, block_size),
            "sweep_estimate_s": {k: round(v, 1) for k, v in plan.estimate.items()},
            **({"fit_replays": args.fit_replays, "trace": args.trace} if fit_replays else {}),
        },
    )
    profile.save(out / f"{tag}.json")
    print(profile_report(profile), flush=True)
    for name, window, scale in replays:
        rows.append(serve_replay(args, llm, gpu, block_size, name, window, scale, out))
    return rows


def serve_replay(args, llm: LLM, gpu: str, block_size: int, name: str, window: str, scale: float, out: Path):
    """Replay one window of the trace in real time from a cold prefix cache; write its folder. A row."""
    trace = load_trace_arg(args.trace, scale, None, window)
    t0 = time.perf_counter()
    extra = {"source": args.trace, "window": window, "rate_scale": scale, "gpu": gpu}
    requests = replay_fresh(llm, trace, out / f"replay_{name}_bs{block_size}", extra, max_wall_s=200)
    done = requests["finish_reason"].isin(["length", "max_model_len"]).sum()
    return (
        f"bs{block_size}: replay {name} ({window} x{scale})",
        f"{done}/{len(trace)} done in {time.perf_counter() - t0:.0f} s, "
        f"{int(requests['num_preemptions'].sum())} preemptions",
    )


if __name__ == "__main__":
    main()
