"""Command line for planning: `kvplan sweep`, `kvplan plan` and `kvplan capacity`.

`register(subparsers)` adds the three commands to the kvplan front; each handler only wires arguments
to simulator.sweep and simulator.plan and prints their formatted results.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from typing import Any

from engine.core.config import POLICIES
from simulator.cli import add_sim_arguments, sim_config_from_args
from simulator.config import ROUTERS
from simulator.defaults import DEFAULT_MODEL, DEFAULT_TRACE
from simulator.load import KEEPS_UP_RATIO, run_load
from simulator.metrics import SLO_HELP
from traces.cli import load_trace_arg


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None

    return parse


def _add_exec_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=None, help="local worker processes (default: all cores)")
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="run points as Ray tasks: a cluster address, 'auto' (the running cluster) or 'local' (start one)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")


def _profile_arg(value: str) -> str:
    from simulator.latency.profile import check_profile_file

    if value not in ("auto", "roofline"):
        check_profile_file(value)
    return value


def _timed(
    evaluate: Callable[[list[dict]], list[dict]], quiet: bool, done: list[dict] | None = None
) -> Callable[[list[dict]], list[dict]]:
    """`evaluate` with a progress line per round on stderr; each round's rows also go to `done`."""
    state = {"round": 0, "sims": 0, "t0": time.perf_counter()}

    def run(points: list[dict]) -> list[dict]:
        rows = evaluate(points)
        if done is not None:
            done.extend(rows)
        state["round"] += 1
        state["sims"] += len(points)
        if not quiet:
            elapsed = time.perf_counter() - state["t0"]
            print(
                f"  round {state['round']}: {len(points)} simulations ({state['sims']} in all, {elapsed:.0f} s)",
                file=sys.stderr,
            )
        return rows

    return run


def _check_workers(args: argparse.Namespace) -> None:
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers: must be a positive number of processes, got {args.workers}")


def _check_plan_axes(args: argparse.Namespace) -> None:
    """Each value of --block-sizes, --max-num-seqs and --max-num-batched-tokens is one a
    configuration can take: an error naming the flag now, not an invalid row per option."""
    from simulator.cli import flag_error
    from simulator.config import SimConfig
    from simulator.models import resolve_model

    model = resolve_model(args.model)
    for flag, field, values in (
        ("--block-sizes", "block_size", args.block_sizes),
        ("--max-num-seqs", "max_num_seqs", args.max_num_seqs),
        ("--max-num-batched-tokens", "max_num_batched_tokens", args.max_num_batched_tokens),
    ):
        if not values:
            raise ValueError(f"{flag}: give at least one value")
        for value in values:
            try:
                SimConfig(model=model, **{field: value})
            except ValueError as e:
                message = str(flag_error(e))
                raise ValueError(
                    flag + message[message.index(":") :] if ":" in message else message
                ) from None


def _interrupted(rows: list[dict], best: str) -> str:
    """What an interrupted search found in its finished rounds: `best` 'cost' (the cheapest
    configuration meeting the SLOs) or 'rate' (the highest rate scale meeting them); a row that falls
    behind its offered rate (`simulator.load`) does not count, as in the search itself."""
    met = [
        r
        for r in rows
        if r.get("slo_met") is True and r.get("error") is None and not run_load(r).falls_behind
    ]
    lines = [f"\ninterrupted: {len(rows)} simulations had finished (points in flight were stopped)"]
    if not met:
        lines.append("  none of them met the SLOs")
    elif best == "cost":
        r = min(met, key=lambda r: float(r.get("cost_per_hour_usd", math.inf)))
        lines.append(
            f"  the cheapest of them meeting the SLOs: {r.get('replicas', 1)} x {r.get('gpu')} tp={r.get('tp', 1)}, "
            f"block {r.get('block_size')}, max_num_seqs {r.get('max_num_seqs')}, max_num_batched_tokens "
            f"{r.get('max_num_batched_tokens')}: ${float(r.get('cost_per_hour_usd', math.nan)):,.2f}/h "
            "(the search was not finished)"
        )
    else:
        r = max(met, key=lambda r: float(r.get("rate_scale", 1.0)))
        lines.append(
            f"  the highest rate of them meeting the SLOs: {float(r.get('rate_scale', 1.0)):.4g}x the trace "
            "(the search was not finished)"
        )
    return "\n".join(lines)


