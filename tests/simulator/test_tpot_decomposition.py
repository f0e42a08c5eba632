"""benchmarks/tpot_decomposition.py: a request's decode interval holds the real steps that ended
inside it, on a step timeline aligned on the last finish; and a shipped replay decomposes."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tpot_decomposition as td  # noqa: E402  (benchmarks/ is not a package)

DIAGNOSTIC = ROOT / "simulator" / "data" / "diagnostic" / "h200_qwen3-0.6b_bs16_async_diag_mooncake_x4"


def test_decode_intervals_sum_the_steps_that_end_inside_each_interval():
    # steps end at 10 + (1, 3, 6, 10) s: the idle second before the third step counts in no step
    steps = pd.DataFrame(
        {
            "idle_before_s": [None, 0.0, 1.0, 0.0],
            "wall_time_s": [1.0, 2.0, 2.0, 4.0],
            "predicted_s": [1, 1, 1, 1.5],
        }
    )
    requests = pd.DataFrame(
        {
            "request_id": [7, 8, 9],
            "num_output_tokens": [3, 2, 1],  # 9: one token, no interval
            "first_token_s": [11.0, 13.0, 13.0],
            "finish_s": [16.0, 20.0, 13.0],
        }
    )
    out = td.decode_intervals(requests, steps)
    assert out["request_id"].tolist() == [7, 8]
    assert out["real"].tolist() == [2.5, 7.0]  # (16 - 11) / 2, (20 - 13) / 1
    assert out["steps_wall"].tolist() == [2.0, 6.0]  # steps 2 and 3; steps 3 and 4
    assert out["predicted"].tolist() == [1.0, 2.5]


def test_a_shipped_diagnostic_replay_decomposes():
    profile = ROOT / "simulator" / "profiles" / "qwen3-0.6b_h200_tp1_bs16_async.json"
    frame = td.decompose(DIAGNOSTIC, profile)
    assert len(frame) == 166
    # the real steps inside the intervals hold all but the idle time of each real TPOT
    assert frame["steps_wall"].mean() == pytest.approx(frame["real"].mean(), rel=0.01)
    lines = td.report(DIAGNOSTIC, profile, frame)
    assert lines[0].startswith(
        "h200_qwen3-0.6b_bs16_async_diag_mooncake_x4 on qwen3-0.6b_h200_tp1_bs16_async.json"
    )
    assert [line.split()[0] for line in lines[2:]] == ["all", "2-3", "4-32", "33+"]
