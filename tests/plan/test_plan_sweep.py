"""Sweep execution: resume, atomic incremental output, invalid points recorded, and the same rows
inline, in a local process pool and on a local Ray instance."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from plan_helpers import SMALL_GEN

import simulator.sweep as sweep
from simulator.latency.gpus import GPUS_JSON
from simulator.sweep import SweepSpec, run_sweep

PRICES = {
    name: g["price_per_hour_usd"] for name, g in json.loads(Path(GPUS_JSON).read_text())["gpus"].items()
}
# Columns that measure the host, not the simulated system.
TIMING = ["wall_s", "sim_wall_s", "sim_speedup", "shared_run"]  # and how a row was made


def small_spec(grid: dict, **over) -> SweepSpec:
    raw = {"trace": {"generate": SMALL_GEN}, "model": "qwen3-0.6b", "profile": "roofline", "grid": grid}
    raw.update(over)
    return SweepSpec.from_dict(raw)


@pytest.fixture
def counted(monkeypatch):
    """Count (and optionally interrupt) the simulations a sweep runs in this process."""
    state = {"calls": 0, "fail_at": None}
    real = sweep.simulate_config

    def counting(*args, **kwargs):
        state["calls"] += 1
        if state["calls"] == state["fail_at"]:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep, "simulate_config", counting)
    return state


def test_resume_skips_points_already_in_the_output(tmp_path, counted):
    out = tmp_path / "r.parquet"
    spec = small_spec({"block_size": [16, 32], "policy": ["chunked", "prefill_first"]})
    rep = run_sweep(spec, out, workers=1, progress=False)
    assert counted["calls"] == 4 and (rep.num_run, rep.num_skipped, rep.num_errors) == (4, 0, 0)
    first = pd.read_parquet(out)
    assert len(first) == 4 and first["key"].is_unique

    rep = run_sweep(spec, out, workers=1, progress=False)
    assert counted["calls"] == 4 and (rep.num_run, rep.num_skipped) == (0, 4)
    pd.testing.assert_frame_equal(pd.read_parquet(out), first)

    bigger = small_spec({"block_size": [16, 32, 64], "policy": ["chunked", "prefill_first"]})
    rep = run_sweep(bigger, out, workers=1, progress=False)
    assert counted["calls"] == 6 and (rep.num_run, rep.num_skipped) == (2, 4)
    df = pd.read_parquet(out)
    assert len(df) == 6 and df["key"].tolist() == [bigger.point_key(p) for p in bigger.points()]
    kept = df[df["key"].isin(first["key"])].reset_index(drop=True)
    pd.testing.assert_frame_equal(kept[first.columns], first)  # earlier rows are kept as they were

    other_slo = small_spec({"block_size": [16]}, slo="ttft=1s")  # another SLO is another point
    run_sweep(other_slo, out, workers=1, progress=False)
    assert counted["calls"] == 7 and len(pd.read_parquet(out)) == 7


def test_an_interrupted_sweep_keeps_every_finished_point(tmp_path, counted):
    out = tmp_path / "r.parquet"
    spec = small_spec({"block_size": [16, 32, 64, 128, 256]})
    counted["fail_at"] = 3
    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec, out, workers=1, progress=False)
    assert len(pd.read_parquet(out)) == 2
    assert not list(tmp_path.glob(".*.tmp"))
    counted["fail_at"] = None
    rep = run_sweep(spec, out, workers=1, progress=False)
    assert (rep.num_run, rep.num_skipped) == (3, 2) and counted["calls"] == 6
    assert pd.read_parquet(out)["block_size"].tolist() == [16, 32, 64, 128, 256]


def test_invalid_points_are_recorded_not_raised(tmp_path, counted):
    out = tmp_path / "r.parquet"
    # Qwen3-8B has 32 heads (tp=3 does not divide them) and ~16 GB of weights (more than 30% of an L40S).
    spec = small_spec(
        {"gpu": ["L40S", "H200"], "tp": [1, 3], "gpu_memory_utilization": [0.3]},
        model="qwen3-8b",
        slo="ttft=2s",
    )
    rep = run_sweep(spec, out, workers=1, progress=False)
    assert rep.num_errors == 3 and len(rep.errors) == 3
    df = pd.read_parquet(out).set_index(["gpu", "tp"])
    errors = df["error_type"].fillna("").to_dict()
    assert errors == {
        ("L40S", 1): "ValueError",
        ("L40S", 3): "ValueError",
        ("H200", 1): "",
        ("H200", 3): "ValueError",
    }
    assert "does not fit on L40S" in df.loc[("L40S", 1), "error"]
    assert "3 does not divide num_heads 32" in df.loc[("H200", 3), "error"]
    ok = df.loc[("H200", 1)]
    assert ok["num_finished"] == SMALL_GEN["num_requests"] and ok["slo_met"] in (True, False)
    assert ok["cost_per_hour_usd"] == pytest.approx(PRICES["H200-SXM"])
    assert ok["cost_per_million_output_tokens_usd"] == pytest.approx(
        PRICES["H200-SXM"] / (ok["output_tok_s"] * 3600) * 1e6
    )
    assert pd.isna(df.loc[("L40S", 3), "ttft_p99_s"])
    calls = counted["calls"]
    assert run_sweep(spec, out, workers=1, progress=False).num_run == 0  # invalid configs are final
    assert counted["calls"] == calls


def test_failures_other_than_invalid_configs_are_retried(tmp_path, monkeypatch):
    out = tmp_path / "r.parquet"
    spec = small_spec({"block_size": [16, 32]})

    def broken(*args, **kwargs):
        raise RuntimeError("worker lost")

    real = sweep.simulate_config
    monkeypatch.setattr(sweep, "simulate_config", broken)
    assert run_sweep(spec, out, workers=1, progress=False).num_errors == 2
    assert pd.read_parquet(out)["error_type"].tolist() == ["RuntimeError", "RuntimeError"]
    assert pd.read_parquet(out)["error"].tolist() == ["worker lost", "worker lost"]
    monkeypatch.setattr(sweep, "simulate_config", real)
    rep = run_sweep(spec, out, workers=1, progress=False)
    assert (rep.num_run, rep.num_errors) == (2, 0)
    assert pd.read_parquet(out)["error"].isna().all()


def _rows(path):
    return pd.read_parquet(path).drop(columns=TIMING)


def test_a_process_pool_and_ray_give_the_same_rows_as_inline(tmp_path):
    grid = {"block_size": [16, 32], "replicas": [1, 2], "tp": [1, 3], "router": ["least_outstanding"]}
    spec = small_spec(grid, slo="ttft=50ms")
    run_sweep(spec, tmp_path / "inline.parquet", workers=1, progress=False)
    run_sweep(spec, tmp_path / "pool.parquet", workers=2, progress=False)
    inline = _rows(tmp_path / "inline.parquet")
    assert len(inline) == 8 and inline["error"].notna().sum() == 4
    pd.testing.assert_frame_equal(_rows(tmp_path / "pool.parquet"), inline)

    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        run_sweep(spec, tmp_path / "ray.parquet", ray_address="auto", progress=False)
    finally:
        ray.shutdown()
    pd.testing.assert_frame_equal(_rows(tmp_path / "ray.parquet"), inline)


def test_points_that_differ_in_limits_they_never_reach_share_a_run(tmp_path, counted, monkeypatch):
    """Points that differ only in capacity limits share one simulation where its run shows that
    they schedule alike (simulator/share.py), whatever runs them: their rows are their own runs'."""
    grid = {
        "block_size": [16, 32],
        "max_num_seqs": [1, 64, 128],
        "max_num_batched_tokens": [256, 4096],
        "num_kv_blocks": [20, None],
    }
    spec = small_spec(grid, slo="ttft=1s")
    num_points = len(spec.points())
    run_sweep(spec, tmp_path / "inline.parquet", workers=1, progress=False)
    shared_calls = counted["calls"]
    assert (shared_calls, num_points) == (14, 24)  # some points share, some limits bind
    assert int(pd.read_parquet(tmp_path / "inline.parquet")["shared_run"].sum()) == 10
    run_sweep(spec, tmp_path / "pool.parquet", workers=2, progress=False)
    monkeypatch.setattr(sweep.share, "shares_run", lambda *args: False)
    run_sweep(spec, tmp_path / "alone.parquet", workers=1, progress=False)
    assert counted["calls"] == shared_calls + num_points
    alone = _rows(tmp_path / "alone.parquet")
    assert alone["error"].isna().all()
    pd.testing.assert_frame_equal(_rows(tmp_path / "inline.parquet"), alone)
    pd.testing.assert_frame_equal(_rows(tmp_path / "pool.parquet"), alone)


