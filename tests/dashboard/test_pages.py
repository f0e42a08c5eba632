"""AppTest smoke tests, one or more per dashboard page: each runs the page, changes widgets, and
checks that figures and tables update and that no exception is shown."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("streamlit")
pytest.importorskip("plotly")
from dash_apptest import app_on, button, charts, frame, no_exceptions, texts
from dash_samples import step_records

from dashboard import figures

# ---- Traffic ----------------------------------------------------------------------------------------


def test_traffic_shipped_trace_and_widgets():
    at = app_on("traffic")
    no_exceptions(at)
    first = charts(at)
    assert {"traffic_rate_chart", "traffic_prompt_chart", "traffic_output_chart"} <= set(first)
    assert at.metric[0].value == "19,366"
    at.selectbox(key="traffic_shipped").set_value("mooncake_synthetic").run()
    no_exceptions(at)
    second = charts(at)
    assert at.metric[0].value != "19,366"
    assert second["traffic_rate_chart"]["data"] != first["traffic_rate_chart"]["data"]
    assert second["traffic_reuse_chart"]["data"]  # Mooncake carries prefix ids: a reuse curve
    assert "traffic_reuse_chart" not in first  # Azure does not: a caption says so
    assert any(m.label == "Prefix token reuse" for m in at.metric)
    assert first["traffic_prompt_chart"]["layout"]["xaxis"]["type"] == "log"
    at.toggle(key="traffic_log").set_value(False).run()
    assert charts(at)["traffic_prompt_chart"]["layout"]["xaxis"].get("type", "linear") == "linear"
    assert at.session_state["kvplan_active_trace"] == "shipped:mooncake_synthetic"


def test_traffic_upload_malformed_shows_the_loader_error():
    at = app_on("traffic")
    at.radio(key="traffic_source").set_value("Upload a file").run()
    assert any("Upload a trace" in t for t in texts(at.info))
    bad = b"arrival_s,prompt_len,output_len\n0.0,100,20\n0.5,-3,30\n"
    at.file_uploader(key="traffic_upload").set_value(("broken.csv", bad, "text/csv")).run()
    no_exceptions(at)
    errors = texts(at.error)
    assert len(errors) == 1 and "broken.csv" in errors[0] and "prompt_len" in errors[0]
    assert "Traceback" not in errors[0]
    good = b"arrival_s,prompt_len,output_len\n" + b"".join(b"%d.0,%d,20\n" % (i, 100 + i) for i in range(50))
    at.file_uploader(key="traffic_upload").set_value(("good.csv", good, "text/csv")).run()
    no_exceptions(at)
    assert not at.error and at.metric[0].value == "50"
    assert at.session_state["kvplan_active_trace"].startswith("uploaded:")


def test_traffic_generate():
    at = app_on("traffic")
    at.radio(key="traffic_source").set_value("Generate").run()
    at.number_input(key="gen_num").set_value(500)
    at.number_input(key="gen_prefixes").set_value(4)
    button(at, "Generate").click().run()
    no_exceptions(at)
    assert at.metric[0].value == "500"
    assert charts(at)["traffic_reuse_chart"]["data"]
    at.text_input(key="gen_prompt").set_value("nonsense:1")
    button(at, "Generate").click().run()
    no_exceptions(at)
    assert any("Could not generate" in t for t in texts(at.error))
    for text, says in (
        ("lognormal:abc", "Prompt lengths 'lognormal:abc': 'abc' is not a number"),
        ("empirical:nope", "Prompt lengths 'empirical:nope': nope: no such trace file"),
    ):
        at.text_input(key="gen_prompt").set_value(text)
        button(at, "Generate").click().run()
        no_exceptions(at)
        assert any(says in t for t in texts(at.error)), texts(at.error)


# ---- What-if --------------------------------------------------------------------------------------------


def test_whatif_compares_and_updates():
    at = app_on("whatif", wi_window=30.0)
    no_exceptions(at)
    table = frame(at, "TTFT p99 (ms)")
    assert list(table.index) == ["A: default", "B: block 256", "C: small batch", "D: 2 replicas"]
    assert table.loc["D: 2 replicas", "GPUs"] == 2
    assert any("Best by lowest p99 TTFT" in t for t in texts(at.success))
    first = charts(at)
    assert {"wi_cdf_ttft_s", "wi_cdf_tpot_s", "wi_cdf_e2e_s"} <= set(first)
    assert len(first["wi_cdf_e2e_s"]["data"]) == 4
    # Change configuration C and compare again: its row and curves change.
    at.number_input(key="wi_seqs_2").set_value(4)
    button(at, "Compare").click().run()
    no_exceptions(at)
    table2 = frame(at, "TTFT p99 (ms)")
    assert table2.loc["C: small batch", "max seqs"] == 4
    assert table2.loc["C: small batch", "E2E p99 (ms)"] != table.loc["C: small batch", "E2E p99 (ms)"]
    assert charts(at)["wi_cdf_e2e_s"]["data"][2] != first["wi_cdf_e2e_s"]["data"][2]
    # The other chart views.
    at.radio(key="wi_view").set_value("Throughput, KV and queues").run()
    no_exceptions(at)
    views = charts(at)
    assert {"wi_tput", "wi_kv", "wi_queue", "wi_running"} <= set(views) and "wi_cdf_e2e_s" not in views
    assert len(views["wi_kv"]["data"]) == 4
    at.radio(key="wi_view").set_value("Preemptions and prefix hits").run()
    assert {"wi_preempt", "wi_hits"} <= set(charts(at))
    # A different objective picks (and says) its own best.
    at.selectbox(key="wi_objective").set_value("highest output tok/s").run()
    assert any("Best by highest output tok/s" in t for t in texts(at.success))


def test_whatif_two_configs_other_model_and_trace():
    at = app_on("whatif", wi_window=20.0, wi_n=2)
    no_exceptions(at)
    assert len(frame(at, "TTFT p99 (ms)")) == 2
    at.selectbox(key="wi_tp_1").set_value(8)
    at.selectbox(key="wi_model").set_value("qwen3-0.6b")
    button(at, "Compare").click().run()
    no_exceptions(at)
    table = frame(at, "TTFT p99 (ms)")
    assert table["TP"].tolist() == [1, 8] and table["GPUs"].tolist() == [1, 8]
    at.selectbox(key="wi_trace").set_value("shipped:mooncake_synthetic")
    at.number_input(key="wi_window").set_value(60.0)
    button(at, "Compare").click().run()
    no_exceptions(at)
    assert (frame(at, "prefix hit rate")["prefix hit rate"] > 0).all()  # Mooncake shares prefixes
    assert any("mooncake_synthetic" in t for t in texts(at.caption))


def test_whatif_latency_against_load():
    """The load view simulates only on its button, then draws each configuration's p99 against the
    offered rate with its knee, and a table of the knee and kvplan capacity's rate."""
    at = app_on("whatif", wi_window=10.0, wi_n=2, wi_view="Latency against load")
    no_exceptions(at)
    assert "wi_load_curve" not in charts(at)
    assert any("Draw the load curves" in t for t in texts(at.info))
    button(at, "Draw the load curves").click().run()
    no_exceptions(at)
    curve = charts(at)["wi_load_curve"]
    lines = [t for t in curve["data"] if t.get("mode") == "lines+markers"]
    assert len(lines) == 2 and len(lines[0]["marker"]["symbol"]) == 6  # one marker per rate
    assert any(t["name"].startswith("knee") for t in curve["data"])
    table = frame(at, "kvplan capacity (req/s)")
    assert list(table["config"]) == ["A: default", "B: block 256"]
    assert (table["kvplan capacity (req/s)"] > 0).all()


