"""Scheduler on hand-made cases: exact batch contents of both policies, chunking, preemption by
recompute, rejection, finish reasons, timestamps from the injected clock and ITL counts."""

import pytest
from cp_helpers import ManualClock, batch_summary, check_block_invariants, make_scheduler

from engine.core.config import SchedulerConfig
from engine.core.scheduler import Scheduler, make_batch
from engine.core.sequence import Sequence, SequenceStatus
from engine.sampling_params import SamplingParams
from simulator.fast_forward import FastForwardScheduler

LONG = SamplingParams(max_tokens=100, ignore_eos=True)


def tokens(start: int, n: int) -> list[int]:
    """n distinct token ids from `start`: prompts that share no block with one another."""
    return list(range(start, start + n))


def step(sched: Scheduler, clock: ManualClock, dt: float = 1.0, token: int = 7):
    batch = sched.schedule()
    clock.t += dt
    finished = sched.postprocess(batch, [token] * batch.num_seqs)
    check_block_invariants(sched)
    return batch, finished


def grants(batch) -> list[tuple[int, int]]:
    return [(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_scheduled_tokens)]


# ---- policies --------------------------------------------------------------------------------------------
def test_chunked_policy_mixes_decodes_first_then_prefill_chunks():
    sched, bm, clock = make_scheduler(
        block_size=4, num_blocks=32, enable_prefix_caching=False, max_num_seqs=4, max_num_batched_tokens=10
    )
    a = sched.add_request(tokens(100, 6), LONG)
    b = sched.add_request(tokens(200, 7), LONG)
    c = sched.add_request(tokens(300, 5), LONG)

    batch, _ = step(sched, clock)  # A whole, B chunked into the 4 tokens left
    assert batch.kind == "prefill"
    assert grants(batch) == [(0, 6), (1, 4)]
    assert batch.num_computed_tokens == (0, 0)
    assert batch.is_prefill == (True, True)
    assert batch.do_sample == (True, False)
    assert batch.num_prefill_tokens == batch.total_num_scheduled_tokens == 10
    assert batch.prefill_attn_work == 6 * (0 + 7 / 2) + 4 * (0 + 5 / 2)
    assert (a.num_output_tokens, b.num_output_tokens) == (1, 0)
    assert (len(a.block_table), len(b.block_table)) == (2, 1)
    assert [s.seq_id for s in sched.waiting] == [2]

    batch, _ = step(sched, clock)  # A's decode, B's last 3 prompt tokens, then C whole
    assert batch.kind == "mixed"
    assert grants(batch) == [(0, 1), (1, 3), (2, 5)]
    assert batch.num_computed_tokens == (6, 4, 0)
    assert batch.is_prefill == (False, True, True)
    assert batch.do_sample == (True, True, True)
    assert (batch.num_prefill_seqs, batch.num_decode_seqs) == (2, 1)
    assert batch.num_prefill_tokens == 8
    assert batch.num_context_tokens == 10
    assert batch.max_seq_len == 7
    assert batch.prefill_attn_work == 3 * (4 + 4 / 2) + 5 * (0 + 6 / 2)
    assert batch.num_kv_blocks_used == 2 + 2 + 2

    batch, _ = step(sched, clock)
    assert batch.kind == "decode"
    assert grants(batch) == [(0, 1), (1, 1), (2, 1)]
    assert batch.num_computed_tokens == (7, 7, 5)
    assert batch.max_seq_len == 8
    assert batch.prefill_attn_work == 0.0
    assert [s.num_output_tokens for s in (a, b, c)] == [3, 2, 2]


