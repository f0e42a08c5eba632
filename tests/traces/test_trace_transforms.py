"""Transforms: time window, rate scaling, subsampling, length capping, concatenation."""

import numpy as np
import pandas as pd
import pytest

import traces
from traces import Trace


def small() -> Trace:
    return Trace(
        pd.DataFrame(
            {
                "request_id": [0, 1, 2, 3],
                "arrival_s": [0.0, 1.0, 2.0, 4.0],
                "prompt_len": [100, 2000, 600, 50],
                "output_len": [10, 100, 600, 5],
                "session_id": [0, 0, 1, 1],
                "prefix_block_ids": [[0], [0, 1, 2, 3], [4, 5], [6]],
            }
        ),
        name="small",
        prefix_block_size=512,
    )


def test_time_window():
    w = traces.time_window(small(), 1.0, 4.0)
    assert w.df["request_id"].tolist() == [1, 2]
    assert w.df["arrival_s"].tolist() == [0.0, 1.0]
    w = traces.time_window(small(), 1.0, rebase=False)
    assert w.df["arrival_s"].tolist() == [1.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="end_s"):
        traces.time_window(small(), 2.0, 1.0)


def test_scale_rate():
    t = small()
    f = traces.scale_rate(t, 2.0)
    assert f.df["arrival_s"].tolist() == [0.0, 0.5, 1.0, 2.0]
    g = traces.scale_rate(t, target_rate=4.0)  # 4 rows over 4 s = 1 req/s -> 4x faster
    assert g.df["arrival_s"].tolist() == [0.0, 0.25, 0.5, 1.0]
    assert t.df["arrival_s"].tolist() == [0.0, 1.0, 2.0, 4.0]  # input untouched
    with pytest.raises(ValueError, match="exactly one"):
        traces.scale_rate(t, 2.0, target_rate=3.0)
    with pytest.raises(ValueError, match="positive"):
        traces.scale_rate(t, -1.0)


def test_subsample_seeded():
    t = traces.load_shipped("azure_conv_2023")
    a = traces.subsample(t, 0.1, seed=1)
    b = traces.subsample(t, 0.1, seed=1)
    c = traces.subsample(t, 0.1, seed=2)
    assert len(a) == 1937
    assert a.df["request_id"].tolist() == b.df["request_id"].tolist() != c.df["request_id"].tolist()
    assert (np.diff(a.df["arrival_s"]) >= 0).all()
    assert len(traces.subsample(t, n=10, seed=0)) == 10
    with pytest.raises(ValueError):
        traces.subsample(t, 1.5)


def test_cap_lengths_truncate():
    t, rep = traces.cap_lengths(small(), 1024)
    assert t.df["prompt_len"].tolist() == [100, 1023, 600, 50]
    assert t.df["output_len"].tolist() == [10, 1, 424, 5]
    assert (rep.prompts_capped, rep.outputs_capped, rep.rows_capped, rep.rows_dropped) == (1, 2, 2, 0)
    assert t.df["prefix_block_ids"].tolist() == [[0], [0, 1], [4, 5], [6]]
    assert (t.df["prompt_len"] + t.df["output_len"] <= 1024).all()
    assert "capped 2 rows" in rep.summary()
    # capped prompts keep their leading tokens
    assert t.token_ids(1) == small().token_ids(1)[:1023]


def test_cap_lengths_drop_and_token_ids():
    t, rep = traces.cap_lengths(small(), 1024, policy="drop")
    assert t.df["request_id"].tolist() == [0, 3] and rep.rows_dropped == 2
    toks = Trace(
        pd.DataFrame(
            {
                "request_id": [0, 1],
                "arrival_s": [0.0, 1.0],
                "prompt_len": [5, 3],
                "output_len": [5, 1],
                "prompt_token_ids": [[1, 2, 3, 4, 5], None],
            }
        )
    )
    c, rep = traces.cap_lengths(toks, 4)
    assert c.df["prompt_token_ids"].tolist()[0] == [1, 2, 3] and c.token_ids(0) == [1, 2, 3]
    assert pd.isna(c.df["prompt_token_ids"].iloc[1])
    assert rep.prompts_capped == 1


def test_concat():
    a = small()
    b = small()
    c = traces.concat([a, b], gap_s=1.0)
    assert len(c) == 8
    assert c.df["request_id"].tolist() == list(range(8))
    assert c.df["arrival_s"].tolist() == [0.0, 1.0, 2.0, 4.0, 5.0, 6.0, 7.0, 9.0]
    assert c.df["session_id"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    ids = c.df["prefix_block_ids"].tolist()
    assert ids[:4] == [[0], [0, 1, 2, 3], [4, 5], [6]]
    assert ids[4:] == [[7], [7, 8, 9, 10], [11, 12], [13]]
    assert c.name == "small+small"
    # a trace without prefix ids joins with empty lists; mismatched block sizes are refused
    plain = Trace(pd.DataFrame({"request_id": [0], "arrival_s": [0.0], "prompt_len": [3], "output_len": [1]}))
    d = traces.concat([plain, a])
    assert d.df["prefix_block_ids"].tolist()[0] == [] and d.df["session_id"].tolist()[0] == -1
    other = traces.generate(rate=1, num_requests=3, prefix_block_size=16, seed=0)
    with pytest.raises(ValueError, match="different prefix_block_size"):
        traces.concat([a, other])
    # prefix reuse is preserved within each part and never across parts
    r = traces.prefix_reuse(c)
    assert r.reused_blocks == 2 * traces.prefix_reuse(a).reused_blocks
