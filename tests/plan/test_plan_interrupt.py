"""Ctrl-C in `kvplan plan` / `kvplan capacity`: exit status 130 and what the finished rounds found,
no traceback."""

from __future__ import annotations

import pytest

import simulator.plan
import simulator.sweep
from simulator.cli import main

ROWS = [
    {"gpu": "H200", "tp": 1, "replicas": 2, "block_size": 16, "max_num_seqs": 256,
     "max_num_batched_tokens": 16384, "rate_scale": 2.0, "slo_met": True, "cost_per_hour_usd": 7.0,
     "error": None},
    {"gpu": "H200", "tp": 1, "replicas": 1, "block_size": 16, "max_num_seqs": 256,
     "max_num_batched_tokens": 16384, "rate_scale": 4.0, "slo_met": False, "cost_per_hour_usd": 3.5,
     "error": None},
]  # fmt: skip


@pytest.fixture
def interrupted_search(monkeypatch):
    """The runner returns ROWS for the first round; the search is interrupted after it."""
    monkeypatch.setattr(simulator.sweep.PointRunner, "run", lambda self, points: [dict(r) for r in ROWS])

    def search(evaluate, *args, **kwargs):
        evaluate([{}, {}])
        raise KeyboardInterrupt

    monkeypatch.setattr(simulator.plan, "find_plan", search)
    monkeypatch.setattr(simulator.plan, "find_capacity", search)


def _main(argv: list[str]) -> int:
    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped kvplan")


def test_plan_interrupted(interrupted_search, capsys):
    argv = ["plan", "--rate", "1", "--slo", "ttft=1s", "--gpus", "H200", "--limit", "50", "--workers", "1"]
    assert _main([*argv, "--quiet"]) == 130
    err = capsys.readouterr().err
    assert "interrupted: 2 simulations had finished" in err
    assert "the cheapest of them meeting the SLOs: 2 x H200 tp=1, block 16" in err and "$7.00/h" in err
    assert "Traceback" not in err


def test_capacity_interrupted(interrupted_search, capsys):
    argv = ["capacity", "--slo", "ttft=1s", "--limit", "50", "--workers", "1", "--quiet"]
    assert _main(argv) == 130
    err = capsys.readouterr().err
    assert "interrupted: 2 simulations had finished" in err
    assert "the highest rate of them meeting the SLOs: 2x the trace" in err


def test_interrupted_plan_passes_over_a_row_that_falls_behind():
    """A finished row that met the latency objectives but fell behind its offered rate (mean wait
    5 s over 10 s of arrivals: 5 of 10 req/s served) is not what the interrupted search found."""
    from simulator.plan_cli import _interrupted

    load = {"num_requests": 100, "num_finished": 100, "arrival_span_s": 10.0}
    behind = {**ROWS[1], "slo_met": True, **load, "queue_mean_s": 5.0}
    keeps = {**ROWS[0], **load, "queue_mean_s": 0.0}
    text = _interrupted([behind, keeps], "cost")
    assert "the cheapest of them meeting the SLOs: 2 x H200 tp=1" in text and "$7.00/h" in text
    assert "none of them met the SLOs" in _interrupted([behind], "rate")
