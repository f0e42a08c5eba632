"""Lazy registration: the full blocks after a sequence's fresh first block are cached but neither
hashed nor registered until someone finds that first block, with the outcomes of eager registration.

White-box where it shows the laziness (`_hash_to_block_id` and `_lazy_chains` read directly, since
the public views materialize); every scenario also runs on the core's eager BlockManager, and
both must agree on hits, block ids, the free list, ref counts,
evictions and, at the end, hashes and cached tokens.
"""

from __future__ import annotations

from cp_helpers import admit, allocation_state, batch_summary, block_manager_state, make_scheduler, seq

from engine.core.block_manager import BlockManager
from engine.core.sequence import SequenceStatus
from engine.sampling_params import SamplingParams
from simulator.lazy_blocks import LazyBlockManager


def lazy_and_eager(num_blocks: int, block_size: int) -> tuple[BlockManager, BlockManager]:
    return LazyBlockManager(num_blocks, block_size), BlockManager(num_blocks, block_size)


def num_registered(bm: BlockManager) -> int:
    """Registered hashes, lazy chains left as they are."""
    return len(bm._hash_to_block_id)


def test_blocks_after_a_fresh_first_block_are_cached_but_not_registered():
    seen = []
    for bm in lazy_and_eager(8, 2):
        a = seq(0, [1, 2, 3, 4, 5, 6, 7])
        admit(bm, a)  # blocks 0 (first), 1, 2 full; 3 partial
        assert (a.block_table, a.num_cached_blocks) == ([0, 1, 2, 3], 3)
        if isinstance(bm, LazyBlockManager):
            assert num_registered(bm) == 1
            assert bm.registers_lazily(a) and list(bm._lazy_chains) == [0]
            assert a.block_hashes == bm.block_hashes(seq(9, [1, 2]), 1)  # only the first is hashed
        before = allocation_state(bm)
        b = seq(1, [1, 2, 3, 4, 5, 6, 9])  # shares a's three full blocks
        hits = admit(bm, b)
        assert hits == [0, 1, 2]
        if isinstance(bm, LazyBlockManager):  # the lookup found block 0: a's chain registered, a eager
            assert num_registered(bm) == 3
            assert not bm.registers_lazily(a) and not bm._lazy_chains
        a.token_ids.append(8)
        assert bm.allocate_slots(a, 8)  # fills block 3 ([7, 8]): registered at once now
        assert num_registered(bm) == 4
        seen.append((before, hits, allocation_state(bm), block_manager_state(bm)))
    assert seen[0] == seen[1]


