"""The `kvplan` command line: argument wiring only; every command is a thin call into a library.

`kvplan simulate` with no arguments replays a shipped trace on the shipped default profile.
Subcommands of other packages register themselves through their own `register(subparsers)`.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from engine.core.config import POLICIES
from simulator.config import ROUTERS
from simulator.defaults import DEFAULT_GPU, DEFAULT_MODEL, DEFAULT_TRACE, default_latency_file
from traces.cli import check_out_dir, load_trace_arg

if TYPE_CHECKING:
    from simulator.latency.profile import LatencyProfile

# Packages whose `cli.register(subparsers)` adds commands; a missing one (not built, or an extra
# not installed) simply adds none.
_PLUGINS = ("traces.cli", "simulator.plan_cli", "simulator.profile_cli", "engine.cli", "dashboard.cli")
_OPTIONAL_DEPS = {"torch", "transformers", "safetensors", "streamlit", "plotly", "ray", "simpy", "yaml"}
# The extra that installs each optional dependency, for the error a command without it prints.
_EXTRA_OF = {
    "torch": "engine",
    "transformers": "engine",
    "safetensors": "engine",
    "xxhash": "engine",
    "triton": "engine",
    "simpy": "sim",
    "streamlit": "dashboard",
    "plotly": "dashboard",
    "ray": "ray",
    "yaml": "dev",
}

# The flag that sets each configuration field, so that an error names what the user typed.
FIELD_FLAGS = {
    "num_replicas": "--replicas",
    "tensor_parallel_size": "--tp",
    "block_size": "--block-size",
    "num_blocks": "--num-kv-blocks",
    "num_kv_blocks": "--num-kv-blocks",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "policy": "--policy",
    "router": "--router",
    "async_scheduling": "--async-scheduling",
}
_FIELD_RE = re.compile(
    r"\b(?:(?:Sim|Cache|Scheduler|Parallel)Config\.)?(" + "|".join(FIELD_FLAGS) + r")(?=:)"
)


def flag_error(e: ValueError) -> ValueError:
    """`e` with the configuration fields it names (`CacheConfig.block_size: ...`) as their flags."""
    return ValueError(_FIELD_RE.sub(lambda m: FIELD_FLAGS[m.group(1)], str(e)))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless it has none (None, off) or its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that builds a SimConfig."""
    from simulator.config import MAX_REPLICAS

    p.add_argument("--model", default=DEFAULT_MODEL, help="shipped preset name or model folder")
    p.add_argument("--gpu", default=DEFAULT_GPU, help="GPU type from simulator/data/gpus.json")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree per replica")
    p.add_argument(
        "--replicas", type=int, default=1, help=f"identical engines behind the router (1 to {MAX_REPLICAS})"
    )
    p.add_argument(
        "--block-size", type=int, default=16, help="KV cache block size in tokens (a power of two, 1 to 1024)"
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV blocks per replica (default: sized from GPU memory)",
    )
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory the engine may use"
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once per replica")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=16384, help="token budget of one step per replica"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens; longer prompts are rejected (default: the model's context)",
    )
    p.add_argument(
        "--policy",
        default="chunked",
        choices=POLICIES,
        help="scheduling: chunked prefill mixed with decodes (vLLM v1), or prefill-only / decode-only steps",
    )
    p.add_argument(
        "--router",
        default="round_robin",
        choices=ROUTERS,
        help="how requests are spread over replicas",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    p.add_argument(
        "--profile",
        default="auto",
        help="fitted profile JSON, 'auto' (the shipped fitted profile, else the transferred model "
        "simulator/profiles/transfer_h200.json) or 'roofline'",
    )


def sim_config_from_args(args: argparse.Namespace):
    from simulator.config import SimConfig
    from simulator.models import resolve_model

    try:
        return _sim_config(SimConfig, resolve_model(args.model), args)
    except ValueError as e:
        raise flag_error(e) from None


def _sim_config(SimConfig, model, args: argparse.Namespace):
    return SimConfig(
        model=model,
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
    from simulator.latency.profile import check_profile_file

    if args.profile == "roofline":
        return None
    if args.profile == "auto":
        async_scheduling = getattr(args, "async_scheduling", False)
        return default_latency_file(args.model, args.gpu, args.block_size, args.tp, async_scheduling)
    return check_profile_file(args.profile)


def cmd_simulate(args: argparse.Namespace) -> int:
    from simulator.band import run_with_band
    from simulator.metrics import SLO
    from simulator.report import format_summary

    check_out_dir(args.out)
    slo = SLO.parse(args.slo) if args.slo else None
    config = sim_config_from_args(args)
    profile = resolve_profile(args)
    trace = load_trace_arg(args.trace, args.rate_scale, args.limit, args.window)
    banded = run_with_band(
        trace, config, profile=profile, slo=slo, progress=not args.quiet, band=not args.no_band
    )
    result = banded.result
    print(format_summary(result.summary))
    if slo is not None:
        print(format_slo(slo, result.summary))
    if args.out:
        out = result.save(args.out)
        print(f"\nwrote {out}/requests.parquet, timeline.parquet, summary.json")
    return 0


def format_slo(slo, summary: dict) -> str:
    """One line per --slo objective: the run's value against its limit, with its band where the
    summary has one (and whether the band's other end would turn the verdict)."""
    lines = []
    ranges = (summary.get("band") or {}).get("ranges", {})
    for name, limit, value, met in slo.results(summary):
        shown = "-" if math.isnan(value) else f"{value * 1e3:,.1f} ms"
        verdict = "met" if met else "MISSED"
        pair = ranges.get(f"{name}_s")
        if pair is not None and not math.isnan(value):
            shown += f" [{pair[0] * 1e3:,.1f}, {pair[1] * 1e3:,.1f}]"
            if met and pair[1] > limit:
                verdict += " (missed at the band's high end)"
            elif not met and pair[0] <= limit:
                verdict += " (met at the band's low end)"
        lines.append(f"SLO {name:<10} <= {limit * 1e3:,.1f} ms: {shown}, {verdict}")
    return "\n".join(lines)


def cmd_validate(args: argparse.Namespace) -> int:
    from simulator.validate import format_table, validate_profile, validate_run, write_report

    check_out_dir(args.out)
    if args.suite:
        return validate_suite(args)
    if len(args.real) > 1 or len(args.profile) > 1:
        return validate_many(args)
    v = validate_run(args.real[0], validate_profile(args.profile[0], args.real[0]), args.repeat)
    print(format_table(v))
    out = write_report(v, args.out or Path("validation") / Path(args.real[0]).resolve().name)
    print(f"\nwrote {out}/report.html; {'within' if v.passed else 'OUTSIDE'} the targets")
    return 0 if v.passed or args.no_fail else 1


def validate_suite(args: argparse.Namespace) -> int:
    """The fidelity scoreboard of a suite (simulator/scoreboard.py); its tables as CSV with --out."""
    from simulator.scoreboard import format_scoreboard, load_suite, run_suite
    from simulator.validate import validate_profile

    if args.repeat is not None or len(args.profile) > 1:
        print("kvplan validate: --suite takes at most one --profile and no --repeat", file=sys.stderr)
        return 2
    if args.workers is not None and args.workers < 1:
        print(
            f"kvplan validate: --workers must be a positive number of processes, got {args.workers}",
            file=sys.stderr,
        )
        return 2
    suite = load_suite(args.suite)
    choice = "auto" if args.profile == [None] else args.profile[0]
    fixed = None if choice == "auto" else validate_profile(choice, suite.replays[0].run)
    workers = args.workers or min(os.cpu_count() or 1, len(suite.replays))
    rows, families = run_suite(
        suite, lambda run: validate_profile("auto", run) if choice == "auto" else fixed, workers=workers
    )
    print(format_scoreboard(suite, rows, families))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        rows.to_csv(out / "scoreboard_replays.csv", index=False)
        families.to_csv(out / "scoreboard_families.csv", index=False)
        print(f"\nwrote {out / 'scoreboard_replays.csv'} and {out / 'scoreboard_families.csv'}")
    return 0


def validate_many(args: argparse.Namespace) -> int:
    """Several runs and/or profiles: the targets each pair meets, as a table (and CSV with --out)."""
    from simulator.validate import format_matrix, validate_profile, validation_matrix

    if args.repeat is not None:
        print("kvplan validate: --repeat takes one --real run and one --profile", file=sys.stderr)
        return 2
    profiles = [validate_profile(p, args.real[0]) if p != "auto" else p for p in args.profile]
    if "auto" in profiles:
        print("kvplan validate: --profile auto takes one --real run", file=sys.stderr)
        return 2
    matrix = validation_matrix(args.real, profiles)
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

    from simulator.latency.profile import LatencyProfile, check_profile_file, profile_report, refit_like

    records = pd.read_parquet(args.records)
    like = LatencyProfile.load(check_profile_file(args.like, "--like"))
    extra = {**like.extra, "records": Path(args.records).name, "refit_of": Path(args.like).name}
    if args.infer_overlapped:
        from simulator.latency.fitted import infer_overlapped

        if "overlapped" in records.columns:
            raise ValueError(f"--infer-overlapped: {args.records} already has an overlapped column")
        records = records.assign(overlapped=infer_overlapped(records))
        extra["overlapped"] = "inferred (kvplan fit --infer-overlapped)"
    profile = refit_like(
        records,
        like,
        target=args.target,
        loss=args.loss,
        split_kv=like.split_kv if args.split_kv == "like" else parse_split_kv(args.split_kv),
        floors=not args.no_floors,
        host_table=not args.no_host_table,
        prefix_hits=_prefix_hits(args, like),
        span=_span_term(args, like),
        extra=extra,
    )
    profile.save(args.out)
    print(profile_report(profile))
    print(f"wrote {args.out}")
    return 0


def _prefix_hits(args: argparse.Namespace, like: LatencyProfile) -> bool:
    """Whether the refit takes the prefix-hit term: as flagged, else as the --like profile has it."""
    from simulator.latency.fitted import PREFIX_FEATURES

    return _term_choice(
        args.prefix_hit_term, args.no_prefix_hit_term, "prefix-hit-term", PREFIX_FEATURES[0], like
    )


def _span_term(args: argparse.Namespace, like: LatencyProfile) -> bool:
    """Whether the refit takes the span term: as flagged, else as the --like profile has it."""
    from simulator.latency.fitted import SPAN_FEATURES

    return _term_choice(args.span_term, args.no_span_term, "span-term", SPAN_FEATURES[0], like)


def _term_choice(on: bool, off: bool, flag: str, feature: str, like: LatencyProfile) -> bool:
    """--FLAG / --no-FLAG: on, off, or (neither) whether `like`'s prefill fit has `feature`."""
    if on and off:
        raise ValueError(f"--{flag} and --no-{flag}: give one of them")
    return on if on or off else feature in like.prefill.features


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvplan", description="Capacity planning for LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from simulator.metrics import SLO_HELP

    sim = sub.add_parser("simulate", help="replay a trace through the simulator and print the metrics")
    sim.add_argument("--trace", default=DEFAULT_TRACE, help="shipped trace name or a trace file")
    sim.add_argument("--rate-scale", type=float, default=None, help="replay k times faster")
    sim.add_argument("--limit", type=int, default=None, help="only the first N requests")
    sim.add_argument(
        "--window", default=None, help="START:END seconds of the trace (rebased to 0; either may be empty)"
    )
    sim.add_argument("--slo", default=None, help=SLO_HELP)
    sim.add_argument("--out", default=None, help="folder for requests/timeline Parquet and summary JSON")
    sim.add_argument("--quiet", action="store_true", help="no progress bar")
    sim.add_argument(
        "--no-band",
        action="store_true",
        help="skip the confidence band: by default the run is repeated with every step time scaled by "
        "(1 - e) and (1 + e), e the fitted profile's held-back p90 relative error (decode and "
        "prefill fits apart; the transferred model's: its leave-one-out p90 error), and each figure "
        "is printed with its [low, high]; the two extra runs "
        "cost twice the CPU of the first (they run in processes beside it where the machine has two "
        "cores or more). The roofline has no band (its error is not measured)",
    )
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
    which = val.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--real",
        nargs="+",
        help="replay folder written by `kvplan replay`; several: a table of the targets each run meets "
        "with each --profile",
    )
    which.add_argument(
        "--suite",
        help="a scoreboard suite (e.g. simulator/data/validation/suite.json): every replay it lists, "
        "held-out ones counted apart, errors of E2E/TTFT/TPOT at mean/p90/p99, and each trace family's "
        "knee under each of the suite's SLOs simulated against the real replays around it; --profile: "
        "one for all, or 'auto' (default here) for each replay's shipped profile",
    )
    val.add_argument(
        "--profile",
        nargs="+",
        default=[None],
        help="fitted profile JSON, 'roofline' (default) or 'auto' (the shipped profile of the replay's "
        "configuration, else the transferred model); several: compared on every --real run",
    )
    val.add_argument(
        "--repeat",
        default=None,
        help="another replay folder of the same trace and configuration: adds the real system's "
        "own run-to-run difference beside the simulator's error",
    )
    val.add_argument(
        "--out",
        default=None,
        help="folder for report.html, validation.json, sim_requests.parquet (default: validation/RUN "
        "in the current folder; several runs: validation_matrix.csv, written only with --out)",
    )
    val.add_argument(
        "--no-fail",
        action="store_true",
        help="exit 0 even when the simulation is outside the targets (by default: exit status 1; a "
        "table of several runs or profiles always exits 0)",
    )
    val.add_argument(
        "--workers",
        type=int,
        default=None,
        help="--suite: processes that score its replays and search its knees at once (default: one a "
        "CPU core; 1 runs them in this process)",
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
    fit.add_argument(
        "--target",
        default="wall_time_s",
        choices=["wall_time_s", "gpu_time_s"],
        help="the step time to fit: host wall time, or GPU time (CUDA events)",
    )
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
        "--no-host-table",
        action="store_true",
        help="records of async scheduling: leave out the decode fit's sync_x_table_entries (the host "
        "time of a step not scheduled ahead that grows with its block table's entries, num_seqs x "
        "blocks of the longest sequence; fitted by default), as profiles fitted before it",
    )
    fit.add_argument(
        "--prefix-hit-term",
        action="store_true",
        help="add total_num_cached_tokens to the prefill/mixed fit: the host's time of a step's "
        "prefix-cache hits (benchmarks/prefill_fit.py scores it on held-back steps); default: as "
        "--like's profile has it",
    )
    fit.add_argument(
        "--no-prefix-hit-term",
        action="store_true",
        help="leave the prefix-hit term out even where --like's profile has it",
    )
    fit.add_argument(
        "--span-term",
        action="store_true",
        help="add attn_span to the prefill/mixed fit: the longest sequence's keys beyond the step's "
        "keys per SM (short queries over long cached prefixes run as long as the longest sequence; "
        "its SMs are --like's split_kv's); default: as --like's profile has it",
    )
    fit.add_argument(
        "--no-span-term",
        action="store_true",
        help="leave the span term out even where --like's profile has it",
    )
    fit.add_argument(
        "--infer-overlapped",
        action="store_true",
        help="records of an engine with async scheduling from before the step records' overlapped "
        "column: infer it (a decode step after a decode step of as many requests); for profiling "
        "sweeps only, not replays near saturation",
    )
    fit.add_argument("--out", required=True, help="profile JSON to write")
    fit.set_defaults(func=cmd_fit)
    for module in _PLUGINS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module or (e.name or "").split(".")[0] in _OPTIONAL_DEPS:
                continue
            raise
        mod.register(sub)
    _show_defaults(parser)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every (sub)command's --help shows the options' defaults."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_defaults(sub)


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
    except ModuleNotFoundError as e:
        extra = _EXTRA_OF.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(
            f"kvplan {args.command}: error: needs {e.name}, which is not installed; install the "
            f"'{extra}' extra: pip install -e '.[{extra}]'",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
