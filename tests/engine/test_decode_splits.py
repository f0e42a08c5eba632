"""The split-KV decode kernel's split policy (engine/decode_splits.py): exact split counts, and the
batch-only part that the simulator's fitted model uses."""

from __future__ import annotations

from engine.decode_splits import choose_num_splits, num_splits_for_batch


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


def test_num_splits_for_batch_is_the_policy_before_the_context_cap():
    assert [num_splits_for_batch(b, 8, 132) for b in (1, 2, 4, 8, 16, 32, 48, 64, 128, 256)] == [
        32, 17, 9, 5, 3, 2, 1, 1, 1, 1,
    ]  # fmt: skip
    for batch in (1, 3, 8, 16, 96):
        for context in (1, 64, 65, 700, 4096, 1 << 16):
            assert choose_num_splits(batch, 8, context, 16) == min(
                num_splits_for_batch(batch, 8, 132), -(-context // 64)
            )