def test_whatif_async_scheduling_takes_the_async_profile():
    """The async toggle simulates the engine's async loop on the shipped `_async` profile (Qwen3-0.6B,
    block 16): decode steps scheduled ahead skip the host's time, so TPOT p50 drops."""
    at = app_on("whatif", wi_window=20.0, wi_n=1, wi_model="qwen3-0.6b")
    no_exceptions(at)
    before = frame(at, "TPOT p50 (ms)").iloc[0]["TPOT p50 (ms)"]
    at.toggle(key="wi_async").set_value(True)
    button(at, "Compare").click().run()
    no_exceptions(at)
    after = frame(at, "TPOT p50 (ms)").iloc[0]["TPOT p50 (ms)"]
    assert after < 0.9 * before, (before, after)


# ---- Capacity plan --------------------------------------------------------------------------------------


def test_capacity_plan():
    at = app_on("capacity")
    no_exceptions(at)
    assert any("press **Plan**" in t for t in texts(at.info))
    at.number_input(key="cap_requests").set_value(120)
    at.number_input(key="cap_rate").set_value(6.0)
    button(at, "Plan").click().run()
    no_exceptions(at)
    assert any("Recommended" in t for t in texts(at.success)), texts(at.warning)
    cands = frame(at, "why")
    assert cands.iloc[0]["status"] == "best" and len(cands) == 4
    assert list(cands.columns[:4]) == ["status", "configuration", "$/h", "$/M output tokens"]
    (bar,) = at.get("progress")  # at the top of the results, done
    assert bar.proto.value == 100 and "simulations in" in bar.proto.text
    (command,) = [c.value for c in at.code if c.value.startswith("kvplan plan")]
    assert "--limit 120 --rate 6 --slo ttft_p99=2000ms,tpot_p99=80ms" in command
    assert any(e.label == "What these numbers mean" for e in at.expander)
    pareto = charts(at)["cap_pareto"]
    assert any(t.get("name") == "recommended" for t in pareto["data"])
    assert "E2E" in pareto["layout"]["xaxis"]["title"]["text"]
    at.radio(key="cap_pareto_metric").set_value("TTFT").run()
    assert "TTFT" in charts(at)["cap_pareto"]["layout"]["xaxis"]["title"]["text"]
    # Impossible objectives: a warning with the closest miss, no exception.
    at.number_input(key="cap_ttft").set_value(1.0)
    at.number_input(key="cap_max_gpus").set_value(2)
    button(at, "Plan").click().run()
    no_exceptions(at)
    assert any("No configuration meets" in t for t in texts(at.warning))
    reasons = frame(at, "why")["why"]
    assert any("p99 TTFT" in r for r in reasons) and not any("_p99" in r or "max_gpus" in r for r in reasons)


