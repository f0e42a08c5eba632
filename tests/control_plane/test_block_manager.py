"""BlockManager: exact block ids, ref counts, prefix hits, hash-collision token check, LRU eviction.

Semantics under test (vLLM v1 style): a block's hash is registered at allocation, for the tokens the
coming step computes; `free` releases tail first; free blocks wait in an OrderedDict where blocks
without a cached prefix go to the front and cached ones to the back; allocation pops the front.
"""

import pytest
from cp_helpers import admit, block_tokens, make_scheduler, seq

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence
from engine.sampling_params import SamplingParams

GREEDY_ONE = SamplingParams(max_tokens=1, ignore_eos=True)


def check_consistent(bm: BlockManager, *holders: Sequence) -> None:
    refs = {}
    for s in holders:
        for b in s.block_table:
            refs[b] = refs.get(b, 0) + 1
    for block_id in range(bm.num_blocks):
        assert bm.ref_count(block_id) == refs.get(block_id, 0)
        assert (block_id in bm.free_block_ids) == (bm.ref_count(block_id) == 0)


# ---- the seed example -----------------------------------------------------------------------------------
def test_seed_example_through_the_scheduler():
    sched, bm, _ = make_scheduler(block_size=3, num_blocks=8)
    a = sched.add_request([10, 12, 15, 16], GREEDY_ONE)
    b = sched.add_request([10, 12, 15, 10, 12, 15], GREEDY_ONE)
    c = sched.add_request([10, 12], GREEDY_ONE)
    batch = sched.schedule()
    assert batch.seqs == (a, b, c)
    assert [a.block_table, b.block_table, c.block_table] == [[0, 1], [0, 2], [3]]
    assert batch.num_cached_tokens == (0, 3, 0)
    assert batch.num_computed_tokens == (0, 3, 0)
    assert batch.num_scheduled_tokens == (4, 3, 2)
    assert batch.total_num_cached_tokens == 3
    assert batch.num_kv_blocks_used == 4
    assert [bm.ref_count(i) for i in range(bm.num_blocks)] == [2, 1, 1, 1, 0, 0, 0, 0]
    assert list(bm.free_block_ids) == [4, 5, 6, 7]
    assert (bm.num_prefix_hit_tokens, bm.num_prefix_queried_tokens) == (3, 4 + 6 + 2)
    assert bm.prefix_hit_rate == 3 / 12
    # full blocks are registered at allocation: block 0 [10,12,15] and block 2 (the second
    # [10,12,15], a different hash: its chain starts from block 0); partial blocks 1 and 3 are not
    assert [block_tokens(bm, i) for i in range(4)] == [(10, 12, 15), None, (10, 12, 15), None]
    assert sorted(bm.hash_to_block_id.values()) == [0, 2]
    assert b.num_cached_tokens == 3

    finished = sched.postprocess(batch, [7, 7, 7])  # max_tokens=1: all three finish, in batch order
    assert finished == [a, b, c]
    # a frees 1 (uncached: front) then 0 (still held by b); b frees 2 then 0 (cached: back);
    # c frees 3 (uncached: front)
    assert list(bm.free_block_ids) == [3, 1, 4, 5, 6, 7, 2, 0]
    assert [bm.ref_count(i) for i in range(bm.num_blocks)] == [0] * 8
    assert a.block_table == b.block_table == c.block_table == []


def test_seed_example_on_the_block_manager():
    bm = BlockManager(8, 3)
    a, b, c = seq(0, [10, 12, 15, 16]), seq(1, [10, 12, 15, 10, 12, 15]), seq(2, [10, 12])
    assert admit(bm, a) == []
    assert admit(bm, b) == [0]
    assert admit(bm, c) == []
    assert [a.block_table, b.block_table, c.block_table] == [[0, 1], [0, 2], [3]]
    assert (bm.num_prefix_hit_tokens, bm.num_prefix_queried_tokens) == (3, 12)
    check_consistent(bm, a, b, c)
    # a request that repeats b's six tokens and adds one hits both of b's blocks
    d = seq(3, [10, 12, 15, 10, 12, 15, 1])
    assert bm.lookup_prefix(d) == [0, 2]


