"""`FastForwardScheduler.fast_forward` (simulator/fast_forward.py) is exactly equal to stepping the core.

The driver (`cp_helpers.drive`) mimics the simulator: a clock variable t; arrivals join when t reaches
them; each iteration first tries `fast_forward(decode_times, t, next_arrival)` and otherwise runs one
`schedule()` / `postprocess()` step whose length comes from a fake latency formula (decode-only
batches use the same `decode_step_time` that fast-forward accumulates). The same workload is run with
fast-forward on and off, and every per-request field, the block manager's state and the ITL counts
must be identical.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace
from functools import partial

import pytest
from cp_helpers import (
    Workload,
    block_manager_state,
    decode_step_time,
    decode_times,
    drive,
    itl_counts,
    make_scheduler,
    new_hit_workload,
    request_fields,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.config import cdiv
from engine.sampling_params import SamplingParams
from simulator.fast_forward import _near_block_ends, accumulate_decode_times

IGNORE_EOS = partial(SamplingParams, ignore_eos=True)


def assert_same_run(stepped, forwarded) -> None:
    assert [request_fields(s) for s in forwarded.seqs] == [request_fields(s) for s in stepped.seqs]
    assert block_manager_state(forwarded.bm) == block_manager_state(stepped.bm)
    assert itl_counts(forwarded.sched) == itl_counts(stepped.sched)
    a, b = stepped.sched, forwarded.sched
    assert (b.num_preemptions, b.num_finished, b.num_rejected) == (
        a.num_preemptions,
        a.num_finished,
        a.num_rejected,
    )
    assert forwarded.end_time == stepped.end_time
    assert forwarded.finished == stepped.finished  # handed back at the same times, in the same order
    # the steps fast-forward did not collapse are the same batches, in the same order
    non_decode = [s for s in stepped.steps if s[0] != "decode"]
    assert [s for s in forwarded.steps if s[0] != "decode"] == non_decode
    assert len(forwarded.steps) + forwarded.num_ff_steps == len(stepped.steps)


def compare_lazy_forwarded_with_eager_stepped(w: Workload) -> None:
    """Fast-forward with lazy registration against stepping with eager registration."""
    stepped = drive(replace(w, lazy_registration=False), use_fast_forward=False)
    forwarded = drive(replace(w, lazy_registration=True), use_fast_forward=True)
    assert_same_run(stepped, forwarded)


def compare(w: Workload):
    stepped = drive(w, use_fast_forward=False)
    forwarded = drive(w, use_fast_forward=True)
    assert stepped.num_ff_steps == 0
    assert_same_run(stepped, forwarded)
    return stepped, forwarded


def compare_fused(w: Workload):
    """Fast-forward with each step's postprocess fused with the run after it, against stepping."""
    stepped = drive(w, use_fast_forward=False)
    fused = drive(w, use_fast_forward=True, fuse_steps=True)
    assert_same_run(stepped, fused)
    return stepped, fused


# ---- random workloads ---------------------------------------------------------------------------------
@st.composite
def workloads(draw) -> Workload:
    block_size = draw(st.integers(1, 32))
    tok = st.integers(0, 50)  # 0 is the token every fast-forwarded step samples: runs may make hits
    prefixes = draw(st.lists(st.lists(tok, max_size=2 * block_size + 5), min_size=1, max_size=3))
    arrivals, t = [], 0.0
    for _ in range(draw(st.integers(1, 12))):
        t += draw(st.sampled_from([0.0, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2]))
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(tok, max_size=10))
        prompt = prompt or [0]
        arrivals.append((t, prompt, draw(st.integers(1, 60))))
    longest = max(len(p) for _, p, _ in arrivals)
    num_blocks = cdiv(longest, block_size) + draw(st.integers(0, 12))  # tight: preemptions
    caching = draw(st.booleans())
    policy = draw(st.sampled_from(["chunked", "prefill_first"]))
    max_num_seqs = draw(st.integers(1, 8))
    budget = draw(st.integers(max_num_seqs, 64))
    return Workload(
        arrivals=arrivals,
        block_size=block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=caching,
        policy=policy,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=draw(st.sampled_from([4096, longest + draw(st.integers(0, 40))])),
    )