def test_a_run_stands_only_for_points_of_its_own_trace_and_axes(counted):
    """`simulate_points` derives rows only for points that differ from the run's in capacity axes:
    one at another rate scale, or another block size, gets None (it must run alone). (It derives
    none without the prompts a PromptCache keeps: their first blocks' hashes decide.)"""
    spec = small_spec({"max_num_seqs": [64, 128]})
    ctx = spec.context()
    run, looser = spec.points()[1], spec.points()[0]
    others = [looser, {**looser, "rate_scale": 2.0}, {**looser, "block_size": 32}]
    rows = sweep.simulate_points(ctx, run, others, sweep.PromptCache())
    assert counted["calls"] == 1 and rows[0]["error"] is None
    assert rows[1] is not None and rows[1]["max_num_seqs"] == 64
    assert rows[2:] == [None, None]
    alone = sweep.simulate_point(ctx, looser)
    drop = set(TIMING)
    assert {k: v for k, v in rows[1].items() if k not in drop} == {
        k: v for k, v in alone.items() if k not in drop
    }


def test_share_plan_runs_the_loosest_limits_first_then_by_budget():
    points = [
        {"gpu": g, "max_num_seqs": m, "max_num_batched_tokens": b}
        for g in ("H100", "A100")
        for m in (64, 256)
        for b in (2048, 8192)
    ]
    plan = sweep.SharePlan(points)
    first = plan.take()
    assert first == [(3, [1, 2, 0]), (7, [5, 6, 4])]
    plan.done(first[0], [{}, None, None, None])  # its run stood for none of them: by budget
    assert plan.take() == [(1, []), (2, [0])]
    plan.done((2, [0]), [{}, None])  # one budget: what is left runs alone
    plan.done(first[1], [{}, {}, None, {}])
    assert plan.take() == [(0, []), (6, [])]
    assert not plan.ready


