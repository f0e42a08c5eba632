"""benchmarks/serve_replays.py on the CPU: its --run checks, and two windows served by one tiny
engine, each from an empty prefix cache, into folders `kvplan validate` reads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import serve_replays as sr  # noqa: E402  (after the path fix)


def test_run_fields_are_checked() -> None:
    assert sr.check_run("x8", "azure_conv_2023", "600:840", "8") == ("x8", "azure_conv_2023", "600:840", 8.0)
    assert sr.check_run("all", "t.parquet", "-", "1.5") == ("all", "t.parquet", None, 1.5)
    with pytest.raises(SystemExit, match="SCALE 'fast' is not a number"):
        sr.check_run("x", "azure_conv_2023", "-", "fast")
    with pytest.raises(SystemExit, match="SCALE must be > 0"):
        sr.check_run("x", "azure_conv_2023", "-", "0")
    with pytest.raises(SystemExit, match="a name of letters"):
        sr.check_run("a/b", "azure_conv_2023", "-", "1")


def test_two_windows_on_one_engine(tmp_path: Path) -> None:
    argv = [
        "--random",
        "tiny",
        "--gpu",
        "H200",
        "--max-model-len",
        "4096",
        "--max-num-batched-tokens",
        "2048",
    ]
    argv += ["--out", str(tmp_path), "--run", "a", "azure_code_2023", "0:2", "1"]
    argv += ["--run", "b", "azure_code_2023", "0:2", "4"]
    assert sr.main(argv) == 0
    for name, scale in (("a", 1.0), ("b", 4.0)):
        run = json.loads((tmp_path / name / "run.json").read_text())
        assert (run["rate_scale"], run["window"], run["source"]) == (scale, "0:2", "azure_code_2023")
        requests = pd.read_parquet(tmp_path / name / "requests.parquet")
        trace = pd.read_parquet(tmp_path / name / "trace.parquet")
        assert len(requests) == len(trace) > 0
    # the second run started from an empty prefix cache: its first request hit nothing
    first = pd.read_parquet(tmp_path / "b" / "requests.parquet").iloc[0]
    assert first["num_cached_tokens"] == 0
    with pytest.raises(SystemExit, match="already exist"):
        sr.main(argv)


def test_gc_log_keeps_the_passes_of_its_run(tmp_path: Path) -> None:
    log = sr.GcLog()
    log("start", {"generation": 0})
    log("stop", {"generation": 0})
    since = log.passes[-1][0] + 1e-9  # a run that starts after that pass
    log("start", {"generation": 2})
    log("stop", {"generation": 2})
    summary = log.write(since, tmp_path / "gc.json")
    rows = json.loads((tmp_path / "gc.json").read_text())
    assert [r["generation"] for r in rows] == [2]  # the earlier pass is not this run's
    assert summary.startswith("gc: 1 passes, 1 full") and "(gen 2)" in summary
    assert sr.GcLog().write(0.0, tmp_path / "none.json") == "gc: 0 passes, 0 full, 0.000 s in all"


def test_serving_with_a_gc_log_writes_each_runs_passes(tmp_path: Path, capsys) -> None:
    argv = ["--random", "tiny", "--gpu", "H200", "--max-model-len", "4096", "--gc-log"]
    argv += ["--out", str(tmp_path), "--run", "a", "azure_code_2023", "0:2", "1"]
    import gc

    callbacks = list(gc.callbacks)
    assert sr.main(argv) == 0
    assert gc.callbacks == callbacks  # the log's callback is gone with the command
    assert isinstance(json.loads((tmp_path / "a" / "gc_pauses.json").read_text()), list)
    out = capsys.readouterr().out
    assert "engine up: freeze_gc=True" in out and "  gc: " in out
