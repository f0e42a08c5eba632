"""The kvplan front's bad-input errors: one line naming the flag (exit status 2) before any work,
never a traceback; every option documented with its default."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest

import simulator.run
import simulator.validate
from simulator.cli import build_parser, main
from simulator.config import SimConfig
from simulator.metrics import SLO
from simulator.plan import parse_objectives


def _err(capsys) -> str:
    return capsys.readouterr().err


@pytest.fixture
def no_run(monkeypatch):
    """Fail the test if a simulation starts: these errors must come before the work."""

    def boom(*a, **k):
        raise AssertionError("the simulation ran")

    monkeypatch.setattr(simulator.run, "run_simulation", boom)


def test_window_past_the_trace_end_names_the_trace_span(capsys, no_run):
    assert main(["simulate", "--window", "99999:100000", "--quiet"]) == 2
    err = _err(capsys)
    assert "--window: 99999:100000 holds no requests" in err
    assert "azure_conv_2023 has 19,366 requests arriving from 0.0 s to 3,501.7 s" in err


@pytest.mark.parametrize("window", ["5:2", "-3:10", "nan:4"])
def test_window_bounds_must_be_ordered_seconds(capsys, no_run, window):
    assert main(["simulate", f"--window={window}", "--quiet"]) == 2
    assert "--window:" in _err(capsys)


@pytest.mark.parametrize(
    "slo,message",
    [
        ("ttft=-1s", "'ttft=-1s' must be a positive time"),
        ("tpot=nan", "'tpot=nan' must be a positive time"),
        ("e2e=inf", "'e2e=inf' must be a positive time"),
        ("ttft=0", "'ttft=0' must be a positive time"),
        ("ttft_foo=1s", "unknown objective 'ttft_foo'"),
        ("ttft", "'ttft' is not NAME=TIME"),
        (",", "give at least one objective"),
    ],
)
def test_simulate_rejects_what_capacity_rejects(capsys, no_run, slo, message):
    assert main(["simulate", "--slo", slo, "--quiet", "--limit", "5"]) == 2
    assert f"--slo: {message}" in _err(capsys)
    with pytest.raises(ValueError, match="--slo"):
        parse_objectives(slo)


@pytest.mark.parametrize("text", ["ttft=2s", "ttft_p99=2s,tpot_p50=80ms", "e2e_mean=30,tpot=0.05s"])
def test_one_slo_grammar_for_simulate_and_plan(text):
    """`NAME_STAT=` is an objective on the run's statistic in both; a bare NAME is its p99."""
    slo = SLO.parse(text)
    assert [(m, s, pytest.approx(v)) for m, s, v in slo.objectives] == [
        (o.metric, o.stat, o.limit_s) for o in parse_objectives(text)
    ]


def test_slo_goodput_bounds_and_results():
    slo = SLO.parse("ttft_p50=1s,ttft_p99=2s,tpot=80ms")
    assert (slo.ttft_s, slo.tpot_s, slo.e2e_s) == (1.0, 0.08, None)  # the tightest bound per metric
    summary = {"ttft_p50_s": 0.5, "ttft_p99_s": 2.5, "tpot_p99_s": float("nan")}
    assert slo.results(summary) == [
        ("ttft_p50", 1.0, 0.5, True),
        ("ttft_p99", 2.0, 2.5, False),
        ("tpot_p99", 0.08, pytest.approx(float("nan"), nan_ok=True), False),
    ]


def test_simulate_prints_each_objective(capsys):
    assert main(["simulate", "--slo", "ttft_p99=10s,tpot_p50=1ms", "--quiet", "--limit", "50"]) == 0
    out = capsys.readouterr().out
    assert "SLO ttft_p99   <= 10,000.0 ms:" in out and out.count("met") >= 1
    assert "SLO tpot_p50   <= 1.0 ms:" in out


def test_out_naming_a_file_fails_before_the_run(tmp_path, capsys, no_run):
    existing = tmp_path / "results"
    existing.write_text("not a folder")
    assert main(["simulate", "--out", str(existing), "--quiet", "--limit", "5"]) == 2
    assert f"--out: {existing} exists and is not a folder" in _err(capsys)


