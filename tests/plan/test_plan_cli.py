"""`kvplan sweep`, `kvplan plan` and `kvplan capacity` end to end on small traces.

The first 60-80 requests of a shipped trace, the roofline latency model, inline execution (--workers 1).
"""

from __future__ import annotations

import argparse

import pandas as pd
import pytest

from simulator import plan_cli


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvplan")
    plan_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_sweep_command_writes_and_resumes(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "trace: {source: azure_conv_2023, limit: 60}\nprofile: roofline\nslo: ttft=1s\n"
        "grid: {block_size: [16, 32], tp: [1, 3]}\n"
    )
    out = tmp_path / "r.parquet"
    assert run(["sweep", str(spec), "--out", str(out), "--workers", "1", "--quiet"]) == 0
    assert "4 points: 0 already in" in capsys.readouterr().out
    df = pd.read_parquet(out)
    assert len(df) == 4 and df["error"].notna().sum() == 2 and df["slo_met"].notna().sum() == 2
    assert run(["sweep", str(spec), "--out", str(out), "--workers", "1", "--quiet"]) == 0
    assert "4 points: 4 already in" in capsys.readouterr().out


def test_plan_command(capsys):
    argv = [
        "plan",
        "--limit",
        "80",
        "--rate",
        "8",
        "--slo",
        "ttft_p99=2s,tpot_p99=80ms",
        "--gpus",
        "H100,L40S",
    ]
    argv += ["--max-gpus", "2", "--profile", "roofline", "--workers", "1", "--quiet"]
    assert run(argv) == 0
    out = capsys.readouterr().out
    assert "Best: 1 x (L40S tp=1" in out and "(1 simulations)" in out  # L40S first: the cheapest
    assert "[pruned] (H100-SXM tp=1 block=16 seqs=256 batched_tokens=16384): one replica costs $2.69/h" in out
    assert "tp=4" not in out  # default TP degrees stop at --max-gpus
    assert run([*argv, "--exhaustive"]) == 0
    out = capsys.readouterr().out
    assert "Best: 1 x (L40S tp=1" in out and "[feasible] 1 x (H100-SXM tp=1" in out


def test_infeasible_plan_exits_1_and_says_why(capsys):
    argv = ["plan", "--limit", "80", "--rate", "8", "--slo", "ttft=1ms", "--gpus", "L40S", "--tp", "1"]
    assert run([*argv, "--max-gpus", "1", "--profile", "roofline", "--workers", "1", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "Infeasible" in out and "closest: 1 x (L40S" in out and "ttft_p99" in out


def test_capacity_command(capsys):
    argv = ["capacity", "--limit", "80", "--slo", "tpot_p99=20ms", "--gpu", "L40S", "--tolerance", "0.1"]
    assert run([*argv, "--profile", "roofline", "--workers", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "max sustainable rate" in out and "per million output tokens" in out


def test_capacity_with_async_scheduling(capsys):
    """`--async-scheduling` reaches the simulated engines: on the shipped Qwen3-0.6B profiles (the
    `_async` one at block 16) the same SLO sustains a higher rate than on the synchronous engine."""
    argv = ["capacity", "--limit", "80", "--slo", "tpot_p99=3ms", "--model", "qwen3-0.6b", "--gpu", "H200"]
    argv += ["--tolerance", "0.1", "--workers", "1", "--quiet"]
    rates = []
    for extra in ([], ["--async-scheduling"]):
        assert run([*argv, *extra]) == 0
        out = capsys.readouterr().out
        rates.append(float(out.split("max sustainable rate:")[1].split()[0]))
    assert rates[1] > rates[0], rates


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="unknown objective"):
        run(["plan", "--rate", "1", "--slo", "latency=1s", "--quiet"])