# ---- hits ----------------------------------------------------------------------------------------------
def test_lookup_leaves_at_least_one_token_to_compute():
    bm = BlockManager(8, 2)
    admit(bm, seq(0, [1, 2, 3, 4]))  # 2 full blocks, both registered
    assert sorted(bm.hash_to_block_id.values()) == [0, 1]
    assert bm.lookup_prefix(seq(1, [1, 2, 3, 4])) == [0]  # exactly 2 cached blocks: hits 1
    assert bm.lookup_prefix(seq(2, [1, 2, 3, 4, 5])) == [0, 1]
    assert bm.lookup_prefix(seq(3, [1, 2])) == []  # exactly 1 cached block: hits 0
    assert bm.lookup_prefix(seq(4, [1])) == []
    assert bm.lookup_prefix(seq(5, [1, 2, 9, 4, 5])) == [0]  # chain stops at the first miss
    assert bm.lookup_prefix(seq(6, [9, 2, 3, 4, 5])) == []  # a later block never hits alone


def test_hits_across_the_same_step_see_blocks_registered_at_allocation():
    bm = BlockManager(8, 2)
    a = seq(0, [1, 2, 3])
    assert bm.allocate_slots(a, 2)  # only the first chunk of 2 tokens is scheduled
    assert block_tokens(bm, a.block_table[0]) == (1, 2)
    assert bm.lookup_prefix(seq(1, [1, 2, 3])) == a.block_table[:1]


def test_hash_collision_is_caught_by_the_token_check():
    bm = BlockManager(4, 2)
    a = seq(0, [1, 2, 3])
    admit(bm, a)
    b = seq(1, [5, 6, 7])
    h = bm.block_hashes(b, 1)[0]
    assert h not in bm.hash_to_block_id
    bm.hash_to_block_id[h] = a.block_table[0]  # a colliding entry: same hash, tokens (1, 2)
    assert block_tokens(bm, a.block_table[0]) == (1, 2)
    assert bm.lookup_prefix(b) == []
    # control: the same forged entry is a hit when the tokens do match
    c = seq(2, [1, 2, 7])
    bm.hash_to_block_id[bm.block_hashes(c, 1)[0]] = a.block_table[0]
    assert bm.lookup_prefix(c) == [a.block_table[0]]


def test_hit_on_a_free_cached_block_takes_it_off_the_free_list():
    bm = BlockManager(4, 2)
    a = seq(0, [1, 2, 3])
    admit(bm, a)  # blocks 0 (cached) and 1 (partial)
    bm.free(a)
    assert list(bm.free_block_ids) == [1, 2, 3, 0]
    b = seq(1, [1, 2, 3, 4, 5])
    hits = bm.lookup_prefix(b)
    assert hits == [0]
    assert bm.num_blocks_needed(b, 5, hits) == 2 + 1  # 2 fresh blocks + the free cached hit
    assert bm.allocate_slots(b, 5, hits)
    assert b.block_table == [0, 1, 2]
    assert bm.ref_count(0) == 1
    assert list(bm.free_block_ids) == [3, 0][:1]
    assert bm.num_evictions == 0


def test_prefix_caching_off_registers_nothing():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    a = seq(0, [1, 2, 3, 4])
    admit(bm, a)
    assert bm.hash_to_block_id == {}
    assert bm.lookup_prefix(seq(1, [1, 2, 3, 4, 5])) == []
    bm.free(a)
    assert list(bm.free_block_ids) == [0, 1, 2, 3]  # all uncached: each one moved to the front


def test_tail_block_filled_by_a_decode_is_registered_by_the_next_step():
    """A decode's pending token (7 here) may not have reached the host when an engine schedules
    ahead, so the block it fills is registered by the next step, before that step admits."""
    sched, bm, clock = make_scheduler(block_size=4, num_blocks=8)
    a = sched.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    for token in (7, 8):
        batch = sched.schedule()
        sched.postprocess(batch, [token] * batch.num_seqs)
    # step 1 computed [1, 2, 3] and sampled 7; step 2 computed 7, which filled block 0
    assert a.token_ids == [1, 2, 3, 7, 8]
    assert block_tokens(bm, a.block_table[0]) is None and a.num_cached_blocks == 0
    b = sched.add_request([1, 2, 3, 7, 8], SamplingParams(max_tokens=1, ignore_eos=True))
    batch = sched.schedule()  # a opens block 1, registering block 0 first; then b hits it
    assert block_tokens(bm, a.block_table[0]) == (1, 2, 3, 7)
    assert batch.seqs == (a, b)
    assert batch.num_cached_tokens == (0, 4)
    assert b.block_table[0] == a.block_table[0]
    assert bm.ref_count(a.block_table[0]) == 2


