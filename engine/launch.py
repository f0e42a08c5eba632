"""An LLM from command-line flags: the engine arguments the GPU commands share (`kvplan profile`,
`kvplan replay`, benchmarks/calibrate.py), the random-weight presets and the GPU the results stand for."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.core.config import POLICIES

PRESET_ARCH = {"qwen3-0.6b": "qwen3", "qwen3-8b": "qwen3", "llama-3-8b": "llama", "tiny": "qwen3"}


def engine_arguments(p: argparse.ArgumentParser) -> None:
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


def open_llm(args: argparse.Namespace, workdir: str):
    """The LLM `engine_arguments` describe (with --random, its checkpoint made under `workdir`)."""
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


def package_version() -> str:
    """kvplan's installed version ("dev" when run from a checkout that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvplan")
    except PackageNotFoundError:
        return "dev"
