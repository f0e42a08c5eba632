"""Paged KV-cache block allocator with hash-chained prefix caching and LRU eviction.

Torch-free bookkeeping only (block ids, ref counts, hashes); the engine's KV tensor and the
simulator both follow it. Every operation on one block is O(1): the free list is an OrderedDict.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.config import cdiv
from engine.sequence import Sequence

ROOT_HASH = 0x6B76706C616E  # chain seed for a sequence's first block


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_src", "token_offset")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set once the block is registered in the cache
        self.token_src: list[int] | None = None  # token list holding this block's tokens ...
        self.token_offset = 0  # ... from this index: for the token check on a hit


class BlockManager:
    """Allocates fixed-size blocks to sequences; caches full blocks by the hash of their prefix chain.

    Free blocks wait in `free_block_ids`, least valuable first: blocks that hold no cached prefix sit
    at the front, cached ones join the back when their last user frees them, and allocation evicts
    from the front (least recently freed cached block once no uncached block is left).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be a positive integer, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size: must be a positive integer, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_evictions = 0

    # ---- counters -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        q = self.num_prefix_queried_tokens
        return self.num_prefix_hit_tokens / q if q else 0.0

    # ---- hashing --------------------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The hash chain of the first `num_blocks` full blocks of `seq` (memoised on the sequence)."""
        hashes = seq.block_hashes
        bs, tokens = self.block_size, seq.token_ids
        prev = hashes[-1] if hashes else ROOT_HASH
        for start in range(len(hashes) * bs, num_blocks * bs, bs):
            prev = hash((prev, tuple(tokens[start : start + bs])))
            hashes.append(prev)
        return hashes

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of `seq`, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        hashes = self.block_hashes(seq, max_blocks)
        hits: list[int] = []
        tokens, get = seq.token_ids, self.hash_to_block_id.get
        for i in range(max_blocks):
            block_id = get(hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            off = block.token_offset
            if block.token_src[off : off + bs] != tokens[i * bs : (i + 1) * bs]:
                break  # a hash collision: the tokens differ
            hits.append(block_id)
        return hits

    def block_token_ids(self, block_id: int) -> tuple[int, ...] | None:
        """The tokens a cached block holds (None when it holds no cached prefix)."""
        block = self.blocks[block_id]
        if block.token_src is None:
            return None
        return tuple(block.token_src[block.token_offset : block.token_offset + self.block_size])

    # ---- allocation -----------------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence, num_tokens: int, hits: list[int] | None = None) -> int:
        """Free blocks that covering `num_tokens` slots of `seq` (after taking `hits`) would use up."""
        have = len(seq.block_table) + (len(hits) if hits else 0)
        need = max(0, cdiv(num_tokens, self.block_size) - have)
        if hits:
            need += sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return need

    def allocate_slots(self, seq: Sequence, num_tokens: int, hits: list[int] | None = None) -> bool:
        """Grow `seq.block_table` to cover `num_tokens` slots, first taking the prefix-hit blocks, and
        register the blocks those tokens fill. Returns False, changing nothing, when too few are free.
        """
        table, free_ids = seq.block_table, self.free_block_ids
        if hits:
            if self.num_blocks_needed(seq, num_tokens, hits) > len(free_ids):
                return False
            for block_id in hits:
                block = self.blocks[block_id]
                if block.ref_count == 0:
                    del free_ids[block_id]
                block.ref_count += 1
                table.append(block_id)
            seq.num_cached_blocks = len(table)
        num_new = -(-num_tokens // self.block_size) - len(table)
        if num_new > len(free_ids):
            return False
        if num_new > 0:
            self.take_free_blocks(table, num_new)
        if self.enable_prefix_caching and num_tokens // self.block_size > seq.num_cached_blocks:
            self.cache_full_blocks(seq, num_tokens)
        return True

    def record_prefix_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.num_prefix_queried_tokens += num_queried_tokens
        self.num_prefix_hit_tokens += num_hit_tokens

    def take_free_blocks(self, table: list[int], num: int) -> None:
        """Append `num` blocks from the front of the free list to `table`, evicting cached prefixes."""
        popitem, blocks, cached = self.free_block_ids.popitem, self.blocks, self.hash_to_block_id
        num_evicted = 0
        for _ in range(num):
            block_id = popitem(last=False)[0]
            block = blocks[block_id]
            if block.block_hash is not None:  # evict the cached prefix this block held
                del cached[block.block_hash]  # a block keeps a hash only while the cache maps it there
                block.block_hash = None
                block.token_src = None
                num_evicted += 1
            block.ref_count = 1
            table.append(block_id)
        self.num_evictions += num_evicted

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that are full once the first `num_tokens` tokens of `seq` are computed.

        As in vLLM v1 this happens at allocation, for the tokens the coming step computes: a request
        scheduled later in the same step may hit them, because every layer stores its KV before it
        attends. A block keeps a reference to its tokens (the sequence's list, which only grows).
        """
        bs = self.block_size
        num_full = num_tokens // bs
        hashes, tokens = seq.block_hashes, seq.token_ids
        if len(hashes) + 1 == num_full:  # the decode case: one block to hash, inlined
            start = num_full * bs - bs
            hashes.append(hash((hashes[-1] if hashes else ROOT_HASH, tuple(tokens[start : start + bs]))))
        elif len(hashes) < num_full:
            self.block_hashes(seq, num_full)
        table, blocks = seq.block_table, self.blocks
        setdefault = self.hash_to_block_id.setdefault
        for i in range(seq.num_cached_blocks, num_full):
            block_id = table[i]
            block_hash = hashes[i]
            if setdefault(block_hash, block_id) == block_id:  # else a copy of a cached block, left uncached
                block = blocks[block_id]
                block.block_hash = block_hash
                block.token_src = tokens
                block.token_offset = i * bs
        seq.num_cached_blocks = num_full

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (between independent runs); only while no block is in use."""
        if self.num_used_blocks:
            raise RuntimeError(f"reset_prefix_cache: {self.num_used_blocks} blocks are still in use")
        for block in self.blocks:
            block.block_hash = None
            block.token_src = None
        self.hash_to_block_id.clear()
        self.free_block_ids = OrderedDict.fromkeys(range(self.num_blocks))

    def free(self, seq: Sequence) -> None:
        """Release the blocks of `seq`, tail first, so that its prefix stays cached longest."""
        free_ids, blocks = self.free_block_ids, self.blocks
        for block_id in reversed(seq.block_table):
            block = blocks[block_id]
            ref_count = block.ref_count - 1
            block.ref_count = ref_count
            if not ref_count:
                free_ids[block_id] = None
                if block.block_hash is None:
                    free_ids.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_cached_blocks = 0