@st.composite
def crowded_workloads(draw) -> Workload:
    """Where lazy and eager registration could part: small blocks, three token ids (0 is the one every
    step samples), prompts cut from a few shared ones (often to one block: copies of first blocks),
    tight caches, prefix caching on."""
    block_size = draw(st.integers(1, 4))
    tok = st.integers(0, 2)
    shared = draw(st.lists(st.lists(tok, min_size=1, max_size=3 * block_size), min_size=1, max_size=3))
    arrivals, t = [], 0.0
    for _ in range(draw(st.integers(2, 10))):
        t += draw(st.sampled_from([0.0, 1e-3, 3e-3, 1e-2]))
        prompt = draw(st.sampled_from(shared))
        prompt = prompt[: draw(st.sampled_from([block_size, len(prompt)]))] or prompt
        arrivals.append((t, prompt + draw(st.lists(tok, max_size=block_size)), draw(st.integers(1, 30))))
    longest = max(len(p) for _, p, _ in arrivals)
    max_num_seqs = draw(st.integers(1, 4))
    return Workload(
        arrivals=arrivals,
        block_size=block_size,
        num_blocks=cdiv(longest, block_size) + draw(st.integers(0, 6)),
        policy=draw(st.sampled_from(["chunked", "prefill_first"])),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 24)),
    )


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_fast_forward_equals_stepping_on_random_workloads(w):
    compare(w)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(workloads(), crowded_workloads()))
def test_lazy_fast_forward_equals_eager_stepping_on_random_workloads(w):
    compare_lazy_forwarded_with_eager_stepped(w)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(workloads(), crowded_workloads()))
def test_fused_postprocess_and_fast_forward_equals_stepping_on_random_workloads(w):
    compare_fused(w)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(workloads(), crowded_workloads()))
def test_lazy_fused_fast_forward_equals_eager_stepping_on_random_workloads(w):
    stepped = drive(replace(w, lazy_registration=False), use_fast_forward=False)
    fused = drive(replace(w, lazy_registration=True), use_fast_forward=True, fuse_steps=True)
    assert_same_run(stepped, fused)


# ---- one big deterministic case ---------------------------------------------------------------------------
def big_workload(policy: str, enable_prefix_caching: bool, seed: int = 20240601) -> Workload:
    rng = random.Random(seed)
    system_prompts = [[rng.randrange(1, 32000) for _ in range(rng.choice([48, 64, 96]))] for _ in range(4)]
    arrivals, t = [], 0.0
    for i in range(800):
        t += rng.expovariate(150.0)  # ~150 requests/s against ~1-3 ms steps: tens running
        prompt = [rng.randrange(1, 32000) for _ in range(rng.randrange(1, 200))] + [100_000 + i]
        if rng.random() < 0.6:
            prompt = rng.choice(system_prompts) + prompt
        arrivals.append((t, prompt, rng.choice([1, 2, 8, 32, 64, 128, 256, 400])))
    longest = max(len(p) for _, p, _ in arrivals)
    return Workload(
        arrivals=arrivals,
        block_size=16,
        num_blocks=220,  # 3520 tokens: well under the peak demand, so requests get preempted
        enable_prefix_caching=enable_prefix_caching,
        policy=policy,
        max_num_seqs=48,
        max_num_batched_tokens=256 if policy == "chunked" else longest + 400,
        max_model_len=4096,
    )


@pytest.mark.parametrize(
    ("policy", "caching"), [("chunked", True), ("chunked", False), ("prefill_first", True)]
)
def test_fast_forward_equals_stepping_on_a_big_workload(policy, caching):
    stepped, forwarded = compare(big_workload(policy, caching))
    decode_steps = sum(1 for s in stepped.steps if s[0] == "decode")
    assert len(stepped.steps) > 2000
    assert stepped.sched.num_preemptions > 10
    if caching:
        assert stepped.bm.num_prefix_hit_tokens > 1000
        assert stepped.bm.num_evictions > 0
    # fast-forward collapsed most decode steps, in far fewer calls
    assert forwarded.num_ff_steps > 0.6 * decode_steps
    assert forwarded.num_ff_calls < forwarded.num_ff_steps / 3