def test_chunked_policy_grants_decodes_after_a_prefill_chunk_in_the_middle_of_running():
    sched, bm, clock = make_scheduler(block_size=4, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=16)
    a = sched.add_request(tokens(100, 3), LONG)
    b = sched.add_request(tokens(200, 5), LONG)
    d = sched.add_request(tokens(400, 3), LONG)
    c = sched.add_request(tokens(300, 30), LONG)
    batch, _ = step(sched, clock)  # A, B, D whole, C's first 5 tokens
    assert grants(batch) == [(0, 3), (1, 5), (2, 3), (3, 5)]
    batch, _ = step(sched, clock)  # three decodes (A fills a block, D opens one), C's next 13
    assert batch.kind == "mixed"
    assert grants(batch) == [(0, 1), (1, 1), (2, 1), (3, 13)]
    assert batch.do_sample == (True, True, True, False)
    sched.running = [a, b, c, d]  # C's last chunk between decodes

    batch, _ = step(sched, clock)  # A opens a block, B mid-block, C's last 12, D opens a block
    assert batch.kind == "mixed"
    assert grants(batch) == [(0, 1), (1, 1), (3, 12), (2, 1)]
    assert batch.num_computed_tokens == (4, 6, 18, 4)
    assert batch.is_prefill == (False, False, True, False)
    assert batch.do_sample == (True, True, True, True)
    assert (batch.num_prefill_seqs, batch.num_decode_seqs) == (1, 3)
    assert (batch.num_prefill_tokens, batch.total_num_scheduled_tokens) == (12, 15)
    assert batch.num_context_tokens == 32
    assert batch.max_seq_len == 30
    assert batch.prefill_attn_work == 12 * (18 + 13 / 2)
    assert [len(s.block_table) for s in (a, b, c, d)] == [2, 2, 8, 2]
    assert [(s.num_tokens, s.num_computed_tokens) for s in (a, b, c, d)] == [(6, 5), (8, 7), (31, 30), (6, 5)]
    assert bm.num_used_blocks == batch.num_kv_blocks_used == 14

    batch, _ = step(sched, clock)
    assert batch.kind == "decode"
    assert grants(batch) == [(0, 1), (1, 1), (3, 1), (2, 1)]


def test_make_batch_with_leading_decodes_matches_the_general_path():
    seqs = [Sequence(i, tokens(10 * i + 1, n), LONG) for i, n in enumerate((5, 9, 12, 7, 20, 3))]
    num_new = [1, 1, 4, 1, 6, 1]
    computed = [4, 8, 8, 6, 10, 2]  # a decode, a decode, a chunk, a decode, a chunk, a decode
    cached = [0, 0, 0, 0, 4, 0]
    general = make_batch(seqs, num_new, computed, cached, [9], 11)
    bulk = make_batch(seqs, num_new, computed, cached, [9], 11, num_leading_decodes=2)
    assert bulk == general
    assert bulk.kind == "mixed"
    assert bulk.is_prefill == (False, False, True, False, True, False)
    assert bulk.do_sample == (True, True, True, True, False, True)
    assert (bulk.num_prefill_seqs, bulk.num_prefill_tokens, bulk.total_num_scheduled_tokens) == (2, 10, 14)
    assert (bulk.num_context_tokens, bulk.max_seq_len, bulk.total_num_cached_tokens) == (38, 16, 4)
    assert bulk.prefill_attn_work == 4 * (8 + 5 / 2) + 6 * (10 + 7 / 2)
    decodes = make_batch(seqs[:2], [1, 1], computed[:2], [0, 0], [], 3, num_leading_decodes=2)
    assert decodes == make_batch(seqs[:2], [1, 1], computed[:2], [0, 0], [], 3)
    assert (decodes.kind, decodes.max_seq_len, decodes.num_context_tokens) == ("decode", 9, 12)


def test_chunked_policy_chunks_a_long_prompt_over_steps():
    sched, _, clock = make_scheduler(block_size=4, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=8)
    a = sched.add_request(tokens(100, 20), LONG)
    kinds = []
    for _ in range(3):
        batch, _ = step(sched, clock)
        kinds.append((batch.kind, grants(batch), batch.num_computed_tokens, batch.do_sample))
    assert kinds == [
        ("prefill", [(0, 8)], (0,), (False,)),
        ("prefill", [(0, 8)], (8,), (False,)),
        ("prefill", [(0, 4)], (16,), (True,)),
    ]
    assert a.num_output_tokens == 1
    assert a.first_token_time == 3.0


