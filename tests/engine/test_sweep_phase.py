"""benchmarks/sweep_phase.py on a CPU: `run` serves the corpus prefill and the named phases' workloads
on a tiny engine and writes their records; `price` tables them against a profile by running decodes."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import sweep_phase  # noqa: E402  (benchmarks/ is not a package)

TINY = [
    "--random",
    "tiny",
    "--max-num-seqs",
    "8",
    "--max-num-batched-tokens",
    "256",
    "--max-model-len",
    "512",
]


def test_run_then_price_a_phase(tmp_path, capsys):
    records = tmp_path / "steps.parquet"
    assert sweep_phase.main(["run", *TINY, "--phases", "mixed_serving", "--records", str(records)]) == 0
    steps = pd.read_parquet(records)
    mixed = steps[(steps.kind == "mixed") & (steps.num_prefill_seqs == 1)]
    # the tiny engine's joins: prompts of 128 tokens (256 do not fit beside the batch in a 256-token
    # step), three rounds, beside a running batch of 2 (8 would leave no slot for a join)
    assert sorted(set(mixed.total_num_scheduled_tokens - mixed.num_decode_seqs)) == [128]
    assert sorted(set(mixed.num_decode_seqs)) == [2] and len(mixed) == 3
    profile = ROOT / "simulator" / "profiles" / "qwen3-0.6b_h200_tp1_bs16.json"
    assert sweep_phase.main(["price", "--records", str(records), "--profile", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "summed error" in out and "mixed" in out and "(0, 16]" in out


def test_run_names_a_phase_it_cannot_run(tmp_path):
    with pytest.raises(SystemExit, match=r"--phases: \['serving'\] are not workload phases"):
        sweep_phase.main(["run", *TINY, "--phases", "serving", "--records", str(tmp_path / "s.parquet")])
