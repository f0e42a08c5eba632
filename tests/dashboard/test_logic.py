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
from simulator.load import KEEPS_UP, NEAR_SATURATION, NO_LOAD, OVERLOADED, Load, load_verdict
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
    qualified = table[table["status"].isin(logic.QUALIFIED)]
    assert list(qualified.index) == ["a"]  # b (8 sequences at a time) falls behind
    for objective, (column, larger) in logic.OBJECTIVES.items():
        best = logic.best_config(table, objective)
        values = qualified[column]
        assert values[best] == (values.max() if larger else values.min())
    assert np.isnan(logic.summary_table(results)["SLO attainment"]).all()
    assert logic.best_config(logic.summary_table(results), "highest SLO attainment") is None


def test_best_config_ties_prefer_fewer_gpus():
    table = pd.DataFrame({"GPUs": [4, 1, 2], "E2E p99 (ms)": [1.0, 1.0, 2.0]}, index=["x", "y", "z"])
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
        "transferred model, to compare like with like. Turn on Mix latency models to keep the profiles."
    )
    transferred = "transferred transfer_h200.json"  # the model of options without a fitted profile
    assert list(logic.plan_candidates(out.result)["latency model"]) == [transferred, transferred]
    assert logic.plan_latency_warning(out.result) is None
    mixed = logic.run_plan(
        trace, "qwen3-0.6b", logic.LATENCY_AUTO, objectives, **args, mix_latency_models=True
    )
    assert mixed.latency_note is None
    assert set(logic.plan_candidates(mixed.result)["latency model"].dropna()) <= {
        transferred,
        "fitted qwen3-0.6b_h200_tp1_bs16.json",
    }
    assert sorted(mixed.points["latency model"]) == ["fitted qwen3-0.6b_h200_tp1_bs16.json", transferred]
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


# ---- planned traffic, load, best ----------------------------------------------------------------


def test_plan_trace_is_a_fixed_number_of_requests_at_any_rate():
    """The plan rescales the trace's first N requests: at 100 req/s as many requests as at 6 req/s
    (a window cut before rescaling simulated a few seconds of traffic at a high rate)."""
    trace = small_trace(400, rate_scale=1.0)
    head = logic.plan_trace(trace, 300)
    assert len(head) == 300 and head.df["arrival_s"].iloc[0] == trace.df["arrival_s"].iloc[0]
    for rate in (6.0, 100.0):
        scaled = traces.scale_rate(head, target_rate=rate)
        assert len(scaled) == 300
        assert scaled.duration_s == pytest.approx(300 / rate)
    assert logic.plan_trace(trace, 0) is trace and logic.plan_trace(trace, 10_000) is trace
    with pytest.raises(ValueError, match="requests to simulate"):
        logic.plan_trace(trace, -1)


def test_tail_note_says_which_request_a_p99_is():
    assert "5th-worst request" in logic.tail_note(456)
    assert "the worst request" in logic.tail_note(80)
    assert "2nd-worst" in logic.tail_note(150)
    assert logic.tail_note(1000) is None


def test_load_verdict_offered_against_served():
    light = {"num_requests": 100, "num_finished": 100, "queue_mean_s": 0.0}
    assert load_verdict(light, 10.0) == Load(10.0, 10.0, KEEPS_UP)
    # A queue that grows: mean wait T/2 (lambda/mu - 1) = 5 s over T = 10 s -> mu = lambda / 2.
    behind = {**light, "queue_mean_s": 5.0}
    load = load_verdict(behind, 10.0)
    assert load.served_rps == pytest.approx(5.0) and load.verdict == OVERLOADED
    assert load_verdict({**light, "queue_mean_s": 0.5}, 10.0).verdict == NEAR_SATURATION
    rejected = load_verdict({**light, "num_finished": 50}, 10.0)
    assert rejected.served_rps == pytest.approx(5.0)
    assert load_verdict({"num_requests": 1}, 10.0).verdict == NO_LOAD


