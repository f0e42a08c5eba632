"""Command line for traces: `kvplan traces stats FILE` and `kvplan traces gen --out FILE ...`.

`register(subparsers)` adds the `traces` command to the kvplan argparse front; each handler is a thin
function over the library. `python -m traces.cli ...` runs the same commands without the front.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .generators import ARRIVALS, generate, parse_length_spec
from .loaders import FORMATS, TIME_UNITS, load, load_shipped, save, shipped_names
from .schema import TraceError
from .stats import trace_stats


# ---- shared by every kvplan command that reads a trace or writes a folder --------------------------
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
        if not all(x is None or (math.isfinite(x) and x >= 0) for x in (start, end)) or (
            start is not None and end is not None and end <= start
        ):
            raise ValueError(f"--window: {window!r}: START and END must be seconds >= 0 with START < END")
        whole = trace
        trace = traces.time_window(trace, start or 0.0, end)
        if len(trace) == 0:
            raise ValueError(
                f"--window: {window} holds no requests; {whole.name} has {len(whole):,} requests arriving from "
                f"{whole.df['arrival_s'].iat[0]:,.1f} s to {whole.df['arrival_s'].iat[-1]:,.1f} s"
            )
    if limit is not None:
        if limit <= 0:
            raise ValueError(f"--limit: must be a positive number of requests, got {limit}")
        trace = trace.with_frame(trace.df.iloc[:limit].reset_index(drop=True))
    if rate_scale is not None:
        if not (math.isfinite(rate_scale) and rate_scale > 0):
            raise ValueError(f"--rate-scale: must be a positive number, got {rate_scale}")
        trace = traces.scale_rate(trace, factor=rate_scale)
    return trace


def check_out_dir(out: str | None, flag: str = "--out") -> None:
    """Before a run: an output folder that exists as something else than a folder is an error now,
    not after the work."""
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"{flag}: {out} exists and is not a folder")


def _friendly(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Print bad-input errors as one line on stderr (exit status 2) instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (TraceError, ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return wrapper


@_friendly
def cmd_stats(args: argparse.Namespace) -> int:
    """`traces stats FILE`: load a trace (a path or a shipped name) and print its statistics."""
    kwargs: dict[str, Any] = {"format": args.format, "time_unit": args.time_unit}
    if not Path(args.file).exists() and args.file in shipped_names():
        trace = load_shipped(args.file, **kwargs)
    else:
        trace = load(args.file, **kwargs)
    st = trace_stats(trace)
    print(json.dumps(st.to_dict(), indent=2) if args.json else st.format())
    return 0


def gen_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The generate() spec for `traces gen` arguments (a --spec file, then the flags given on top)."""
    spec: dict[str, Any] = {}
    if args.spec:
        text = Path(args.spec).read_text()
        if args.spec.endswith((".yaml", ".yml")):
            import yaml

            spec = yaml.safe_load(text) or {}
        else:
            spec = json.loads(text)
    flags = {
        "name": args.name,
        "seed": args.seed,
        "num_requests": args.num_requests,
        "duration_s": args.duration,
        "arrival": args.arrival,
        "rate": args.rate,
        "cv": args.cv,
        "on_s": args.on_s,
        "off_s": args.off_s,
        "rate_off": args.rate_off,
        "prompt": None if args.prompt is None else parse_length_spec(args.prompt),
        "output": None if args.output is None else parse_length_spec(args.output),
        "prefix_block_size": args.prefix_block_size,
    }
    spec.update({k: v for k, v in flags.items() if v is not None})
    if args.shared_prefixes:
        spec["shared_prefix"] = {
            "num_prefixes": args.shared_prefixes,
            "prefix_len": parse_length_spec(args.prefix_len),
            "zipf": args.zipf,
            "fraction": args.prefix_fraction,
        }
    if args.turns:
        spec["sessions"] = {"turns": parse_length_spec(args.turns), "think_time_s": args.think_time}
    spec.setdefault("name", Path(args.out).stem)
    return spec


