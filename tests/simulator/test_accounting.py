"""How a run counts its requests: rejected ones apart from the finished (truncated ones among
them), with no latencies, and finish reasons from a small fixed vocabulary."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

import traces
from simulator.config import SimConfig
from simulator.latency.roofline import RooflineModel
from simulator.metrics import REJECTED_REASONS, SERVED_REASONS, TRUNCATED_REASONS, add_latencies
from simulator.report import format_counts, format_summary
from simulator.run import run_simulation


def _run(df: pd.DataFrame, config: SimConfig):
    latency = RooflineModel(config.model, config.gpu, config.tensor_parallel_size)
    return run_simulation(traces.Trace(df, name="t"), config, latency=latency)


def _trace(prompts: list[int], outputs: list[int] | None = None) -> pd.DataFrame:
    n = len(prompts)
    return pd.DataFrame(
        {
            "request_id": range(n),
            "arrival_s": np.arange(n) * 0.01,
            "prompt_len": prompts,
            "output_len": outputs or [4] * n,
        }
    )


def test_rejections_have_two_reasons_however_many_lengths(qwen06):
    """60 prompts of 60 lengths over max_model_len, 40 that fit max_model_len but not the cache."""
    too_long = list(range(5000, 5060))
    too_big = list(range(200, 240))  # 13-15 blocks of 16 > 10 blocks
    cfg = SimConfig(model=qwen06, num_kv_blocks=10, block_size=16, max_model_len=4096)
    res = _run(_trace([*too_long, *too_big, 20]), cfg)
    reasons = res.requests.set_index("request_id")["finish_reason"]
    assert set(reasons[:60]) == {"rejected_prompt_too_long"}
    assert set(reasons[60:100]) == {"rejected_kv_capacity"}
    assert set(reasons) <= {*SERVED_REASONS, *TRUNCATED_REASONS, *REJECTED_REASONS}
    s = res.summary
    assert (s["num_rejected"], s["num_rejected_prompt_too_long"], s["num_rejected_kv_capacity"]) == (
        100,
        60,
        40,
    )
    assert s["num_finished"] == 1 and s["num_finished"] + s["num_rejected"] == s["num_requests"]


def test_rejected_requests_have_no_latencies(qwen06):
    cfg = SimConfig(model=qwen06, num_kv_blocks=50, block_size=16, max_model_len=4096)
    res = _run(_trace([100, 5000, 300]), cfg)
    row = res.requests.set_index("request_id").loc[1]
    assert row["finish_reason"] == "rejected_prompt_too_long"
    for col in ("ttft_s", "e2e_s", "tpot_s", "queue_s"):
        assert math.isnan(row[col]), col
    assert not res.requests.set_index("request_id").loc[[0, 2], "e2e_s"].isna().any()


def test_replays_with_the_older_rejection_text_count_the_same():
    real = pd.DataFrame(
        {
            "request_id": [0, 1],
            "arrival_s": [0.0, 1.0],
            "first_scheduled_s": [0.0, None],
            "first_token_s": [0.1, None],
            "finish_s": [0.5, 1.0],
            "num_output_tokens": [3, 0],
            "finish_reason": ["length", "rejected: prompt of 9 tokens exceeds max_model_len 8"],
        }
    )
    df = add_latencies(real)
    assert df["e2e_s"].iloc[0] == 0.5 and math.isnan(df["e2e_s"].iloc[1])


def test_the_finished_line_counts_truncated_inside_and_rejected_apart(qwen06):
    """One request outgrows the cache (truncated, finished), one is rejected, one is served."""
    cfg = SimConfig(model=qwen06, num_kv_blocks=10, block_size=16, max_model_len=4096)
    res = _run(_trace([100, 5000, 20], [1000, 4, 4]), cfg)
    s = res.summary
    assert (s["num_finished"], s["num_truncated"], s["num_rejected"]) == (2, 1, 1)
    assert format_counts(s) == (
        "2 of 3 (1 of them truncated); rejected 1 (1 prompt longer than max_model_len)"
    )
    assert "finished         2 of 3 (1 of them truncated); rejected 1" in format_summary(s)
