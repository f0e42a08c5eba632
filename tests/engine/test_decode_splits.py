"""The split-KV decode kernel's split policy (engine/decode_splits.py): exact split counts, the
balanced splits a sequence uses, and the longest split's divisor that the simulator's fitted model uses."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engine.decode_splits import (
    balance_programs,
    choose_num_splits,
    grid_splits,
    longest_split_divisor,
    num_splits_for_batch,
    sequence_splits,
    split_block,
    split_unit,
    target_split_units,
)


def test_choose_num_splits():
    # about 2 x 132 programs: 264 / (batch x 8 kv heads) splits, at most 32 and one per unit of
    # max(page, 64) tokens of the longest context
    assert choose_num_splits(1, 8, 4096, 16) == 32
    assert choose_num_splits(1, 8, 4096, 256) == 16
    assert choose_num_splits(1, 8, 512, 16) == 8
    assert choose_num_splits(1, 8, 512, 128) == 4
    assert choose_num_splits(1, 8, 100, 16) == 2
    assert choose_num_splits(1, 8, 1, 16) == 1
    assert choose_num_splits(1, 8, 0, 16) == 1
    assert choose_num_splits(8, 8, 4096, 16) == 5
    assert choose_num_splits(16, 8, 4096, 16) == 3
    assert choose_num_splits(64, 8, 4096, 16) == 1
    assert choose_num_splits(256, 8, 512, 16) == 1
    assert choose_num_splits(2, 4, 1 << 20, 16, num_sms=66) == 17
    assert choose_num_splits(1, 1, 1 << 20, 16) == 32


def test_split_block_splits_large_pages_inside():
    """Fine splits (the engine's default): pages over 64 tokens count as 64-token units, so
    one row of 384 keys at block 256 takes 6 splits, not 2; small pages are as before."""
    assert [split_block(b) for b in (16, 64, 128, 256, 512)] == [16, 64, 64, 64, 64]
    assert [split_block(b, fine=False) for b in (16, 64, 128, 256, 512)] == [16, 64, 128, 256, 512]
    assert [split_unit(split_block(b)) for b in (16, 256)] == [64, 64]
    assert choose_num_splits(1, 8, 384, split_block(256)) == 6
    assert choose_num_splits(1, 8, 384, split_block(256, fine=False)) == 2
    assert longest_split_divisor(1, 383, 384, 8, 132, split_block(256)) == 6
    assert longest_split_divisor(1, 383, 384, 8, 132, 256) == 2


def test_num_splits_for_batch_is_the_policy_before_the_context_cap():
    assert [num_splits_for_batch(b, 8, 132) for b in (1, 2, 4, 8, 16, 32, 48, 64, 128, 256)] == [
        32, 17, 9, 5, 3, 2, 1, 1, 1, 1,
    ]  # fmt: skip
    for batch in (1, 3, 8, 16, 96):
        for context in (1, 64, 65, 700, 4096, 1 << 16):
            assert choose_num_splits(batch, 8, context, 16) == min(
                num_splits_for_batch(batch, 8, 132), -(-context // 64)
            )


def test_balanced_grid_keeps_four_splits_for_large_batches():
    assert [grid_splits(b, 8, 132) for b in (1, 8, 16, 32, 48, 96, 512)] == [32, 5, 4, 4, 4, 4, 4]
    assert [grid_splits(b, 8, 132, balanced=False) for b in (16, 32, 48, 96)] == [3, 2, 1, 1]
    assert choose_num_splits(96, 8, 16384, 16, balanced=True) == 4
    assert choose_num_splits(96, 8, 100, 16, balanced=True) == 2  # two units of 64 tokens
    assert balance_programs(132) == 1056 and balance_programs(132, balanced=False) == 0
    assert balance_programs(132, num_splits=5) == 0  # small batches: every sequence uses every split


def test_target_split_units():
    # 114,096 keys x 8 kv heads over 1,056 programs: 865 tokens a program, 14 units of 64
    assert target_split_units(114_096, 8, 16, 1056) == 14
    assert target_split_units(114_096, 8, 256, 1056) == 4  # units of one 256-token page
    assert target_split_units(256, 8, 16, 1056) == 1
    assert target_split_units(10**9, 8, 16, 0) == 1  # not balanced


def test_sequence_splits():
    # (splits used, units a split covers): a long sequence among short ones takes the grid's 4
    assert sequence_splits(6360, 4, 14, 16) == (4, 25)
    assert sequence_splits(900, 4, 14, 16) == (2, 8)
    assert sequence_splits(500, 4, 14, 16) == (1, 8)  # one split: no merge
    # not balanced (target 1): every unit its own split up to the grid's
    assert sequence_splits(256, 32, 1, 16) == (4, 1)
    assert sequence_splits(4096, 32, 1, 16) == (32, 2)
    assert sequence_splits(9 * 64, 4, 1, 16) == (3, 3)  # 4 wanted, 3 of 3 units cover the 9
    assert sequence_splits(0, 4, 3, 16) == (1, 1)


def test_longest_split_divisor():
    # the serving-like step of docs/PERF.md: 96 sequences, 114,000 cached keys, the longest 6,360
    assert longest_split_divisor(96, 114_000, 6360, 8, 132, 16) == 4
    assert longest_split_divisor(96, 114_000, 900, 8, 132, 16) == 2
    assert longest_split_divisor(1, 255, 256, 8, 132, 16) == 4  # one row: all four units
    assert longest_split_divisor(1, 4095, 4096, 8, 132, 16) == 32


@given(
    context=st.integers(0, 1 << 20),
    num_splits=st.integers(1, 32),
    target=st.integers(1, 4096),
    block_size=st.sampled_from([16, 64, 256]),
)
def test_used_splits_cover_the_context_exactly_once(context, num_splits, target, block_size):
    used, per_split = sequence_splits(context, num_splits, target, block_size)
    units = max(1, -(-context // split_unit(block_size)))
    assert 1 <= used <= num_splits
    assert (used - 1) * per_split < units <= used * per_split