def test_result_load_of_simulations_that_keep_up_and_fall_behind():
    trace = small_trace(300, rate_scale=4.0)
    model = resolve_model(MODEL)
    jobs = [
        logic.SimJob(logic.ConfigSpec("x", max_num_seqs=seqs).to_sim_config(model, GPU)) for seqs in (256, 8)
    ]
    fast, slow = (logic.result_load(r) for r in logic.run_jobs(trace, jobs))
    assert fast.verdict == KEEPS_UP and fast.offered_rps == pytest.approx(slow.offered_rps)
    assert slow.verdict == OVERLOADED and slow.served_rps < 0.5 * slow.offered_rps


def test_best_config_only_among_those_that_meet_the_slo_and_keep_up():
    table = pd.DataFrame(
        {
            "status": ["misses SLO, overloaded", "meets SLO, keeps up", "meets SLO, overloaded"],
            "GPUs": [1, 1, 1],
            "$/M output tokens": [0.1, 0.5, 0.2],
            "SLO attainment": [0.0, 0.0, 0.0],
        },
        index=["cheap but behind", "ok", "behind"],
    )
    assert logic.best_config(table, "lowest $ per M output tokens") == "ok"
    none = table.assign(status="misses SLO, keeps up")
    assert logic.best_config(none, "highest SLO attainment") is None


def test_summary_table_leads_with_status_cost_and_why(two_results):
    _, _, results = two_results
    table = logic.summary_table(results, SLO(ttft_s=2.0))
    assert list(table.columns[: len(logic.LEAD_COLUMNS)]) == list(logic.LEAD_COLUMNS)
    assert not [c for c in table.columns if "(s)" in c or "_" in c]  # ms, and no snake_case
    assert table.loc["a", "status"] == "meets SLO, keeps up" and table.loc["a", "why"] == ""
    b = table.loc["b"]  # 8 sequences at a time: falls behind the offered rate
    assert b["status"] != "meets SLO, keeps up" and "req/s offered" in b["why"]
    assert b["served (req/s)"] < b["offered (req/s)"]


def test_config_status_names_the_missed_objective_in_ms():
    summary = {"num_requests": 10, "num_finished": 10, "ttft_p99_s": 3.21, "queue_mean_s": 0.0}
    load = load_verdict(summary, 5.0)
    status, why = logic.config_status(summary, load, logic.slo_objectives(SLO(ttft_s=2.0)))
    assert status == "misses SLO, keeps up" and why == "p99 TTFT 3,210 ms > 2,000 ms"
    assert logic.config_status(summary, load, ()) == ("keeps up", "")


def test_plan_pick_passes_over_a_best_that_falls_behind():
    from simulator.plan import Candidate, Option, PlanResult

    opt = Option("H100-SXM", 1, 16, 256, 16384)
    behind = {"num_requests": 100, "num_finished": 100, "queue_mean_s": 5.0}
    keeps = {**behind, "queue_mean_s": 0.0}
    best = Candidate(opt, "best", 3, behind)
    other = Candidate(Option("H200-SXM", 1, 16, 256, 16384), "feasible", 4, keeps)
    result = PlanResult(10.0, (), 8, [best, other], 2)
    pick, why = logic.plan_pick(result, 10.0)
    assert pick is other and "serves 5.0 of 10.0 req/s offered" in why
    assert logic.plan_pick(PlanResult(10.0, (), 8, [best], 1), 10.0)[0] is None
    ok = PlanResult(10.0, (), 8, [Candidate(opt, "best", 3, keeps)], 1)
    assert logic.plan_pick(ok, 10.0) == (ok.best, None)


def test_parse_int_list_names_the_field_and_the_item():
    assert logic.parse_int_list(" 128, 256 ,", "Max sequences per batch") == (128, 256)
    with pytest.raises(ValueError, match=r"Max sequences per batch: 'abc' is not a whole number"):
        logic.parse_int_list("128,abc", "Max sequences per batch")
    with pytest.raises(ValueError, match="positive"):
        logic.parse_int_list("0", "x")