def test_registration_is_idempotent_over_decode_steps():
    bm = BlockManager(8, 2)
    a = seq(0, [1, 2, 3])
    admit(bm, a)
    assert a.num_cached_blocks == 1
    a.token_ids.append(4)
    assert bm.allocate_slots(a, 4)  # the decode that fills block 1
    assert a.num_cached_blocks == 2
    snapshot = dict(bm.hash_to_block_id)
    assert bm.allocate_slots(a, 4)  # asking again changes nothing
    assert bm.hash_to_block_id == snapshot
    assert a.block_table == [0, 1]


# ---- allocation failure -----------------------------------------------------------------------------------
def test_allocation_failure_changes_nothing():
    bm = BlockManager(3, 2)
    a = seq(0, [1, 2, 3])
    admit(bm, a)
    before = (
        list(bm.free_block_ids),
        dict(bm.hash_to_block_id),
        [bm.ref_count(i) for i in range(bm.num_blocks)],
    )
    big = seq(1, [1, 2, 9, 9, 9])  # hits block 0, needs 2 more blocks, only 1 free
    hits = bm.lookup_prefix(big)
    assert hits == [0]
    assert not bm.allocate_slots(big, 5, hits)
    assert not bm.allocate_slots(seq(2, [5, 6, 7, 8, 9]), 5)
    assert big.block_table == []
    assert (
        list(bm.free_block_ids),
        dict(bm.hash_to_block_id),
        [bm.ref_count(i) for i in range(bm.num_blocks)],
    ) == before


def test_constructor_validates():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(16, 0)


# ---- eviction order ---------------------------------------------------------------------------------------
def test_uncached_blocks_are_reused_before_cached_ones():
    bm = BlockManager(4, 2)
    a = seq(0, [1, 2, 3])  # block 0 cached, block 1 partial
    admit(bm, a)
    bm.free(a)
    b = seq(1, [5, 6, 7])  # two new blocks: 1 (uncached, front) then 2 (never used)
    admit(bm, b)
    assert b.block_table == [1, 2]
    assert bm.num_evictions == 0
    assert bm.lookup_prefix(seq(2, [1, 2, 3])) == [0]  # a's prefix survived


def test_lru_eviction_order_is_exact():
    bm = BlockManager(6, 2)
    a = seq(0, [1, 2, 3, 4, 5])  # blocks 0, 1 cached; 2 partial
    b = seq(1, [6, 7, 8, 9, 10])  # blocks 3, 4 cached; 5 partial
    admit(bm, a)
    admit(bm, b)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5])
    assert bm.num_free_blocks == 0
    bm.free(a)  # tail first: 2 to the front, then 1, 0 to the back
    assert list(bm.free_block_ids) == [2, 1, 0]
    bm.free(b)
    assert list(bm.free_block_ids) == [5, 2, 1, 0, 4, 3]
    check_consistent(bm)

    c = seq(2, [11, 12, 13, 14, 15, 16, 17])  # 4 blocks: the 2 uncached ones, then a's (freed first)
    admit(bm, c)
    assert c.block_table == [5, 2, 1, 0]
    assert bm.num_evictions == 2
    assert list(bm.free_block_ids) == [4, 3]
    assert bm.lookup_prefix(seq(3, [1, 2, 3, 4, 5])) == []  # a's prefix is gone
    assert bm.lookup_prefix(seq(4, [6, 7, 8, 9, 10])) == [3, 4]  # b's is intact

    d = seq(5, [20])  # 1 block: b's tail block goes first (b freed its tail first)
    admit(bm, d)
    assert d.block_table == [4]
    assert bm.num_evictions == 3
    assert bm.lookup_prefix(seq(6, [6, 7, 8, 9, 10])) == [3]  # the head of b's prefix survives
    # c's full blocks are registered under their own hashes; partial tails (0, 4) hold nothing
    assert [block_tokens(bm, i) for i in range(6)] == [None, (15, 16), (13, 14), (6, 7), None, (11, 12)]
    assert sorted(bm.hash_to_block_id.values()) == [1, 2, 3, 5]
    check_consistent(bm, c, d)


