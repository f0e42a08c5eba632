"""A sweep's pool workers die with it: killed (SIGKILL) the parent leaves no worker running, and
Ctrl-C ends the points in flight at once instead of waiting for them."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Twelve distinct points (block sizes) of the whole shipped trace replayed 30x faster on two workers:
# a second or more each, so the pool is still simulating well after the pids are printed.
SCRIPT = textwrap.dedent(
    """
    import signal, sys, threading, time
    import traces

    # Ctrl-C raises KeyboardInterrupt whatever SIGINT disposition this process inherited (Python
    # leaves an ignored one ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from simulator.sweep import PointRunner, RunContext

    trace = traces.scale_rate(traces.load_shipped("azure_conv_2023"), factor=30.0)
    ctx = RunContext(trace, "qwen3-0.6b", "roofline", None, "t")
    points = [{"max_num_seqs": 1024, "block_size": b} for b in (8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)]
    mode = sys.argv[1]
    runner = PointRunner(ctx, workers=2)

    def report():
        while runner._pool is None or len(runner._pool._processes) < 2:
            time.sleep(0.05)
        time.sleep(1.0)  # the workers are simulating
        print("pids", *runner._pool._processes, flush=True)

    if mode == "kill":
        threading.Thread(target=lambda: list(runner.map_unordered(points)), daemon=True).start()
        report()
        time.sleep(600)
    else:
        threading.Thread(target=report, daemon=True).start()
        try:
            with runner:
                runner.run(points)
        except KeyboardInterrupt:
            print("interrupted", time.monotonic(), flush=True)
            sys.exit(130)
        print("finished before the interrupt", flush=True)
    """
)


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _start(mode: str) -> tuple[subprocess.Popen, list[int]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, mode], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    ready, _, _ = select.select([proc.stdout], [], [], 120.0)  # never wait for ever
    if not ready:
        proc.kill()
        pytest.fail("the sweep script printed no pids within 120 s")
    line = proc.stdout.readline().split()
    assert line and line[0] == "pids", line
    pids = [int(x) for x in line[1:]]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    return proc, pids


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_workers_die_when_the_parent_is_killed():
    proc, pids = _start("kill")
    try:
        proc.kill()
        proc.wait()
        assert _wait_gone(pids, 5.0) == []
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads process states from /proc")
def test_ctrl_c_ends_the_points_in_flight_at_once():
    proc, pids = _start("int")
    try:
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "interrupted" in out
        assert time.monotonic() - sent < 5.0
        assert _wait_gone(pids, 2.0) == []
    finally:
        proc.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
