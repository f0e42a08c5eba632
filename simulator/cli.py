"""The `kvplan` command line: argument wiring only; every command is a thin call into a library.

`kvplan simulate` with no arguments replays a shipped trace on the shipped default profile.
Subcommands of other packages register themselves through their own `register(subparsers)`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

DEFAULT_TRACE = "azure_conv_2023"
DEFAULT_MODEL = "qwen3-0.6b"
DEFAULT_GPU = "H200"

# Packages whose `cli.register(subparsers)` adds commands; a missing one (not built, or an extra
# not installed) simply adds none.
_PLUGINS = ("traces.cli", "simulator.plan_cli", "engine.cli", "dashboard.cli")
_OPTIONAL_DEPS = {"torch", "transformers", "safetensors", "streamlit", "plotly", "ray", "simpy", "yaml"}


def default_profile(
    model: str, gpu: str, block_size: int, tp: int, async_scheduling: bool = False
) -> Path | None:
    """The shipped fitted profile for this model, GPU (any of its names), block size and TP, if any.
    With `async_scheduling`, the one calibrated on an engine scheduling asynchronously (`..._async`)
    where there is one, else the synchronous engine's."""
    from simulator.latency.gpus import canonical_gpu_name, get_gpu
    from simulator.run import SHIPPED_PROFILE_DIR

    suffixes = ("_async", "") if async_scheduling else ("",)
    for suffix in suffixes:
        for name in dict.fromkeys([gpu, canonical_gpu_name(gpu), *get_gpu(gpu).aliases]):
            stem = f"{model.lower()}_{name.lower()}_tp{tp}_bs{block_size}{suffix}"
            path = SHIPPED_PROFILE_DIR / f"{stem}.json"
            if path.is_file():
                return path
    return None


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that builds a SimConfig."""
    p.add_argument("--model", default=DEFAULT_MODEL, help="shipped preset name or model folder")
    p.add_argument("--gpu", default=DEFAULT_GPU, help="GPU type from simulator/data/gpus.json")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree per replica")
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="override KV blocks per replica")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--policy", default="chunked", choices=["chunked", "prefill_first"])
    p.add_argument(
        "--router", default="round_robin", choices=["round_robin", "least_outstanding", "prefix_aware"]
    )
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--profile", default="auto", help="fitted profile JSON, 'auto' (shipped) or 'roofline'")


def sim_config_from_args(args: argparse.Namespace):
    from simulator.config import SimConfig
    from simulator.models import resolve_model

    return SimConfig(
        model=resolve_model(args.model),
        gpu=args.gpu,
        tensor_parallel_size=args.tp,
        num_replicas=args.replicas,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        policy=args.policy,
        router=args.router,
        async_scheduling=getattr(args, "async_scheduling", False),
    )


def resolve_profile(args: argparse.Namespace) -> Path | None:
    if args.profile == "roofline":
        return None
    if args.profile == "auto":
        async_scheduling = getattr(args, "async_scheduling", False)
        return default_profile(args.model, args.gpu, args.block_size, args.tp, async_scheduling)
    path = Path(args.profile)
    if not path.is_file():
        raise ValueError(f"--profile: {path} does not exist")
    return path


def load_trace_arg(
    spec: str, rate_scale: float | None = None, limit: int | None = None, window: str | None = None
):
    """A shipped trace name or a trace file; optionally a START:END window (seconds, rebased to 0),
    its first `limit` rows, and replayed `rate_scale` times faster."""
    import traces

    trace = traces.load_shipped(spec) if spec in traces.shipped_names() else traces.load(spec)
    if window:
        try:
            start, end = (float(x) if x else None for x in window.split(":"))
        except ValueError:
            raise ValueError(f"--window: {window!r} is not START:END in seconds (e.g. 600:900)") from None
        trace = traces.time_window(trace, start or 0.0, end)
    if limit is not None:
        if limit <= 0:
            raise ValueError(f"--limit: must be a positive number of requests, got {limit}")
        trace = trace.with_frame(trace.df.iloc[:limit].reset_index(drop=True))
    if rate_scale is not None:
        trace = traces.scale_rate(trace, factor=rate_scale)
    return trace


def cmd_simulate(args: argparse.Namespace) -> int:
    from simulator.metrics import SLO
    from simulator.report import format_summary
    from simulator.run import run_simulation

    config = sim_config_from_args(args)
    profile = resolve_profile(args)
    trace = load_trace_arg(args.trace, args.rate_scale, args.limit, args.window)
    slo = SLO.parse(args.slo) if args.slo else None
    result = run_simulation(trace, config, profile=profile, slo=slo, progress=not args.quiet)
    print(format_summary(result.summary))
    if args.out:
        out = result.save(args.out)
        print(f"\nwrote {out}/requests.parquet, timeline.parquet, summary.json")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from simulator.validate import format_table, validate_run, write_report

    if len(args.real) > 1 or len(args.profile) > 1:
        return validate_many(args)
    v = validate_run(args.real[0], args.profile[0], args.repeat)
    print(format_table(v))
    out = write_report(v, args.out or Path(args.real[0]) / "validation")
    print(f"\nwrote {out}/report.html; {'within' if v.passed else 'OUTSIDE'} the targets")
    return 0


def validate_many(args: argparse.Namespace) -> int:
    """Several runs and/or profiles: the targets each pair meets, as a table (and CSV with --out)."""
    from simulator.validate import format_matrix, validation_matrix

    if args.repeat is not None:
        print("kvplan validate: --repeat takes one --real run and one --profile", file=sys.stderr)
        return 2
    matrix = validation_matrix(args.real, args.profile)
    print(format_matrix(matrix))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        matrix.to_csv(out / "validation_matrix.csv", index=False)
        print(f"\nwrote {out / 'validation_matrix.csv'}")
    return 0


def parse_split_kv(text: str):
    """--split-kv: 'none', KV_HEADS:SMS (splits by batch size), KV_HEADS:SMS:BLOCK_SIZE (balanced) or
    KV_HEADS:SMS:BLOCK_SIZE:SPLIT_TOKENS (balanced, pages split inside into units of SPLIT_TOKENS)."""
    from simulator.latency.fitted import SplitKV

    if text.strip().lower() == "none":
        return None
    try:
        parts = [int(x) for x in text.split(":")]
        if len(parts) == 2:
            return SplitKV(*parts)
        if len(parts) in (3, 4):
            return SplitKV(*parts[:3], balanced=True, split_tokens=parts[3] if len(parts) == 4 else 0)
        raise ValueError
    except ValueError as e:
        detail = (
            str(e)
            if str(e).startswith("split_kv")
            else "expected KV_HEADS:SMS (e.g. 8:132), KV_HEADS:SMS:BLOCK_SIZE (balanced, e.g. 8:132:16) "
            "or KV_HEADS:SMS:BLOCK_SIZE:SPLIT_TOKENS (e.g. 8:132:256:64)"
        )
        raise ValueError(f"--split-kv: {text!r}: {detail}, 'none' or 'like'") from None


def cmd_fit(args: argparse.Namespace) -> int:
    import pandas as pd

    from engine.cli import profile_report
    from simulator.latency.profile import LatencyProfile, fit_profile

    records = pd.read_parquet(args.records)
    like = LatencyProfile.load(args.like)
    extra = {**like.extra, "records": Path(args.records).name, "refit_of": Path(args.like).name}
    if args.infer_overlapped:
        from simulator.latency.fitted import infer_overlapped

        if "overlapped" in records.columns:
            raise ValueError(f"--infer-overlapped: {args.records} already has an overlapped column")
        records = records.assign(overlapped=infer_overlapped(records))
        extra["overlapped"] = "inferred (kvplan fit --infer-overlapped)"
    profile = fit_profile(
        records,
        model=like.model_spec(),
        gpu=like.gpu,
        max_num_seqs=like.max_num_seqs,
        max_num_batched_tokens=like.max_num_batched_tokens,
        tp=like.tp,
        block_size=like.block_size,
        attention_backend=like.attention_backend,
        engine_version=like.engine_version,
        num_kv_blocks=like.num_kv_blocks,
        target=args.target,
        loss=args.loss,
        split_kv=like.split_kv if args.split_kv == "like" else parse_split_kv(args.split_kv),
        floors=not args.no_floors,
        extra=extra,
    )
    profile.save(args.out)
    print(profile_report(profile))
    print(f"wrote {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvplan", description="Capacity planning for LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sim = sub.add_parser("simulate", help="replay a trace through the simulator and print the metrics")
    sim.add_argument("--trace", default=DEFAULT_TRACE, help="shipped trace name or a trace file")
    sim.add_argument("--rate-scale", type=float, default=None, help="replay k times faster")
    sim.add_argument("--limit", type=int, default=None, help="only the first N requests")
    sim.add_argument("--window", default=None, help="START:END seconds of the trace (rebased to 0)")
    sim.add_argument("--slo", default=None, help="e.g. ttft=2s,tpot=80ms (adds goodput)")
    sim.add_argument("--out", default=None, help="folder for requests/timeline Parquet and summary JSON")
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    add_sim_arguments(sim)
    sim.add_argument(
        "--async-scheduling",
        action="store_true",
        help="the engine schedules each decode step while the one before it runs (kvplan replay "
        "--async-scheduling); with --profile auto, the shipped profile calibrated with it where there is one",
    )
    sim.set_defaults(func=cmd_simulate)
    val = sub.add_parser(
        "validate", help="simulate a real replay's trace and configuration; report the errors"
    )
    val.add_argument(
        "--real",
        required=True,
        nargs="+",
        help="replay folder written by `kvplan replay`; several: a table of the targets each run meets "
        "with each --profile",
    )
    val.add_argument(
        "--profile",
        nargs="+",
        default=[None],
        help="fitted profile JSON (default: roofline); several: compared on every --real run",
    )
    val.add_argument(
        "--repeat",
        default=None,
        help="another replay folder of the same trace and configuration: adds the real system's "
        "own run-to-run difference beside the simulator's error",
    )
    val.add_argument(
        "--out", default=None, help="folder for report.html, validation.json, sim_requests.parquet"
    )
    val.set_defaults(func=cmd_validate)
    fit = sub.add_parser("fit", help="fit a latency profile on engine step records (metadata from --like)")
    fit.add_argument("--records", required=True, help="step records Parquet (kvplan profile --records)")
    fit.add_argument("--like", required=True, help="profile JSON whose model/GPU/limits metadata to keep")
    fit.add_argument(
        "--loss",
        default="median",
        choices=["median", "absolute", "relative"],
        help="least absolute seconds (default: robust to a host's slow phases), squared seconds, or squared relative error",
    )
    fit.add_argument("--target", default="wall_time_s", choices=["wall_time_s", "gpu_time_s"])
    fit.add_argument(
        "--split-kv",
        default="like",
        help="how the engine's decode kernel split each sequence's KV: KV_HEADS:SMS (kv heads per TP rank, "
        "GPU SMs; the Triton split-KV kernel before balanced splits, e.g. 8:132 for Qwen3 on an H200), "
        "KV_HEADS:SMS:BLOCK_SIZE (its balanced splits, e.g. 8:132:16), KV_HEADS:SMS:BLOCK_SIZE:SPLIT_TOKENS "
        "(balanced, pages over 64 tokens split inside, e.g. 8:132:256:64), 'none', or "
        "'like' (default: --like's)",
    )
    fit.add_argument(
        "--no-floors",
        action="store_true",
        help="fit no host floors (per step kind, the least time a step takes; fitted by default)",
    )
    fit.add_argument(
        "--infer-overlapped",
        action="store_true",
        help="records of an engine with async scheduling from before the step records' overlapped "
        "column: infer it (a decode step after a decode step of as many requests); for profiling "
        "sweeps only, not replays near saturation",
    )
    fit.add_argument("--out", required=True)
    fit.set_defaults(func=cmd_fit)
    for module in _PLUGINS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module or (e.name or "").split(".")[0] in _OPTIONAL_DEPS:
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvplan {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
