"""How the Triton split-KV decode kernel divides its work: the grid's splits per sequence, and how many
of them each sequence uses. Pure (no torch): the kernel launches with it, the simulator predicts with it."""

from __future__ import annotations

MAX_SPLITS = 32  # cap of choose_num_splits; also the merge kernel's chunk of splits
WAVES = 2  # num_splits_for_batch aims at this many programs per SM
MIN_SPLIT_TOKENS = 64  # a split covers whole pages and at least this many tokens
# Balanced splitting (the default): a large batch keeps MIN_GRID_SPLITS programs per
# sequence and kv head in its grid, and a sequence uses as many of them as it needs for none of its
# splits to read more than 1 / (BALANCE_WAVES x SMs) of the step's KV (whole units, at least one).
# Without it one long sequence among many short ones is one program that the whole step waits for.
MIN_GRID_SPLITS = 4
BALANCE_WAVES = 8


def split_unit(block_size: int) -> int:
    """Tokens of the unit that splits are made of: one page, or MIN_SPLIT_TOKENS for small pages."""
    return max(block_size, MIN_SPLIT_TOKENS)


def split_block(block_size: int, fine: bool = True) -> int:
    """The page size the split rules here count in (their `block_size`) for a cache of `block_size`
    pages. `fine` (the engine's default): pages over MIN_SPLIT_TOKENS are split inside, so
    splits are made of MIN_SPLIT_TOKENS-token units at any page size (the kernel looks up each token's
    page). Without it, whole pages (the engine before; with $KVPLAN_DECODE_FINE_SPLITS=0)."""
    return min(block_size, MIN_SPLIT_TOKENS) if fine else block_size


def num_splits_for_batch(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Splits per sequence that make the stage-1 grid (batch x kv heads x splits) about WAVES
    programs per SM, at most MAX_SPLITS; before the cap by context length (`choose_num_splits`)."""
    programs = max(1, batch * num_kv_heads)
    return max(1, min(-(-WAVES * num_sms // programs), MAX_SPLITS))


def grid_splits(batch: int, num_kv_heads: int, num_sms: int, balanced: bool = True) -> int:
    """Splits per sequence in the kernel's grid: `num_splits_for_batch`, at least MIN_GRID_SPLITS
    when `balanced` (the programs a sequence does not need end at once)."""
    n = num_splits_for_batch(batch, num_kv_heads, num_sms)
    return max(n, MIN_GRID_SPLITS) if balanced else n


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_context: int,
    block_size: int,
    num_sms: int = 132,
    balanced: bool = False,
) -> int:
    """Grid splits per sequence (`grid_splits`), at most one per unit of `max_context`. Without
    balancing every sequence uses all of them: its longest split covers ceil(units / splits) units."""
    units = -(-max_context // split_unit(block_size))
    return max(1, min(grid_splits(batch, num_kv_heads, num_sms, balanced), units))


def balance_programs(num_sms: int, balanced: bool = True, num_splits: int = MIN_GRID_SPLITS) -> int:
    """The kernel's `balance` argument: programs a step's KV is spread over; 0 = not balanced, and
    so for grids of more than MIN_GRID_SPLITS splits (small batches: every sequence uses them all,
    and the kernel saves summing the batch's keys)."""
    return BALANCE_WAVES * num_sms if balanced and num_splits <= MIN_GRID_SPLITS else 0


def target_split_units(total_keys: int, num_kv_heads: int, block_size: int, balance: int) -> int:
    """Units a split of a balanced step covers at least: the step's keys (`total_keys`, summed over
    the grid's sequences, padding rows included) times kv heads, over `balance` programs; 1 when
    `balance` is 0."""
    if balance <= 0:
        return 1
    per_program = -(-total_keys * num_kv_heads // balance)
    return max(1, -(-per_program // split_unit(block_size)))


def sequence_splits(context: int, num_splits: int, target_units: int, block_size: int) -> tuple[int, int]:
    """(splits used, units each covers but the last) of one sequence of `context` keys in a grid of
    `num_splits`: as few as keep its splits near `target_units`, at most `num_splits`. Splits past
    the used ones end at once; a sequence that uses one writes its output without the merge."""
    units = max(1, -(-context // split_unit(block_size)))
    wanted = min(num_splits, -(-units // max(1, target_units)))
    per_split = -(-units // wanted)
    return -(-units // per_split), per_split


def longest_split_divisor(
    padded_batch: int,
    num_context_tokens: int,
    max_seq_len: int,
    num_kv_heads: int,
    num_sms: int,
    block_size: int,
) -> int:
    """Splits of the longest sequence of a balanced decode step that runs in a graph of `padded_batch`
    rows (`num_context_tokens` cached before the step, as the scheduler counts them: the kernel's
    keys are those plus one a row, the padding rows' one key included)."""
    num_splits = choose_num_splits(padded_batch, num_kv_heads, max_seq_len, block_size, num_sms, True)
    grid = grid_splits(padded_batch, num_kv_heads, num_sms)
    balance = balance_programs(num_sms, True, grid)
    target = target_split_units(num_context_tokens + padded_batch, num_kv_heads, block_size, balance)
    return sequence_splits(max_seq_len, num_splits, target, block_size)[0]
