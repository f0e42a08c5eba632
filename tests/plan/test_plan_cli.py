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


def test_plan_counts_a_run_that_falls_behind_as_infeasible(capsys, monkeypatch):
    """One sequence at a time on one L40S serves 2.24 of the 8 req/s offered: every request still
    finishes and its TPOT is within the objective (the run ends with the trace), but the plan is
    infeasible and the table says what it serves of what it is offered."""
    from simulator import plan

    results: list = []
    find_plan = plan.find_plan
    monkeypatch.setattr(plan, "find_plan", lambda *a, **k: results.append(find_plan(*a, **k)) or results[-1])
    argv = ["plan", "--limit", "80", "--rate", "8", "--slo", "tpot_p99=80ms", "--gpus", "L40S", "--tp", "1"]
    argv += ["--max-gpus", "1", "--max-num-seqs", "1", "--profile", "roofline", "--workers", "1", "--quiet"]
    assert run(argv) == 1
    out = capsys.readouterr().out
    assert "Infeasible: no configuration meets the SLOs and keeps up with the rate within 1 GPUs." in out
    assert (
        "  [infeasible] 1 x (L40S tp=1 block=16 seqs=1 batched_tokens=16384) $0.79/h [roofline]: fails "
        "with 1 replica, the most max_gpus=1 allows: overloaded: serves 2.24 of 8 req/s offered"
    ) in out
    (c,) = results[0].candidates
    row = c.row
    assert row["num_finished"] == 80 and row["num_truncated"] == 0
    assert plan.violations(row, plan.parse_objectives("tpot_p99=80ms")) == []  # the objective alone: met


def test_plan_and_capacity_help_say_a_run_must_keep_up(capsys):
    for command in ("plan", "capacity"):
        with pytest.raises(SystemExit):
            run([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "keeps up with the rate: a run that serves less than 95% of the requests per second" in text
        assert "is infeasible however its percentiles look" in text


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
