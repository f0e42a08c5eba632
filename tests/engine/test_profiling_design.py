"""The profile sweep's design (engine/profiling.py): which step shapes it plans, exactly."""

from __future__ import annotations

import numpy as np

from engine.profiling import (
    SweepLimits,
    design,
    fill_shortest,
    full_cache_workloads,
    serving_lengths,
    spread_lengths,
)


def test_spread_lengths_are_geometric():
    assert spread_lengths(5, 2048) == [128, 256, 512, 1024, 2048]
    assert spread_lengths(1, 300) == [300]
    lengths = spread_lengths(128, 4096)
    assert max(lengths) * len(lengths) / sum(lengths) > 3  # serving-like: longest >> mean


def test_design_plans_spread_decodes_that_fit():
    spread = [(w.num_seqs, w.prompt_len) for w in design(SweepLimits(256, 8192, 16384, 131072, "chunked"))
              if w.kind == "decode_spread" and w.shortest == 128]  # fmt: skip
    assert spread == [(16, 2048), (32, 2048), (64, 2048), (96, 2048), (128, 2048),
                      (16, 4096), (32, 4096), (64, 4096), (96, 4096)]  # fmt: skip
    # batch limit and context limit cut the list
    small = [(w.num_seqs, w.prompt_len) for w in design(SweepLimits(64, 8192, 4096, 131072, "chunked"))
             if w.kind == "decode_spread" and w.shortest == 128]  # fmt: skip
    assert small == [(16, 2048), (32, 2048), (64, 2048)]


def test_full_cache_workloads_fill_the_cache_with_spread_lengths():
    """Serving near saturation: large batches whose spread lengths sum to ~90 % of the cache less
    room to decode; the mixed ones add a joining prefill chunk to such a batch."""
    planned = [(w.kind, w.num_seqs, w.prompt_len, w.shortest, w.chunk_len)
               for w in full_cache_workloads(SweepLimits(256, 8192, 16384, 131072, "chunked", 16))]  # fmt: skip
    assert planned == [
        ("decode_serving", 64, 122757, 0, 0), ("decode_serving", 96, 121221, 0, 0),
        ("decode_serving", 128, 119685, 0, 0), ("decode_serving", 160, 118149, 0, 0),
        ("decode_serving", 192, 116613, 0, 0),
        ("decode_spread", 64, 2048, 1549, 0), ("decode_spread", 96, 2048, 589, 0),
        ("decode_spread", 128, 2048, 257, 0), ("decode_spread", 160, 2048, 119, 0),
        ("decode_spread", 192, 2048, 56, 0), ("decode_spread", 64, 4096, 561, 0),
        ("mixed", 64, 4096, 561, 512), ("mixed", 64, 4096, 561, 2048),
        ("decode_spread", 96, 4096, 135, 0), ("decode_spread", 128, 4096, 35, 0),
        ("mixed", 128, 4096, 35, 512), ("mixed", 128, 4096, 35, 2048),
        ("decode_spread", 64, 8192, 79, 0),
    ]  # fmt: skip
    for w in full_cache_workloads(SweepLimits(256, 8192, 16384, 131072, "chunked", 16))[5:]:
        budget = int(0.9 * 131072) - w.num_seqs * (40 + 16)
        total = sum(spread_lengths(w.num_seqs, w.prompt_len, w.shortest))
        assert total <= budget < sum(spread_lengths(w.num_seqs, w.prompt_len, w.shortest + 1))
    assert len(design(SweepLimits(256, 8192, 16384, 131072, "chunked", 16))) == 112
    # prefill_first plans no mixed steps; a batch limit of 64 keeps only batches of 64
    assert {w.kind for w in full_cache_workloads(SweepLimits(256, 8192, 16384, 131072, "prefill_first"))} == {
        "decode_serving",
        "decode_spread",
    }
    assert {w.num_seqs for w in full_cache_workloads(SweepLimits(64, 8192, 16384, 131072, "chunked"))} == {64}


def test_fill_shortest_edges():
    assert fill_shortest(4, 1000, 10_000) is None  # even uniform 1,000-token prompts leave room
    assert fill_shortest(256, 8192, 50_000) is None  # 16..8192 over 256 prompts is already too much
    assert fill_shortest(5, 2048, 3968) == 128  # exactly 128 + 256 + 512 + 1024 + 2048


def test_serving_lengths_fill_their_total_within_bounds():
    """Lognormal lengths scaled to the workload's total: within 16..longest, summing to the total
    within rounding (a clipped draw may fall short)."""
    rng = np.random.default_rng(0)
    for b, total in ((64, 122757), (192, 116613)):
        lengths = serving_lengths(b, total, 8192, rng)
        assert len(lengths) == b and min(lengths) >= 16 and max(lengths) <= 8192
        assert abs(sum(lengths) - total) <= b
        assert max(lengths) > 3 * np.median(lengths)  # skewed as conversations are


def test_serving_batches_fit_the_cache_at_large_pages():
    """At block 256 a serving batch leaves half a page a sequence of room: ~110k of 131k tokens at
    96 sequences, and its blocks (each sequence's tokens and its 40 decode steps, rounded up to
    pages) stay within the cache for any draw."""
    limits = SweepLimits(256, 8192, 16384, 131072, "chunked", 256)
    planned = {w.num_seqs: w.prompt_len for w in full_cache_workloads(limits) if w.kind == "decode_serving"}
    assert planned == {64: 115077, 96: 109701, 128: 104325, 160: 98949, 192: 93573}
    for seed in range(20):
        for b, total in planned.items():
            lengths = serving_lengths(b, total, 8192, np.random.default_rng(seed))
            assert sum(-(-(n + 40) // 256) for n in lengths) <= 512