def test_prefill_first_runs_prefills_alone_and_chunks_only_the_first():
    sched, _, clock = make_scheduler(
        block_size=4,
        num_blocks=32,
        enable_prefix_caching=False,
        policy="prefill_first",
        max_num_seqs=4,
        max_num_batched_tokens=10,
    )
    sched.add_request(tokens(100, 6), LONG)
    sched.add_request(tokens(200, 7), LONG)
    sched.add_request(tokens(300, 5), LONG)
    summaries = []
    for _ in range(4):
        batch, _ = step(sched, clock)
        summaries.append((batch.kind, grants(batch)))
    assert summaries == [
        ("prefill", [(0, 6)]),  # B (7 > 4 left) is not chunked: it is not the step's first prefill
        ("prefill", [(1, 7)]),  # A's decode waits while prefills remain; C (5 > 3 left) waits too
        ("prefill", [(2, 5)]),
        ("decode", [(0, 1), (1, 1), (2, 1)]),
    ]


def test_prefill_first_chunks_the_first_prefill_to_the_budget():
    sched, _, clock = make_scheduler(
        block_size=4, num_blocks=32, policy="prefill_first", max_num_seqs=4, max_num_batched_tokens=10
    )
    x = sched.add_request(tokens(100, 15), LONG)
    sched.add_request(tokens(200, 3), LONG)
    summaries = []
    for _ in range(3):
        batch, _ = step(sched, clock)
        summaries.append((batch.kind, grants(batch), batch.num_computed_tokens, batch.do_sample))
    assert summaries == [
        ("prefill", [(0, 10)], (0,), (False,)),
        ("prefill", [(0, 5), (1, 3)], (10, 0), (True, True)),  # the unfinished chunk goes first
        ("decode", [(0, 1), (1, 1)], (15, 3), (True, True)),
    ]
    assert x.num_output_tokens == 2