def cmd_sweep(args: argparse.Namespace) -> int:
    from simulator.sweep import SweepSpec, run_sweep

    _check_workers(args)
    spec = SweepSpec.load(args.spec)
    try:
        report = run_sweep(
            spec, args.out, workers=args.workers, ray_address=args.ray, progress=not args.quiet
        )
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: finished points are in {args.out}; run the same command to resume",
            file=sys.stderr,
        )
        return 130
    print(report.format())
    if report.latency_warning:
        print(report.latency_warning, file=sys.stderr)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import traces
    from simulator.plan import find_plan, format_plan, like_with_like, parse_objectives, plan_options
    from simulator.sweep import PointRunner, RunContext

    objectives = parse_objectives(args.slo)
    _check_workers(args)
    if args.max_gpus < 1:
        raise ValueError(f"--max-gpus: must be a positive number of GPUs, got {args.max_gpus}")
    if not (math.isfinite(args.rate) and args.rate > 0):
        raise ValueError(f"--rate: must be a positive number of requests per second, got {args.rate}")
    trace = traces.scale_rate(load_trace_arg(args.trace, None, args.limit), target_rate=args.rate)
    gpus = args.gpus
    if gpus is None:
        from simulator.latency.gpus import load_gpu_specs

        gpus = sorted(load_gpu_specs())
    tps = args.tp if args.tp is not None else [tp for tp in (1, 2, 4, 8) if tp <= args.max_gpus]
    _check_plan_axes(args)
    options = plan_options(gpus, tps, args.block_sizes, args.max_num_seqs, args.max_num_batched_tokens)
    base = {
        "policy": args.policy,
        "router": args.router,
        "prefix_caching": not args.no_prefix_caching,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        **_async_axis(args),
    }
    profile, note = like_with_like(
        options, _profile_arg(args.profile), args.model, args.async_scheduling, args.mix_latency_models
    )
    if note:
        print(note, file=sys.stderr)
    ctx = RunContext(trace, args.model, profile, args.slo, trace.name)
    if not args.quiet:
        print(f"planning over {len(options)} options ({len(trace)} requests each run)", file=sys.stderr)
    done: list[dict] = []
    try:
        with PointRunner(ctx, args.workers, args.ray) as runner:
            result = find_plan(
                _timed(runner.run, args.quiet, done),
                options,
                objectives,
                args.max_gpus,
                args.rate,
                base,
                wave_size=None if args.exhaustive else runner.parallelism,
                prune=not args.exhaustive,
            )
    except KeyboardInterrupt:
        print(_interrupted(done, "cost"), file=sys.stderr)
        return 130
    print(format_plan(result, trace.name, args.model, None if args.show_all else 12))
    if not args.no_band:
        print(_plan_band(args, result, ctx, base))
    return 0 if result.best is not None else 1


def _band_runners(args: argparse.Namespace, ctx) -> tuple[Any, Any]:
    """PointRunners of the band's optimistic and pessimistic runs (simulator.band.BandLatency)."""
    import dataclasses

    from simulator.band import BandLatency
    from simulator.sweep import PointRunner

    def runner(side: str) -> Any:
        return PointRunner(
            dataclasses.replace(ctx, latency=BandLatency(ctx.profile, ctx.model, side)),
            args.workers,
            args.ray,
        )

    return runner("low"), runner("high")


def _no_band(ctx, gpu: str, block_size: int, tp: int, async_scheduling: bool) -> str | None:
    """Why a configuration's runs have no band (None: they have one)."""
    from simulator.band import ROOFLINE_NO_BAND, profile_band_errors
    from simulator.sweep import profile_for

    path = profile_for(ctx.profile, ctx.model, gpu, block_size, tp, async_scheduling)
    if path is None:
        return ROOFLINE_NO_BAND
    return None if profile_band_errors(path) is not None else f"{path.name} records no fit error"


def _plan_band(args: argparse.Namespace, result, ctx, base: dict) -> str:
    """The plan's band (simulator.plan.plan_band), or why there is none."""
    from simulator.plan import PlanBand, format_plan_band, plan_band

    head = result.best or result.closest
    if head is None:
        return format_plan_band(PlanBand(note="no configuration ran"), result)
    o = head.option
    reason = _no_band(ctx, o.gpu, o.block_size, o.tp, args.async_scheduling)
    if reason is not None:
        return format_plan_band(PlanBand(note=reason), result)
    low, high = _band_runners(args, ctx)
    try:
        with low, high:
            band = plan_band(result, _timed(low.run, args.quiet), _timed(high.run, args.quiet), base)
    except KeyboardInterrupt:
        return format_plan_band(PlanBand(note="interrupted"), result)
    return format_plan_band(band, result)