@_friendly
def cmd_gen(args: argparse.Namespace) -> int:
    """`traces gen --out FILE ...`: generate a synthetic trace and write it (.parquet, .csv or .jsonl)."""
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests: must be a positive number of requests, got {args.num_requests}")
    if Path(args.out).suffix.lower() not in (".parquet", ".csv", ".jsonl", ".json"):
        raise ValueError(f"--out: {args.out}: unknown suffix; use .parquet, .csv or .jsonl")
    trace = generate(gen_spec(args))
    if len(trace) == 0:
        raise ValueError("no requests generated: give a larger --num-requests, --duration or --rate")
    save(trace, args.out)
    print(f"wrote {len(trace):,} requests over {trace.duration_s:,.1f} s to {args.out}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `traces stats` and `traces gen` to an argparse subparsers object (sets func= on each)."""
    p = subparsers.add_parser("traces", help="inspect, convert and generate request traces")
    sub = p.add_subparsers(dest="traces_command", metavar="{stats,gen}")
    sub.required = True

    s = sub.add_parser("stats", help="print a trace's statistics")
    s.add_argument("file", help=f"trace file, or a shipped name ({', '.join(shipped_names())})")
    s.add_argument("--format", choices=FORMATS, default=None, help="override format detection")
    s.add_argument(
        "--time-unit", choices=[*TIME_UNITS, "datetime"], default=None, help="time unit of generic files"
    )
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(func=cmd_stats)

    g = sub.add_parser("gen", help="generate a synthetic trace")
    g.add_argument("--out", required=True, help="output file: .parquet, .csv or .jsonl")
    g.add_argument("--spec", default=None, help="JSON or YAML generate() spec; flags override it")
    g.add_argument("--name", default=None, help="trace name (default: the --out file's stem)")
    g.add_argument("--seed", type=int, default=None, help="random seed (default 0)")
    g.add_argument(
        "--num-requests", type=int, default=None, help="requests to generate (with --duration: at most)"
    )
    g.add_argument("--duration", type=float, default=None, help="seconds")
    g.add_argument("--arrival", choices=ARRIVALS, default=None, help="arrival process (default poisson)")
    g.add_argument("--rate", type=float, default=None, help="requests/s (sessions/s with --turns)")
    g.add_argument("--cv", type=float, default=None, help="gamma: coefficient of variation of the gaps")
    g.add_argument("--on-s", type=float, default=None, help="onoff: seconds on")
    g.add_argument("--off-s", type=float, default=None, help="onoff: seconds off")
    g.add_argument("--rate-off", type=float, default=None, help="onoff: rate while off (default 0)")
    g.add_argument(
        "--prompt",
        default=None,
        help="prompt length: 512 | uniform:100:2000 | lognormal:mean=1000,sigma=0.8 | "
        "lognormal:p50=800,p90=3000 | empirical:azure_conv_2023 (default 512)",
    )
    g.add_argument("--output", default=None, help="output length, same forms as --prompt (default 128)")
    g.add_argument("--shared-prefixes", type=int, default=0, help="number of shared system prompts")
    g.add_argument("--prefix-len", default="1024", help="system prompt length (a length spec)")
    g.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of system prompt popularity")
    g.add_argument(
        "--prefix-fraction", type=float, default=1.0, help="share of requests with a system prompt"
    )
    g.add_argument("--turns", default=None, help="multi-turn sessions: turns per session (a length spec)")
    g.add_argument("--think-time", type=float, default=10.0, help="mean seconds between turns")
    g.add_argument("--prefix-block-size", type=int, default=None, help="tokens per prefix block id")
    g.set_defaults(func=cmd_gen)
    return p


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: `python -m traces.cli stats FILE` (same as `kvplan traces stats FILE`)."""
    parser = argparse.ArgumentParser(prog="python -m traces.cli")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["traces", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
