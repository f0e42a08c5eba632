"""Shared helpers for the control-plane tests: a manual clock, fake latency formulas, a driver loop
that mimics the simulator (with and without `FastForwardScheduler.fast_forward`) and block-manager invariants.

Not a test module; imported by the tests in this folder.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from functools import partial

from engine.core.block_manager import BlockManager
from engine.core.config import SchedulerConfig, cdiv
from engine.core.scheduler import ScheduledBatch
from engine.core.sequence import Sequence, SequenceStatus
from engine.sampling_params import SamplingParams
from simulator.fast_forward import FastForwardScheduler, accumulate_decode_times
from simulator.lazy_blocks import LazyBlockManager


class ManualClock:
    """A clock the test moves by hand; the scheduler reads it through `__call__`."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def decode_step_time(num_seqs: int, num_context_tokens: int, max_seq_len: int) -> float:
    """Fake latency of a decode-only step (the formula the fast-forward test is written against)."""
    return 1e-3 + 1e-6 * num_seqs + 3e-9 * num_context_tokens + 1e-7 * max_seq_len


# what `FastForwardScheduler.fast_forward` takes: step end times as a stepwise run accumulates them
decode_times = partial(accumulate_decode_times, decode_step_time)


def step_latency(batch: ScheduledBatch) -> float:
    """Fake latency of any step: `decode_step_time` for a decode-only batch, another formula otherwise."""
    if batch.kind == "decode":
        return decode_step_time(batch.num_seqs, batch.num_context_tokens, batch.max_seq_len)
    return (
        2e-3
        + 2e-6 * batch.total_num_scheduled_tokens
        + 1e-9 * batch.prefill_attn_work
        + 3e-9 * batch.num_context_tokens
        + 1e-7 * batch.max_seq_len
        + 5e-7 * batch.num_decode_seqs
    )


def make_scheduler(
    *,
    block_size: int,
    num_blocks: int,
    enable_prefix_caching: bool = True,
    policy: str = "chunked",
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 4096,
    clock: ManualClock | None = None,
    lazy_registration: bool = True,
) -> tuple[FastForwardScheduler, BlockManager, ManualClock]:
    clock = clock or ManualClock()
    manager = LazyBlockManager if lazy_registration else BlockManager
    bm = manager(num_blocks, block_size, enable_prefix_caching)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        policy=policy,
    )
    return FastForwardScheduler(config, bm, clock=clock), bm, clock


def batch_summary(batch: ScheduledBatch) -> tuple:
    """Everything a step decided, as plain values (for step-by-step comparisons)."""
    return (
        batch.kind,
        tuple(s.seq_id for s in batch.seqs),
        batch.num_scheduled_tokens,
        batch.num_computed_tokens,
        batch.num_cached_tokens,
        batch.is_prefill,
        batch.do_sample,
        batch.preempted_seq_ids,
        batch.num_kv_blocks_used,
    )


# ---- the simulator-like driver ---------------------------------------------------------------------
@dataclass
class Workload:
    arrivals: list[tuple[float, list[int], int]]  # (arrival time, prompt, max_tokens), sorted by time
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    policy: str = "chunked"
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    max_model_len: int = 4096
    lazy_registration: bool = True


@dataclass
class Run:
    sched: FastForwardScheduler
    bm: BlockManager
    seqs: list[Sequence]
    steps: list[tuple] = field(default_factory=list)  # batch summaries of the steps run one by one
    finished: list[tuple[float, int]] = field(default_factory=list)  # (time handed back, seq id)
    num_ff_calls: int = 0  # fast_forward calls that collapsed at least one step
    num_ff_steps: int = 0  # steps collapsed by fast_forward
    num_fused: int = 0  # steps whose postprocess ran the decode run after them (`fuse_steps`)
    end_time: float = 0.0


def new_hit_workload(num_output: int) -> Workload:
    """A decodes zeros; B's prompt is A's prompt, five zeros and a 9, so A's third block fills with
    B's third block while B waits for free blocks: a prefix hit that appears during a decode run."""
    return Workload(
        arrivals=[
            (0.0, [1, 2, 3, 4, 5, 6, 7], num_output),
            (0.0025, [1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0, 0, 9], 2),
        ],
        block_size=4,
        num_blocks=4,
    )