@pytest.mark.parametrize(
    ("policy", "caching"), [("chunked", True), ("chunked", False), ("prefill_first", True)]
)
def test_fused_fast_forward_equals_stepping_on_a_big_workload(policy, caching):
    stepped, fused = compare_fused(big_workload(policy, caching))
    forwarded = drive(big_workload(policy, caching), use_fast_forward=True)
    # the same steps are stepped and collapsed; under chunked scheduling (decodes and prefills in
    # one step) many steps ran the decode run after them in their postprocess
    assert fused.num_fused > (100 if policy == "chunked" else 0)
    assert fused.num_ff_steps == forwarded.num_ff_steps
    assert len(fused.steps) == len(forwarded.steps)


@pytest.mark.parametrize("policy", ["chunked", "prefill_first"])
def test_lazy_fast_forward_equals_eager_stepping_on_a_big_workload(policy):
    compare_lazy_forwarded_with_eager_stepped(big_workload(policy, True))


def test_postprocess_and_fast_forward_runs_the_decodes_after_a_mixed_step():
    """A and B decode while C's prompt is computed in one mixed step; its postprocess then runs the
    four decode steps of all three up to B's last token, as `fast_forward` would after it."""
    sched, bm, clock = make_scheduler(block_size=4, num_blocks=64, max_num_batched_tokens=64)
    a = sched.add_request([1, 2, 3], IGNORE_EOS(max_tokens=10), arrival_time=0.0)
    b = sched.add_request([4, 5, 6, 7, 8], IGNORE_EOS(max_tokens=6), arrival_time=0.0)
    first = sched.schedule()
    clock.t = 0.5
    sched.postprocess(first, [0, 0])
    c = sched.add_request([9, 10, 11, 12], IGNORE_EOS(max_tokens=8), arrival_time=0.7)
    clock.t = 1.0
    mixed = sched.schedule()
    assert mixed.kind == "mixed" and [s.seq_id for s in mixed.seqs] == [0, 1, 2]
    clock.t = 1.25
    k, end, finished = sched.postprocess_and_fast_forward(mixed, decode_times, math.inf)
    # B has 2 of its 6 tokens after the mixed step: 4 more steps of 3 sequences, the first reading
    # 4 + 6 + 4 cached tokens, the longest sequence then 7 long
    assert (k, finished) == (4, [b])
    assert end == accumulate_decode_times(decode_step_time, 3, 14, 7, 4, 1.25, math.inf)[4]
    assert [len(s.token_ids) for s in (a, b, c)] == [3 + 6, 5 + 6, 4 + 5]
    assert [s.num_computed_tokens for s in (a, c)] == [8, 8]
    assert (c.first_scheduled_time, c.first_token_time, c.last_token_time) == (1.0, 1.25, end)
    assert (a.first_token_time, a.last_token_time, b.finish_time) == (0.5, end, end)
    assert sched.running == [a, c] and b.block_table == []
    assert [len(s.block_table) for s in (a, c)] == [2, 2]  # 8 computed tokens each: 2 full blocks
    # the run's last step filled block 1 of each: registered by the next step (`_register_known`)
    assert a.num_cached_blocks == c.num_cached_blocks == 1
    assert bm.num_used_blocks == 4
    gaps = itl_counts(sched)
    assert gaps[1.25 - 0.5] == 2  # A and B in the mixed step (C's first token has no gap)
    assert sum(gaps.values()) == 2 + 3 * 4


def test_fast_forward_collapses_a_pure_decode_run_into_one_call_per_finish():
    w = Workload(
        arrivals=[(0.0, [i + 1, i + 2, i + 3], 200 + 10 * i) for i in range(5)],
        block_size=4,
        num_blocks=1000,
        max_num_seqs=8,
    )
    stepped, forwarded = compare(w)
    # the longest request needs 1 prefill step (its first token) and 239 decode steps; each
    # fast-forward runs up to and including the step in which the next request finishes
    assert len(stepped.steps) == 1 + 239
    assert [s[0] for s in forwarded.steps] == ["prefill"]
    assert forwarded.num_ff_calls == 5
    assert forwarded.num_ff_steps == 239
    assert [seq_id for _, seq_id in forwarded.finished] == [0, 1, 2, 3, 4]