def test_points_table_names_and_units():
    points = pd.DataFrame(
        {
            "label": ["a"],
            "meets_slo": [True],
            "cost_per_hour_usd": [1.0],
            "ttft_p99_s": [0.25],
            "load": ["keeps up"],
        }
    )
    out = logic.points_table(points)
    assert list(out.columns) == ["configuration", "meets SLO", "load", "$/h", "TTFT p99 (ms)"]
    assert out.loc[0, "TTFT p99 (ms)"] == 250 and out.loc[0, "meets SLO"] == "yes"


def test_repeat_candidates_are_runs_of_the_same_trace_and_configuration(tmp_path):
    import dash_samples

    replay = dash_samples.write_replay_run(tmp_path / "a")
    dash_samples.write_repeat_run(replay, tmp_path / "a-again")
    dash_samples.write_replay_run(tmp_path / "other-trace", num_requests=100)
    other = dash_samples.write_repeat_run(replay, tmp_path / "other-config")
    meta = json.loads((other / "run.json").read_text())
    (other / "run.json").write_text(json.dumps({**meta, "max_num_seqs": 8}))
    runs = logic.find_validation_runs(tmp_path)
    assert len([k for _, k in runs if k == logic.REPLAY]) == 4
    assert logic.repeat_candidates(replay, runs) == [tmp_path / "a-again"]
    assert logic.repeat_candidates(tmp_path / "other-trace", runs) == []


def test_validation_table_names_metrics_and_times_in_ms():
    table = validate.compare(
        {"throughput_rps": 2.0, "ttft_p50_s": 0.1, "tpot_mean_s": 0.02},
        {"throughput_rps": 2.1, "ttft_p50_s": 0.12, "tpot_mean_s": 0.02},
    )
    shown = logic.validation_table(table).set_index("metric")
    assert shown.loc["throughput (req/s)", "simulated"] == pytest.approx(2.1)
    assert shown.loc["TTFT p50 (ms)", "real"] == pytest.approx(100.0)
    assert shown.loc["TTFT p50 (ms)", "within target"] == "no"  # +20 % against 10 %
    assert shown.loc["TPOT mean (ms)", "within target"] == "yes"
    assert not [c for c in shown.columns if "_" in c]


@pytest.mark.parametrize(
    "text, says",
    [
        ("lognormal:abc", "Prompt lengths 'lognormal:abc': 'abc' is not a number"),
        ("128,abc", "Prompt lengths '128,abc': not a length spec"),
        ("uniform:5,1", "Prompt lengths 'uniform:5,1': uniform lengths need 1 <= low <= high"),
        ("empirical:nope", "Prompt lengths 'empirical:nope': nope: no such trace file"),
    ],
)
def test_generator_spec_errors_name_the_field(text, says):
    with pytest.raises(ValueError) as info:
        logic.generator_spec(num_requests=10, rate=1.0, prompt=text)
    assert str(info.value).startswith(says) and "could not convert" not in str(info.value)


def test_read_profile_json_rejects_what_is_not_a_profile(tmp_path, records):
    with pytest.raises(ValueError, match=r"p\.json: a latency profile is a JSON object .* holds a list"):
        logic.read_profile_json(b"[1, 2]", "p.json")
    with pytest.raises(ValueError, match=r"p\.json: not JSON"):
        logic.read_profile_json(b"{nope", "p.json")
    path = write_profile(tmp_path / "ok.json", records)
    assert logic.read_profile_json(path.read_bytes(), "ok.json").gpu == LatencyProfile.load(path).gpu


