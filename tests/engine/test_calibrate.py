"""benchmarks/calibrate.py on a CPU: --plan-only prints a block size's sweep without an engine; a tiny
calibration (no replays) records in its profile the envelope its sweep covered and the estimate it
was held to."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import pandas as pd
import pytest

from engine.profiling import envelope
from simulator.latency.ranges import FitRanges

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import calibrate  # noqa: E402  (benchmarks/ is not a package)


def _main(monkeypatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["calibrate.py", *argv])
    calibrate.main()


def test_plan_only_prints_the_sweep_of_each_block_size(monkeypatch, capsys):
    _main(monkeypatch, "--plan-only", "--preset", "qwen3-0.6b", "--block-sizes", "16,256", "--num-kv-tokens",
          "65536", "--max-num-seqs", "16", "--max-num-batched-tokens", "1024", "--max-model-len", "4096",
          "--profile-budget", "20")  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "qwen3-0.6b block 16: 4,096 KV blocks (65,536 tokens)"
    assert lines[1] == (
        "  profile: estimated device time 32 s on qwen3-0.6b_h200_tp1_bs16.json: short 2.6 s (1,135 steps), "
        "long 0.8 s (252 steps), mixed_long 0.3 s (63 steps), mixed_serving 0.1 s (38 steps), full 0.3 s "
        "(71 steps), serving 28 s"
    )
    assert lines[2].startswith('  envelope: {"block_size": 16, "decode": {"steps": ')
    assert lines[3] == "  over --profile-budget 20 s: a run would stop before the sweep"
    assert lines[4] == "qwen3-0.6b block 256: 256 KV blocks (65,536 tokens)"
    assert len(lines) == 8


def test_a_tiny_calibration_records_its_envelope_and_estimate(monkeypatch, tmp_path):
    estimator = ROOT / "simulator" / "profiles" / "qwen3-0.6b_h200_tp1_bs16.json"
    _main(monkeypatch, "--out", str(tmp_path), "--preset", "tiny", "--max-num-seqs", "4", "--max-num-batched-tokens",
          "128", "--max-model-len", "256", "--num-kv-tokens", "2048", "--replays", "", "--no-serving-replays",
          "--estimate-profile", str(estimator))  # fmt: skip
    profile = json.loads((tmp_path / "tiny_h200_tp1_bs16.json").read_text())
    records = pd.read_parquet(tmp_path / "steps_tiny_h200_tp1_bs16.parquet")
    extra = profile["extra"]
    assert profile["num_kv_blocks"] == 128
    assert extra["sweep_envelope"] == envelope(records, 16)
    assert extra["sweep_envelope"]["decode"]["longest"] == [129, 215]
    assert extra["fit_ranges"] == FitRanges.of_records(records, "steps_tiny_h200_tp1_bs16.parquet").as_dict()
    assert extra["records"] == "steps_tiny_h200_tp1_bs16.parquet"  # written beside the profile
    phases = ["short", "long", "mixed_long", "mixed_serving", "full", "serving", "total"]
    assert list(extra["sweep_estimate_s"]) == phases
    assert extra["sweep_estimate_s"]["serving"] == 0.0
    with pytest.raises(ValueError, match="--profile-budget: the sweep is estimated at 29 s"):
        _main(monkeypatch, "--out", str(tmp_path / "b"), "--preset", "tiny", "--max-num-seqs", "4",
              "--max-num-batched-tokens", "128", "--max-model-len", "256", "--num-kv-tokens", "2048", "--replays",
              "", "--profile-budget", "10", "--estimate-profile", str(estimator))  # fmt: skip
    assert gc.get_freeze_count() == 0  # the engine that raised was closed: its frozen objects freed
