"""How the Triton split-KV decode kernel divides its work: splits per sequence for a batch size.
Pure (no torch): the kernel launches with it and the simulator's fitted latency model predicts with it."""

from __future__ import annotations

MAX_SPLITS = 32  # cap of choose_num_splits; also the merge kernel's chunk of splits
WAVES = 2  # choose_num_splits aims at this many programs per SM
MIN_SPLIT_TOKENS = 64  # a split covers whole pages and at least this many tokens


def split_unit(block_size: int) -> int:
    """Tokens of the unit that splits are made of: one page, or MIN_SPLIT_TOKENS for small pages."""
    return max(block_size, MIN_SPLIT_TOKENS)


def num_splits_for_batch(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per sequence that make the stage-1 grid (batch x kv heads x splits) about WAVES
    programs per SM, at most MAX_SPLITS; before the cap by context length (`choose_num_splits`)."""
    programs = max(1, batch * num_kv_heads)
    return max(1, min(-(-WAVES * num_sms // programs), MAX_SPLITS))


def choose_num_splits(
    batch: int, num_kv_heads: int, max_context: int, block_size: int, num_sms: int = 132
) -> int:
    """Splits per sequence: `num_splits_for_batch`, at most one split per unit of `max_context`.
    A sequence's longest split then covers ceil(units / splits) units, about context / splits tokens."""
    units = -(-max_context // split_unit(block_size))
    return max(1, min(num_splits_for_batch(batch, num_kv_heads, num_sms), units))
