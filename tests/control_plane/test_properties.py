"""Invariants of the scheduler and block manager over random workloads (hypothesis).

Each example drives one workload to completion with a fake sampler (small vocabulary, so EOS and
shared blocks are frequent) and checks after every schedule() and postprocess(): ref counts never
negative, no block both free and referenced, free + used == total, every used block's ref count equals
the number of running sequences holding it, the token budget and max_num_seqs are respected, every
admitted request finishes within a bound, and a rerun gives identical step-by-step decisions.
Lazy registration (the default) is checked against eager registration run in lockstep: the same
decisions and allocation state after every step and operation, the same hashes at the end.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from cp_helpers import (
    ManualClock,
    allocation_state,
    batch_summary,
    block_manager_state,
    check_block_invariants,
    check_running_coverage,
    make_scheduler,
    request_fields,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.config import cdiv
from engine.core.sequence import Sequence, SequenceStatus
from engine.sampling_params import SamplingParams

VOCAB = 6  # tiny: sampled tokens often hit EOS (0) and repeat blocks of other requests
FINISH_REASONS = {"length", "stop", "max_model_len", "kv_capacity"}


@dataclass
class Case:
    requests: list[tuple[int, list[int], int, bool]]  # (arrival step, prompt, max_tokens, ignore_eos)
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    policy: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@st.composite
def cases(draw) -> Case:
    block_size = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16]))
    tok = st.integers(0, VOCAB - 1)
    prefixes = draw(st.lists(st.lists(tok, max_size=3 * block_size), min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        prompt = draw(st.sampled_from(prefixes)) + draw(
            st.lists(tok, min_size=1, max_size=2 * block_size + 3)
        )
        requests.append((draw(st.integers(0, 30)), prompt, draw(st.integers(1, 24)), draw(st.booleans())))
    requests.sort(key=lambda r: r[0])
    longest = max(len(p) for _, p, _, _ in requests)
    max_model_len = draw(st.sampled_from([4096, longest + draw(st.integers(0, 12))]))
    # from "the longest prompt alone fills the cache" up: tight caches preempt a lot
    num_blocks = cdiv(longest, block_size) + draw(st.integers(0, 10))
    caching = draw(st.booleans())
    policy = draw(st.sampled_from(["chunked", "prefill_first"]))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 48))
    return Case(requests, block_size, num_blocks, caching, policy, max_num_seqs, budget, max_model_len)


@st.composite
def crowded_cases(draw) -> Case:
    """Where lazy and eager registration could part: small blocks, three token ids, prompts cut from a
    few shared ones (many exactly one block long, so that their first block is a copy), tight caches
    (evictions, preemptions), prefix caching on."""
    block_size = draw(st.sampled_from([1, 2, 3, 4]))
    tok = st.integers(0, 2)
    shared = draw(st.lists(st.lists(tok, min_size=1, max_size=3 * block_size), min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(2, 12))):
        prompt = draw(st.sampled_from(shared))
        prompt = prompt[: draw(st.sampled_from([block_size, len(prompt)]))] or prompt
        prompt = prompt + draw(st.lists(tok, max_size=block_size + 1))
        requests.append((draw(st.integers(0, 12)), prompt, draw(st.integers(1, 12)), draw(st.booleans())))
    requests.sort(key=lambda r: r[0])
    longest = max(len(p) for _, p, _, _ in requests)
    num_blocks = cdiv(longest, block_size) + draw(st.integers(0, 6))
    policy = draw(st.sampled_from(["chunked", "prefill_first"]))
    max_num_seqs = draw(st.integers(1, 4))
    budget = draw(st.integers(max_num_seqs, 24))
    return Case(requests, block_size, num_blocks, True, policy, max_num_seqs, budget, 4096)


def sample(seq) -> int:
    """A deterministic fake sampler."""
    return (seq.seq_id * 7919 + seq.num_tokens * 104729) % VOCAB


def sample_by_position(seq) -> int:
    """A fake sampler that lets sequences with the same tokens go on alike (copies of blocks)."""
    return (seq.num_tokens * 5 + 1) % 3


def check_batch(sched, batch) -> None:
    cfg, bs = sched.config, sched.block_manager.block_size
    assert batch.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert batch.num_seqs <= cfg.max_num_seqs
    assert sched.num_running <= cfg.max_num_seqs
    assert len({s.seq_id for s in batch.seqs}) == batch.num_seqs
    assert not set(batch.preempted_seq_ids) & {s.seq_id for s in batch.seqs}
    assert batch.num_kv_blocks_used == sched.block_manager.num_used_blocks
    running = {s.seq_id for s in sched.running}
    for i, s in enumerate(batch.seqs):
        n, c = batch.num_scheduled_tokens[i], batch.num_computed_tokens[i]
        assert s.seq_id in running
        assert n >= 1
        assert c == s.num_computed_tokens
        assert c + n <= s.num_tokens
        assert len(s.block_table) * bs >= c + n  # every slot this step writes has a block
        assert batch.do_sample[i] == (c + n == s.num_tokens)
        assert batch.num_cached_tokens[i] % bs == 0
        assert batch.num_cached_tokens[i] <= c
    for seq_id in batch.preempted_seq_ids:
        assert seq_id not in running
    kinds = {"prefill": batch.num_prefill_seqs == batch.num_seqs > 0, "decode": batch.num_prefill_seqs == 0}
    assert batch.kind == "empty" if batch.is_empty else kinds.get(batch.kind, True)


def case_scheduler(case: Case, **kw) -> tuple:
    """(scheduler, block manager, clock) configured as `case` says; `kw` passes on to make_scheduler."""
    return make_scheduler(
        block_size=case.block_size,
        num_blocks=case.num_blocks,
        enable_prefix_caching=case.enable_prefix_caching,
        policy=case.policy,
        max_num_seqs=case.max_num_seqs,
        max_num_batched_tokens=case.max_num_batched_tokens,
        max_model_len=case.max_model_len,
        **kw,
    )


def run_case(case: Case) -> tuple[list[tuple], list[tuple], int]:
    """Drive `case` to completion, checking invariants; returns (step summaries, requests, steps)."""
    clock = ManualClock()
    sched, bm, _ = case_scheduler(case, clock=clock)
    pending = list(case.requests)
    seqs, summaries = [], []
    # every request needs at most prompt + max_tokens steps alone; recompute after preemption can
    # repeat them, but the oldest running request always progresses
    bound = 50 + sum(len(p) + m for _, p, m, _ in pending) * (len(pending) + 1)
    step = 0
    while pending or sched.has_unfinished():
        assert step < bound, "the workload did not finish"
        while pending and pending[0][0] <= step:
            _, prompt, max_tokens, ignore_eos = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
            seqs.append(sched.add_request(prompt, params, eos_token_id=0))
        batch = sched.schedule()
        check_batch(sched, batch)
        check_block_invariants(sched)
        summaries.append(batch_summary(batch))
        clock.t = float(step + 1)
        finished = sched.postprocess(batch, [sample(s) for s in batch.seqs])
        check_block_invariants(sched)
        check_running_coverage(sched)
        for s in finished:
            assert s.status is SequenceStatus.FINISHED and s.finish_reason in FINISH_REASONS
            assert s.block_table == []
        step += 1
    assert bm.num_free_blocks == bm.num_blocks
    assert all(bm.ref_count(i) == 0 for i in range(bm.num_blocks))
    for s in seqs:
        assert s.is_finished
        if s.status is SequenceStatus.REJECTED:
            assert s.finish_reason.startswith("rejected")
            continue
        assert s.finish_reason in FINISH_REASONS
        assert 1 <= s.num_output_tokens <= s.max_tokens
        assert s.first_scheduled_time is not None and s.first_token_time is not None
        assert s.arrival_time <= s.first_scheduled_time < s.first_token_time <= s.finish_time
        if s.finish_reason == "stop":
            assert s.token_ids[-1] == 0 and not s.ignore_eos
        if s.finish_reason == "length":
            assert s.num_output_tokens == s.max_tokens
    assert sched.num_finished + sched.num_rejected == len(seqs)
    return summaries, [request_fields(s) for s in seqs], step


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(cases())
def test_invariants_hold_and_runs_are_deterministic(case):
    first = run_case(case)
    second = run_case(case)
    assert first == second


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases(), st.integers(0, 2**32 - 1))
def test_block_manager_invariants_under_random_operations(case, seed):
    """Lower level: random admit / grow / free operations on the block manager alone."""
    rng = random.Random(seed)
    sched, bm, _ = make_scheduler(
        block_size=case.block_size,
        num_blocks=case.num_blocks,
        enable_prefix_caching=case.enable_prefix_caching,
    )
    live: list = []
    for op in range(60):
        choice = rng.random()
        if choice < 0.4 or not live:
            _, prompt, _, _ = rng.choice(case.requests)
            s = Sequence(op, prompt, SamplingParams())
            hits = bm.lookup_prefix(s)
            if bm.allocate_slots(s, s.num_tokens, hits):
                s.num_computed_tokens = s.num_tokens
                live.append(s)
            else:
                assert s.block_table == []
        elif choice < 0.8:
            s = rng.choice(live)
            s.token_ids.append(rng.randrange(VOCAB))
            if bm.allocate_slots(s, s.num_tokens):
                s.num_computed_tokens = s.num_tokens
            else:
                s.token_ids.pop()  # nothing changed; forget the token
                assert len(s.block_table) == cdiv(s.num_computed_tokens, bm.block_size)
        else:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        sched.running = live  # the invariant checker counts holders among running sequences
        for s in live:
            s.status = SequenceStatus.RUNNING
        check_block_invariants(sched)


# ---- lazy registration against eager registration ------------------------------------------------------
def lockstep_schedulers(case: Case) -> list[tuple]:
    """(scheduler, block manager, clock) with lazy registration, then with eager registration."""
    return [case_scheduler(case, lazy_registration=lazy) for lazy in (True, False)]


@SETTINGS
@given(st.one_of(cases(), crowded_cases()))
def test_lazy_registration_decides_as_eager_registration(case):
    """Lazy and eager schedulers in lockstep: the same batches, finished requests and allocation state
    after every step (nothing in between materializes the lazy chains), the same hashes at the end."""
    runs = lockstep_schedulers(case)
    (lazy_sched, lazy_bm, _), (eager_sched, eager_bm, _) = runs
    pending = list(case.requests)
    seqs: list[list] = [[], []]
    bound = 50 + sum(len(p) + m for _, p, m, _ in pending) * (len(pending) + 1)
    for step in range(bound):
        while pending and pending[0][0] <= step:
            _, prompt, max_tokens, ignore_eos = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
            for (sched, _, _), added in zip(runs, seqs):
                added.append(sched.add_request(prompt, params, eos_token_id=0))
        if not pending and not eager_sched.has_unfinished():
            break
        batches = [sched.schedule() for sched, _, _ in runs]
        assert batch_summary(batches[0]) == batch_summary(batches[1])
        assert allocation_state(lazy_bm) == allocation_state(eager_bm)
        finished = []
        for (sched, _, clock), batch in zip(runs, batches):
            clock.t = float(step + 1)
            tokens = [sample_by_position(s) for s in batch.seqs]
            finished.append([s.seq_id for s in sched.postprocess(batch, tokens)])
        assert finished[0] == finished[1]
        assert allocation_state(lazy_bm) == allocation_state(eager_bm)
        check_block_invariants(eager_sched)
    assert not lazy_sched.has_unfinished()
    assert [request_fields(s) for s in seqs[0]] == [request_fields(s) for s in seqs[1]]
    assert block_manager_state(lazy_bm) == block_manager_state(eager_bm)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(cases(), crowded_cases()), st.integers(0, 2**32 - 1))
def test_lazy_registration_allocates_as_eager_registration_under_random_operations(case, seed):
    """Random admit / grow / free / drop-the-lists operations on a lazy and an eager block manager:
    the same hits, tables and allocation state after each, the same hashes at the end."""
    rng = random.Random(seed)
    managers = [bm for _, bm, _ in lockstep_schedulers(case)]
    live: list[tuple[Sequence, Sequence]] = []
    for op in range(80):
        choice = rng.random()
        if choice < 0.4 or not live:
            _, prompt, _, _ = rng.choice(case.requests)
            pair = (Sequence(op, prompt, SamplingParams()), Sequence(op, prompt, SamplingParams()))
            hits = [bm.lookup_prefix(s) for bm, s in zip(managers, pair)]
            assert hits[0] == hits[1]
            admitted = [bm.allocate_slots(s, s.num_tokens, h) for bm, s, h in zip(managers, pair, hits)]
            assert admitted[0] == admitted[1]
            if admitted[0]:
                for s in pair:
                    s.num_computed_tokens = s.num_tokens
                live.append(pair)
        elif choice < 0.8:
            pair = rng.choice(live)
            token = rng.choice([0, rng.randrange(VOCAB)])  # 0 half the time: sequences go on alike
            for s in pair:
                s.token_ids.append(token)
            grown = [bm.allocate_slots(s, s.num_tokens) for bm, s in zip(managers, pair)]
            assert grown[0] == grown[1]
            for s in pair:
                if grown[0]:
                    s.num_computed_tokens = s.num_tokens
                else:
                    s.token_ids.pop()
        else:
            pair = live.pop(rng.randrange(len(live)))
            finished = rng.random() < 0.5  # in the simulator: it drops a finished sequence's lists
            for bm, s in zip(managers, pair):
                bm.free(s)
                if finished:
                    s.token_ids, s.block_hashes = [], []
        assert [s.block_table for s, _ in live] == [s.block_table for _, s in live]
        assert allocation_state(managers[0]) == allocation_state(managers[1])
    assert block_manager_state(managers[0]) == block_manager_state(managers[1])