def test_reused_cached_block_moves_to_the_back_again_when_freed():
    bm = BlockManager(4, 2)
    a, b = seq(0, [1, 2, 3]), seq(1, [5, 6, 7])
    admit(bm, a)
    admit(bm, b)
    bm.free(a)
    bm.free(b)
    assert list(bm.free_block_ids) == [3, 1, 0, 2]
    a2 = seq(2, [1, 2, 9])  # hits a's block 0 again, then frees it: now the most recent
    assert admit(bm, a2) == [0]
    bm.free(a2)
    assert list(bm.free_block_ids) == [3, 1, 2, 0]
    e = seq(3, [8, 8, 8, 8, 8, 8, 8])  # 4 blocks: 3, 1 uncached, then b's 2, then a's 0
    admit(bm, e)
    assert e.block_table == [3, 1, 2, 0]
    assert bm.num_evictions == 2


def test_hits_on_a_free_cached_block_leave_the_free_list_exact():
    """A hit takes a free cached block out of the middle of the free list; the entry it leaves behind
    is skipped by allocation and dropped once such entries outnumber the blocks."""
    bm = BlockManager(4, 2)
    a = seq(0, [1, 2, 3])
    admit(bm, a)
    bm.free(a)
    assert list(bm.free_block_ids) == [1, 2, 3, 0]
    for i in range(3):  # hit block 0 while it is free, take block 1, free both again
        b = seq(1 + i, [1, 2, 9])
        assert admit(bm, b) == [0]
        assert b.block_table == [0, 1]
        assert list(bm.free_block_ids) == [2, 3]
        bm.free(b)
        assert list(bm.free_block_ids) == [1, 2, 3, 0]
    c = seq(10, [5, 6, 7, 8, 9, 10, 11])  # the whole cache: block 0 is evicted once, last
    admit(bm, c)
    assert c.block_table == [1, 2, 3, 0]
    assert bm.num_evictions == 1
    bm.free(c)
    assert list(bm.free_block_ids) == [0, 3, 2, 1]
    for i in range(6):  # more hits on free cached block 1 than there are blocks
        d = seq(20 + i, [5, 6, 9])
        assert admit(bm, d) == [1]
        assert d.block_table == [1, 0]
        bm.free(d)
    assert list(bm.free_block_ids) == [0, 3, 2, 1]
    assert len(bm.free_cached) <= bm.num_blocks  # the entries the hits left were dropped
    check_consistent(bm)


def test_shared_block_is_freed_only_by_its_last_user():
    bm = BlockManager(4, 2)
    a, b = seq(0, [1, 2, 3]), seq(1, [1, 2, 4])
    admit(bm, a)
    assert admit(bm, b) == [0]
    assert bm.ref_count(0) == 2
    bm.free(a)
    assert 0 not in bm.free_block_ids
    assert bm.ref_count(0) == 1
    bm.free(b)
    assert list(bm.free_block_ids)[-1] == 0
    check_consistent(bm)


def test_duplicate_full_block_is_not_treated_as_cached():
    bm = BlockManager(3, 2)
    a = seq(0, [1, 2, 3, 4])
    admit(bm, a)  # blocks 0 [1,2] and 1 [3,4], both registered
    b = seq(1, [1, 2, 3, 4])  # hits only block 0 (one token must be computed) and recomputes [3,4]
    assert admit(bm, b) == [0]
    assert b.block_table == [0, 2]
    assert bm.hash_to_block_id[bm.block_hashes(b, 2)[1]] == 1  # block 2 is an unreachable duplicate
    bm.free(a)
    bm.free(b)
    c = seq(2, [9])
    admit(bm, c)  # one block: the duplicate (reachable by no lookup) should be the one reused
    assert bm.num_evictions == 0
    assert bm.lookup_prefix(seq(3, [1, 2, 3, 4, 5])) == [0, 1]


def test_reset_prefix_cache_forgets_every_prefix():
    bm = BlockManager(4, 2)
    a = seq(0, [1, 2, 3, 4, 5])
    admit(bm, a)
    with pytest.raises(RuntimeError, match="in use"):
        bm.reset_prefix_cache()
    assert bm.lookup_prefix(seq(1, [1, 2, 3])) == [0]  # nothing changed
    bm.free(a)
    bm.reset_prefix_cache()
    assert bm.hash_to_block_id == {}
    assert list(bm.free_block_ids) == [0, 1, 2, 3]
    assert [block_tokens(bm, i) for i in range(4)] == [None] * 4
    assert bm.lookup_prefix(seq(2, [1, 2, 3, 4, 5])) == []
    b = seq(3, [1, 2, 3, 4, 5, 6, 7])  # the whole cache again, no eviction counted
    evictions = bm.num_evictions
    admit(bm, b)
    assert b.block_table == [0, 1, 2, 3]
    assert bm.num_evictions == evictions