def test_all_zero_charts_carry_a_note():
    table = pd.DataFrame({"preemptions": [0, 0]}, index=["a", "b"])
    fig = figures.bar_figure(table, "preemptions", "Preemptions", figures.color_map(["a", "b"]))
    assert any("zero in every configuration" in a.text for a in fig.layout.annotations)
    some = figures.bar_figure(table.assign(preemptions=[0, 3]), "preemptions", "P", figures.color_map("ab"))
    assert not some.layout.annotations
    timeline = pd.DataFrame({"config": ["a"] * 3, "time_s": [0, 1, 2], "num_waiting": [0, 0, 0]})
    fig = figures.timeline_figure(timeline, "num_waiting", "Queue", "requests", {})
    assert any("zero throughout" in a.text for a in fig.layout.annotations)


def test_fixed_colours_for_verdicts_and_step_kinds():
    points = pd.DataFrame(
        {
            "label": ["x"],
            "meets_slo": [False],
            "cost_per_hour_usd": [1.0],
            "e2e_p99_s": [2.0],
            "pareto": [True],
        }
    )
    (trace,) = figures.pareto_figure(points, "e2e_p99_s", "E2E", None).data
    assert trace.name == "misses SLO" and trace.marker.color == figures.SLO_COLORS["misses SLO"]
    assert trace.x[0] == 2000.0  # ms
    res = pd.DataFrame(
        {"kind": ["mixed"], "total_num_scheduled_tokens": [10], "residual": [0.1], "num_seqs": [1]}
    ).assign(measured_s=1.0, predicted_s=1.1)
    assert figures.residual_figure(res).data[0].marker.color == figures.KIND_COLORS["mixed"]


def test_run_jobs_and_plan_points_report_progress(two_results):
    trace, jobs, _ = two_results
    calls = []
    logic.run_jobs(trace, jobs, on_done=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 2), (2, 2)]
    seen = []
    logic.run_plan(
        logic.plan_trace(trace, 60),
        MODEL,
        logic.LATENCY_ROOFLINE,
        logic.plan_objectives(5.0, None, None),
        rate=4.0,
        gpus=["H100-SXM"],
        tps=[1],
        block_sizes=[16],
        max_num_seqs=[256],
        max_num_batched_tokens=[16384],
        max_gpus=2,
        on_point=lambda row, done: seen.append((row["gpu"], done)),
    )
    assert seen and [d for _, d in seen] == list(range(1, len(seen) + 1))


def test_plan_command_is_what_kvplan_plan_reads():
    import shlex

    from simulator.cli import build_parser

    cmd = logic.plan_command(
        "azure_conv_2023",
        2000,
        "qwen3-8b",
        "auto",
        logic.plan_objectives(2.0, 0.08, None),
        60.0,
        ["H100-SXM", "H200-SXM"],
        [1, 2],
        [16],
        [128, 256],
        [16384],
        16,
        "least_outstanding",
        True,
    )
    args = build_parser().parse_args(shlex.split(cmd)[1:])
    assert (args.command, args.trace, args.limit, args.rate) == ("plan", "azure_conv_2023", 2000, 60.0)
    assert args.slo == "ttft_p99=2000ms,tpot_p99=80ms" and args.max_num_seqs == [128, 256]
    assert args.gpus == ["H100-SXM", "H200-SXM"] and args.tp == [1, 2] and args.mix_latency_models


def test_load_curve_and_its_knee(two_results):
    trace, jobs, _ = two_results
    runs = {}
    for mult in (0.5, 1.0, 4.0):
        t = traces.scale_rate(trace, factor=mult)
        runs[mult] = dict(zip(("a", "b"), logic.run_jobs(t, jobs)))
    curve = logic.load_curve(runs, SLO(ttft_s=2.0), "ttft_p99_s")
    assert len(curve) == 6 and set(curve["config"]) == {"a", "b"}
    a = curve[curve["config"] == "a"].sort_values("multiplier")
    assert a["offered_rps"].is_monotonic_increasing and a["latency_ms"].iloc[-1] > a["latency_ms"].iloc[0]
    knee = logic.knees(curve).set_index("config")
    assert knee.loc["a", "offered_rps"] >= a["offered_rps"].iloc[0]
    # the knee is the last qualifying point before the first that is not
    made_up = pd.DataFrame(
        {
            "config": ["x"] * 3,
            "offered_rps": [1.0, 2.0, 3.0],
            "latency_ms": [1.0, 2.0, 9.0],
            "qualifies": [True, False, True],
        }
    )
    assert logic.knees(made_up)["offered_rps"].tolist() == [1.0]
    assert logic.knees(made_up.assign(qualifies=False)).empty


