"""Unit tests of dashboard.logic (the pure helpers behind the pages), dashboard.figures and the
`kvplan dashboard` command (dashboard.cli)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("streamlit")
pytest.importorskip("plotly")
from dash_samples import GPU, MODEL, small_trace, write_profile

import traces
from dashboard import figures, logic
from simulator import validate
from simulator.latency import LatencyProfile, RooflineModel
from simulator.metrics import SLO
from simulator.models import resolve_model

GOOD_CSV = b"arrival_s,prompt_len,output_len\n0.0,100,20\n0.5,200,30\n1.5,50,5\n"


# ---- traces -------------------------------------------------------------------------------------


def test_load_trace_bytes_reads_a_generic_csv():
    loaded = logic.load_trace_bytes(GOOD_CSV, "mine.csv")
    assert len(loaded.trace) == 3 and loaded.trace.name == "mine"
    assert "mine.csv" in loaded.report and "kvplan-upload" not in loaded.report


@pytest.mark.parametrize(
    "data, expect",
    [
        (b"arrival_s,prompt_len,output_len\n0.0,100,20\n0.5,abc,30\n", ["bad.csv", "prompt_len"]),
        (b"", ["bad.csv", "empty"]),
        (b"\x00\x01\x02garbage" * 10, ["bad.csv"]),
        (b'{"arrival_s": 0, "prompt_len": 1}\n{not json\n', ["bad.csv"]),
    ],
)
def test_load_trace_bytes_malformed_gives_a_clear_value_error(data, expect):
    with pytest.raises(ValueError) as info:
        logic.load_trace_bytes(data, "bad.csv")
    message = str(info.value)
    for word in expect:
        assert word in message
    assert "kvplan-upload" not in message  # the temporary path never leaks


def test_load_trace_bytes_enforces_the_size_limit():
    with pytest.raises(ValueError, match="upload limit"):
        logic.load_trace_bytes(GOOD_CSV, "big.csv", limit_bytes=10)


def test_nice_bins_and_arrival_rate():
    assert logic.nice_step(0.3) == 0.5 and logic.nice_step(7) == 10 and logic.nice_step(20) == 20
    trace = small_trace(300, rate_scale=1.0)
    bin_s = logic.auto_bin_s(trace.duration_s)
    rate = logic.arrival_rate(trace, bin_s)
    assert rate["requests"].sum() == len(trace)
    assert np.allclose(rate["rate_rps"], rate["requests"] / bin_s)


def test_histogram_counts_every_value():
    v = np.array([1, 2, 3, 10, 100, 1000])
    for log in (True, False):
        h = logic.histogram(v, bins=5, log=log)
        assert h["count"].sum() == len(v)
    assert logic.histogram([], bins=5).empty


def test_prefix_reuse_curve_only_with_prefix_ids():
    assert logic.prefix_reuse_curve(small_trace(50)) is None
    gen = traces.generate(logic.generator_spec(num_requests=300, rate=10, num_prefixes=4, prefix_len=512))
    curve = logic.prefix_reuse_curve(gen, points=10)
    assert curve is not None and len(curve) == 10
    assert curve["requests"].iloc[-1] == len(gen)
    assert curve["token_reuse"].iloc[-1] == pytest.approx(traces.prefix_reuse(gen).token_reuse)


def test_prepare_trace_windows_then_scales():
    trace = small_trace(300, rate_scale=1.0)
    out = logic.prepare_trace(trace, window_s=20.0, rate_scale=2.0)
    assert len(out) == int((trace.df["arrival_s"] < 20.0).sum())
    assert out.duration_s <= 10.0
    assert logic.prepare_trace(trace, None, 1.0) is trace


# ---- what-if ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_results():
    trace = small_trace(120)
    model = resolve_model(MODEL)
    jobs = [
        logic.SimJob(logic.ConfigSpec("a").to_sim_config(model, GPU)),
        logic.SimJob(
            logic.ConfigSpec("b", max_num_seqs=8, max_num_batched_tokens=2048).to_sim_config(model, GPU)
        ),
    ]
    a, b = logic.run_jobs(trace, jobs)
    return trace, jobs, {"a": a, "b": b}


def test_invalid_config_is_a_value_error():
    with pytest.raises(ValueError, match="tensor"):
        logic.ConfigSpec("x", tensor_parallel_size=3).to_sim_config(resolve_model(MODEL), GPU)


def test_run_jobs_cached_reuses_results(two_results):
    trace, jobs, results = two_results
    store = logic.ResultStore(max_entries=8)
    first = logic.run_jobs_cached(store, "t", trace, jobs)
    assert len(store) == 2
    again = logic.run_jobs_cached(store, "t", trace, list(reversed(jobs)))
    assert again[0] is first[1] and again[1] is first[0]
    assert first[0].summary["ttft_p99_s"] == results["a"].summary["ttft_p99_s"]


def test_run_jobs_reports_a_bad_profile_per_job(tmp_path):
    trace = small_trace(20)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    job = logic.SimJob(logic.ConfigSpec("x").to_sim_config(resolve_model(MODEL), GPU), bad)
    (out,) = logic.run_jobs(trace, [job])
    assert isinstance(out, ValueError) and "bad.json" in str(out)


def test_run_jobs_in_a_process_pool_matches_in_process(two_results):
    trace, jobs, results = two_results
    ctx = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(2, mp_context=ctx) as pool:
        out = logic.run_jobs(trace, jobs, pool)
    for got, label in zip(out, ("a", "b")):
        pd.testing.assert_frame_equal(got.requests, results[label].requests)


def test_jobs_in_a_worker_share_prompts_and_match_in_process(two_results):
    """A pool worker keeps the trace's prompts for its next jobs (found by rows, not by object):
    the results equal those of jobs that build their own."""
    import pickle

    trace, jobs, results = two_results
    for job, label in zip(jobs * 2, ("a", "b") * 2):
        copy = pickle.loads(pickle.dumps(trace))  # as a pool receives it
        got = logic.run_job_in_worker(copy, job)
        pd.testing.assert_frame_equal(got.requests, results[label].requests, check_exact=True)
        assert logic._WORKER_PROMPTS.get(trace, job.config) == trace.token_ids_many(0, len(trace), 256)


def test_summary_table_and_best_config(two_results):
    _, _, results = two_results
    table = logic.summary_table(results, SLO(ttft_s=0.5))
    assert list(table.index) == ["a", "b"]
    assert table.loc["b", "max seqs"] == 8 and table.loc["a", "GPUs"] == 1
    assert table.loc["a", "$/h"] == pytest.approx(3.59)
    assert 0 <= table.loc["a", "SLO attainment"] <= 1
    for objective, (column, larger) in logic.OBJECTIVES.items():
        best = logic.best_config(table, objective)
        values = table[column]
        assert values[best] == (values.max() if larger else values.min())
    assert np.isnan(logic.summary_table(results)["SLO attainment"]).all()
    assert logic.best_config(logic.summary_table(results), "highest SLO attainment") is None


def test_best_config_ties_prefer_fewer_gpus():
    table = pd.DataFrame({"GPUs": [4, 1, 2], "E2E p99 (s)": [1.0, 1.0, 2.0]}, index=["x", "y", "z"])
    assert logic.best_config(table, "lowest p99 E2E") == "y"


def test_latency_cdfs_timelines_and_throughput(two_results):
    _, _, results = two_results
    cdf = logic.latency_cdfs(results, "e2e_s", points=50)
    assert set(cdf["config"]) == {"a", "b"} and len(cdf) == 100
    for _, g in cdf.groupby("config"):
        assert g["value_s"].is_monotonic_increasing and g["quantile"].iloc[-1] == 1.0
    tl = logic.cluster_timeline(results)
    assert {"kv_usage", "num_running", "num_waiting"} <= set(tl.columns) and set(tl["config"]) == {"a", "b"}
    tput = logic.token_throughput(results, bins=40)
    for label, g in tput.groupby("config"):
        bin_s = g["time_s"].iloc[1] - g["time_s"].iloc[0]
        total = results[label].requests["num_output_tokens"].sum()
        assert (g["output_tok_s"] * bin_s).sum() == pytest.approx(total, rel=1e-6)


def test_figures_build_for_every_chart(two_results):
    _, _, results = two_results
    colors = figures.color_map(list(results))
    table = logic.summary_table(results)
    figs = [
        figures.cdf_figure(logic.latency_cdfs(results, "ttft_s"), "TTFT", colors, True),
        figures.timeline_figure(logic.cluster_timeline(results), "kv_usage", "KV", "KV", colors, True),
        figures.bar_figure(table, "preemptions", "Preemptions", colors),
        figures.cdf_figure(pd.DataFrame(columns=["config", "value_s", "quantile"]), "TTFT", colors),
    ]
    assert [len(f.data) for f in figs[:3]] == [2, 2, 1]
    assert figs[3].layout.annotations  # the empty state says why


# ---- capacity plan --------------------------------------------------------------------------------


def test_pareto_mask():
    cost = [1, 2, 3, 2, np.nan]
    lat = [3, 2, 1, 3, 0]
    assert logic.pareto_mask(cost, lat).tolist() == [True, True, True, False, False]


def test_plan_objectives():
    objs = logic.plan_objectives(2.0, 0.08, None)
    assert [o.name for o in objs] == ["ttft_p99", "tpot_p99"]
    assert logic.objectives_text(objs) == "ttft_p99=2.0s,tpot_p99=0.08s"
    with pytest.raises(ValueError):
        logic.plan_objectives(None, 0, None)


def test_run_plan_finds_the_cheapest_configuration():
    trace = logic.prepare_trace(small_trace(400, rate_scale=1.0), 30.0)
    out = logic.run_plan(
        trace,
        MODEL,
        logic.LATENCY_ROOFLINE,
        logic.plan_objectives(2.0, 0.08, None),
        rate=8.0,
        gpus=["H100-SXM", "H200-SXM"],
        tps=[1, 2],
        block_sizes=[16],
        max_num_seqs=[256],
        max_num_batched_tokens=[16384],
        max_gpus=8,
    )
    best = out.result.best
    assert best is not None and best.option.gpu in ("H100-SXM", "H200-SXM")
    assert {"label", "meets_slo", "cost_per_hour_usd", "ttft_p99_s"} <= set(out.points.columns)
    feasible = out.points[out.points["meets_slo"]]
    assert best.cost_per_hour == pytest.approx(feasible["cost_per_hour_usd"].min())
    cands = logic.plan_candidates(out.result)
    assert cands.iloc[0]["status"] == "best" and len(cands) == 4
    fig = figures.pareto_figure(
        out.points.assign(pareto=logic.pareto_mask(out.points["cost_per_hour_usd"], out.points["e2e_p99_s"])),
        "e2e_p99_s",
        "E2E",
        0,
    )
    assert any(t.name == "recommended" for t in fig.data)


def test_run_plan_compares_like_with_like_unless_asked_to_mix():
    trace = logic.prepare_trace(small_trace(100, rate_scale=1.0), 20.0)
    args = dict(
        rate=4.0,
        gpus=["H100-SXM", "H200-SXM"],
        tps=[1],
        block_sizes=[16],
        max_num_seqs=[256],
        max_num_batched_tokens=[16384],
        max_gpus=1,
    )
    objectives = logic.plan_objectives(5.0, None, None)
    out = logic.run_plan(trace, "qwen3-0.6b", logic.LATENCY_AUTO, objectives, **args)
    assert out.latency_note == (
        "Only 1 of 2 options have a shipped fitted profile (H200-SXM tp=1 block=16 seqs=256 "
        "batched_tokens=16384 (fitted qwen3-0.6b_h200_tp1_bs16.json)): every option was simulated on the "
        "roofline, to compare like with like. Turn on Mix latency models to keep the profiles."
    )
    assert list(logic.plan_candidates(out.result)["latency model"]) == ["roofline", "roofline"]
    assert logic.plan_latency_warning(out.result) is None
    mixed = logic.run_plan(
        trace, "qwen3-0.6b", logic.LATENCY_AUTO, objectives, **args, mix_latency_models=True
    )
    assert mixed.latency_note is None
    assert set(logic.plan_candidates(mixed.result)["latency model"].dropna()) <= {
        "roofline",
        "fitted qwen3-0.6b_h200_tp1_bs16.json",
    }
    assert sorted(mixed.points["latency model"]) == ["fitted qwen3-0.6b_h200_tp1_bs16.json", "roofline"]
    assert logic.plan_latency_warning(mixed.result).startswith("warning: these results come from different")


# ---- sim vs real -----------------------------------------------------------------------------------


def test_find_and_load_validation_runs(validation_root):
    runs = logic.find_validation_runs(validation_root)
    assert [(p.name, k) for p, k in runs] == [
        ("pair-run", logic.PAIR),
        ("replay-run", logic.REPLAY),
        ("validation", logic.REPORT),
        ("replay-run-again", logic.REPLAY),
    ]
    assert logic.repeat_candidates(validation_root / "replay-run", runs) == [
        validation_root / "replay-run-again"
    ]
    assert logic.find_validation_runs(validation_root / "missing") == []
    pair = logic.load_validation(*runs[0])
    assert {"metric", "real", "sim", "rel_error", "target", "ok"} <= set(pair.table.columns)
    assert (pair.table.set_index("metric")["rel_error"].abs() > 0.01).any()  # "real" is slower
    assert pair.steps is not None and {"predicted_s", "measured_s", "residual"} <= set(pair.steps.columns)
    assert not pair.steps["compiled"].any()
    summary = validate.step_error_by_kind(pair.steps)
    assert set(summary["kind"]) == {"decode", "prefill", "mixed"}
    assert (summary["median |rel. error|"] < 0.2).all()
    for kind, row in summary.set_index("kind").iterrows():  # the summed error is time-weighted
        steps = pair.steps[pair.steps["kind"] == kind]
        assert row["summed error"] == pytest.approx(
            steps["predicted_s"].sum() / steps["measured_s"].sum() - 1
        )
    paired = logic.paired_requests(pair.real, pair.sim)
    assert len(paired) == len(pair.real) and "ttft_s_real" in paired
    replay = logic.load_validation(*runs[1], profile=validation_root / "pair-run" / "profile.json")
    assert replay.steps is not None and len(replay.sim) == len(replay.real)
    report = logic.load_validation(*runs[2])  # the roofline re-simulation `kvplan validate` wrote
    assert len(report.real) == len(replay.real) and report.steps is None and "no predicted_s" in report.note
    assert report.table.set_index("metric")["rel_error"].abs().max() > 0.01


def test_load_validation_names_the_bad_file(tmp_path):
    (tmp_path / "real_requests.parquet").write_text("not parquet")
    pd.DataFrame({"request_id": [0]}).to_parquet(tmp_path / "sim_requests.parquet")
    with pytest.raises(ValueError, match="sim_requests.parquet"):
        logic.load_validation(tmp_path, logic.PAIR)


def test_step_residuals_are_zero_for_the_true_model(records):
    from dash_samples import REAL_EFFICIENCY

    truth = RooflineModel(resolve_model(MODEL), GPU, efficiency=REAL_EFFICIENCY)
    clean = records.assign(gpu_time_s=[truth.predict(_shape(r)).total for r in records.itertuples()])
    res = logic.step_residuals(clean, truth)
    assert len(res) == len(records) - 1  # the compiled step is dropped
    assert res["residual"].abs().max() < 1e-9


def _shape(row):
    from simulator.latency import StepShape

    return StepShape.of(row._asdict())


def test_read_step_records(records):
    import io

    buf = io.BytesIO()
    records.to_parquet(buf)
    assert len(logic.read_step_records(buf.getvalue(), "r.parquet")) == len(records)
    assert len(logic.read_step_records(records.to_csv(index=False).encode(), "r.csv")) == len(records)
    with pytest.raises(ValueError, match="not step records"):
        logic.read_step_records(b"a,b\n1,2\n", "x.csv")


# ---- latency profiles -------------------------------------------------------------------------------


def test_profile_helpers(tmp_path, records):
    path = write_profile(tmp_path / "p.json", records)
    (tmp_path / "run.json").write_text(json.dumps({"model": "x"}))
    assert logic.profile_files(tmp_path, tmp_path / "none") == [path]
    profile = LatencyProfile.load(path)
    coef = logic.profile_coefficients(profile)
    assert set(coef["fit"]) == {"decode", "prefill"} and len(coef) == 16  # 7 + 6 features, 3 host floors
    floors = coef.set_index("feature").loc[
        ["floor_decode_s", "floor_prefill_s", "floor_mixed_s"], "coefficient"
    ]
    assert tuple(floors) == (profile.floors.decode, profile.floors.prefill, profile.floors.mixed)
    no_floors = dataclasses.replace(profile, floors=None)
    assert len(logic.profile_coefficients(no_floors)) == 13
    assert set(logic.profile_errors(profile)["fit"]) == {"decode", "prefill"}
    model = profile.to_latency_model()
    dec = logic.decode_curves(model, [1, 8, 64], [512, 4096])
    assert len(dec) == 6
    for _, g in dec.groupby("context_len"):
        assert g["step_ms"].is_monotonic_increasing
    pre = logic.prefill_curves(RooflineModel(resolve_model(MODEL), GPU), [16, 256, 4096], cached=(0, 1024))
    assert len(pre) == 6 and (pre["step_ms"] > 0).all()
    parts = pre[["linear_ms", "attention_ms", "communication_ms", "overhead_ms"]].sum(axis=1)
    assert np.allclose(parts, pre["step_ms"])


def test_resolve_profile(tmp_path):
    assert logic.resolve_profile(logic.LATENCY_ROOFLINE, MODEL, GPU, 16, 1) is None
    with pytest.raises(ValueError, match="no such file"):
        logic.resolve_profile(str(tmp_path / "x.json"), MODEL, GPU, 16, 1)


# ---- cli ---------------------------------------------------------------------------------------------


def test_cli_registers_the_dashboard_command(monkeypatch):
    from dashboard import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["dashboard", "--port", "9999"])
    assert args.port == 9999 and args.host == "127.0.0.1"
    calls = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd, cwd: calls.append(cmd) or 0)
    assert args.func(args) == 0
    cmd = calls[0]
    assert cmd[1:4] == ["-m", "streamlit", "run"] and Path(cmd[4]).name == "app.py"
    assert (
        "--server.headless=true" in cmd
        and "--server.port=9999" in cmd
        and "--server.address=127.0.0.1" in cmd
    )


def test_main_cli_offers_dashboard():
    from simulator.cli import build_parser

    args = build_parser().parse_args(["dashboard", "--host", "0.0.0.0"])
    assert args.host == "0.0.0.0" and args.port == 8501
