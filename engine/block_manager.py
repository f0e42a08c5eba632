"""Paged KV-cache block allocator with hash-chained prefix caching and LRU eviction.

Torch-free bookkeeping only (block ids, ref counts, hashes); the engine's KV tensor and the
simulator both follow it. Per-block state lives in flat lists indexed by block id, and the free list
in a list and a deque: every operation on one block is O(1) (amortized), with few dict operations.
A chain of blocks that nobody has found yet is registered lazily (see `BlockManager`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from itertools import islice

from engine.config import cdiv
from engine.sequence import Sequence

ROOT_HASH = 0x6B76706C616E  # chain seed for a sequence's first block


class _LazyChain:
    """The full blocks after a sequence's first block, while that block's hash is registered fresh
    and has never been found: cached, but neither hashed nor registered.

    While `seq` holds them they are its block_table[1:seq.num_cached_blocks]; `free` then moves them
    to `free_blocks` (index order; eviction takes them from the end), forgets `seq` and puts the
    chain in `free_cached` as one entry. `token_ids` and `block_hashes` are the sequence's lists, kept
    for a materialization after it let go: they only grow (the simulator rebinds a finished
    sequence's lists to empty ones, never clears them).
    """

    __slots__ = ("seq", "token_ids", "block_hashes", "free_blocks", "materialized")

    def __init__(self, seq: Sequence) -> None:
        self.seq: Sequence | None = seq
        self.token_ids = seq.token_ids
        self.block_hashes = seq.block_hashes
        self.free_blocks: list[int] = []
        self.materialized = False  # its free_blocks are registered now: evicted one by one


class BlockManager:
    """Allocates fixed-size blocks to sequences; caches full blocks by the hash of their prefix chain.

    The free list, least valuable first, is `free_uncached` (blocks that hold no cached prefix; a
    stack, its end is the front of the free list) followed by `free_cached` (cached blocks, least
    recently freed first): a freed block joins the front when it holds no cached prefix and the back
    when it does, and allocation takes from the front, evicting once no uncached block is left.
    A prefix hit on a free cached block takes it out of the middle of `free_cached` lazily: its entry
    stays, counted in `_num_stale`, and is skipped when it reaches the front.

    Lazy registration (`lazy_registration`, on by default; off registers every full block at once).
    Two full blocks share a hash only when their whole prefixes do (same depth, same first block),
    barring a true 64-bit hash collision, so the blocks "under" a first-block hash H are registered
    only by sequences whose first block has hash H, and a lookup reaches them only through H.
    A sequence that holds the block registered under H frees it after its later blocks (tail first),
    so those are evicted first; later blocks under H can outlive that block only when some sequence's
    first block was a copy of it (`_copied_first_hashes` records such hashes). Hence when a sequence
    registers its first block under a new hash that no first block ever copied, no block under that
    hash is registered, and until someone finds the hash no other sequence fills one: its later
    full blocks can be neither found nor copies. They are filled lazily: they count as cached (the
    sequence's `num_cached_blocks`; `free` puts them at the back of the free list, tail first, and
    eviction counts them), but are neither hashed nor registered, and carry no per-block state.
    A `_LazyChain`, in `_lazy_chains` under the first block's id, knows them: in the owner's block
    table, then, once freed, as one entry of `free_cached` that eviction cuts from by slicing.
    The chain is materialized (its blocks still cached are hashed and registered; the sequence
    registers eagerly from then on) as soon as its first block's hash is found: by a lookup, by
    another sequence whose first block is a copy of it, or by a view (`hash_to_block_id`,
    `block_hash`, `block_token_ids`). Eager registration gives the same hits, block ids, eviction
    order and counts:
    - lazy blocks take the free-list positions registered ones would (the back, tail first);
    - a lookup, copy test or fast-forward collision test that could meet a chain's block meets its
      first block's hash first, which materializes the chain;
    - a lazy chain's blocks are held by its sequence alone (a hit would have materialized it) and
      freed with it, before its first block, so they are evicted before it: a materialization
      registers exactly the blocks eager registration would still hold, and the chain goes when its
      first block is evicted.
    Only a hash collision across chains or depths could make a difference (such a block stays
    unregistered); the token check on a hit guards lookups against those either way.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        lazy_registration: bool = True,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be a positive integer, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size: must be a positive integer, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.lazy_registration = lazy_registration
        self.num_free_blocks = num_blocks
        self.free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        # registered blocks, and freed lazy chains (each stands for its free_blocks, last first)
        self.free_cached: deque[int | _LazyChain] = deque()
        self._num_stale: dict[int, int] = {}  # block id -> entries of free_cached that a hit left
        self._num_stale_total = 0
        # per block, the sequences holding it; but a freed lazy chain's blocks keep the 1 of their
        # sequence until they are evicted (to 1 again) or materialized: `ref_counts` corrects them
        self._ref_counts = [0] * num_blocks
        # per block, while it is registered in the cache: its hash, and where its tokens are for the
        # token check on a hit (a token list of the sequence that filled it, which only grows, and
        # the block's index in that sequence: mostly small ints, which cost no allocation)
        self.cached_hashes: list[int | None] = [None] * num_blocks
        self.cached_token_srcs: list[list[int] | None] = [None] * num_blocks
        self.cached_block_indices = [0] * num_blocks
        self._hash_to_block_id: dict[int, int] = {}
        self._lazy_chains: dict[int, _LazyChain] = {}  # first block id -> the chain after it
        # first-block hashes that a sequence's first block once copied: never lazy again (see above)
        self._copied_first_hashes: set[int] = set()
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_evictions = 0

    # ---- counters -------------------------------------------------------------------------------
    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_hit_rate(self) -> float:
        q = self.num_prefix_queried_tokens
        return self.num_prefix_hit_tokens / q if q else 0.0

    # ---- per-block views (tests, debugging); those that show hashes or tokens materialize -------
    @property
    def free_block_ids(self) -> list[int]:
        """The free list, front (allocated next) first: a snapshot."""
        skip = dict(self._num_stale)
        cached = []
        for block_id in _expand(self.free_cached):
            if skip.get(block_id):
                skip[block_id] -= 1
            else:
                cached.append(block_id)
        return self.free_uncached[::-1] + cached

    def ref_count(self, block_id: int) -> int:
        """Sequences holding `block_id`."""
        return 0 if block_id in self._lazy_free_blocks() else self._ref_counts[block_id]

    @property
    def ref_counts(self) -> list[int]:
        """Sequences holding each block: a snapshot."""
        counts = list(self._ref_counts)
        for block_id in self._lazy_free_blocks():
            counts[block_id] = 0
        return counts

    def _lazy_free_blocks(self) -> set[int]:
        """The free blocks of the freed lazy chains (their stored ref count is their sequence's 1)."""
        return {
            block_id
            for entry in self.free_cached
            if entry.__class__ is _LazyChain and not entry.materialized
            for block_id in entry.free_blocks
        }

    @property
    def hash_to_block_id(self) -> dict[int, int]:
        """Every registered hash -> its block id, lazy chains materialized first: the dict itself."""
        self.materialize_all()
        return self._hash_to_block_id

    def block_hash(self, block_id: int) -> int | None:
        """The hash a block is registered under (None when it holds no cached prefix)."""
        self.materialize_all()
        return self.cached_hashes[block_id]

    def block_token_ids(self, block_id: int) -> tuple[int, ...] | None:
        """The tokens a cached block holds (None when it holds no cached prefix)."""
        self.materialize_all()
        tokens = self.cached_token_srcs[block_id]
        if tokens is None:
            return None
        offset = self.cached_block_indices[block_id] * self.block_size
        return tuple(tokens[offset : offset + self.block_size])

    # ---- hashing --------------------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The hash chain of the first `num_blocks` full blocks of `seq` (memoised on the sequence)."""
        return self._extend_hash_chain(seq.block_hashes, seq.token_ids, num_blocks)

    def _extend_hash_chain(self, hashes: list[int], tokens: list[int], num_blocks: int) -> list[int]:
        """Extend `hashes`, the memo of the hash chain over the full blocks of `tokens`, to `num_blocks`."""
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
        """Block ids of the longest cached prefix of `seq`, leaving at least one token to compute.
        Only the first block is hashed unless it hits (it mostly misses)."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        if not max_blocks:
            return []
        get, hashes = self._hash_to_block_id.get, seq.block_hashes
        first = get(hashes[0] if hashes else self.block_hashes(seq, 1)[0])
        if first is None:
            return []
        if first in self._lazy_chains:
            self._materialize(first)
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
        """Whether one of `hashes` is registered. Lazy chains stay as they are: for the blocks of
        sequences that register eagerly the answer is the same (a lazy chain's hashes cannot match)."""
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
        False, changing nothing, when too few are free.
        """
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
        # the rest are cached blocks, least recently freed first: evict the prefixes they hold
        self.num_evictions += num
        if self._take_from_lazy_front(table, num):  # the usual case
            return
        popleft, stale = self.free_cached.popleft, self._num_stale
        hashes, srcs, hash_to_block_id = self.cached_hashes, self.cached_token_srcs, self._hash_to_block_id
        indices, lazy_chains = self.cached_block_indices, self._lazy_chains
        while num:
            block_id = popleft()
            if block_id.__class__ is _LazyChain:  # a freed lazy chain: many blocks at once
                num -= self._evict_lazy_blocks(block_id, num, table)
                continue
            if stale and block_id in stale:  # an entry a prefix hit left behind
                self._drop_stale(block_id)
                continue
            block_hash = hashes[block_id]
            if block_hash is not None:  # None: only a collision left it so (see _materialize)
                del hash_to_block_id[block_hash]
                if not indices[block_id]:  # a first block: the chain after it (if lazy) goes too
                    lazy_chains.pop(block_id, None)
            hashes[block_id] = None
            srcs[block_id] = None
            ref_counts[block_id] = 1
            table.append(block_id)
            num -= 1

    def _take_from_lazy_front(self, table: list[int], num: int) -> bool:
        """`take_free_blocks` of `num` cached blocks when the front of the free list is a freed lazy
        chain that keeps more than that many: its last ones, last first, the chain staying in front
        (as `_evict_lazy_blocks` would leave it); else False, taking none."""
        chain = self.free_cached[0]
        if chain.__class__ is not _LazyChain or chain.materialized:
            return False
        blocks = chain.free_blocks
        if len(blocks) <= num:
            return False
        if num == 1:  # a decode opening a block
            table.append(blocks.pop())  # its stored ref count is already 1 (see `_free_lazy`)
        else:
            table += blocks[: -num - 1 : -1]
            del blocks[-num:]
        return True

    def _evict_lazy_blocks(self, chain: _LazyChain, num: int, table: list[int]) -> int:
        """Append up to `num` of the free blocks of `chain` (just taken off the front of free_cached)
        to `table`, last first, putting the chain back in front if some are left; returns how many."""
        blocks = chain.free_blocks
        if chain.materialized:  # registered blocks now: back in front one by one, to evict as such
            self.free_cached.extendleft(blocks)
            return 0
        n = min(num, len(blocks))
        taken = blocks[: -n - 1 : -1]  # their stored ref count is already 1 (see `_free_lazy`)
        del blocks[-n:]
        table += taken
        if blocks:
            self.free_cached.appendleft(chain)
        return n

    def _drop_stale(self, block_id: int) -> None:
        count = self._num_stale[block_id]
        if count == 1:
            del self._num_stale[block_id]
        else:
            self._num_stale[block_id] = count - 1
        self._num_stale_total -= 1

    # ---- registration ---------------------------------------------------------------------------
    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that are full once the first `num_tokens` tokens of `seq` are computed.

        As in vLLM v1 this happens at allocation, for the tokens the coming step computes: a request
        scheduled later in the same step may hit them, because every layer stores its KV before it
        attends. A block keeps a reference to its tokens (the sequence's list, which only grows).
        A full block whose hash is already registered (a copy of a cached block) stays unregistered.
        The blocks after a fresh, never found first block join its lazy chain instead.
        """
        num_full = num_tokens // self.block_size
        first = seq.num_cached_blocks
        if first:
            chain = self._lazy_chains.get(seq.block_table[0])  # registers_lazily, inlined
            if chain is not None and chain.seq is seq:
                seq.num_cached_blocks = num_full
                return
        elif self.lazy_registration and self._register_first_block(seq):
            seq.num_cached_blocks = num_full
            return
        self._register(seq, first, num_full)

    def _register(self, seq: Sequence, first: int, num_full: int) -> None:
        """Register blocks first..num_full - 1 of `seq` under their hashes (eager registration)."""
        hashes, tokens = self.block_hashes(seq, num_full), seq.token_ids
        table, setdefault = seq.block_table, self._hash_to_block_id.setdefault
        cached_hashes, srcs, indices = self.cached_hashes, self.cached_token_srcs, self.cached_block_indices
        for i in range(first, num_full):
            block_id = table[i]
            block_hash = hashes[i]
            if setdefault(block_hash, block_id) == block_id:  # else a copy of a cached block, left uncached
                cached_hashes[block_id] = block_hash
                srcs[block_id] = tokens
                indices[block_id] = i
        seq.num_cached_blocks = num_full

    def _register_first_block(self, seq: Sequence) -> bool:
        """Register the first block of `seq`; True when its hash was new: a lazy chain starts after it.
        When the block is a copy, the chain it copies is materialized and False returned."""
        block_id, block_hash = seq.block_table[0], self.block_hashes(seq, 1)[0]
        found = self._hash_to_block_id.setdefault(block_hash, block_id)
        if found != block_id:
            self._copied_first_hashes.add(block_hash)
            if found in self._lazy_chains:
                self._materialize(found)
            return False
        if block_hash in self._copied_first_hashes:
            return False  # blocks under this hash may be registered after all (a copy's chain)
        self.cached_hashes[block_id] = block_hash
        self.cached_token_srcs[block_id] = seq.token_ids
        self.cached_block_indices[block_id] = 0
        self._lazy_chains[block_id] = _LazyChain(seq)
        return True

    def split_lazy_fills(
        self, fills: list[tuple[Sequence, int]]
    ) -> tuple[list[tuple[Sequence, int]], list[tuple[Sequence, int]]]:
        """(sequence, computed tokens) pairs that fill blocks, split into those that register lazily
        (`registers_lazily`) and the others, in order."""
        chains = self._lazy_chains
        lazy: list[tuple[Sequence, int]] = []
        eager: list[tuple[Sequence, int]] = []
        for fill in fills:
            seq = fill[0]
            chain = chains.get(seq.block_table[0]) if seq.num_cached_blocks else None
            (lazy if chain is not None and chain.seq is seq else eager).append(fill)
        return lazy, eager

    def extend_lazy_chains(self, fills: list[tuple[Sequence, int]]) -> None:
        """`cache_full_blocks` of (sequence, computed tokens) pairs whose sequences register lazily
        (`split_lazy_fills`): their new full blocks join their chains."""
        bs = self.block_size
        for seq, num_tokens in fills:
            seq.num_cached_blocks = num_tokens // bs

    def registers_lazily(self, seq: Sequence) -> bool:
        """Whether the full blocks `seq` fills next join its lazy chain: then their hashes match no
        registered hash and no block that another sequence fills."""
        if not seq.num_cached_blocks:
            return False
        chain = self._lazy_chains.get(seq.block_table[0])
        return chain is not None and chain.seq is seq

    def _materialize(self, first_block_id: int) -> None:
        """Hash and register the blocks of the lazy chain after `first_block_id` that are still cached:
        all of them while its sequence holds them, else the free ones eviction has not reached."""
        chain = self._lazy_chains.pop(first_block_id)
        seq = chain.seq
        if seq is not None:
            blocks = seq.block_table[1 : seq.num_cached_blocks]
        else:
            blocks = chain.free_blocks
            chain.materialized = True
            ref_counts = self._ref_counts
            for block_id in blocks:
                ref_counts[block_id] = 0  # free, registered from now on (see `_free_lazy`)
        tokens = chain.token_ids
        hashes = self._extend_hash_chain(chain.block_hashes, tokens, len(blocks) + 1)
        setdefault = self._hash_to_block_id.setdefault
        cached_hashes, srcs, indices = self.cached_hashes, self.cached_token_srcs, self.cached_block_indices
        for i, block_id in enumerate(blocks, 1):
            if setdefault(hashes[i], block_id) == block_id:  # else a hash collision: left unregistered
                cached_hashes[block_id] = hashes[i]
                srcs[block_id] = tokens
                indices[block_id] = i

    def materialize_all(self) -> None:
        """Register every lazy chain (for the views; changes no outcome)."""
        for first_block_id in list(self._lazy_chains):
            self._materialize(first_block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (between independent runs); only while no block is in use."""
        if self.num_used_blocks:
            raise RuntimeError(f"reset_prefix_cache: {self.num_used_blocks} blocks are still in use")
        n = self.num_blocks
        self._ref_counts = [0] * n  # freed lazy chains' blocks kept their 1
        self.cached_hashes = [None] * n
        self.cached_token_srcs = [None] * n
        self._hash_to_block_id.clear()
        self._lazy_chains.clear()
        self._copied_first_hashes.clear()
        self.free_cached.clear()
        self._num_stale.clear()
        self._num_stale_total = 0
        self.free_uncached = list(range(n - 1, -1, -1))

    # ---- release --------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Release the blocks of `seq`, tail first, so that its prefix stays cached longest."""
        if self.registers_lazily(seq):
            self._free_lazy(seq)
        else:
            self._free_blocks(seq.block_table)
        if self._num_stale_total > self.num_blocks:
            self._compact_free_cached()
        seq.block_table = []
        seq.num_cached_blocks = 0

    def _free_blocks(self, table: list[int]) -> None:
        ref_counts, cached_hashes = self._ref_counts, self.cached_hashes
        to_front, to_back = self.free_uncached.append, self.free_cached.append
        num_freed = 0
        for block_id in reversed(table):
            ref_count = ref_counts[block_id] - 1
            ref_counts[block_id] = ref_count
            if not ref_count:
                num_freed += 1
                if cached_hashes[block_id] is None:
                    to_front(block_id)
                else:
                    to_back(block_id)
        self.num_free_blocks += num_freed

    def _free_lazy(self, seq: Sequence) -> None:
        """`free` for a sequence whose chain is lazy: it alone holds its blocks, the first registered,
        the next ones lazy, the rest (a partial tail) uncached; the lazy ones go as one entry."""
        table, n = seq.block_table, seq.num_cached_blocks
        chain = self._lazy_chains[table[0]]
        ref_counts = self._ref_counts
        ref_counts[table[0]] = 0
        for block_id in table[n:]:
            ref_counts[block_id] = 0
        # the lazy blocks keep their 1: eviction hands them out with it, a materialization zeroes it
        self.free_uncached += table[: n - 1 : -1]
        if n > 1:
            chain.free_blocks = table[1:n]
            self.free_cached.append(chain)
        self.free_cached.append(table[0])
        chain.seq = None
        self.num_free_blocks += len(table)

    def _compact_free_cached(self) -> None:
        """Drop the stale entries of `free_cached` (hits on free blocks leave one each)."""
        live: deque[int | _LazyChain] = deque()
        stale = self._num_stale
        for entry in self.free_cached:
            if entry.__class__ is _LazyChain and not entry.materialized:
                live.append(entry)  # no hit reaches a lazy block
                continue
            for block_id in _expand((entry,)):
                if stale.get(block_id):
                    self._drop_stale(block_id)
                else:
                    live.append(block_id)
        self.free_cached = live


def _expand(entries: Iterable[int | _LazyChain]) -> Iterator[int]:
    """The block ids of free_cached entries, in eviction order."""
    for entry in entries:
        if entry.__class__ is _LazyChain:
            yield from reversed(entry.free_blocks)
        else:
            yield entry
