"""The profile sweep's design (engine/profiling.py): which step shapes it plans, exactly."""

from __future__ import annotations

from dataclasses import replace

import engine_helpers
import numpy as np
import pandas as pd
import pytest

from engine.profiling import (
    SweepLimits,
    corpus_lengths,
    design,
    envelope,
    fill_shortest,
    full_cache_workloads,
    mixed_serving_workloads,
    serving_lengths,
    spread_lengths,
    sweep,
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


H200_LIMITS = engine_helpers.h200_limits()  # the serving envelope of issue 25 (docs/CALIBRATION.md)


@pytest.fixture(scope="module")
def h200_plan():
    return engine_helpers.h200_plan()


def test_corpus_fills_most_of_the_cache_longest_at_max_model_len():
    docs = corpus_lengths(H200_LIMITS)
    assert len(docs) == 210 and docs[:2] == [32688, 31517] and docs[-2:] == [17, 16]
    assert sum(docs) == 912326 <= 0.8 * 71457 * 16 < sum(spread_lengths(211, 32688, 16))
    # a cache that holds every slot at the longest length: uniform documents
    assert corpus_lengths(SweepLimits(4, 256, 1024, 8192, "chunked")) == [944] * 4
    assert corpus_lengths(SweepLimits(4, 256, 64, 8192, "chunked")) == []  # no room for a document


def test_sweep_phases_and_sync_twins(h200_plan):
    work, _ = h200_plan
    assert [w.phase for w in work].count("short") == 112  # the 131k-token box's design, as before
    decodes = [
        (w.num_seqs, w.prompt_len) for w in work if w.phase == "long" and w.kind == "decode" and not w.sync
    ]
    assert decodes == [(210, 32688), (128, 32688), (64, 32688), (32, 32688), (16, 32688), (8, 32688),
                       (4, 32688), (2, 32688), (1, 32688), (1, 8192), (4, 8192), (16, 8192),
                       (1, 16384), (4, 16384), (16, 16384), (1, 24576), (4, 24576)]  # fmt: skip
    assert [(w.phase, w.kind, w.num_seqs, w.joins) for w in work if w.phase in ("mixed_long", "full")] == [
        ("mixed_long", "mixed", 13, (512, 2048, 8172, 16344, 32688)),
        ("mixed_long", "mixed", 52, (512, 2048, 8172, 16344, 32688)),
        ("mixed_long", "mixed", 105, (512, 2048, 8172, 16344, 32688)),
        ("full", "prefill", 210, ()), ("full", "decode", 210, ()), ("full", "decode", 210, ()),
    ]  # fmt: skip
    # under async scheduling every long decode workload is followed by its twin that stops at EOS
    long = [w for w in work if w.phase in ("long", "full") and w.kind == "decode"]
    assert [w.sync for w in long] == [False, True] * (len(long) // 2)
    assert all(a.lengths == b.lengths for a, b in zip(long[::2], long[1::2]))
    assert not any(w.sync for w in sweep(SweepLimits(256, 8192, 32768, 71457 * 16, "chunked", 16)))
    full = next(w for w in work if w.phase == "full" and w.kind == "decode")
    assert sum(full.lengths) == 1077525 <= 0.97 * 71457 * 16 - 210 * (40 + 16)


def test_planned_steps_reach_the_serving_envelope(h200_plan):
    """Contexts to max_model_len, decode batches to max_num_seqs, sum of context to most of the cache,
    decode steps not run ahead at every block-table width, mixed steps at long context."""
    _, steps = h200_plan
    assert steps.groupby("phase").size().to_dict() == {
        "full": 110,
        "long": 1472,
        "mixed_long": 63,
        "mixed_serving": 200,
        "short": 3727,
    }
    assert envelope(steps, 16) == {
        "block_size": 16,
        "decode": {"steps": 4552, "batch": [1, 256], "longest": [129, 32727], "context": [128, 1085505],
                   "step_tokens": [1, 256], "kv_blocks": [9, 67956], "table_width": [9, 429660]},
        "decode_sync": {"steps": 1256, "batch": [1, 256], "longest": [129, 32727], "context": [128, 1085505],
                        "step_tokens": [1, 256], "kv_blocks": [9, 67956], "table_width": [9, 429660]},
        "prefill": {"steps": 1020, "batch": [1, 256], "longest": [16, 32700], "context": [0, 1075648],
                    "step_tokens": [5, 8192], "kv_blocks": [1, 67438], "table_width": [1, 429030]},
    }  # fmt: skip
    mixed = steps[(steps.phase == "mixed_long") & (steps.kind == "mixed")]
    assert envelope(mixed, 16)["prefill"] == {
        "steps": 35, "batch": [14, 106], "longest": [32688, 32700], "context": [344616, 926429],
        "step_tokens": [84, 8192], "kv_blocks": [21577, 57978], "table_width": [28616, 216664],
    }  # fmt: skip
    # steps run ahead and steps not, in every factor-of-4 band of block-table width the long phases reach
    decode = steps[(steps.kind == "decode") & (steps.phase != "short")]
    width = decode.num_seqs * ((decode.max_seq_len + 15) // 16)
    bands = np.digitize(width, [2048, 8192, 32768, 131072])
    counts = pd.crosstab(bands, decode.overlapped).to_dict("index")
    assert counts == {0: {False: 161, True: 160}, 1: {False: 202, True: 206}, 2: {False: 164, True: 184},
                      3: {False: 83, True: 100}, 4: {False: 121, True: 122}}  # fmt: skip


def test_mixed_serving_joins_short_prompts_to_running_batches_of_serving_contexts(h200_plan):
    """Serving's common mixed step: one prompt of 128-2,048 tokens joining 2-160 running decodes of
    document prefixes spread from 512 to 4,096 tokens, each join prefilled in one step."""
    work, steps = h200_plan
    phase = [w for w in work if w.phase == "mixed_serving"]
    assert [(w.num_seqs, w.lengths[0], w.lengths[-1]) for w in phase] == [
        (160, 4096, 99), (128, 4096, 318), (96, 4096, 512), (64, 4096, 512), (32, 4096, 512),
        (16, 4096, 512), (8, 4096, 512), (2, 4096, 512),
    ]  # fmt: skip
    assert {w.joins for w in phase} == {(128, 256, 512, 1024, 2048) * 3}
    assert {w.join_prefix for w in phase} == {16}  # one cached block ahead of each join's tokens
    mixed = steps[(steps.phase == "mixed_serving") & (steps.kind == "mixed")]
    joined = mixed[mixed.num_prefill_seqs == 1]
    assert len(mixed) == 127 and len(joined) == 120
    assert sorted(set(joined.total_num_scheduled_tokens - joined.num_decode_seqs)) == [
        128,
        256,
        512,
        1024,
        2048,
    ]
    assert sorted(set(joined.num_decode_seqs)) == [2, 8, 16, 32, 64, 96, 128, 160]
    # none without the chunked policy
    assert mixed_serving_workloads(replace(H200_LIMITS, policy="prefill_first"), [4096] * 8) == []