def test_points_sharing_prompts_give_the_same_rows(tmp_path):
    """A process keeps the trace's prompts between points (PromptCache): the rows equal those of
    points that build their own, rate-scaled points included."""
    spec = small_spec({"block_size": [16, 32], "max_num_seqs": [4, 64]})
    ctx = spec.context()
    cache = sweep.PromptCache()
    points = [{**p, "rate_scale": s} for p in spec.points() for s in (None, 3.0)]
    shared = [sweep.simulate_point(ctx, p, cache) for p in points]
    alone = [sweep.simulate_point(ctx, p) for p in points]
    drop = set(TIMING)
    assert [{k: v for k, v in r.items() if k not in drop} for r in shared] == [
        {k: v for k, v in r.items() if k not in drop} for r in alone
    ]
    assert all(r["error"] is None for r in shared)


def test_prompt_cache_keeps_small_vocabularies_within_its_budget(qwen06_config):
    from simulator.sim import trace_prompts

    trace = small_spec({}).trace.load()  # 60 requests of 200 tokens: 12,000 tokens
    cache = sweep.PromptCache()
    prompts = cache.get(trace, qwen06_config(block_size=16))
    assert prompts == trace_prompts(trace, 256) == trace.token_ids_many(0, 60, 256)
    assert len(prompts) == 60 and all(len(p) == 200 for p in prompts)
    assert cache.get(trace, qwen06_config(block_size=32)) is prompts  # same vocabulary: kept once
    assert cache.get(trace, qwen06_config(block_size=4)) is None  # the model's whole vocabulary
    assert sweep.PromptCache(max_tokens=11_999).get(trace, qwen06_config(block_size=16)) is None


