"""Paged KV-cache block allocator with hash-chained prefix caching and LRU eviction. Torch-free: block
ids, ref counts and hashes in flat lists indexed by block id, each operation on a block O(1)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from itertools import islice

from engine.core.config import cdiv
from engine.core.sequence import Sequence

ROOT_HASH = 0x6B76706C616E  # chain seed for a sequence's first block


class BlockManager:
    """Allocates fixed-size blocks to sequences; caches full blocks by the hash of their prefix chain.

    The free list, front first, is `free_uncached` (a stack: its end is the front) then `free_cached`
    (cached blocks, least recently freed first), so a cached prefix is evicted only once no uncached
    block is left. A hit on a free cached block leaves a stale entry there (`_num_stale`), skipped."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be a positive integer, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size: must be a positive integer, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_free_blocks = num_blocks
        self.free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        self.free_cached: deque = deque()
        self._num_stale: dict[int, int] = {}  # block id -> entries of free_cached that hits left
        self._num_stale_total = 0
        self._ref_counts = [0] * num_blocks
        # per registered block: its hash, and where its tokens are for the token check on a hit (a
        # token list of the sequence that filled it, which only grows, and the block's index in it)
        self.cached_hashes: list[int | None] = [None] * num_blocks
        self.cached_token_srcs: list[list[int] | None] = [None] * num_blocks
        self.cached_block_indices = [0] * num_blocks
        self._hash_to_block_id: dict[int, int] = {}
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_evictions = 0

    # ---- counters and views ---------------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def prefix_hit_rate(self) -> float:
        q = self.num_prefix_queried_tokens
        return self.num_prefix_hit_tokens / q if q else 0.0

    @property
    def free_block_ids(self) -> list[int]:
        """The free list, front (allocated next) first: a snapshot."""
        skip = dict(self._num_stale)
        cached = []
        for block_id in self._free_cached_blocks():
            if skip.get(block_id):
                skip[block_id] -= 1
            else:
                cached.append(block_id)
        return self.free_uncached[::-1] + cached

    def _free_cached_blocks(self) -> Iterable[int]:
        return self.free_cached

    def ref_count(self, block_id: int) -> int:
        """Sequences holding `block_id`."""
        return self._ref_counts[block_id]

    @property
    def ref_counts(self) -> list[int]:
        """Sequences holding each block: a snapshot."""
        return list(self._ref_counts)

    @property
    def hash_to_block_id(self) -> dict[int, int]:
        """Every registered hash -> its block id."""
        return self._hash_to_block_id

    def block_hash(self, block_id: int) -> int | None:
        """The hash a block is registered under (None when it holds no cached prefix)."""
        return self.cached_hashes[block_id]

    def block_token_ids(self, block_id: int) -> tuple[int, ...] | None:
        """The tokens a cached block holds (None when it holds no cached prefix)."""
        tokens = self.cached_token_srcs[block_id]
        if tokens is None:
            return None
        offset = self.cached_block_indices[block_id] * self.block_size
        return tuple(tokens[offset : offset + self.block_size])

    # ---- hashing and lookup ---------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The hash chain of the first `num_blocks` full blocks of `seq` (memoised on the sequence)."""
        return self._extend_hash_chain(seq.block_hashes, seq.token_ids, num_blocks)

    def _extend_hash_chain(self, hashes: list[int], tokens: list[int], num_blocks: int) -> list[int]:
        """Extend `hashes`, the hash chain over the full blocks of `tokens`, to `num_blocks`."""
        bs = self.block_size
        start, end = len(hashes) * bs, num_blocks * bs
        if start >= end:
            return hashes
        prev = hashes[-1] if hashes else ROOT_HASH
        num_new = num_blocks - len(hashes)
        if num_new == 1:  # a decode filling its block
            hashes.append(hash((prev, tuple(tokens[start:end]))))
        elif num_new >= 4 and bs <= 16:  # zip(*[it] * bs) cuts many small blocks into tuples in C
            it = iter(tokens[start:end] if start else tokens)  # a whole prompt: no copy
            hashes += [prev := hash((prev, block)) for block in islice(zip(*[it] * bs), num_new)]
        else:
            hashes += [prev := hash((prev, tuple(tokens[i : i + bs]))) for i in range(start, end, bs)]
        return hashes

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of `seq`, leaving at least one token to compute
        (the first block is hashed alone unless it hits)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        if not max_blocks:
            return []
        get, hashes = self._hash_to_block_id.get, seq.block_hashes
        if get(hashes[0] if hashes else self.block_hashes(seq, 1)[0]) is None:
            return []
        hashes = self.block_hashes(seq, max_blocks)
        hits: list[int] = []
        tokens = seq.token_ids
        srcs, indices = self.cached_token_srcs, self.cached_block_indices
        for i in range(max_blocks):
            block_id = get(hashes[i])
            if block_id is None:
                break
            off = indices[block_id] * bs
            if srcs[block_id][off : off + bs] != tokens[i * bs : (i + 1) * bs]:
                break  # a hash collision: the tokens differ
            hits.append(block_id)
        return hits

    def any_registered(self, hashes: Iterable[int]) -> bool:
        """Whether one of `hashes` is registered."""
        return not self._hash_to_block_id.keys().isdisjoint(hashes)

    # ---- allocation -----------------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence, num_tokens: int, hits: list[int] | None = None) -> int:
        """Free blocks that covering `num_tokens` slots of `seq` (after taking `hits`) would use up."""
        have = len(seq.block_table) + (len(hits) if hits else 0)
        need = max(0, cdiv(num_tokens, self.block_size) - have)
        if hits:
            ref_counts = self._ref_counts
            need += sum(1 for b in hits if not ref_counts[b])
        return need

    def allocate_slots(
        self,
        seq: Sequence,
        num_tokens: int,
        hits: list[int] | None = None,
        num_tokens_to_cache: int | None = None,
    ) -> bool:
        """Grow `seq.block_table` to cover `num_tokens` slots, first taking the prefix-hit blocks, and
        register the blocks that the first `num_tokens_to_cache` tokens (default: all) fill. Returns
        False, changing nothing, when too few are free."""
        table = seq.block_table
        if hits:
            if self.num_blocks_needed(seq, num_tokens, hits) > self.num_free_blocks:
                return False
            ref_counts, stale = self._ref_counts, self._num_stale
            for block_id in hits:
                if not ref_counts[block_id]:  # free: its free_cached entry is now stale
                    stale[block_id] = stale.get(block_id, 0) + 1
                    self._num_stale_total += 1
                    self.num_free_blocks -= 1
                ref_counts[block_id] += 1
            table += hits
            seq.num_cached_blocks = len(table)
        num_new = -(-num_tokens // self.block_size) - len(table)
        if num_new > self.num_free_blocks:
            return False
        if num_new > 0:
            self.take_free_blocks(table, num_new)
        if num_tokens_to_cache is None:
            num_tokens_to_cache = num_tokens
        if self.enable_prefix_caching and num_tokens_to_cache // self.block_size > seq.num_cached_blocks:
            self.cache_full_blocks(seq, num_tokens_to_cache)
        return True

    def record_prefix_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_queried_tokens += num_queried_tokens
        self.num_prefix_hit_tokens += num_hit_tokens

    def take_free_blocks(self, table: list[int], num: int) -> None:
        """Append `num` blocks from the front of the free list to `table`, evicting cached prefixes."""
        self.num_free_blocks -= num
        uncached, ref_counts = self.free_uncached, self._ref_counts
        if uncached:
            if num == 1:  # a decode opening a block
                block_id = uncached.pop()
                ref_counts[block_id] = 1
                table.append(block_id)
                return
            taken = uncached[: -num - 1 : -1]  # the front of the free list (all of them if fewer)
            del uncached[-num:]
            for block_id in taken:
                ref_counts[block_id] = 1
            table += taken
            num -= len(taken)
            if not num:
                return
        self.num_evictions += num
        self._evict(table, num)

    def _evict(self, table: list[int], num: int) -> None:
        """Append `num` blocks from the front of `free_cached` to `table`, forgetting their prefixes."""
        popleft, stale = self.free_cached.popleft, self._num_stale
        hashes, srcs, hash_to_block_id = self.cached_hashes, self.cached_token_srcs, self._hash_to_block_id
        ref_counts = self._ref_counts
        while num:
            block_id = popleft()
            if stale and block_id in stale:  # an entry a prefix hit left behind
                self._drop_stale(block_id)
                continue
            del hash_to_block_id[hashes[block_id]]
            hashes[block_id] = None
            srcs[block_id] = None
            ref_counts[block_id] = 1
            table.append(block_id)
            num -= 1

    def _drop_stale(self, block_id: int) -> None:
        count = self._num_stale[block_id]
        if count == 1:
            del self._num_stale[block_id]
        else:
            self._num_stale[block_id] = count - 1
        self._num_stale_total -= 1

    # ---- registration ---------------------------------------------------------------------------
    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that are full once the first `num_tokens` tokens of `seq` are computed:
        at allocation, as in vLLM v1, so a request later in the same step may hit them. A copy of a
        registered block stays unregistered."""
        num_full = num_tokens // self.block_size
        hashes, tokens = self.block_hashes(seq, num_full), seq.token_ids
        table, setdefault = seq.block_table, self._hash_to_block_id.setdefault
        cached_hashes, srcs, indices = self.cached_hashes, self.cached_token_srcs, self.cached_block_indices
        for i in range(seq.num_cached_blocks, num_full):
            block_id = table[i]
            block_hash = hashes[i]
            if setdefault(block_hash, block_id) == block_id:  # else a copy, left uncached
                cached_hashes[block_id] = block_hash
                srcs[block_id] = tokens
                indices[block_id] = i
        seq.num_cached_blocks = num_full

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (between independent runs); only while no block is in use."""
        if self.num_used_blocks:
            raise RuntimeError(f"reset_prefix_cache: {self.num_used_blocks} blocks are still in use")
        n = self.num_blocks
        self.cached_hashes = [None] * n
        self.cached_token_srcs = [None] * n
        self._hash_to_block_id.clear()
        self.free_cached.clear()
        self._num_stale.clear()
        self._num_stale_total = 0
        self.free_uncached = list(range(n - 1, -1, -1))

    # ---- release --------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Release the blocks of `seq`, tail first, so that its prefix stays cached longest."""
        ref_counts, cached_hashes = self._ref_counts, self.cached_hashes
        to_front, to_back = self.free_uncached.append, self.free_cached.append
        num_freed = 0
        for block_id in reversed(seq.block_table):
            ref_count = ref_counts[block_id] - 1
            ref_counts[block_id] = ref_count
            if not ref_count:
                num_freed += 1
                if cached_hashes[block_id] is None:
                    to_front(block_id)
                else:
                    to_back(block_id)
        self.num_free_blocks += num_freed
        if self._num_stale_total > self.num_blocks:
            self._compact_free_cached()
        seq.block_table = []
        seq.num_cached_blocks = 0

    def _compact_free_cached(self) -> None:
        """Drop the stale entries of `free_cached` (hits on free blocks leave one each)."""
        live: deque = deque()
        stale = self._num_stale
        for block_id in self.free_cached:
            if stale.get(block_id):
                self._drop_stale(block_id)
            else:
                live.append(block_id)
        self.free_cached = live