def cmd_capacity(args: argparse.Namespace) -> int:
    from simulator.plan import find_capacity, format_capacity, parse_objectives
    from simulator.sweep import PointRunner, RunContext

    objectives = parse_objectives(args.slo)
    _check_workers(args)
    if not (math.isfinite(args.tolerance) and 0 < args.tolerance < 1):
        raise ValueError(f"--tolerance: must be a ratio between 0 and 1 (e.g. 0.05), got {args.tolerance}")
    if not (math.isfinite(args.max_scale) and args.max_scale >= 1):
        raise ValueError(
            f"--max-scale: must be at least 1 (the search starts at the trace's rate), got {args.max_scale}"
        )
    sim_config_from_args(args)  # a bad flag is an error naming it now, not a failed search
    trace = load_trace_arg(args.trace, args.rate_scale, args.limit)
    if len(trace) < 2 or trace.duration_s <= 0:
        raise ValueError(f"--trace: {args.trace} needs at least two distinct arrival times")
    base_rate = len(trace) / trace.duration_s
    point = {
        "gpu": args.gpu,
        "tp": args.tp,
        "replicas": args.replicas,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "policy": args.policy,
        "router": args.router,
        "prefix_caching": not args.no_prefix_caching,
        **_async_axis(args),
    }
    ctx = RunContext(trace, args.model, _profile_arg(args.profile), args.slo, trace.name)
    done: list[dict] = []
    try:
        with PointRunner(ctx, args.workers, args.ray) as runner:
            runner_parallelism = runner.parallelism
            result = find_capacity(
                _timed(runner.run, args.quiet, done),
                point,
                objectives,
                base_rate,
                tolerance=args.tolerance,
                parallel=runner.parallelism,
                max_scale=args.max_scale,
            )
    except KeyboardInterrupt:
        print(_interrupted(done, "rate"), file=sys.stderr)
        return 130
    what = f"{args.replicas} x {args.model} on {args.gpu} tp={args.tp} ({trace.name})"
    what += ", async scheduling" if args.async_scheduling else ""
    print(format_capacity(result, what))
    if not args.no_band:
        print(_capacity_band(args, result, ctx, point, runner_parallelism))
    return 0 if result.max_rate is not None else 1


def _capacity_band(args: argparse.Namespace, result, ctx, point: dict, parallel: int) -> str:
    """The capacity's band (simulator.plan.capacity_band), or why there is none."""
    from simulator.plan import CapacityBand, capacity_band, format_capacity_band

    reason = _no_band(ctx, args.gpu, args.block_size, args.tp, args.async_scheduling)
    if reason is not None:
        return format_capacity_band(CapacityBand(note=reason), result)
    low, high = _band_runners(args, ctx)
    try:
        with low, high:
            band = capacity_band(
                result,
                _timed(low.run, args.quiet),
                _timed(high.run, args.quiet),
                point,
                tolerance=args.tolerance,
                parallel=parallel,
                max_scale=args.max_scale,
            )
    except KeyboardInterrupt:
        return format_capacity_band(CapacityBand(note="interrupted"), result)
    return format_capacity_band(band, result)


