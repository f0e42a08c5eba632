"""`kvplan profile` and `kvplan replay`: the GPU-side commands of the calibration loop.

Argument wiring only. Registering them imports no torch; running them needs the `engine` extra
and, to mean anything, a GPU. `--random PRESET` makes a random-weight checkpoint of a real shape.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from engine.core.config import POLICIES

PRESET_ARCH = {"qwen3-0.6b": "qwen3", "qwen3-8b": "qwen3", "llama-3-8b": "llama", "tiny": "qwen3"}


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="HF checkpoint folder (config.json + *.safetensors)")
    src.add_argument(
        "--random", choices=sorted(PRESET_ARCH), help="make a random-weight checkpoint of this shape"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (one process per GPU)")
    p.add_argument(
        "--block-size",
        type=int,
        default=16,
        help="KV cache block size in tokens (flash_attn: a multiple of 256; the others: any)",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "flash_attn_cute", "flash_attn", "torch"],
        help="attention backend; auto: FlashAttention-4 where it runs, else FlashAttention-2 where the "
        "block size suits it, else torch",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="token budget of one step")
    p.add_argument("--max-model-len", type=int, default=16384, help="longest prompt + output in tokens")
    p.add_argument(
        "--policy",
        default="chunked",
        choices=POLICIES,
        help="scheduling: chunked prefill mixed with decodes (vLLM v1), or prefill-only / decode-only steps",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory the engine may use"
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="launch each decode step while the one before it runs (record profiles the way you serve)",
    )
    p.add_argument("--gpu", default=None, help="GPU type to label results with (default: the one detected)")
    p.add_argument("--dist-port", type=int, default=None, help="TP rendezvous port (default: a free one)")
    p.add_argument(
        "--profile-allreduce", action="store_true", help="time TP all-reduces (use with --enforce-eager)"
    )


def detected_gpu(args: argparse.Namespace) -> str:
    """The GPU type for the spec table: --gpu, else the CUDA device's name; a CPU run must say."""
    import torch

    from engine.replay import gpu_name

    if args.gpu:
        return args.gpu
    if not torch.cuda.is_available():
        raise ValueError("--gpu: no CUDA device here; name the GPU type these results stand for")
    return gpu_name(torch.cuda.get_device_name())


def _open_llm(args: argparse.Namespace, workdir: str):
    import torch

    from engine.checkpoint import make_random_checkpoint
    from engine.llm import LLM

    model_dir = args.model
    if args.random:
        model_dir = Path(workdir) / args.random
        device = "cuda" if torch.cuda.is_available() else "cpu"
        make_random_checkpoint(model_dir, arch=PRESET_ARCH[args.random], preset=args.random, device=device)
    return LLM(
        model_dir,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        policy=args.policy,
        enable_prefix_caching=not args.no_prefix_caching,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.backend,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tp,
        dist_port=args.dist_port,
        profile_allreduce=args.profile_allreduce,
        async_scheduling=args.async_scheduling,
    )


def cmd_profile(args: argparse.Namespace) -> int:
    from engine.profiling import run_profile
    from simulator.latency.profile import fit_profile, profile_report

    detected_gpu(args)  # fail before the work, not after it

    with tempfile.TemporaryDirectory() as tmp, _open_llm(args, tmp) as llm:
        records = run_profile(llm, seed=args.seed, time_budget_s=args.time_budget)
        if args.records:
            records.to_parquet(args.records, index=False)
        name = args.random or llm.spec.name
        profile = fit_profile(
            records,
            model=llm.spec,
            gpu=detected_gpu(args),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            tp=args.tp,
            block_size=args.block_size,
            attention_backend=llm.attention_backend,
            engine_version=_version(),
            num_kv_blocks=llm.cache_config.num_blocks,
            target=args.target,
            loss=args.loss,
            split_kv=_split_kv(llm),
            extra={
                "model_name": name,
                "policy": args.policy,
                "num_steps": len(records),
                **llm.kernel_choices(),
            },
        )
    out = Path(args.out or f"{name.lower()}_{profile.gpu.lower()}_tp{args.tp}_bs{args.block_size}.json")
    profile.save(out)
    print(profile_report(profile))
    print(f"wrote {out}")
    return 0


def _split_kv(llm):
    """The engine's decode split policy as the fitted model takes it (None: no split-KV kernel)."""
    from simulator.latency.fitted import SplitKV

    fields = llm.decode_split_kv()
    return SplitKV(**fields) if fields else None


def cmd_replay(args: argparse.Namespace) -> int:
    from engine.replay import replay_trace, write_replay
    from traces.cli import check_out_dir, load_trace_arg

    check_out_dir(args.out)
    trace = load_trace_arg(args.trace, args.rate_scale, args.limit, args.window)
    gpu = detected_gpu(args)
    with tempfile.TemporaryDirectory() as tmp, _open_llm(args, tmp) as llm:
        requests = replay_trace(llm, trace, progress=not args.quiet, max_wall_s=args.max_wall)
        extra = {
            "rate_scale": args.rate_scale,
            "limit": args.limit,
            "window": args.window,
            "source": args.trace,
            "gpu": gpu,
        }
        out = write_replay(llm, trace, requests, args.out, extra)
    print(f"wrote {out}: {len(requests)} requests")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvplan")
    except PackageNotFoundError:
        return "dev"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="(GPU) run a designed sweep of step shapes and fit a latency profile")
    _engine_arguments(p)
    p.add_argument("--out", default=None, help="profile JSON (default: MODEL_GPU_tpN_bsB.json)")
    p.add_argument("--records", default=None, help="also save the step records (Parquet)")
    p.add_argument("--time-budget", type=float, default=240.0, help="seconds of workloads at most")
    p.add_argument(
        "--target",
        default="wall_time_s",
        choices=["wall_time_s", "gpu_time_s"],
        help="the step time to fit: host wall time, or GPU time (CUDA events)",
    )
    p.add_argument(
        "--loss",
        default="median",
        choices=["median", "absolute", "relative"],
        help="least absolute seconds (default: robust to a host's slow phases), squared seconds, or squared relative error",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the designed workloads")
    p.set_defaults(func=cmd_profile)
    r = sub.add_parser("replay", help="(GPU) serve a trace in real time and write a replay folder")
    _engine_arguments(r)
    r.add_argument("--trace", required=True, help="shipped trace name or a trace file")
    r.add_argument("--rate-scale", type=float, default=None, help="replay k times faster")
    r.add_argument("--limit", type=int, default=None, help="only the first N requests")
    r.add_argument("--window", default=None, help="START:END seconds of the trace")
    r.add_argument("--out", required=True, help="replay folder to write (requests, steps, trace, run.json)")
    r.add_argument("--max-wall", type=float, default=None, help="abort after this many seconds")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_replay)