def test_max_num_seqs_limits_admission():
    sched, _, clock = make_scheduler(block_size=4, num_blocks=32, max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        sched.add_request(tokens(100 * (i + 1), 3), LONG)
    batch, _ = step(sched, clock)
    assert grants(batch) == [(0, 3), (1, 3)]
    assert sched.num_running == 2 and sched.num_waiting == 1


def test_budget_must_cover_max_num_seqs():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(block_size=4, num_blocks=4, max_num_seqs=8, max_num_batched_tokens=4)


# ---- preemption --------------------------------------------------------------------------------------------
def test_preemption_recomputes_and_resumes_from_cached_blocks():
    sched, bm, clock = make_scheduler(block_size=2, num_blocks=5, max_num_seqs=4, max_num_batched_tokens=64)
    a = sched.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    b = sched.add_request([4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))

    batch, _ = step(sched, clock, token=7)  # both prompts: A [0, 1], B [2, 3]
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    batch, _ = step(sched, clock, token=9)  # decodes fill blocks 1 and 3: registered, no new block
    assert batch.kind == "decode" and bm.num_free_blocks == 1

    batch = sched.schedule()  # A takes the last block; B finds none
    assert grants(batch) == [(0, 1)]
    assert batch.preempted_seq_ids == (1,)
    assert a.block_table == [0, 1, 4]
    clock.t += 1.0
    assert sched.postprocess(batch, [11]) == [a]  # A's third token: length
    assert b.status is SequenceStatus.WAITING
    assert (b.num_computed_tokens, b.num_preemptions, b.block_table) == (0, 1, [])
    assert b.token_ids == [4, 5, 6, 7, 9]  # recompute keeps the generated tokens
    assert sched.num_preemptions == 1
    assert b.num_cached_tokens == 0

    batch, _ = step(sched, clock, token=13)  # B resumes: blocks 2, 3 are still cached
    assert grants(batch) == [(1, 1)]
    assert batch.num_computed_tokens == (4,)
    assert batch.num_cached_tokens == (4,)
    assert batch.do_sample == (True,)
    assert b.block_table[:2] == [2, 3]
    assert b.num_cached_tokens == 4  # grew from 0: prefix hits are summed over admissions
    assert b.first_scheduled_time == 0.0  # the first admission's, kept across the preemption
    assert b.token_ids == [4, 5, 6, 7, 9, 13]


def test_preemption_takes_the_newest_and_requeues_it_at_the_front():
    sched, bm, clock = make_scheduler(block_size=2, num_blocks=6, max_num_seqs=8, max_num_batched_tokens=64)
    a = sched.add_request([1, 2, 3], LONG)
    b = sched.add_request([4, 5, 6], LONG)
    c = sched.add_request([7, 8, 9], LONG)
    step(sched, clock)  # three prompts, 2 blocks each: the cache is full
    d = sched.add_request([10, 11, 12], LONG)  # cannot be admitted
    batch, _ = step(sched, clock)  # decodes that fill the second blocks: no new block needed
    assert grants(batch) == [(0, 1), (1, 1), (2, 1)]
    assert [s.seq_id for s in sched.waiting] == [3]

    batch, _ = step(sched, clock)  # A and B each need a block: C (newest) goes, then nobody else
    assert grants(batch) == [(0, 1), (1, 1)]
    assert batch.preempted_seq_ids == (2,)
    assert [s.seq_id for s in sched.running] == [0, 1]
    assert [s.seq_id for s in sched.waiting] == [2, 3]  # preempted C goes before D
    assert (a.num_preemptions, b.num_preemptions, c.num_preemptions, d.num_preemptions) == (0, 0, 1, 0)

    batch, _ = step(sched, clock)  # no new blocks needed; C still cannot come back
    assert grants(batch) == [(0, 1), (1, 1)]
    batch, _ = step(sched, clock)  # both need a block again, none is free: B goes, A stays
    assert grants(batch) == [(0, 1)]
    assert batch.preempted_seq_ids == (1,)
    assert [s.seq_id for s in sched.waiting] == [1, 2, 3]


def test_several_preemptions_in_one_step_keep_age_order():
    sched, _, clock = make_scheduler(block_size=1, num_blocks=5, max_num_seqs=8, max_num_batched_tokens=64)
    for prompt in ([1, 2], [3, 4], [5]):
        sched.add_request(prompt, LONG)
    step(sched, clock)  # all 5 blocks used
    batch, _ = step(sched, clock)  # each needs one block: A's need preempts C, B's preempts B itself
    assert grants(batch) == [(0, 1)]
    assert batch.preempted_seq_ids == (2, 1)
    assert [s.seq_id for s in sched.waiting] == [1, 2]


def test_single_request_outgrowing_the_cache_finishes_with_kv_capacity():
    sched, bm, clock = make_scheduler(block_size=2, num_blocks=2, max_num_batched_tokens=64)
    a = sched.add_request([1, 2, 3], LONG)
    step(sched, clock)  # prefill: 2 blocks
    step(sched, clock)  # decode of token 4 fits the second block
    batch = sched.schedule()  # token 5 needs a third block that can never exist
    assert batch.is_empty and batch.kind == "empty"
    assert a.status is SequenceStatus.FINISHED
    assert a.finish_reason == "kv_capacity"
    assert a.finish_time == clock.t
    assert bm.num_free_blocks == 2
    assert sched.has_unfinished()  # until the next postprocess hands it back
    assert sched.postprocess(batch, []) == [a]
    assert not sched.has_unfinished()
    assert a.num_output_tokens == 2
    assert sched.num_finished == 1


# ---- admission -------------------------------------------------------------------------------------------
def test_rejections_carry_a_reason_and_are_counted():
    sched, _, clock = make_scheduler(block_size=2, num_blocks=4, max_model_len=8)
    clock.t = 5.0
    too_long = sched.add_request(tokens(1, 9), LONG)
    assert too_long.status is SequenceStatus.REJECTED
    assert too_long.is_finished
    assert too_long.finish_reason == "rejected_prompt_too_long"
    assert too_long.finish_time == too_long.arrival_time == 5.0

    sched2, _, _ = make_scheduler(block_size=2, num_blocks=4, max_model_len=100)
    too_big = sched2.add_request(tokens(1, 9), LONG)  # 5 blocks of 2 > 4
    assert too_big.status is SequenceStatus.REJECTED
    assert too_big.finish_reason == "rejected_kv_capacity"
    fits = sched2.add_request(tokens(1, 8), LONG)  # exactly the whole cache: admitted
    assert fits.status is SequenceStatus.WAITING

    assert (sched.num_rejected, sched2.num_rejected) == (1, 1)
    assert sched.num_waiting == 0 and not sched.has_unfinished()
    assert [s.seq_id for s in sched2.waiting] == [fits.seq_id]
    assert (too_big.seq_id, fits.seq_id) == (0, 1)  # ids count every request, rejected or not


def test_prompt_of_exactly_max_model_len_is_admitted():
    sched, _, clock = make_scheduler(block_size=4, num_blocks=8, max_model_len=8)
    a = sched.add_request(tokens(1, 8), LONG)
    assert a.status is SequenceStatus.WAITING
    _, finished = step(sched, clock)
    assert finished == [a] and a.finish_reason == "max_model_len"


def test_empty_prompt_is_a_value_error():
    sched, _, _ = make_scheduler(block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request([], LONG)


# ---- finishing -------------------------------------------------------------------------------------------
def run_to_end(sched, clock, sampled):
    for token in sampled:
        _, finished = step(sched, clock, token=token)
        if finished:
            return finished
    return []


def test_finish_reason_length():
    sched, bm, clock = make_scheduler(block_size=4, num_blocks=8)
    a = sched.add_request([1, 2, 3], SamplingParams(max_tokens=2), eos_token_id=0)
    assert run_to_end(sched, clock, [5, 6, 7]) == [a]
    assert (a.finish_reason, a.output_token_ids) == ("length", [5, 6])
    assert bm.num_free_blocks == 8


def test_finish_reason_stop_on_eos_unless_ignored():
    sched, _, clock = make_scheduler(block_size=4, num_blocks=8)
    a = sched.add_request([1, 2, 3], SamplingParams(max_tokens=10), eos_token_id=9)
    b = sched.add_request([1, 2, 4], SamplingParams(max_tokens=3, ignore_eos=True), eos_token_id=9)
    c = sched.add_request([1, 2, 5], SamplingParams(max_tokens=3), eos_token_id=None)
    _, finished = step(sched, clock, token=9)
    assert finished == [a]
    assert (a.finish_reason, a.output_token_ids) == ("stop", [9])
    run_to_end(sched, clock, [9, 9])
    assert (b.finish_reason, b.output_token_ids) == ("length", [9, 9, 9])
    assert (c.finish_reason, c.output_token_ids) == ("length", [9, 9, 9])


def test_finish_reason_max_model_len():
    sched, _, clock = make_scheduler(block_size=4, num_blocks=8, max_model_len=6)
    a = sched.add_request([1, 2, 3, 4], SamplingParams(max_tokens=10, ignore_eos=True))
    assert run_to_end(sched, clock, [5, 5, 5]) == [a]
    assert (a.finish_reason, a.num_tokens, a.num_output_tokens) == ("max_model_len", 6, 2)


def test_length_wins_over_max_model_len_at_the_same_token():
    sched, _, clock = make_scheduler(block_size=4, num_blocks=8, max_model_len=6)
    a = sched.add_request([1, 2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True))
    run_to_end(sched, clock, [5, 5])
    assert a.finish_reason == "length"


def test_sampled_tokens_are_used_only_where_do_sample():
    sched, _, clock = make_scheduler(block_size=4, num_blocks=8, max_num_seqs=2, max_num_batched_tokens=4)
    a = sched.add_request(tokens(1, 6), LONG)
    batch = sched.schedule()
    assert batch.do_sample == (False,)
    sched.postprocess(batch, [None])
    assert a.token_ids == tokens(1, 6) and a.num_computed_tokens == 4


# ---- timestamps and ITL -------------------------------------------------------------------------------------
def test_timestamps_come_from_the_injected_clock():
    clock = ManualClock(1.0)
    sched, _, _ = make_scheduler(block_size=4, num_blocks=8, clock=clock)
    a = sched.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    b = sched.add_request([4, 5], SamplingParams(max_tokens=1), arrival_time=0.5)
    assert (a.arrival_time, b.arrival_time) == (1.0, 0.5)
    assert a.first_scheduled_time is None and a.first_token_time is None

    clock.t = 2.0
    batch = sched.schedule()
    assert a.first_scheduled_time == b.first_scheduled_time == 2.0
    clock.t = 2.5
    assert sched.postprocess(batch, [8, 8]) == [b]
    assert a.first_token_time == a.last_token_time == 2.5
    assert b.first_token_time == b.finish_time == 2.5

    clock.t = 3.0
    batch = sched.schedule()
    clock.t = 3.25
    sched.postprocess(batch, [8])
    clock.t = 4.0
    batch = sched.schedule()
    clock.t = 4.5
    assert sched.postprocess(batch, [8]) == [a]
    assert (a.first_scheduled_time, a.first_token_time, a.last_token_time, a.finish_time) == (
        2.0,
        2.5,
        4.5,
        4.5,
    )
    # gaps between a's tokens: 3.25 - 2.5 and 4.5 - 3.25; first tokens have no gap
    assert sched.itl_histogram() == {0.75: 1, 1.25: 1}


def test_itl_counts_every_decode_token():
    sched, _, clock = make_scheduler(block_size=4, num_blocks=16)
    for i in range(3):
        sched.add_request([10 * i + 1, 10 * i + 2], SamplingParams(max_tokens=4, ignore_eos=True))
    step(sched, clock, dt=0.5)  # first tokens
    step(sched, clock, dt=0.25)
    step(sched, clock, dt=0.25)
    step(sched, clock, dt=0.5)
    assert not sched.has_unfinished()
    assert sched.itl_histogram() == {0.25: 6, 0.5: 3}
    assert sum(sched.itl_histogram().values()) == 3 * (4 - 1)


def test_record_itl_off():
    clock = ManualClock()
    sched, bm, _ = make_scheduler(block_size=4, num_blocks=16, clock=clock)
    quiet = FastForwardScheduler(SchedulerConfig(), bm, clock=clock, record_itl=False)
    quiet.add_request([1, 2], SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in range(3):
        batch = quiet.schedule()
        clock.t += 1
        quiet.postprocess(batch, [0] * batch.num_seqs)
    assert quiet.itl_histogram() == {}


def test_batch_summaries_are_plain_values():
    sched, _, clock = make_scheduler(block_size=4, num_blocks=16)
    sched.add_request([1, 2, 3], LONG)
    batch = sched.schedule()
    assert batch_summary(batch) == ("prefill", (0,), (3,), (0,), (0,), (True,), (True,), (), 1)


def test_prefill_first_chunk_that_preempts_itself_does_not_livelock():
    sched, _, clock = make_scheduler(
        block_size=2,
        num_blocks=4,
        enable_prefix_caching=False,
        policy="prefill_first",
        max_num_seqs=2,
        max_num_batched_tokens=4,
    )
    a = sched.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    step(sched, clock)  # A's prompt: 2 blocks
    b = sched.add_request(tokens(10, 8), SamplingParams(max_tokens=1, ignore_eos=True))
    step(sched, clock)  # B's first chunk of 4 takes the last 2 blocks
    batch = sched.schedule()  # B's second chunk needs 2 more blocks: B (newest) preempts itself
    assert 1 in batch.preempted_seq_ids
    clock.t += 1.0
    sched.postprocess(batch, [0] * batch.num_seqs)
    for _ in range(50):  # A needs 3 more decodes, B 2 chunks: far fewer steps than this
        step(sched, clock)
        if not sched.has_unfinished():
            break
    assert (a.finish_reason, b.finish_reason) == ("length", "length")


@pytest.mark.parametrize("policy", ["chunked", "prefill_first"])
def test_preempted_request_that_outgrew_the_cache_is_finished_not_stuck(policy):
    sched, _, clock = make_scheduler(
        block_size=16, num_blocks=4, policy=policy, max_num_seqs=4, max_num_batched_tokens=256
    )
    a = sched.add_request(tokens(1, 32), SamplingParams(max_tokens=4, ignore_eos=True))
    # B repeats A's 2 blocks and fills the other 2: its 64-token prompt is exactly the cache
    b = sched.add_request(tokens(1, 64), SamplingParams(max_tokens=4, ignore_eos=True))
    batch, _ = step(sched, clock)
    assert batch.num_cached_tokens == (0, 32)
    batch, _ = step(sched, clock)  # A needs a third block: B is preempted with 65 tokens > 4 blocks
    assert batch.preempted_seq_ids == (1,)
    assert b.num_tokens == 65
    for _ in range(20):
        batch, _ = step(sched, clock)
        if not sched.has_unfinished():
            break
    assert a.finish_reason == "length"
    assert b.finish_reason == "kv_capacity"


def _reference_batch_totals(seqs, num_new, computed, k):
    """make_batch's fields by their definitions (CONTRACT.md), the first k grants plain decodes."""
    sample = [True] * k + [c + n == s.num_tokens for s, c, n in list(zip(seqs, computed, num_new))[k:]]
    prefill = [False] * k + [n > 1 or not d for n, d in list(zip(num_new, sample))[k:]]
    pre = [(n, c) for n, c, p in zip(num_new, computed, prefill) if p]
    if pre:
        kind = "prefill" if len(pre) == len(seqs) else "mixed"
        max_seq_len = max(c + n for c, n in zip(computed, num_new))
    else:
        kind = "decode" if seqs else "empty"
        max_seq_len = max(computed) + 1 if seqs else 0
    work = float(sum([n * (c + (n + 1) / 2) for n, c in pre])) if pre else 0.0
    return (tuple(prefill), tuple(sample), kind, len(pre), sum(n for n, _ in pre), max_seq_len, work)


@pytest.mark.parametrize("seed", range(40))
def test_make_batch_totals_match_their_definitions(seed):
    """Random grants (decodes, chunks, finished prompts, the odd zero grant), with and without the
    leading decodes declared: every derived field is the definition's, floats exactly."""
    import random

    rng = random.Random(seed)
    seqs, num_new, computed = [], [], []
    k = rng.randint(0, 6)
    for i in range(k + rng.randint(0, 5)):
        length = rng.randint(1, 300)
        if i < k or rng.random() < 0.4:  # a plain decode
            c, n = length - 1, 1
        else:
            c = rng.randint(0, length - 1)
            n = rng.choice([0, 1, length - c, rng.randint(1, length - c)])
        seqs.append(Sequence(i, tokens(i, length), LONG))
        num_new.append(n)
        computed.append(c)
    cached = [0] * k + [rng.choice([0, 16]) for _ in seqs[k:]]  # hits only where a prompt starts
    for leading in {0, k}:
        batch = make_batch(seqs, num_new, computed, cached, [7], 5, num_leading_decodes=leading)
        got = (
            batch.is_prefill,
            batch.do_sample,
            batch.kind,
            batch.num_prefill_seqs,
            batch.num_prefill_tokens,
            batch.max_seq_len,
            batch.prefill_attn_work,
        )
        assert got == _reference_batch_totals(seqs, num_new, computed, leading)
        assert batch.prefill_attn_work.hex() == got[-1].hex()
        assert (batch.total_num_scheduled_tokens, batch.num_context_tokens) == (sum(num_new), sum(computed))
        assert (batch.total_num_cached_tokens, batch.preempted_seq_ids) == (sum(cached), (7,))


@pytest.mark.parametrize("num_done", [1, 4, 5, 9])
def test_requests_finishing_together_leave_running_in_order(num_done):
    """A step that finishes a few requests (taken out one by one) or many (the queue rebuilt)
    leaves the others running in their order."""
    sched, _, clock = make_scheduler(block_size=4, num_blocks=256, max_num_seqs=32)
    short = SamplingParams(max_tokens=3, ignore_eos=True)
    seqs = [
        sched.add_request(tokens(10 * i, 6), short if i % 2 == 0 and i // 2 < num_done else LONG)
        for i in range(2 * num_done + 1)
    ]
    finished = []
    for _ in range(3):
        _, done = step(sched, clock)
        finished += done
    assert [s.seq_id for s in finished] == [s.seq_id for s in seqs if s.sampling_params is short]
    assert sched.running == [s for s in seqs if s.sampling_params is LONG]
    assert all(s.status is SequenceStatus.FINISHED and s.num_output_tokens == 3 for s in finished)


def _decode_to(sched, seq, num_computed: int) -> None:
    """Run steps (token 7 each) until `seq` has `num_computed` computed tokens."""
    while seq.num_computed_tokens < num_computed:
        batch = sched.schedule()
        sched.postprocess(batch, [7] * batch.num_seqs)


def test_schedule_reads_no_token_values_only_where_admission_or_preemption_needs_them():
    """Filling a block never stops a schedule from running ahead (the block is registered by the
    next step); a waiting request (admission looks prefixes up) and a block the free list cannot
    give (preemption) do."""
    from cp_helpers import make_scheduler

    sched, bm, _ = make_scheduler(block_size=4, num_blocks=6)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    assert not sched.schedule_reads_no_token_values()  # nothing runs
    a = sched.add_request([1, 2, 3, 4, 5], params)
    assert not sched.schedule_reads_no_token_values()  # a waits: admission looks prefixes up
    _decode_to(sched, a, 5)  # the prefill: block 0 full (a lazy chain starts), 1 token in block 1
    steps = []
    for c in range(5, 10):
        _decode_to(sched, a, c)
        steps.append((c, sched.schedule_reads_no_token_values()))
    # c = 7 fills block 1 (registered by the step at c = 8, which opens block 2)
    assert steps == [(5, True), (6, True), (7, True), (8, True), (9, True)]
    assert bm.registers_lazily(a) and a.num_cached_blocks == 2

    b = sched.add_request([1, 2, 3, 4, 9], params)  # its first block is a's: a hit, then eager
    _decode_to(sched, b, 5)
    _decode_to(sched, b, 7)  # b's next step fills its block 1: hashed by the step after it
    assert not bm.registers_lazily(b) and sched.schedule_reads_no_token_values()
    _decode_to(sched, b, 8)
    assert b.num_cached_blocks == 1 and bm.block_token_ids(b.block_table[1]) is None
    _decode_to(sched, b, 9)  # the step at c = 8 opened b's block 2 and registered block 1
    assert b.num_cached_blocks == 2 and bm.block_token_ids(b.block_table[1]) == (9, 7, 7, 7)

    sched2, _, _ = make_scheduler(block_size=4, num_blocks=6)
    c = sched2.add_request([1, 2], params)
    _decode_to(sched2, c, 3)  # its next step fills its first block: registered by the step after
    assert sched2.schedule_reads_no_token_values()

    sched3, bm3, _ = make_scheduler(block_size=4, num_blocks=2)
    d = sched3.add_request([1, 2, 3, 4, 5, 6, 7], params)
    _decode_to(sched3, d, 8)  # both blocks full: the next step opens a third that is not there
    assert bm3.num_free_blocks == 0 and not sched3.schedule_reads_no_token_values()
