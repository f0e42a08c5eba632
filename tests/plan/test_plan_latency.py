"""Every planning result names its latency model, and comparisons across latency models say so.

`kvplan plan` compares like with like: when only some options have a fitted profile, all run on the
transferred model (the default of the others) unless --mix-latency-models. Sweep rows carry
`latency_model` and `profile` columns.
"""

from __future__ import annotations

import argparse
import math

import pandas as pd

from simulator import plan, plan_cli
from simulator.defaults import TRANSFER_MODEL
from simulator.plan import Option
from simulator.sweep import SweepSpec, run_sweep

H200_16 = Option("H200-SXM", 1, 16, 256, 16384)
H200_256 = Option("H200-SXM", 1, 256, 256, 16384)
H100_16 = Option("H100-SXM", 1, 16, 256, 16384)
FITTED_16 = "fitted qwen3-0.6b_h200_tp1_bs16.json"
TRANSFERRED = "transferred transfer_h200.json"


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvplan")
    plan_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_option_latency_names_the_profile_each_option_would_use():
    got = plan.option_latency([H200_16, H200_256, H100_16], "auto", "qwen3-0.6b")
    assert got == {
        H200_16: FITTED_16,
        H200_256: "fitted qwen3-0.6b_h200_tp1_bs256.json",
        H100_16: TRANSFERRED,
    }
    assert plan.option_latency([H200_16], "auto", "qwen3-0.6b", async_scheduling=True) == {
        H200_16: "fitted qwen3-0.6b_h200_tp1_bs16_async.json"
    }
    assert plan.option_latency([H200_16], "roofline", "qwen3-0.6b") == {H200_16: "roofline"}


def test_like_with_like_puts_a_mixed_plan_on_the_transferred_model():
    profile, note = plan.like_with_like([H200_16, H100_16], "auto", "qwen3-0.6b")
    assert profile == str(TRANSFER_MODEL)
    assert note == (
        "note: only 1 of 2 options have a fitted profile (H200-SXM tp=1 block=16 seqs=256 "
        f"batched_tokens=16384 ({FITTED_16})); every option is simulated on the transferred model to "
        "compare like with like (--mix-latency-models keeps the fitted profiles where there are any)"
    )
    profile, note = plan.like_with_like([H200_16, H100_16], "auto", "qwen3-0.6b", mix=True)
    assert profile == "auto"
    assert note.startswith(
        "warning: 1 of 2 options are simulated on fitted profiles and the others on the transferred model"
    )
    # one kind throughout: nothing to change or say
    assert plan.like_with_like([H200_16, H200_256], "auto", "qwen3-0.6b") == ("auto", None)
    assert plan.like_with_like([H100_16], "auto", "qwen3-0.6b") == ("auto", None)
    assert plan.like_with_like([H200_16, H100_16], "roofline", "qwen3-0.6b") == ("roofline", None)


def test_mixed_latency_warning_counts_the_rows_of_each_model():
    fitted = {"latency_model": "fitted", "profile": "a.json"}
    roof = {"latency_model": "roofline", "profile": None}
    error = {"latency_model": math.nan, "profile": math.nan}  # an error row read back from Parquet
    assert plan.row_latency(fitted) == "fitted a.json" and plan.row_latency(roof) == "roofline"
    assert plan.row_latency(error) == "?"
    assert (
        plan.describe_latency([fitted, fitted, roof, error, None])
        == "fitted a.json (2 rows), roofline (1 rows)"
    )
    assert plan.mixed_latency_warning([fitted, roof, error]) == (
        "warning: these results come from different latency models (fitted a.json (1 rows), roofline (1 rows)); "
        "part of their differences comes from the models, not the configurations"
    )
    two_profiles = [fitted, {"latency_model": "fitted", "profile": "b.json"}]
    assert plan.mixed_latency_warning(two_profiles) is None  # both fitted: one kind
    assert plan.mixed_latency_warning([roof, error]) is None


PLAN_ARGV = ["plan", "--limit", "40", "--rate", "4", "--slo", "ttft_p99=5s", "--gpus", "H100,H200"]
PLAN_ARGV += ["--tp", "1", "--max-gpus", "1", "--workers", "1", "--quiet"]


def test_plan_compares_like_with_like_by_default(capsys):
    assert run(PLAN_ARGV) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("note: only 1 of 2 options have a fitted profile (H200-SXM tp=1 block=16")
    assert f"\nLatency: {TRANSFERRED}\n" in captured.out
    assert (
        f"Best: 1 x (H100-SXM tp=1 block=16 seqs=256 batched_tokens=16384) = 1 GPUs, $2.69/h [{TRANSFERRED}]"
        in (captured.out)
    )


