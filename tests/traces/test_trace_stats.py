"""Stats: figures for the shipped traces match traces/data/README.md; prefix reuse on hand-made traces."""

import pandas as pd
import pytest

import traces
from traces import Trace


@pytest.fixture(scope="module")
def shipped_stats():
    return {n: traces.trace_stats(traces.load_shipped(n)) for n in traces.shipped_names()}


def test_pinned_azure_code_stats(shipped_stats):
    """Pinned to the shipped trace file (figures in traces/data/README.md): detects change in it or in
    trace_stats, not correctness."""
    s = shipped_stats["azure_code_2023"]
    assert s.rows == 8819
    assert round(s.duration_s, 1) == 3435.9
    assert round(s.rate_rps, 2) == 2.57
    assert round(s.interarrival_cv, 1) == 13.2
    assert round(s.interarrival_p50_s, 3) == 0.064 and round(s.interarrival_p99_s, 1) == 2.2
    assert round(s.interarrival_max_s) == 217
    p = s.prompt
    assert (round(p.mean, 1), round(p.p50), round(p.p90), round(p.p99), p.min, p.max) == (
        2047.8,
        1469,
        5188,
        7436,
        3,
        7437,
    )
    o = s.output
    assert (round(o.mean, 1), round(o.p50), round(o.p90), round(o.p99), o.min, o.max) == (
        27.9,
        13,
        55,
        251,
        6,
        1899,
    )
    assert s.prefix is None and "n/a" in s.format()


def test_pinned_azure_conv_stats(shipped_stats):
    """Pinned to the shipped trace file (figures in traces/data/README.md): detects change in it or in
    trace_stats, not correctness."""
    s = shipped_stats["azure_conv_2023"]
    assert s.rows == 19366
    assert round(s.duration_s, 1) == 3501.7
    assert round(s.rate_rps, 2) == 5.53
    assert round(s.interarrival_cv, 2) == 1.09
    assert round(s.interarrival_p50_s, 3) == 0.118 and round(s.interarrival_p99_s, 2) == 0.89
    assert round(s.interarrival_max_s, 1) == 4.3
    p = s.prompt
    assert (round(p.mean, 1), round(p.p50), round(p.p90), round(p.p99), p.min, p.max) == (
        1154.7,
        1020,
        2734,
        4142,
        2,
        14050,
    )
    o = s.output
    assert (round(o.mean, 1), round(o.p50), round(o.p90), round(o.p99), o.min, o.max) == (
        211.1,
        129,
        424,
        601,
        7,
        1000,
    )


def test_pinned_mooncake_synthetic_stats(shipped_stats):
    """Pinned to the shipped trace file (figures in traces/data/README.md): detects change in it or in
    trace_stats, not correctness."""
    s = shipped_stats["mooncake_synthetic"]
    assert s.rows == 3993
    assert s.duration_s == pytest.approx(1022.025)
    assert round(s.rate_rps, 2) == 3.91
    assert round(s.interarrival_cv, 2) == 1.01
    assert round(s.interarrival_p50_s, 3) == 0.175
    p = s.prompt
    assert (round(p.mean, 1), round(p.p50), round(p.p90), round(p.p99), p.min, p.max) == (
        15325.5,
        11587,
        38611,
        66456,
        13,
        191378,
    )
    o = s.output
    assert (round(o.mean, 1), round(o.p50), round(o.p90), round(o.p99), o.min, o.max) == (
        149.1,
        69,
        389,
        768,
        1,
        893,
    )
    r = s.prefix
    assert (r.total_blocks, r.distinct_block_ids, r.prefix_block_size) == (121877, 43924, 512)
    assert round(100 * r.block_reuse, 1) == 64.0
    assert round(100 * r.token_reuse, 1) == 65.1
    assert "64.0% of blocks, 65.1% of tokens" in s.format()
    d = s.to_dict()
    assert d["prefix"]["block_reuse"] == r.block_reuse and d["rows"] == 3993


def test_prefix_reuse_exact():
    # leading-prefix matching: [9, 2] after [1, 2] reuses nothing (block 2 follows a different prefix)
    t = Trace(
        pd.DataFrame(
            {
                "request_id": [0, 1, 2, 3],
                "arrival_s": [0.0, 1.0, 2.0, 3.0],
                "prompt_len": [20, 30, 20, 12],
                "output_len": [1, 1, 1, 1],
                "prefix_block_ids": [[1, 2], [1, 2, 3], [9, 2], [1, 7]],
            }
        ),
        prefix_block_size=10,
    )
    r = traces.prefix_reuse(t)
    assert (r.total_blocks, r.reused_blocks, r.distinct_block_ids) == (9, 3, 5)
    # request 1 reuses 20 tokens, request 3 reuses 10 of its 12
    assert (r.total_tokens, r.reused_tokens) == (82, 30)


def test_prefix_reuse_partial_last_block_counts_only_seen_tokens():
    t = Trace(
        pd.DataFrame(
            {
                "request_id": [0, 1],
                "arrival_s": [0.0, 1.0],
                "prompt_len": [4, 10],
                "output_len": [1, 1],
                "prefix_block_ids": [[5], [5]],
            }
        ),
        prefix_block_size=16,
    )
    r = traces.prefix_reuse(t)
    assert (r.reused_blocks, r.reused_tokens, r.total_tokens) == (1, 4, 14)


def test_small_traces():
    one = Trace(pd.DataFrame({"request_id": [0], "arrival_s": [0.0], "prompt_len": [3], "output_len": [1]}))
    s = traces.trace_stats(one)
    assert s.rows == 1 and s.rate_rps is None and s.interarrival_cv is None
    assert "n/a" in s.format()
