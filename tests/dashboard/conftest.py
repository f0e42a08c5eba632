"""Fixtures for the dashboard tests: in-process simulations for AppTest runs, sample validation
folders and step records (helpers live in dash_samples, dash_apptest and dash_browser)."""

from __future__ import annotations

from pathlib import Path

import dash_samples
import pytest


@pytest.fixture(autouse=True)
def _in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """AppTests simulate in-process (no worker pool); the pool has its own test in test_logic."""
    monkeypatch.setenv("KVPLAN_DASHBOARD_WORKERS", "1")


@pytest.fixture(scope="session")
def validation_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("validation")
    dash_samples.write_pair_run(root / "pair-run")
    replay = dash_samples.write_replay_run(root / "replay-run")
    dash_samples.write_report_run(replay)
    dash_samples.write_repeat_run(replay, root / "replay-run-again")
    return root


@pytest.fixture(scope="session")
def records():
    return dash_samples.step_records(400)