def test_plan_mixes_latency_models_only_when_asked(capsys):
    assert run([*PLAN_ARGV, "--mix-latency-models", "--exhaustive"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("warning: 1 of 2 options are simulated on fitted profiles")
    assert f"\nLatency: {TRANSFERRED} (1 rows), {FITTED_16} (1 rows)\n" in captured.out
    assert f"[feasible] 1 x (H200-SXM tp=1 block=16 seqs=256 batched_tokens=16384) $3.59/h [{FITTED_16}]" in (
        captured.out
    )


def test_sweep_rows_name_their_latency_model_and_warn_when_mixed(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text("trace: {source: azure_conv_2023, limit: 30}\ngrid: {gpu: [H100, H200]}\n")
    out = tmp_path / "r.parquet"
    assert run(["sweep", str(spec), "--out", str(out), "--workers", "1", "--quiet"]) == 0
    df = pd.read_parquet(out)
    assert df["gpu"].tolist() == ["H100", "H200"]
    assert df["latency_model"].tolist() == ["transferred", "fitted"]  # H100: no fitted profile
    assert df["profile"].tolist() == ["transfer_h200.json", "qwen3-0.6b_h200_tp1_bs16.json"]
    assert df["profile_choice"].tolist() == ["auto", "auto"]
    assert df["num_kv_blocks_per_replica"].tolist() == [40652, 72145]  # both from GPU memory
    assert df["profile_num_kv_blocks"].tolist()[1] == 71455  # the calibration's cache, recorded
    assert df["kv_blocks_source"].tolist() == ["gpu_memory", "gpu_memory"]
    warning = (
        f"warning: these results come from different latency models ({TRANSFERRED} (1 rows), "
        "fitted qwen3-0.6b_h200_tp1_bs16.json (1 rows)); part of their differences comes from the models, "
        "not the configurations\n"
    )
    assert capsys.readouterr().err == warning
    report = run_sweep(SweepSpec.load(spec), out, workers=1, progress=False)  # resumed: nothing to run
    assert (report.num_run, report.latency_warning) == (0, warning.strip())


def test_sweep_of_one_latency_model_does_not_warn(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text("trace: {source: azure_conv_2023, limit: 30}\ngrid: {block_size: [16, 256]}\n")
    assert run(["sweep", str(spec), "--out", str(tmp_path / "r.parquet"), "--workers", "1", "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    df = pd.read_parquet(tmp_path / "r.parquet")
    assert df["profile"].tolist() == ["qwen3-0.6b_h200_tp1_bs16.json", "qwen3-0.6b_h200_tp1_bs256.json"]
    assert df["num_kv_blocks_per_replica"].tolist() == [72145, 4509]


def test_capacity_names_its_latency_model(capsys):
    argv = [
        "capacity",
        "--limit",
        "40",
        "--slo",
        "ttft_p99=5s",
        "--max-scale",
        "2",
        "--workers",
        "1",
        "--quiet",
    ]
    assert run(argv) == 0
    assert "\n  latency: fitted qwen3-0.6b_h200_tp1_bs16.json\n" in capsys.readouterr().out


def test_rows_say_how_far_they_extrapolate():
    fitted = {"latency_model": "fitted", "profile": "a.json", "steps_outside_fit_share": 0.296}
    assert plan.row_trust(fitted) == "; 29.6% of steps outside the fit"
    assert plan.row_trust({**fitted, "steps_outside_fit_share": 0.0}) == ""
    assert plan.row_trust({"latency_model": "roofline", "steps_outside_fit_share": None}) == ""
    assert plan.row_trust({"steps_outside_fit_share": math.nan}) == ""  # read back from Parquet

    def evaluate(points):  # meets ttft_p99<=1s up to 4x the trace's rate
        return [
            {
                **fitted,
                "num_requests": 10,
                "num_finished": 10,
                "ttft_p99_s": p["rate_scale"] / 4,
                "output_tok_s": 100.0,
            }
            for p in points
        ]

    result = plan.find_capacity(
        evaluate, {"gpu": "H200"}, plan.parse_objectives("ttft_p99=1s"), 2.0, max_scale=8
    )
    lines = plan.format_capacity(result).splitlines()
    assert lines[1] == "  latency: fitted a.json; 29.6% of steps outside the fit"
    assert "max sustainable rate: 8 req/s (4x the trace" in lines[3]
