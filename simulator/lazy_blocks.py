"""Lazy prefix registration: the simulator's `BlockManager`, beside the core, with the same outcomes.

`LazyBlockManager` leaves the full blocks after a sequence's fresh, never found first block cached
but unhashed and unregistered until someone finds that first block. Block ids, hits, eviction order
and counts equal the core's eager registration (tests/control_plane/test_lazy_registration.py and
the lockstep tests in test_properties.py hold it to that). The engine never uses it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence


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


class LazyBlockManager(BlockManager):
    """The core `BlockManager`, registering the blocks after a fresh first block lazily.

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

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        # free_cached also holds freed lazy chains (each stands for its free_blocks, last first), whose
        # blocks keep the ref count 1 of their sequence until they are evicted or materialized
        self._lazy_chains: dict[int, _LazyChain] = {}  # first block id -> the chain after it
        # first-block hashes that a sequence's first block once copied: never lazy again (see above)
        self._copied_first_hashes: set[int] = set()

    # ---- views: those that show hashes or tokens materialize ------------------------------------
    def _free_cached_blocks(self) -> Iterator[int]:
        return _expand(self.free_cached)

    def ref_count(self, block_id: int) -> int:
        return 0 if block_id in self._lazy_free_blocks() else self._ref_counts[block_id]

    @property
    def ref_counts(self) -> list[int]:
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
        self.materialize_all()
        return self._hash_to_block_id

    def block_hash(self, block_id: int) -> int | None:
        self.materialize_all()
        return super().block_hash(block_id)

    def block_token_ids(self, block_id: int) -> tuple[int, ...] | None:
        self.materialize_all()
        return super().block_token_ids(block_id)

    # ---- lookup ---------------------------------------------------------------------------------
    def lookup_prefix(self, seq: Sequence) -> list[int]:
        hits = super().lookup_prefix(seq)
        if hits and hits[0] in self._lazy_chains:  # found a fresh first block: register its chain
            self._materialize(hits[0])
            hits = super().lookup_prefix(seq)
        return hits

    # ---- eviction -------------------------------------------------------------------------------
    def _evict(self, table: list[int], num: int) -> None:
        if self._take_from_lazy_front(table, num):  # the usual case
            return
        popleft, stale = self.free_cached.popleft, self._num_stale
        hashes, srcs, hash_to_block_id = self.cached_hashes, self.cached_token_srcs, self._hash_to_block_id
        indices, lazy_chains, ref_counts = self.cached_block_indices, self._lazy_chains, self._ref_counts
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
        """`_evict` of `num` blocks when the front of the free list is a freed lazy chain that keeps
        more than that many: its last ones, last first, the chain staying in front (as
        `_evict_lazy_blocks` would leave it); else False, taking none."""
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

    # ---- registration ---------------------------------------------------------------------------
    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """The core's registration, but the blocks after a fresh, never found first block join its
        lazy chain instead."""
        if seq.num_cached_blocks:
            chain = self._lazy_chains.get(seq.block_table[0])  # registers_lazily, inlined
            if chain is not None and chain.seq is seq:
                seq.num_cached_blocks = num_tokens // self.block_size
                return
        elif self._register_first_block(seq):
            seq.num_cached_blocks = num_tokens // self.block_size
            return
        super().cache_full_blocks(seq, num_tokens)

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

    def registers_lazily(self, seq: Sequence) -> bool:
        """Whether the full blocks `seq` fills next join its lazy chain: then their hashes match no
        registered hash and no block that another sequence fills."""
        if not seq.num_cached_blocks:
            return False
        chain = self._lazy_chains.get(seq.block_table[0])
        return chain is not None and chain.seq is seq

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
        super().reset_prefix_cache()
        self._ref_counts = [0] * self.num_blocks  # freed lazy chains' blocks kept their 1
        self._lazy_chains.clear()
        self._copied_first_hashes.clear()

    # ---- release --------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        if self.registers_lazily(seq):
            self._free_lazy(seq)
            seq.block_table = []
        super().free(seq)

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
