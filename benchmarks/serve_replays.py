"""Serve several trace windows one after another on one engine, each in real time from an empty
prefix cache, and write a replay folder per run (as `kvplan replay --out` does).

One engine start serves them all (a checkpoint and CUDA graphs once), so validation replays cost
their traffic's time and little more. The process profiles nothing: replays that validate a profile
must be served apart from the process that calibrated it (docs/CALIBRATION.md, the held-out rule).

    PYTHONPATH=. python3 benchmarks/serve_replays.py --random qwen3-0.6b --async-scheduling \
        --max-model-len 32768 --max-num-batched-tokens 8192 --out OUT \
        --run x1 azure_conv_2023 600:660 1 --run x8 azure_conv_2023 600:840 8 [--max-wall 200]

Each `--run NAME TRACE WINDOW SCALE`: TRACE a shipped trace name or a trace file, WINDOW START:END
seconds or '-' for the whole trace, SCALE the rate multiple. A run that fails or overruns is
reported and the next one still runs; the folders already written stay. `--gc-log` times every
collection of Python's garbage collector while a run is served, writes them to the run's
gc_pauses.json (seconds from the run's start, generation, duration) and prints the longest.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

from engine.launch import detected_gpu, engine_arguments, open_llm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    engine_arguments(p)
    p.add_argument(
        "--run",
        nargs=4,
        action="append",
        required=True,
        metavar=("NAME", "TRACE", "WINDOW", "SCALE"),
        help="one replay: its folder name under --out, a trace, START:END or '-', the rate multiple",
    )
    p.add_argument("--out", required=True, help="folder that receives one replay folder per --run")
    p.add_argument("--max-wall", type=float, default=300.0, help="abort a run after this many seconds")
    p.add_argument(
        "--gc-log", action="store_true", help="time the garbage collector's passes (gc_pauses.json a run)"
    )
    args = p.parse_args(argv)
    args.runs = [check_run(*run) for run in args.run]
    names = [r[0] for r in args.runs]
    if len(set(names)) != len(names):
        p.error(f"--run: names must differ, got {names}")
    return args


def check_run(name: str, trace: str, window: str, scale: str) -> tuple[str, str, str | None, float]:
    """One --run's fields, checked: (name, trace, window or None, rate scale)."""
    if not name or any(not (c.isalnum() or c in "._-") for c in name):
        raise SystemExit(f"--run {name}: a name of letters, digits, '.', '_' and '-' only")
    try:
        rate = float(scale)
    except ValueError:
        raise SystemExit(f"--run {name}: SCALE {scale!r} is not a number") from None
    if not rate > 0:
        raise SystemExit(f"--run {name}: SCALE must be > 0, got {scale}")
    return name, trace, (None if window == "-" else window), rate


class GcLog:
    """Every garbage-collector pass (`gc.callbacks`) as (perf_counter at its start, generation, s)."""

    def __init__(self) -> None:
        self.passes: list[tuple[float, int, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._start = now
        else:
            self.passes.append((self._start, int(info["generation"]), now - self._start))

    def write(self, since: float, path: Path) -> str:
        """The passes after `since` into `path` (seconds from `since`); a one-line summary."""
        rows = [
            {"at_s": round(t - since, 4), "generation": g, "seconds": round(d, 5)}
            for t, g, d in self.passes
            if t >= since
        ]
        path.write_text(json.dumps(rows) + "\n")
        full = [r for r in rows if r["generation"] == 2]
        worst = max(rows, key=lambda r: r["seconds"], default=None)
        longest = (
            f", longest {worst['seconds']:.3f} s (gen {worst['generation']}) at {worst['at_s']:.1f} s"
            if worst
            else ""
        )
        return f"gc: {len(rows)} passes, {len(full)} full, {sum(r['seconds'] for r in rows):.3f} s in all{longest}"


def serve(llm, gpu: str, run: tuple[str, str, str | None, float], out: Path, max_wall: float) -> str:
    """Replay one run from an empty prefix cache and write its folder; a one-line summary."""
    from engine.replay import replay_fresh
    from traces.cli import load_trace_arg

    name, trace_arg, window, scale = run
    trace = load_trace_arg(trace_arg, scale, None, window)
    t0 = time.perf_counter()
    extra = {"rate_scale": scale, "limit": None, "window": window, "source": trace_arg, "gpu": gpu}
    requests = replay_fresh(llm, trace, out / name, extra, max_wall)
    preempted = int(requests["num_preemptions"].sum())
    return f"{name}: {len(requests)} requests in {time.perf_counter() - t0:.1f} s, {preempted} preemptions -> {out / name}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    taken = [name for name, *_ in args.runs if (out / name).exists()]
    if taken:
        raise SystemExit(f"--out {out}: {', '.join(taken)} already exist; choose other names or folder")
    gpu = detected_gpu(args)
    gc_log = GcLog() if args.gc_log else None
    if gc_log is not None:
        gc.callbacks.append(gc_log)
    try:
        return serve_all(args, gpu, out, gc_log)
    finally:
        if gc_log is not None:
            gc.callbacks.remove(gc_log)


def serve_all(args: argparse.Namespace, gpu: str, out: Path, gc_log: GcLog | None) -> int:
    """Every --run on one engine, a failed one reported and the next run still served; 1 if any failed."""
    failed = 0
    with tempfile.TemporaryDirectory() as tmp, open_llm(args, tmp) as llm:
        print(f"engine up: freeze_gc={llm.freeze_gc}, {gc.get_freeze_count()} objects frozen", flush=True)
        for run in args.runs:
            try:
                since = time.perf_counter()
                print(serve(llm, gpu, run, out, args.max_wall), flush=True)
                if gc_log is not None:
                    print("  " + gc_log.write(since, out / run[0] / "gc_pauses.json"), flush=True)
            except Exception as exc:  # report and go on: the other runs still count
                failed += 1
                print(f"{run[0]}: FAILED {type(exc).__name__}: {exc}", flush=True)
                # an aborted run leaves requests behind: later runs can't start clean
                if llm.has_unfinished():
                    print("engine holds unfinished requests; the remaining runs are skipped", flush=True)
                    break
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