def drive(
    w: Workload, use_fast_forward: bool, max_iterations: int = 200_000, fuse_steps: bool = False
) -> Run:
    """Run `w` to completion the way the simulator does: arrivals join when the clock reaches them,
    decode-only stretches are collapsed by `fast_forward` (when enabled), every sequence samples 0.
    With `fuse_steps`, a step's postprocess and the run after it are one
    `postprocess_and_fast_forward` call (the requests that arrived during the step join first)."""
    sched, bm, clock = make_scheduler(
        block_size=w.block_size,
        num_blocks=w.num_blocks,
        enable_prefix_caching=w.enable_prefix_caching,
        policy=w.policy,
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.max_num_batched_tokens,
        max_model_len=w.max_model_len,
        lazy_registration=w.lazy_registration,
    )
    run = Run(sched, bm, [])
    arrivals, i = w.arrivals, 0

    def join_arrivals() -> float:
        """Add the requests that arrived by now; the next arrival time."""
        nonlocal i
        while i < len(arrivals) and clock.t >= arrivals[i][0]:
            t_arr, prompt, max_tokens = arrivals[i]
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            run.seqs.append(sched.add_request(prompt, params, arrival_time=t_arr))
            i += 1
        return arrivals[i][0] if i < len(arrivals) else math.inf

    for _ in range(max_iterations):
        join_arrivals()
        if i == len(arrivals) and not sched.has_unfinished():
            run.end_time = clock.t
            return run
        next_arrival = arrivals[i][0] if i < len(arrivals) else math.inf
        if use_fast_forward:
            k, t_end, finished = sched.fast_forward(decode_times, clock.t, next_arrival)
            if k > 0:
                assert t_end > clock.t
                clock.t = t_end
                run.num_ff_calls += 1
                run.num_ff_steps += k
                run.finished.extend((t_end, s.seq_id) for s in finished)  # in the run's last step
                continue
        batch = sched.schedule()
        if batch.is_empty:
            drained = sched.postprocess(batch, [])  # hands back requests finished while scheduling
            run.finished.extend((clock.t, s.seq_id) for s in drained)
            if not drained:
                assert next_arrival < math.inf, "stuck: nothing scheduled, nothing left to arrive"
                clock.t = max(clock.t, next_arrival)
            continue
        run.steps.append(batch_summary(batch))
        clock.t = clock.t + step_latency(batch)
        if fuse_steps:
            k, t_end, finished = sched.postprocess_and_fast_forward(batch, decode_times, join_arrivals())
            if k > 0:
                clock.t = t_end
                run.num_ff_calls += 1
                run.num_ff_steps += k
                run.num_fused += 1
        else:
            finished = sched.postprocess(batch, [0] * batch.num_seqs)
        run.finished.extend((clock.t, s.seq_id) for s in finished)
    raise AssertionError(f"workload did not finish within {max_iterations} iterations")


def itl_counts(sched: FastForwardScheduler) -> Counter:
    """{gap: tokens} over stepwise gaps and fast-forwarded runs (consecutive end times of n tokens)."""
    return Counter(sched.itl_histogram())


def request_fields(seq: Sequence) -> tuple:
    return (
        seq.seq_id,
        seq.status,
        tuple(seq.token_ids),
        seq.num_prompt_tokens,
        seq.num_computed_tokens,
        seq.first_scheduled_time,
        seq.first_token_time,
        seq.last_token_time,
        seq.finish_time,
        seq.num_preemptions,
        seq.num_cached_tokens,
        seq.finish_reason,
    )


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(ignore_eos=True))


def admit(bm: BlockManager, s: Sequence) -> list[int]:
    """What the scheduler does for a whole-prompt admission: look up, allocate, account, compute."""
    hits = bm.lookup_prefix(s)
    assert bm.allocate_slots(s, s.num_tokens, hits)
    bm.record_prefix_query(s.num_tokens, len(hits) * bm.block_size)
    s.num_computed_tokens = s.num_tokens
    return hits


def block_manager_state(bm: BlockManager) -> tuple:
    return (
        bm.num_prefix_hit_tokens,
        bm.num_prefix_queried_tokens,
        bm.num_evictions,
        bm.num_free_blocks,
        list(bm.free_block_ids),
        dict(bm.hash_to_block_id),
        [(bm.ref_count(i), bm.block_hash(i), bm.block_token_ids(i)) for i in range(bm.num_blocks)],
    )


def allocation_state(bm: BlockManager) -> tuple:
    """What lazy and eager registration must agree on at every moment, read without materializing
    a lazy chain (unlike `block_manager_state`, whose hash and token views do)."""
    return (
        bm.num_prefix_hit_tokens,
        bm.num_prefix_queried_tokens,
        bm.num_evictions,
        bm.num_free_blocks,
        bm.free_block_ids,
        list(bm.ref_counts),
    )


def block_tokens(bm: BlockManager, block_id: int) -> tuple[int, ...] | None:
    """The tokens a cached block holds (None when it holds no cached prefix)."""
    return bm.block_token_ids(block_id)


# ---- invariants --------------------------------------------------------------------------------------
def check_block_invariants(sched: FastForwardScheduler) -> None:
    """Ref counts, the free list and the hash table agree with the sequences that hold blocks."""
    bm = sched.block_manager
    free = bm.free_block_ids
    assert len(free) + bm.num_used_blocks == bm.num_blocks
    assert all(0 <= b < bm.num_blocks for b in free)
    holders = Counter(b for seq in sched.running for b in seq.block_table)
    assert len(set(free)) == len(free)
    for block_id in range(bm.num_blocks):
        ref_count = bm.ref_count(block_id)
        assert ref_count >= 0, block_id
        # a block is free exactly when nobody holds it: never both free and referenced
        assert (block_id in free) == (ref_count == 0), block_id
        assert ref_count == holders.get(block_id, 0), block_id
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(set(seq.block_table)) == len(seq.block_table)
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert seq.block_table == []
        assert seq.num_computed_tokens == 0
    for h, block_id in bm.hash_to_block_id.items():
        assert bm.block_hash(block_id) == h


def check_running_coverage(sched: FastForwardScheduler) -> None:
    """Between steps, a running sequence holds exactly the blocks that cover its computed tokens."""
    bs = sched.block_manager.block_size
    for seq in sched.running:
        assert len(seq.block_table) == cdiv(seq.num_computed_tokens, bs), seq
        assert seq.num_tokens - seq.num_computed_tokens >= 1