def test_capacity_answer_is_kvplan_capacitys_search():
    trace = small_trace(120, rate_scale=1.0)
    config = logic.ConfigSpec("a").to_sim_config(resolve_model(MODEL), GPU)
    objectives = logic.plan_objectives(1.0, None, None)
    answer = logic.capacity_answer(trace, MODEL, logic.LATENCY_ROOFLINE, config, objectives, tolerance=0.2)
    assert answer.max_rate is not None and answer.max_rate > len(trace) / trace.duration_s
    assert answer.row["ttft_p99_s"] <= 1.0


def test_candidate_reason_in_the_pages_words():
    from simulator.plan import Candidate, Objective, Option, Violation, describe_violations

    failed = [Violation(Objective("ttft", "p99", 2.0), 2.3)]
    c = Candidate(Option("H100-SXM", 2, 16, 256, 16384), "infeasible", 4, {}, failed)
    c.reason = "fails with 4 replicas, the most max_gpus=8 allows: " + describe_violations(failed)
    assert logic.candidate_reason(c) == (
        "fails with 4 replicas, the most the GPU budget of 8 allows: p99 TTFT 2,300 ms > 2,000 ms"
    )


def test_candidate_reason_of_a_plan_candidate_that_falls_behind():
    """A plan's candidate infeasible for falling behind (`simulator.plan.failures`) reads as the
    what-if table says it: the verdict, then what it serves of what it is offered."""
    from simulator.plan import Candidate, Option, describe_violations, failures

    row = {"num_requests": 100, "num_finished": 100, "num_truncated": 0, "ttft_p99_s": 1.0}
    row |= {"queue_mean_s": 5.0, "arrival_span_s": 10.0}
    failed = failures(row, logic.slo_objectives(SLO(ttft_s=2.0)))
    assert [logic.describe_miss(v) for v in failed] == ["overloaded: serves 5.0 of 10.0 req/s offered"]
    c = Candidate(Option("H100-SXM", 1, 16, 256, 16384), "infeasible", 8, row, failed)
    c.reason = "fails with 8 replicas, the most max_gpus=8 allows: " + describe_violations(failed)
    assert logic.candidate_reason(c) == (
        "fails with 8 replicas, the most the GPU budget of 8 allows: overloaded: serves 5.0 of 10.0 req/s offered"
    )
    # The what-if status of the same run: the same rule, the same words.
    status, why = logic.config_status(row, load_verdict(row, 10.0), logic.slo_objectives(SLO(ttft_s=2.0)))
    assert (status, why) == ("meets SLO, overloaded", "serves 5.0 of 10.0 req/s offered")


def test_plain_number_has_no_scientific_notation():
    assert [logic.plain_number(v) for v in (1148.0, 9.914, 0.000294, 12345678.0, 0)] == [
        "1,148",
        "9.914",
        "0.0002940",
        "12,345,678",
        "0",
    ]


def test_tables_show_a_dash_not_none_for_missing_values():
    frame = pd.DataFrame({"a": [1.5, np.nan], "b": [1.0, 2.0], "c": ["x", None]})
    shown, left = logic.with_missing_shown(frame, {"a": "{:.2f}", "b": "{:.1f}"})
    assert shown["a"].tolist() == ["1.50", "–"] and shown["c"].tolist() == ["x", "–"]
    assert left == {"b": "{:.1f}"} and shown["b"].dtype == float