@pytest.mark.parametrize("content,what", [("[1, 2]", "a JSON list, not an object"), ("{", "not valid JSON")])
def test_profile_that_is_not_a_json_object(tmp_path, capsys, no_run, content, what):
    path = tmp_path / "p.json"
    path.write_text(content)
    assert main(["simulate", "--profile", str(path), "--quiet", "--limit", "5"]) == 2
    assert f"--profile: {path} is not a latency profile: {what}" in _err(capsys)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--block-size", "7"], "--block-size: must be a power of two from 1 to 1024 tokens, got 7"),
        (
            ["--block-size", "100000"],
            "--block-size: must be a power of two from 1 to 1024 tokens, got 100000",
        ),
        (["--block-size", "0"], "--block-size: must be a power of two"),
        (["--replicas", "100000"], "--replicas: must be 1 to 1024"),
        (["--replicas", "0"], "--replicas: must be 1 to 1024"),
        (["--max-num-seqs", "0"], "--max-num-seqs: must be a positive integer, got 0"),
        (["--num-kv-blocks", "0"], "--num-kv-blocks: must be a positive integer, got 0"),
        (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization: must be in (0, 1]"),
        (["--tp", "3"], "--tp: 3 does not divide"),
        (["--rate-scale", "0"], "--rate-scale: must be a positive number, got 0.0"),
    ],
)
def test_config_errors_name_the_flag(capsys, no_run, flags, message):
    assert main(["simulate", *flags, "--quiet", "--limit", "5"]) == 2
    err = _err(capsys)
    assert message in err
    assert "Config." not in err and "factor" not in err


def test_capacity_config_errors_name_the_flag_before_searching(capsys, monkeypatch):
    import simulator.plan

    monkeypatch.setattr(simulator.plan, "find_capacity", lambda *a, **k: pytest.fail("searched"))
    assert main(["capacity", "--slo", "ttft=1s", "--block-size", "7", "--quiet", "--workers", "1"]) == 2
    assert "--block-size: must be a power of two" in _err(capsys)


def test_sim_config_caps():
    from simulator.models import resolve_model

    model = resolve_model("qwen3-0.6b")
    for bs in (1, 16, 256, 1024):
        SimConfig(model=model, block_size=bs)
    for bs in (3, 7, 48, 2048):
        with pytest.raises(ValueError, match="SimConfig.block_size"):
            SimConfig(model=model, block_size=bs)
    SimConfig(model=model, num_replicas=1024)
    with pytest.raises(ValueError, match="SimConfig.num_replicas"):
        SimConfig(model=model, num_replicas=1025)


def test_a_missing_extra_names_the_install_command(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ModuleNotFoundError
    assert main(["profile", "--random", "tiny", "--gpu", "H200"]) == 2
    err = _err(capsys)
    assert "needs torch, which is not installed" in err and "pip install -e '.[engine]'" in err


def _subparsers(parser: argparse.ArgumentParser, path=()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, (*path, name))


def test_every_option_of_every_command_has_help_and_shows_its_default():
    missing, hidden = [], []
    commands = dict(_subparsers(build_parser()))
    assert {("simulate",), ("validate",), ("fit",), ("sweep",), ("plan",), ("capacity",)} <= set(commands)
    for path, parser in commands.items():
        help_text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = " ".join(path) + " " + (action.option_strings or [action.dest])[0]
            if not action.help:
                missing.append(name)
            elif action.default not in (None, False, argparse.SUPPRESS) and (
                f"default: {action.default}" not in " ".join(help_text.split())
                and "default" not in action.help
            ):
                hidden.append(name)
    assert not missing, f"options without help: {missing}"
    assert not hidden, f"options whose default --help does not show: {hidden}"


class _FakeValidation:
    def __init__(self, passed: bool) -> None:
        self.passed = passed


@pytest.fixture
def fake_validate(monkeypatch, tmp_path):
    calls = SimpleNamespace(profile="unset", out=None, passed=True)

    def validate_run(run, profile, repeat=None):
        calls.profile = profile
        return _FakeValidation(calls.passed)

    def write_report(v, out):
        calls.out = Path(out)
        return calls.out

    monkeypatch.setattr(simulator.validate, "validate_run", validate_run)
    monkeypatch.setattr(simulator.validate, "write_report", write_report)
    monkeypatch.setattr(simulator.validate, "format_table", lambda v: "table")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "x10"
    run.mkdir(parents=True)
    return calls, run


def test_validate_fails_outside_the_targets_unless_told_not_to(fake_validate, capsys):
    calls, run = fake_validate
    calls.passed = False
    assert main(["validate", "--real", str(run)]) == 1
    assert "OUTSIDE the targets" in capsys.readouterr().out
    assert main(["validate", "--real", str(run), "--no-fail"]) == 0
    calls.passed = True
    assert main(["validate", "--real", str(run)]) == 0


def test_validate_writes_outside_the_replay_folder_by_default(fake_validate):
    calls, run = fake_validate
    assert main(["validate", "--real", str(run)]) == 0
    assert calls.out == Path("validation") / "x10"
    assert run not in calls.out.resolve().parents and calls.out.resolve() != run
    assert main(["validate", "--real", str(run), "--out", "elsewhere"]) == 0
    assert calls.out == Path("elsewhere")


def test_validate_takes_the_profile_choices_simulate_takes(fake_validate, tmp_path, capsys):
    calls, run = fake_validate
    assert main(["validate", "--real", str(run), "--profile", "roofline"]) == 0
    assert calls.profile is None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([1]))
    assert main(["validate", "--real", str(run), "--profile", str(bad)]) == 2
    assert "is not a latency profile" in capsys.readouterr().err


