"""`kvplan replay`: serve a trace in real time on the engine and write a replay folder (argument
wiring only; registering imports no torch, running needs the `engine` extra and, to mean anything, a GPU)."""

from __future__ import annotations

import argparse
import tempfile

from engine.launch import detected_gpu, engine_arguments, open_llm


def cmd_replay(args: argparse.Namespace) -> int:
    from engine.replay import replay_trace, write_replay
    from traces.cli import check_out_dir, load_trace_arg

    check_out_dir(args.out)
    trace = load_trace_arg(args.trace, args.rate_scale, args.limit, args.window)
    gpu = detected_gpu(args)
    with tempfile.TemporaryDirectory() as tmp, open_llm(args, tmp) as llm:
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


def register(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("replay", help="(GPU) serve a trace in real time and write a replay folder")
    engine_arguments(r)
    r.add_argument("--trace", required=True, help="shipped trace name or a trace file")
    r.add_argument("--rate-scale", type=float, default=None, help="replay k times faster")
    r.add_argument("--limit", type=int, default=None, help="only the first N requests")
    r.add_argument("--window", default=None, help="START:END seconds of the trace")
    r.add_argument("--out", required=True, help="replay folder to write (requests, steps, trace, run.json)")
    r.add_argument("--max-wall", type=float, default=None, help="abort after this many seconds")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_replay)
