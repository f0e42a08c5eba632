"""A replay is priced on a profile of its own engine (simulator.defaults.profile_of_engine): where the
shipped profile records other engine choices, the newest superseded one of the same name that matches."""

from __future__ import annotations

import json
from pathlib import Path

from simulator.defaults import SHIPPED_PROFILE_DIR, profile_of_engine
from simulator.validate import validate_profile

VALIDATION = Path(__file__).resolve().parents[2] / "simulator" / "data" / "validation"


def _profile(path: Path, created: str, **extra) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"created": created, "extra": extra}))
    return path


def test_the_newest_superseded_profile_of_the_replays_engine(tmp_path):
    shipped = _profile(tmp_path / "m_bs16.json", "2026-12-02T18:00:00+00:00", step_graphs=True)
    old = tmp_path / "superseded"
    _profile(old / "m_bs16_2026-11-30.json", "2026-11-30T10:00:00+00:00")
    newest = _profile(old / "m_bs16_2026-12-02_1222.json", "2026-12-02T12:22:00+00:00", step_graphs=False)
    _profile(old / "m_bs16_async_2026-12-02.json", "2026-12-02T13:00:00+00:00")  # another name
    _profile(old / "m_bs16_2026-12-02_1700.json", "2026-12-02T17:00:00+00:00", step_graphs=True)
    assert profile_of_engine(shipped, {"step_graphs": True}) == shipped
    assert profile_of_engine(shipped, {}) == newest  # a replay from before the choice existed
    assert profile_of_engine(shipped, {"step_graphs": False}) == newest
    assert profile_of_engine(newest, {"step_graphs": False}) == newest
    lone = _profile(tmp_path / "n_bs16.json", "2026-12-02T18:00:00+00:00", step_graphs=True)
    assert profile_of_engine(lone, {}) == lone  # nothing matches: the shipped one


def test_every_engine_choice_must_match(tmp_path):
    """Whole-step graphs and kept block-table rows: a replay of graphs without rows is priced on the
    newest fit recorded so, not on one of neither or of both."""
    shipped = _profile(
        tmp_path / "m_bs16.json", "2026-12-04T01:23:00+00:00", step_graphs=True, table_rows=True
    )
    old = tmp_path / "superseded"
    graphs = _profile(old / "m_bs16_2026-12-03_1453.json", "2026-12-03T14:53:00+00:00", step_graphs=True)
    _profile(old / "m_bs16_2026-12-02_1222.json", "2026-12-02T12:22:00+00:00")
    assert profile_of_engine(shipped, {"step_graphs": True, "table_rows": True}) == shipped
    assert profile_of_engine(shipped, {"step_graphs": True}) == graphs
    assert profile_of_engine(shipped, {"step_graphs": True, "table_rows": False}) == graphs


def test_validate_auto_pairs_replays_with_their_engines_profile():
    pairs = {
        "h200_qwen3-0.6b_bs16_azure-conv_x4b": "superseded/qwen3-0.6b_h200_tp1_bs16_2026-12-02_1222.json",
        "h200_qwen3-0.6b_bs16_async_azure-conv_x4b": "superseded/qwen3-0.6b_h200_tp1_bs16_async_2026-12-02_1222.json",
        "h200_qwen3-0.6b_bs16_sg_azure-conv_x1": "superseded/qwen3-0.6b_h200_tp1_bs16_2026-12-03_1216.json",
        # the engine with the tables' device copy: the block-16 sync fit served beside it
        "h200_qwen3-0.6b_bs16_dt_azure-conv_x1": "qwen3-0.6b_h200_tp1_bs16.json",
        # the engine before kept block-table rows: the block-16 async fit it was served beside
        "h200_qwen3-0.6b_bs16_async_sg_azure-conv_x1": "superseded/qwen3-0.6b_h200_tp1_bs16_async_2026-12-03_1453.json",
        # the engine with kept rows and no device copy: its block-16 async fit, superseded since
        "h200_qwen3-0.6b_bs16_async_tr_azure-conv_x1": "superseded/qwen3-0.6b_h200_tp1_bs16_async_2026-12-04_0121.json",
        "h200_qwen3-0.6b_bs16_async_dc_azure-conv_x1": "qwen3-0.6b_h200_tp1_bs16_async.json",
        "h200_qwen3-0.6b_bs256_async_azure-conv_x4b": "superseded/qwen3-0.6b_h200_tp1_bs256_async_2026-12-02_1222.json",
        "h200_qwen3-0.6b_bs256_async_sg_azure-conv_x8": "qwen3-0.6b_h200_tp1_bs256_async.json",
        "h200_qwen3-0.6b_bs256_light": "superseded/qwen3-0.6b_h200_tp1_bs256_2026-12-02_0721.json",
        "h200_qwen3-0.6b_bs256_sg_azure-conv_x8": "qwen3-0.6b_h200_tp1_bs256.json",
        "h200_qwen3-8b_bs16_async_azure-conv_x2": "superseded/qwen3-8b_h200_tp1_bs16_async_2026-12-02_0721.json",
        "h200_qwen3-8b_bs16_async_sg_azure-conv_x1": "qwen3-8b_h200_tp1_bs16_async.json",
        "h200_qwen3-8b_bs256_azure-conv_x1": "superseded/qwen3-8b_h200_tp1_bs256_2026-12-02_1254.json",
    }
    for run, profile in pairs.items():
        assert validate_profile("auto", VALIDATION / run) == SHIPPED_PROFILE_DIR / profile, run