def test_validate_exit_status_follows_the_shipped_replays_targets(tmp_path):
    run = Path(__file__).resolve().parents[2] / "simulator/data/validation/h200_qwen3-0.6b_bs256_light"
    passed = simulator.validate.validate_run(run, None).passed
    assert main(["validate", "--real", str(run), "--out", str(tmp_path / "v")]) == (0 if passed else 1)
    assert (tmp_path / "v" / "report.html").is_file() and not (run / "validation").exists()


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--block-sizes", "16,7"], "--block-sizes: must be a power of two from 1 to 1024 tokens, got 7"),
        (["--max-num-seqs", "0"], "--max-num-seqs: must be a positive integer, got 0"),
        (["--max-num-batched-tokens", "-5"], "--max-num-batched-tokens: must be a positive integer, got -5"),
        (["--block-sizes", ","], "--block-sizes: give at least one value"),
    ],
)
def test_plan_axes_name_the_flag_before_any_simulation(capsys, monkeypatch, flags, message):
    import simulator.plan

    monkeypatch.setattr(simulator.plan, "find_plan", lambda *a, **k: pytest.fail("searched"))
    argv = ["plan", "--rate", "1", "--slo", "ttft=2s", "--gpus", "H200", "--quiet", "--workers", "1"]
    assert main([*argv, *[f"{flags[0]}={flags[1]}"]]) == 2
    assert message in _err(capsys)


def test_fit_like_that_is_not_a_profile(tmp_path, capsys):
    like = tmp_path / "like.json"
    like.write_text("[]")
    records = tmp_path / "steps.parquet"
    pd.DataFrame({"wall_time_s": [0.001]}).to_parquet(records)
    assert (
        main(["fit", "--records", str(records), "--like", str(like), "--out", str(tmp_path / "o.json")]) == 2
    )
    assert f"--like: {like} is not a latency profile: a JSON list, not an object" in _err(capsys)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["plan", "--slo", "ttft=2s", "--rate", "inf"], "--rate: must be a positive number of requests"),
        (["plan", "--slo", "ttft=2s", "--rate", "1", "--max-gpus", "0"], "--max-gpus: must be a positive"),
        (["plan", "--slo", "ttft=2s", "--rate", "1", "--workers", "0"], "--workers: must be a positive"),
        (
            ["capacity", "--slo", "ttft=2s", "--tolerance", "0"],
            "--tolerance: must be a ratio between 0 and 1",
        ),
        (["capacity", "--slo", "ttft=2s", "--max-scale", "0.5"], "--max-scale: must be at least 1"),
        (["sweep", "spec.yaml", "--out", "x.parquet", "--workers", "0"], "--workers: must be a positive"),
    ],
)
def test_search_flags_are_named_in_their_errors(capsys, argv, message):
    assert main([*argv, "--quiet"]) == 2
    err = _err(capsys)
    assert message in err
    assert not any(
        f"error: {name}" in err for name in ("max_gpus", "workers", "tolerance", "start", "factor")
    )