def test_capacity_plan_compares_like_with_like_unless_mixed():
    at = app_on("capacity")
    at.number_input(key="cap_requests").set_value(100)
    at.number_input(key="cap_rate").set_value(6.0)
    at.multiselect(key="cap_tps").set_value([1])
    button(at, "Plan").click().run()
    no_exceptions(at)
    assert any(
        "every option was simulated on the transferred model, to compare like with like" in t
        for t in texts(at.info)
    )
    assert set(frame(at, "why")["latency model"]) == {"transferred transfer_h200.json"}
    assert not any("different latency models" in t for t in texts(at.warning))
    at.toggle(key="cap_mix").set_value(True)
    button(at, "Plan").click().run()
    no_exceptions(at)
    assert any("different latency models" in t for t in texts(at.warning))
    assert "fitted qwen3-8b_h200_tp1_bs16.json" in set(frame(at, "why")["latency model"])


def test_capacity_plan_simulates_a_fixed_number_of_requests():
    """The candidates simulate the trace's first N requests rescaled to the rate: as many at 30
    req/s as at 6 req/s, over a shorter time; the caption says how many and how long, and a warning
    says that a p99 of 150 requests is the 2nd-worst one."""
    at = app_on("capacity")
    at.number_input(key="cap_requests").set_value(150)
    at.multiselect(key="cap_tps").set_value([1])
    for rate, seconds in ((6.0, "25.0 s of arrivals"), (30.0, "5.0 s of arrivals")):
        at.number_input(key="cap_rate").set_value(rate)
        button(at, "Plan").click().run()
        no_exceptions(at)
        caption = next(t for t in texts(at.caption) if "Each candidate simulated" in t)
        assert "150 requests" in caption and seconds in caption, caption
        assert any("2nd-worst request" in t for t in texts(at.warning))
    assert "load" in frame(at, "why") and "served (req/s)" in frame(at, "why")