# ---- the call itself ----------------------------------------------------------------------------------------
def decoding(n: int = 2, max_tokens: int | list[int] = 100, **kwargs):
    """A scheduler whose n requests have their first token out (one prefill step from t=0 to t=1)."""
    kwargs = {"block_size": 4, "num_blocks": 64, **kwargs}
    sched, bm, clock = make_scheduler(**kwargs)
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
    seqs = [
        sched.add_request([10 * i + 1, 10 * i + 2, 10 * i + 3], IGNORE_EOS(max_tokens=m))
        for i, m in enumerate(limits)
    ]
    batch = sched.schedule()
    clock.t = 1.0
    sched.postprocess(batch, [0] * batch.num_seqs)
    return sched, bm, clock, seqs


HALF = partial(accumulate_decode_times, lambda n, c, m: 0.5)  # every decode step takes 0.5 s


def test_steps_run_only_while_they_start_before_the_deadline():
    sched, _, _, seqs = decoding()
    assert sched.fast_forward(HALF, 1.0, 2.2) == (3, 2.5, [])  # steps start at 1.0, 1.5, 2.0
    assert [s.num_output_tokens for s in seqs] == [4, 4]
    assert [s.last_token_time for s in seqs] == [2.5, 2.5]
    assert [s.num_computed_tokens for s in seqs] == [6, 6]
    assert sched.fast_forward(HALF, 2.5, 3.5) == (2, 3.5, [])  # 3.5 itself is not before the deadline
    assert sched.fast_forward(HALF, 3.5, 3.5) == (0, 3.5, [])
    assert sched.fast_forward(HALF, 3.5, math.inf, max_steps=7) == (7, 7.0, [])
    assert itl_counts(sched) == {0.5: 2 * (3 + 2 + 7)}


def test_token_id_is_appended():
    sched, _, _, seqs = decoding(n=1)
    assert sched.fast_forward(HALF, 1.0, math.inf, token_id=42, max_steps=3) == (3, 2.5, [])
    assert seqs[0].output_token_ids == [0, 42, 42, 42]


def test_runs_through_the_step_in_which_the_first_request_finishes():
    sched, bm, _, seqs = decoding(n=3, max_tokens=[10, 6, 6])
    k, t, finished = sched.fast_forward(HALF, 1.0, math.inf)
    assert (k, t) == (5, 3.5)  # tokens 2..6 of the two requests with max_tokens=6
    assert finished == seqs[1:]
    assert [(s.finish_reason, s.finish_time, s.num_output_tokens) for s in finished] == [
        ("length", 3.5, 6)
    ] * 2
    assert [s.block_table for s in finished] == [[], []]
    assert sched.running == seqs[:1]
    assert bm.num_used_blocks == len(seqs[0].block_table)
    k, t, finished = sched.fast_forward(HALF, t, math.inf)
    assert (k, t, finished) == (4, 5.5, seqs[:1])
    assert not sched.has_unfinished()


def test_max_model_len_finishes_within_a_run():
    sched, _, _, seqs = decoding(n=1, max_model_len=10)
    assert sched.fast_forward(HALF, 1.0, math.inf) == (6, 4.0, seqs)  # 3 + 1 + 6 = 10 tokens
    assert (seqs[0].finish_reason, seqs[0].num_tokens) == ("max_model_len", 10)


def test_stops_before_the_step_that_would_preempt():
    # 2 requests, 3 tokens each: one block of 4 each; 3 blocks: the first new block fits, not the second
    sched, bm, _, seqs = decoding(n=2, num_blocks=3)
    k, _, _ = sched.fast_forward(HALF, 1.0, math.inf)
    # step 1 computes token 4 (fills block 0), step 2 computes token 5: request 0 opens the last
    # block, request 1 would have to preempt; so only step 1 runs
    assert k == 1
    assert bm.num_free_blocks == 1
    batch = sched.schedule()
    assert batch.preempted_seq_ids == (1,)