def test_prompt_cache_finds_the_same_rows_in_another_trace_object(qwen06_config):
    """Keyed by request ids and prompt lengths: a copy of the trace (pickled to a worker, rate
    scaled) finds the prompts; other rows replace them; a trace with prefix ids is keyed by itself."""
    import pickle

    import traces

    config = qwen06_config(block_size=16)
    trace = small_spec({}).trace.load()
    cache = sweep.PromptCache()
    prompts = cache.get(trace, config)
    assert cache.get(pickle.loads(pickle.dumps(trace)), config) is prompts
    assert cache.get(traces.scale_rate(trace, factor=3.0), config) is prompts
    same_rows = traces.generate({**SMALL_GEN, "seed": 4})  # other arrivals, same ids and lengths
    assert cache.get(same_rows, config) is prompts
    other = traces.generate({**SMALL_GEN, "prompt": 150})
    assert cache.get(other, config) == other.token_ids_many(0, 60, 256) != prompts
    shared = traces.generate(
        num_requests=30,
        rate=5.0,
        seed=2,
        prompt=100,
        output=10,
        shared_prefix={"num_prefixes": 2, "prefix_len": 64},
    )
    assert shared.has_prefix_ids
    first = cache.get(shared, config)
    assert first == shared.token_ids_many(0, 30, 256)
    assert cache.get(shared, config) is first
    copy = pickle.loads(pickle.dumps(shared))
    assert cache.get(copy, config) == first and cache.get(copy, config) is not first


def test_simulate_checks_the_number_of_prompts(qwen06_config):
    from simulator.latency.roofline import RooflineModel
    from simulator.sim import simulate

    trace = small_spec({}).trace.load()
    config = qwen06_config(block_size=16)
    with pytest.raises(ValueError, match="prompts: 59 given for a trace of 60 requests"):
        simulate(trace, config, RooflineModel(config.model, config.gpu), 1000, prompts=[[1]] * 59)


@pytest.fixture
def qwen06_config():
    from simulator.config import SimConfig
    from simulator.models import resolve_model

    def make(**kw):
        return SimConfig(model=resolve_model("qwen3-0.6b"), **kw)

    return make


def test_async_scheduling_is_an_axis_only_where_the_grid_names_it(tmp_path):
    """`async_scheduling` (added after sweeps were written) is in a point only when the grid names
    it, so earlier specs keep their points and resume keys. With profile auto, the async points take
    the shipped `_async` profile (Qwen3-0.6B, H200, block 16) and count their overlapped steps."""
    plain = small_spec({"block_size": [16]})
    assert "async_scheduling" not in plain.points()[0]
    both = small_spec({"block_size": [16], "async_scheduling": [False, True]}, profile="auto")
    points = both.points()
    assert [p["async_scheduling"] for p in points] == [False, True]
    assert both.point_key({k: v for k, v in points[0].items() if k != "async_scheduling"}) != both.point_key(
        points[0]
    )
    out = tmp_path / "a.parquet"
    assert run_sweep(both, out, workers=1, progress=False).num_errors == 0
    df = pd.read_parquet(out).set_index("async_scheduling")
    assert df.loc[False, "profile_used"].endswith("qwen3-0.6b_h200_tp1_bs16.json")
    assert df.loc[True, "profile_used"].endswith("qwen3-0.6b_h200_tp1_bs16_async.json")
    assert df.loc[True, "sim_overlapped_steps"] > 0 and pd.isna(df.loc[False, "sim_overlapped_steps"])
    with pytest.raises(ValueError, match="grid.async_scheduling: 'yes' is not a bool"):
        small_spec({"async_scheduling": ["yes"]})