def test_capacity_plan_located_error_for_a_bad_batch_limit():
    at = app_on("capacity")
    at.text_input(key="cap_seqs").set_value("128,abc")
    button(at, "Plan").click().run()
    no_exceptions(at)
    (error,) = texts(at.error)
    assert "Max sequences per batch: 'abc' is not a whole number" in error
    assert "invalid literal" not in error


def test_capacity_plan_stays_until_the_next_click():
    """A plan shown stays on the page without re-planning: leaving for another page and coming back
    shows the same plan, with the form as it was, and plans nothing until Plan is pressed."""
    at = app_on("capacity")
    at.number_input(key="cap_requests").set_value(100)
    at.number_input(key="cap_rate").set_value(5.0)
    at.multiselect(key="cap_tps").set_value([1])
    button(at, "Plan").click().run()
    no_exceptions(at)
    shown = at.session_state["cap_result"]
    at.switch_page("app_pages/traffic.py").run()
    no_exceptions(at)
    at.switch_page("app_pages/capacity.py").run()
    no_exceptions(at)
    assert at.number_input(key="cap_rate").value == 5.0 and at.number_input(key="cap_requests").value == 100
    assert at.multiselect(key="cap_tps").value == [1]
    assert at.session_state["cap_result"] is shown  # the same plan, not planned again
    assert any("Recommended" in t for t in texts(at.success))


def test_whatif_simulates_only_on_compare():
    """A new window or rate scale changes nothing until Compare is pressed (a whole trace can take
    a minute per configuration)."""
    at = app_on("whatif", wi_window=10.0, wi_n=1)
    before = frame(at, "status")["served (req/s)"].iloc[0]
    at.number_input(key="wi_rate").set_value(1.0).run()
    no_exceptions(at)
    assert frame(at, "status")["served (req/s)"].iloc[0] == before
    at.number_input(key="wi_rate").set_value(1.0)  # (a run without the submit reset the form's value)
    button(at, "Compare").click().run()
    assert frame(at, "status")["served (req/s)"].iloc[0] < before / 2


def test_whatif_keeps_its_settings_across_pages():
    at = app_on("whatif", wi_window=20.0, wi_n=2)
    at.number_input(key="wi_rate").set_value(2.0)
    at.number_input(key="wi_seqs_1").set_value(32)
    button(at, "Compare").click().run()
    no_exceptions(at)
    at.switch_page("app_pages/capacity.py").run()
    at.switch_page("app_pages/whatif.py").run()
    no_exceptions(at)
    assert at.number_input(key="wi_rate").value == 2.0 and at.number_input(key="wi_seqs_1").value == 32
    assert frame(at, "status").iloc[1]["max seqs"] == 32


def test_whatif_best_only_among_configurations_that_keep_up():
    """A configuration of 2 sequences at a time has the lowest TPOT but falls far behind the offered
    rate: it is not called best, and its status and why say so; with objectives nothing meets, no
    configuration is best and a warning says none meets the SLO and keeps up."""
    at = app_on("whatif", wi_window=20.0, wi_n=2, wi_objective="lowest p99 TPOT")
    at.number_input(key="wi_seqs_1").set_value(2)
    button(at, "Compare").click().run()
    no_exceptions(at)
    table = frame(at, "status")
    throttled = table.iloc[1]
    assert throttled["TPOT p99 (ms)"] < table.iloc[0]["TPOT p99 (ms)"]
    assert "overloaded" in throttled["status"] and "req/s offered" in throttled["why"]
    assert any("Best by lowest p99 TPOT: **A: default**" in t for t in texts(at.success))
    at.number_input(key="wi_slo_ttft").set_value(1.0).run()  # 1 ms: nothing meets it
    no_exceptions(at)
    assert not at.success
    assert any("No configuration meets the SLO and keeps up" in t for t in texts(at.warning))