@pytest.mark.parametrize("case", ["no_running", "eos_not_ignored", "admissible", "chunk", "no_first_token"])
def test_does_nothing_unless_every_running_request_is_a_plain_decode(case):
    sched, _, clock = make_scheduler(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=8)
    params = IGNORE_EOS(max_tokens=50)
    if case == "no_running":
        sched.add_request([1, 2, 3], params)
    else:
        sched.add_request([1, 2, 3], params if case != "eos_not_ignored" else SamplingParams(max_tokens=50))
        batch = sched.schedule()
        clock.t = 1.0
        sched.postprocess(batch, [0])
        if case == "admissible":
            sched.add_request([5, 6, 7], params)
        elif case == "chunk":
            sched.add_request(list(range(100, 120)), params)  # 20 tokens > the 7 left: chunked
            batch = sched.schedule()
            clock.t = 2.0
            sched.postprocess(batch, [0] * batch.num_seqs)
        elif case == "no_first_token":
            sched.add_request(list(range(100, 108)), params)  # 7 of 8 prompt tokens in the step
            batch = sched.schedule()
            assert batch.num_scheduled_tokens == (1, 7)
            clock.t = 2.0
            sched.postprocess(batch, [0, 0])
            assert sched.running[1].num_tokens - sched.running[1].num_computed_tokens == 1
    before = [request_fields(s) for s in sched.running]
    assert sched.fast_forward(decode_times, clock.t, math.inf) == (0, clock.t, [])
    assert [request_fields(s) for s in sched.running] == before


def test_waiting_request_that_cannot_fit_does_not_stop_it():
    sched, _, _, seqs = decoding(n=1, num_blocks=3)
    sched.add_request(list(range(100, 112)), IGNORE_EOS(max_tokens=5))  # 3 blocks: never while seq 0 runs
    k, _, _ = sched.fast_forward(HALF, 1.0, math.inf)
    assert k > 0


# ---- a known gap -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_output", [6, 9])
def test_prefix_hits_that_appear_during_a_run_stop_it(num_output):
    # A decodes zeros; B's prompt is A's prompt, five zeros and a 9. Once A has taken its third
    # block, B (4 blocks, 2 of them hits on A's blocks) needs 2 free blocks and finds 1: blocked.
    # A's third block fills with [0, 0, 0, 0], B's third block. With 6 outputs that is A's last
    # decode, and the block is registered when A finishes; with 9 it is registered by the decode
    # that opens A's fourth block, which takes the last free block: B, needing 1, still waits.
    # Either way fast-forward (which found B blocked when it started) must stop where stepping
    # registers the block, and both admit B with 12 cached tokens once A finishes.
    w = new_hit_workload(num_output)
    stepped = drive(w, use_fast_forward=False)
    a, b = stepped.seqs
    assert b.first_scheduled_time == a.finish_time and b.num_cached_tokens == 12
    forwarded = drive(w, use_fast_forward=True)
    assert forwarded.seqs[1].first_scheduled_time == b.first_scheduled_time
    assert_same_run(stepped, forwarded)


def test_near_block_ends_lists_the_decodes_that_open_or_fill_a_block_within_k_steps():
    computed = [16, 17, 30, 31, 32, 14, 5]
    assert _near_block_ends(computed, 16, 0) == []
    assert _near_block_ends(computed, 16, 1) == [0, 3, 4]  # 16 and 32 open a block, 31 fills one
    assert _near_block_ends(computed, 16, 2) == [0, 2, 3, 4, 5]
    assert _near_block_ends(computed, 16, 16) == list(range(7))
    for bs in (1, 2, 4, 16):
        for k in range(0, 2 * bs + 1):
            for c in range(1, 3 * bs + 1):
                opens = cdiv(c, bs) * bs - c + 1 <= k  # blocks cover exactly the computed tokens
                fills = (c + k) // bs > c // bs
                assert (_near_block_ends([c], bs, k) == [0]) == (opens or fills), (bs, k, c)


def test_a_run_that_finishes_some_leaves_the_others_known_as_plain_decodes():
    sched, _, _, seqs = decoding(n=3, max_tokens=[10, 6, 8])
    assert sched.fast_forward(HALF, 1.0, math.inf) == (5, 3.5, [seqs[1]])
    assert sched._plain_decodes and sched._decode_steps_left is None
    # 3 + 6 of 3 + 10 and of 3 + 8 tokens: 4 and 2 left; the same as checking every request
    assert sched._decode_run_limit(1 << 30) == 2
    assert sched._decode_run_limit(1) == 1
    sched._plain_decodes = False
    assert sched._decode_run_limit(1 << 30) == 2
    sched._plain_decodes = True
    assert sched.fast_forward(HALF, 3.5, math.inf) == (2, 4.5, [seqs[2]])
    assert sched.running == seqs[:1] and sched._plain_decodes
    sched.schedule()
    assert not sched._plain_decodes and sched._decode_steps_left is None