def test_a_preempted_sequence_hits_its_own_lazy_chain_again():
    seen = []
    for lazy in (True, False):
        sched, bm, clock = make_scheduler(
            block_size=2, num_blocks=5, max_num_seqs=4, max_num_batched_tokens=64, lazy_registration=lazy
        )
        a = sched.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
        b = sched.add_request([4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
        steps = []
        for token in (7, 9, 11, 13):
            batch = sched.schedule()
            steps.append((batch_summary(batch), allocation_state(bm)))
            clock.t += 1.0
            sched.postprocess(batch, [token] * batch.num_seqs)
            if token == 11:  # B was preempted (blocks 2, 3) and A finished (blocks 0, 1, 4)
                assert b.status is SequenceStatus.WAITING and a.status is SequenceStatus.FINISHED
                if lazy:  # both chains freed unregistered after their first blocks
                    assert num_registered(bm) == 2 and sorted(bm._lazy_chains) == [0, 2]
        assert b.block_table[:2] == [2, 3] and steps[-1][0][4] == (4,)  # B's resumption hit 4 tokens
        if lazy:
            assert num_registered(bm) == 3 and list(bm._lazy_chains) == [0]
        seen.append((steps, block_manager_state(bm)))
    assert seen[0] == seen[1]


def test_a_copy_of_a_first_block_materializes_the_chain_it_copies():
    seen = []
    for bm in lazy_and_eager(6, 2):
        a = seq(0, [1, 2, 3, 4, 5])  # blocks 0 (first), 1 full; 2 partial
        admit(bm, a)
        b = seq(1, [1, 2])  # one block, and one token left to compute: no lookup can hit
        assert admit(bm, b) == []
        assert b.block_table == [3]  # a copy of block 0, left unregistered
        if isinstance(bm, LazyBlockManager):
            assert num_registered(bm) == 2 and not bm._lazy_chains
        a.token_ids.append(6)
        assert bm.allocate_slots(a, 6)  # a fills block 2: registered at once
        assert num_registered(bm) == 3
        bm.free(b)
        assert bm.free_block_ids[0] == 3  # the copy goes to the front
        bm.free(a)
        seen.append((allocation_state(bm), block_manager_state(bm)))
    assert seen[0] == seen[1]


def test_lazy_blocks_are_evicted_tail_first_and_a_later_hit_finds_what_is_left():
    seen = []
    for bm in lazy_and_eager(8, 2):
        a = seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # 0 (first), 1, 2, 3 full; 4 partial
        admit(bm, a)
        bm.free(a)
        assert bm.free_block_ids == [4, 5, 6, 7, 3, 2, 1, 0]
        c = seq(1, list(range(20, 31)))  # 6 blocks: 4 uncached, then a's tail blocks 3 and 2
        admit(bm, c)
        assert c.block_table == [4, 5, 6, 7, 3, 2]
        assert bm.num_evictions == 2
        bm.free(c)
        assert bm.free_block_ids == [2, 1, 0, 3, 7, 6, 5, 4]
        d = seq(2, [1, 2, 3, 4, 5, 6, 7, 8, 9])
        assert admit(bm, d) == [0, 1]  # a's block 2 is gone, so the chain stops there
        assert d.block_table == [0, 1, 2, 3, 7]  # then 2 (uncached) and c's two tail blocks
        assert bm.num_evictions == 4
        seen.append((allocation_state(bm), block_manager_state(bm)))
    assert seen[0] == seen[1]


def test_the_chain_goes_when_its_first_block_is_evicted():
    seen = []
    for bm in lazy_and_eager(4, 2):
        a = seq(0, [1, 2, 3, 4, 5])  # 0 (first), 1 full; 2 partial
        admit(bm, a)
        bm.free(a)
        if isinstance(bm, LazyBlockManager):
            assert list(bm._lazy_chains) == [0]
        e = seq(1, list(range(10, 17)))  # the whole cache: 2, 3, then a's 1 and 0 are evicted
        admit(bm, e)
        assert e.block_table == [2, 3, 1, 0] and bm.num_evictions == 2
        if isinstance(bm, LazyBlockManager):
            assert list(bm._lazy_chains) == [2]  # e's own chain; a's went with block 0
        assert bm.lookup_prefix(seq(2, [1, 2, 3, 4, 5])) == []
        seen.append((allocation_state(bm), block_manager_state(bm)))
    assert seen[0] == seen[1]


def test_a_chain_outlives_the_lists_a_finished_sequence_drops():
    """The simulator rebinds a finished request's token_ids and block_hashes to empty lists."""
    seen = []
    for bm in lazy_and_eager(8, 2):
        a = seq(0, [1, 2, 3, 4, 5, 6, 7])
        admit(bm, a)
        bm.free(a)
        a.token_ids, a.block_hashes = [], []
        b = seq(1, [1, 2, 3, 4, 5, 6, 8])
        assert admit(bm, b) == [0, 1, 2]
        assert [bm.block_token_ids(i) for i in range(3)] == [(1, 2), (3, 4), (5, 6)]
        seen.append((allocation_state(bm), block_manager_state(bm)))
    assert seen[0] == seen[1]


def test_views_materialize_and_change_no_outcome():
    seen = []
    for look in (False, True):
        bm = LazyBlockManager(6, 2)
        a = seq(0, [1, 2, 3, 4, 5])
        admit(bm, a)
        if look:
            assert len(bm.hash_to_block_id) == 2 and not bm._lazy_chains
        bm.free(a)
        b = seq(1, [1, 2, 3, 4, 9])
        seen.append((admit(bm, b), allocation_state(bm), block_manager_state(bm)))
    assert seen[0] == seen[1]


def test_blocks_taken_from_a_freed_lazy_chain_in_front_are_its_last_ones():
    seen = []
    for bm in lazy_and_eager(8, 2):
        a = seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
        admit(bm, a)  # blocks 0 (first) .. 5, all full: 1..5 lazy
        bm.free(a)
        bm.take_free_blocks([], 2)  # the two uncached blocks (6, 7)
        table: list[int] = []
        bm.take_free_blocks(table, 3)  # from the chain in front: its last three, last first
        assert table == [5, 4, 3]
        if isinstance(bm, LazyBlockManager):
            assert [len(e.free_blocks) for e in bm.free_cached if not isinstance(e, int)] == [2]
        bm.take_free_blocks(table, 1)
        assert table == [5, 4, 3, 2]
        seen.append((table, allocation_state(bm), block_manager_state(bm)))
    assert seen[0] == seen[1]


def test_run_fills_split_into_lazy_and_eager_ones():
    bm = LazyBlockManager(16, 2)
    a = seq(0, [1, 2, 3, 4, 5, 6, 7])
    admit(bm, a)  # a lazy chain: blocks 1, 2 after first block 0
    b = seq(1, [9])  # no full block yet: its first fill registers eagerly
    admit(bm, b)
    assert bm.split_lazy_fills([(a, 9), (b, 2)]) == ([(a, 9)], [(b, 2)])
    assert bm.split_lazy_fills([]) == ([], [])
    states = []
    for extend in (True, False):
        bm = LazyBlockManager(16, 2)
        a = seq(0, [1, 2, 3, 4, 5, 6, 7])
        admit(bm, a)
        a.token_ids += [8, 9]
        bm.take_free_blocks(a.block_table, 1)  # blocks for 9 tokens: 4 and 5 full after the step
        if extend:
            bm.extend_lazy_chains([(a, 9)])
        else:
            bm.cache_full_blocks(a, 9)
        states.append((a.num_cached_blocks, bm.registers_lazily(a), num_registered(bm), allocation_state(bm)))
    assert states[0] == states[1]
    assert states[0][:3] == (4, True, 1)  # still lazy: only the first block is registered