# How plan and capacity count the offered rate (simulator.load: Load.falls_behind).
_KEEPS_UP = (
    f"keeps up with the rate: a run that serves less than {KEEPS_UP_RATIO:.0%} of the requests per "
    "second it is offered (near saturation or overloaded, as `kvplan simulate` and the dashboard "
    "call it) is infeasible however its percentiles look, as its queue would grow for as long as the "
    "traffic lasts"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    sw = subparsers.add_parser(
        "sweep", help="run a grid of simulations from a YAML spec into Parquet (resumable)"
    )
    sw.add_argument("spec", help="sweep spec YAML (see docs/sweep-example.yaml)")
    sw.add_argument("--out", required=True, help="results Parquet; points already in it are skipped")
    _add_exec_arguments(sw)
    sw.set_defaults(func=cmd_sweep)

    pl = subparsers.add_parser(
        "plan",
        help="the cheapest configuration meeting latency SLOs at a request rate",
        description="The cheapest configuration whose simulation, on the trace rescaled to --rate, "
        f"serves every request, meets each --slo objective and {_KEEPS_UP}. Each alternative is "
        "listed with why it lost (a missed objective by how much, or what it serves of what it is "
        "offered).",
    )
    pl.add_argument("--trace", default=DEFAULT_TRACE, help="shipped trace name or a trace file")
    pl.add_argument("--limit", type=int, default=None, help="only the first N requests (faster, less exact)")
    pl.add_argument(
        "--rate", type=float, required=True, help="target request rate (req/s); the trace is rescaled"
    )
    pl.add_argument("--slo", required=True, help=SLO_HELP)
    pl.add_argument("--model", default=DEFAULT_MODEL, help="shipped preset name or model folder")
    pl.add_argument(
        "--gpus", type=_csv(str), default=None, help="GPU types, e.g. H100,H200 (default: all known)"
    )
    pl.add_argument("--max-gpus", type=int, default=8, help="GPU budget per configuration")
    pl.add_argument(
        "--tp", type=_csv(int), default=None, help="TP degrees (default: 1,2,4,8 up to --max-gpus)"
    )
    pl.add_argument(
        "--block-sizes", type=_csv(int), default=[16], help="KV block sizes to try, e.g. 16,256 (default: 16)"
    )
    pl.add_argument(
        "--max-num-seqs",
        type=_csv(int),
        default=[256],
        help="batch limits to try, e.g. 128,256 (default: 256)",
    )
    pl.add_argument(
        "--max-num-batched-tokens",
        type=_csv(int),
        default=[16384],
        help="step token budgets to try, e.g. 8192,16384 (default: 16384)",
    )
    pl.add_argument(
        "--policy",
        default="chunked",
        choices=POLICIES,
        help="scheduling policy of every option",
    )
    pl.add_argument(
        "--router",
        default="least_outstanding",
        choices=ROUTERS,
        help="how requests are spread over replicas",
    )
    pl.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    _add_async_argument(pl)
    pl.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory the engine may use"
    )
    pl.add_argument("--profile", default="auto", help="fitted profile JSON, 'auto' (shipped) or 'roofline'")
    pl.add_argument(
        "--mix-latency-models",
        action="store_true",
        help="with --profile auto, simulate each option on the shipped fitted profile where there is one "
        "and on the roofline elsewhere (warned on stderr). By default a plan compares like with like: "
        "when only some options have a fitted profile, every option is simulated on the roofline",
    )
    pl.add_argument("--show-all", action="store_true", help="list every alternative (default: the first 12)")
    pl.add_argument(
        "--exhaustive",
        action="store_true",
        help="find every option's fewest replicas, even those that cannot beat the best (slower)",
    )
    pl.add_argument(
        "--no-band",
        action="store_true",
        help="skip the confidence band. By default, after the search, the best configuration runs "
        "again with every step time x (1 - e) and x (1 + e), e its fitted profile's held-back p90 "
        "relative error, and the cheaper configurations the search saw fail (up to 8, nearest the "
        "best's cost first) run with x (1 - e): a note names any that then meets the SLOs. That is up "
        "to 10 more simulations; the roofline has no band",
    )
    _add_exec_arguments(pl)
    pl.set_defaults(func=cmd_plan)

    cap = subparsers.add_parser(
        "capacity",
        help="the highest request rate a configuration sustains under SLOs",
        description="The highest rate (a scale of the trace's own) at which the configuration's "
        f"simulation serves every request, meets each --slo objective and {_KEEPS_UP}.",
    )
    cap.add_argument("--trace", default=DEFAULT_TRACE, help="shipped trace name or a trace file")
    cap.add_argument("--limit", type=int, default=None, help="only the first N requests (faster, less exact)")
    cap.add_argument(
        "--rate-scale", type=float, default=None, help="pre-scale the trace (the search starts here)"
    )
    cap.add_argument("--slo", required=True, help=SLO_HELP)
    cap.add_argument(
        "--tolerance", type=float, default=0.05, help="stop when the bracket is within this ratio"
    )
    cap.add_argument("--max-scale", type=float, default=1024.0, help="highest rate scale to try")
    add_sim_arguments(cap)
    _add_async_argument(cap)
    cap.add_argument(
        "--no-band",
        action="store_true",
        help="skip the confidence band. By default the rate search is repeated with every step time "
        "x (1 - e) and x (1 + e), e the fitted profile's held-back p90 relative error, from the "
        "point's answer: the max sustainable rate becomes a range. About twice the simulations of the "
        "point's search; the roofline has no band",
    )
    _add_exec_arguments(cap)
    cap.set_defaults(func=cmd_capacity)


def _add_async_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="engines that schedule each decode step while the one before it runs (with --profile "
        "auto, the shipped profiles calibrated with async scheduling where there are any)",
    )


def _async_axis(args: argparse.Namespace) -> dict[str, bool]:
    """The point's async_scheduling axis: named only when set, so other points keep their keys."""
    return {"async_scheduling": True} if args.async_scheduling else {}