def test_capacity_rejects_no_objective():
    at = app_on("capacity")
    at.number_input(key="cap_ttft").set_value(0.0)
    at.number_input(key="cap_tpot").set_value(0.0)
    button(at, "Plan").click().run()
    no_exceptions(at)
    assert any("at least one latency objective" in t for t in texts(at.error))


# ---- Sim vs real ----------------------------------------------------------------------------------------


def test_validation_empty_state(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPLAN_VALIDATION_DIR", str(tmp_path))
    at = app_on("validation")
    no_exceptions(at)
    assert any("No validation runs found" in t for t in texts(at.info))


def test_validation_runs(validation_root, monkeypatch):
    monkeypatch.setenv("KVPLAN_VALIDATION_DIR", str(validation_root))
    at = app_on("validation")
    no_exceptions(at)
    assert frame(at, "error")["metric"].iloc[0] == "throughput (req/s)"
    shown = frame(at, "error")
    assert not shown.isna().any().any() and "–" in set(shown["target"])  # no None where there is no target
    first = charts(at)
    assert {"val_errors", "val_scatter", "val_residuals"} <= set(first)
    at.radio(key="val_metric").set_value("E2E").run()
    assert charts(at)["val_scatter"]["data"][0]["x"] != first["val_scatter"]["data"][0]["x"]
    # The replay folder is re-simulated (roofline without a profile; residuals against it).
    replay = next(o for o in at.selectbox(key="val_run").options if "replay" in o)
    at.selectbox(key="val_run").set_value(replay).run()
    no_exceptions(at)
    assert frame(at, "error")["error"].abs().max() > 0.01
    assert "val_residuals" in charts(at)
    # With the fitted profile beside the pair run, the re-simulation matches the "real" run closely.
    assert at.selectbox(key="val_profile").value == "roofline / none"  # an option, not a placeholder
    profile = next(o for o in at.selectbox(key="val_profile").options if o.endswith("profile.json"))
    at.selectbox(key="val_profile").set_value(profile).run()
    no_exceptions(at)
    assert frame(at, "error").set_index("metric").loc["E2E p50 (ms)", "error"] == pytest.approx(0, abs=0.05)


def test_validation_picks_the_profile_of_a_shipped_replays_engine(monkeypatch):
    """On the shipped H200 replays, a run opens with the profile of the engine that served it: the
    `_async` one for an async-scheduling replay (azure_code's 12x window, a replay of the engine before
    whole-step graphs, on that engine's, then meets all 7 targets), the synchronous one
    for the synchronous replays, and the roofline for a run whose run.json names no decode kernel."""
    from simulator.defaults import SHIPPED_PROFILE_DIR

    runs = SHIPPED_PROFILE_DIR.parent / "data" / "validation"
    monkeypatch.setenv("KVPLAN_VALIDATION_DIR", str(runs))
    at = app_on("validation")
    expected = {
        "h200_qwen3-0.6b_bs16_async_azure-code_x12": str(
            SHIPPED_PROFILE_DIR / "superseded" / "qwen3-0.6b_h200_tp1_bs16_async_2026-12-02_1222.json"
        ),  # a replay of the engine before whole-step graphs: the profile of that engine
        "h200_qwen3-0.6b_bs16_async_sg_azure-conv_x1": str(
            SHIPPED_PROFILE_DIR / "superseded" / "qwen3-0.6b_h200_tp1_bs16_async_2026-12-03_1453.json"
        ),  # before kept block-table rows
        "h200_qwen3-0.6b_bs16_async_tr_azure-conv_x1": str(
            SHIPPED_PROFILE_DIR / "superseded" / "qwen3-0.6b_h200_tp1_bs16_async_2026-12-04_0121.json"
        ),  # before the block tables' device copy
        "h200_qwen3-0.6b_bs16_async_dc_azure-conv_x1": str(
            SHIPPED_PROFILE_DIR / "qwen3-0.6b_h200_tp1_bs16_async.json"
        ),
        "h200_qwen3-0.6b_bs256_light": str(
            SHIPPED_PROFILE_DIR / "superseded" / "qwen3-0.6b_h200_tp1_bs256_2026-12-02_0721.json"
        ),
        "h200_qwen3-0.6b_bs256_sg_azure-conv_x8": str(SHIPPED_PROFILE_DIR / "qwen3-0.6b_h200_tp1_bs256.json"),
        "h200_qwen3-8b_bs16_async_x3": str(
            SHIPPED_PROFILE_DIR / "superseded" / "qwen3-8b_h200_tp1_bs16_async_2026-12-02_0721.json"
        ),
        "h200_qwen3-8b_bs16_async_sg_azure-conv_x1": str(
            SHIPPED_PROFILE_DIR / "qwen3-8b_h200_tp1_bs16_async.json"
        ),
        "h200_qwen3-0.6b_bs16_fa4decode_light": "roofline / none",
    }
    for run, profile in expected.items():
        at.selectbox(key="val_run").set_value(str(runs / run)).run()
        no_exceptions(at)
        assert at.selectbox(key="val_profile").value == profile, run
    at.selectbox(key="val_run").set_value(str(runs / "h200_qwen3-0.6b_bs16_async_azure-code_x12")).run()
    assert any("7 of 7 targeted metrics" in t for t in texts(at.success)), texts(at.warning)


def test_validation_repeat_run(validation_root, monkeypatch):
    """A replay and the same replay served again 10 ms later: the real-vs-real column appears."""
    monkeypatch.setenv("KVPLAN_VALIDATION_DIR", str(validation_root))
    at = app_on("validation")
    replay = str(validation_root / "replay-run")
    at.selectbox(key="val_run").set_value(replay).run()
    no_exceptions(at)
    assert "real vs real" not in frame(at, "error")
    repeat = at.selectbox(key="val_repeat")
    assert repeat.options == ["none", f"replay-run-again — {'replay folder (re-simulated here)'}"]
    repeat.set_value(str(validation_root / "replay-run-again")).run()
    no_exceptions(at)
    table = frame(at, "error").set_index("metric")
    real = table.loc["TTFT p50 (ms)", "real"]
    assert table.loc["TTFT p50 (ms)", "repeat"] == pytest.approx(real + 10.0, abs=1e-6)  # 10 ms later
    assert table.loc["TTFT p50 (ms)", "real vs real"] == pytest.approx(10.0 / real, rel=1e-6)


def test_validation_a_repeat_that_fails_to_load_keeps_the_run(tmp_path, monkeypatch):
    """A repeat run whose requests cannot be read: an error says so, and the run is still shown."""
    import dash_samples

    replay = dash_samples.write_replay_run(tmp_path / "replay-run")
    bad = dash_samples.write_repeat_run(replay, tmp_path / "replay-broken")
    (bad / "requests.parquet").write_bytes(b"not parquet")
    monkeypatch.setenv("KVPLAN_VALIDATION_DIR", str(tmp_path))
    at = app_on("validation")
    at.selectbox(key="val_run").set_value(str(replay)).run()
    at.selectbox(key="val_repeat").set_value(str(bad)).run()
    no_exceptions(at)
    assert any("Cannot compare with this repeat run" in t for t in texts(at.error))
    assert "real vs real" not in frame(at, "error") and len(frame(at, "error")) > 5
    assert "val_scatter" in charts(at)


# ---- Engine profile -------------------------------------------------------------------------------------


def test_profile_roofline_then_step_records():
    at = app_on("profile")
    no_exceptions(at)
    assert {"prof_decode", "prof_prefill", "prof_breakdown"} <= set(charts(at))
    assert any("Upload step records" in t for t in texts(at.info))
    at.selectbox(key="prof_source").set_value("roofline (no profile)…").run()
    no_exceptions(at)
    first = charts(at)
    at.selectbox(key="prof_tp").set_value(2).run()
    no_exceptions(at)
    assert charts(at)["prof_decode"]["data"][0]["y"] != first["prof_decode"]["data"][0]["y"]
    data = step_records(300).to_csv(index=False).encode()
    at.file_uploader(key="prof_records").set_value(("steps.csv", data, "text/csv")).run()
    no_exceptions(at)
    assert at.selectbox(key="prof_source").value == "fit on the uploaded step records"
    coef = frame(at, "µs per unit")
    assert set(coef["fit"]) == {"decode", "prefill"}
    res = frame(at, "median |rel. error|")
    assert (res["median |rel. error|"] < 0.2).all()
    assert any(t.get("name") == "measured steps" for t in charts(at)["prof_decode"]["data"])
    # The records against the roofline they were not fitted on: residuals still shown.
    at.selectbox(key="prof_source").set_value("roofline (no profile)…").run()
    no_exceptions(at)
    assert "prof_residuals" in charts(at)


def test_profile_tiles_and_coefficients_read_plainly():
    import pyarrow as pa

    at = app_on("profile")
    no_exceptions(at)
    values = [m.value for m in at.metric]
    assert "wall time" in values and not any(v in ("None", "?") or "_" in v for v in values)
    (table,) = [el for el in at.dataframe if "µs per unit" in el.value.columns]
    shown = pa.ipc.open_stream(table.proto.arrow_data.styler.display_values).read_all().to_pandas()
    assert shown["µs per unit"].iloc[0] == "1,047" and not shown["µs per unit"].str.contains("e-").any()


def test_profile_bad_uploads_are_errors():
    at = app_on("profile")
    at.file_uploader(key="prof_records").set_value(("x.csv", b"a,b\n1,2\n", "text/csv")).run()
    no_exceptions(at)
    assert any("not step records" in t for t in texts(at.error))
    at.selectbox(key="prof_source").set_value("upload a profile JSON…").run()
    at.file_uploader(key="prof_upload").set_value(("p.json", b'{"format": "nope"}', "application/json")).run()
    no_exceptions(at)
    assert any("not a latency profile" in t for t in texts(at.error))
    at.file_uploader(key="prof_upload").set_value(("list.json", b"[1, 2]", "application/json")).run()
    no_exceptions(at)
    assert any("list.json: a latency profile is a JSON object" in t for t in texts(at.error))


@pytest.mark.parametrize("page", ["traffic", "whatif", "capacity", "validation", "profile"])
def test_every_page_renders(page):
    at = app_on(page, wi_window=10.0)
    no_exceptions(at)
    assert at.title[0].value
    for chart in at.get("plotly_chart"):  # no modebar over the charts' titles
        assert json.loads(chart.proto.config)["displayModeBar"] is False


def test_whatif_colours_follow_the_form_not_the_results():
    """Configuration C keeps the colour of its form column when B cannot run (a fitted profile of
    block 16 does not apply to B's block 256), as it does when every configuration runs."""
    from simulator.defaults import SHIPPED_PROFILE_DIR

    profile = str(SHIPPED_PROFILE_DIR / "qwen3-8b_h200_tp1_bs16.json")
    at = app_on("whatif", wi_window=10.0, wi_latency=profile)
    no_exceptions(at)
    assert any(t.startswith("B: block 256") for t in texts(at.error))
    lines = {t["name"]: t["line"]["color"] for t in charts(at)["wi_cdf_e2e_s"]["data"] if "line" in t}
    assert lines["C: small batch"] == figures.PALETTE[2] and lines["D: 2 replicas"] == figures.PALETTE[3]
