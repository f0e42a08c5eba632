"""The scheduler: which requests compute how many tokens in the next step, and what happens after it.
Torch-free; the engine and the simulator drive this same class, differing only in the injected clock."""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import chain, compress, islice
from operator import is_, not_

from engine.core.block_manager import BlockManager
from engine.core.config import SchedulerConfig, cdiv
from engine.core.sequence import Sequence, SequenceStatus
from engine.sampling_params import SamplingParams

RUNNING = SequenceStatus.RUNNING
_NO_TIME = object()  # a sentinel no token time is


@dataclass(frozen=True, slots=True)
class ScheduledBatch:
    """One step's work. Per-sequence tuples are aligned with `seqs` (execution order)."""

    seqs: tuple[Sequence, ...]
    num_scheduled_tokens: tuple[int, ...]  # tokens computed this step
    num_computed_tokens: tuple[int, ...]  # tokens already in the KV cache before the step
    is_prefill: tuple[bool, ...]
    do_sample: tuple[bool, ...]  # the step completes the sequence's pending tokens: sample one
    num_cached_tokens: tuple[int, ...]  # prefix-cache hit tokens granted at this step
    preempted_seq_ids: tuple[int, ...]
    num_kv_blocks_used: int
    kind: str  # "prefill" | "decode" | "mixed" | "empty"
    num_prefill_seqs: int
    total_num_scheduled_tokens: int
    num_prefill_tokens: int
    total_num_cached_tokens: int
    num_context_tokens: int  # sum of num_computed_tokens
    max_seq_len: int  # max of num_computed + num_scheduled
    prefill_attn_work: float  # sum over prefills of new * (computed + (new + 1) / 2)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_decode_seqs(self) -> int:
        return len(self.seqs) - self.num_prefill_seqs

    @property
    def is_empty(self) -> bool:
        return not self.seqs


def make_batch(
    seqs: list[Sequence],
    num_new: list[int],
    computed: list[int],
    cached: list[int],
    preempted: list[int],
    num_kv_blocks_used: int,
    num_leading_decodes: int = 0,
) -> ScheduledBatch:
    """Build a ScheduledBatch and its totals from one step's grants; the first `num_leading_decodes`
    are plain decodes (one token that completes the sequence, no prefix hit): only the rest are read."""
    k = num_leading_decodes
    tail_prefill: list[bool] = []
    tail_sample: list[bool] = []
    prefill_terms: list[float] = []  # new * (computed + (new + 1) / 2) of each prefill
    num_prefill_tokens = max_seq_len = 0
    if k < len(seqs):
        max_seq_len = max(computed[:k]) + 1 if k else 0  # with prefills: max of computed + new
        for seq, c, n in zip(seqs[k:], computed[k:], num_new[k:]):
            sample = c + n == len(seq.token_ids)
            tail_sample.append(sample)
            if n > 1 or not sample:
                tail_prefill.append(True)
                prefill_terms.append(n * (c + (n + 1) / 2))
                num_prefill_tokens += n
            else:
                tail_prefill.append(False)
            if c + n > max_seq_len:
                max_seq_len = c + n
    num_prefill_seqs = len(prefill_terms)
    if num_prefill_seqs:
        kind = "prefill" if num_prefill_seqs == len(seqs) else "mixed"
    else:
        kind = "decode" if seqs else "empty"
        max_seq_len = max(computed) + 1 if seqs else 0
    return ScheduledBatch(
        seqs=tuple(seqs),
        num_scheduled_tokens=tuple(num_new),
        num_computed_tokens=tuple(computed),
        is_prefill=(False,) * k + tuple(tail_prefill),
        do_sample=(True,) * k + tuple(tail_sample),
        num_cached_tokens=tuple(cached),
        preempted_seq_ids=tuple(preempted),
        num_kv_blocks_used=num_kv_blocks_used,
        kind=kind,
        num_prefill_seqs=num_prefill_seqs,
        total_num_scheduled_tokens=k + sum(num_new[k:]),  # a token per leading decode
        num_prefill_tokens=num_prefill_tokens,
        total_num_cached_tokens=sum(cached[k:]),  # no hits for the leading decodes
        num_context_tokens=sum(computed),
        max_seq_len=max_seq_len,
        prefill_attn_work=float(sum(prefill_terms)) if num_prefill_seqs else 0.0,
    )


class _StepBuilder:
    """Accumulates one step's grants while a policy schedules."""

    __slots__ = ("seqs", "num_new", "computed", "cached", "preempted", "budget", "num_leading_decodes")

    def __init__(self, budget: int) -> None:
        self.seqs: list[Sequence] = []
        self.num_new: list[int] = []
        self.computed: list[int] = []
        self.cached: list[int] = []  # prefix hits; shorter than seqs means zeros for the rest
        self.preempted: list[int] = []
        self.budget = budget
        # the first grants that are plain decodes (one token that completes the sequence)
        self.num_leading_decodes = 0

    def add(self, seq: Sequence, num_new: int, num_cached: int = 0) -> None:
        self.seqs.append(seq)
        self.num_new.append(num_new)
        self.computed.append(seq.num_computed_tokens)
        self.cached.extend([0] * (len(self.seqs) - 1 - len(self.cached)))
        self.cached.append(num_cached)
        self.budget -= num_new

    def cached_tokens(self) -> list[int]:
        return self.cached + [0] * (len(self.seqs) - len(self.cached))


class Scheduler:
    """Waiting and running queues over a BlockManager; `schedule()` then `postprocess()` each step."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
        record_itl: bool = True,
    ) -> None:
        if config.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({config.max_num_seqs}): every running request needs a token each decode step"
            )
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.policy: Policy = POLICY_CLASSES[config.policy]()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.record_itl = record_itl
        # inter-token gaps (gap, tokens that saw it), per step, in compact arrays
        self.itl_gaps = array("d")
        self.itl_weights = array("q")
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_rejected = 0
        self._next_seq_id = 0
        self._finished_outside_step: list[Sequence] = []

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        eos_token_id: int | None = None,
        copy_prompt: bool = True,
    ) -> Sequence:
        """Queue a request; one that can never run comes back REJECTED with its reason."""
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        now = self.clock() if arrival_time is None else arrival_time
        seq = Sequence(seq_id, prompt_token_ids, sampling_params, now, eos_token_id, copy_prompt)
        seq.stop_num_tokens = min(seq.stop_num_tokens, self.config.max_model_len)
        reason = self.rejection_reason(seq.num_prompt_tokens)
        if reason:
            seq.status = SequenceStatus.REJECTED
            seq.finish_reason = reason
            seq.finish_time = now
            self.num_rejected += 1
        else:
            self.waiting.append(seq)
        return seq

    def rejection_reason(self, n: int) -> str | None:
        """Why a prompt of `n` tokens can never run here (a finish reason), or None; reads no token."""
        bm = self.block_manager
        if n > self.config.max_model_len:
            return "rejected_prompt_too_long"
        if cdiv(n, bm.block_size) > bm.num_blocks:
            return "rejected_kv_capacity"  # more KV blocks than the whole cache has
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._finished_outside_step)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        step = self.policy.schedule(self)
        return make_batch(
            step.seqs,
            step.num_new,
            step.computed,
            step.cached_tokens(),
            step.preempted,
            self.block_manager.num_used_blocks,
            num_leading_decodes=step.num_leading_decodes,
        )

    def postprocess(self, batch: ScheduledBatch, sampled_token_ids: Seq[int | None]) -> list[Sequence]:
        """Account the step's computed tokens, append sampled tokens, finish what is done."""
        now = self.clock()
        finished, self._finished_outside_step = self._finished_outside_step, []
        if batch.kind == "decode":  # the hot path: every sequence computed its one pending token
            sampled: Iterable[tuple[Sequence, int | None]] = zip(batch.seqs, sampled_token_ids)
        else:
            sampled = _account_unsampled(batch, sampled_token_ids)
        gaps: dict[float, int] = {}  # previous token time -> tokens that had it
        run_last: object = _NO_TIME  # the previous token time shared by a run of sequences (most do)
        run = 0
        num_done = len(finished)  # those before it finished outside the running queue
        for seq, token in sampled:
            tokens = seq.token_ids
            seq.num_computed_tokens = len(tokens)  # a sampling step computed every pending token
            tokens.append(token)
            last = seq.last_token_time
            if last is run_last:
                run += 1
            elif last is None:
                seq.first_token_time = now
            else:
                if run:
                    gaps[run_last] = gaps.get(run_last, 0) + run
                run_last, run = last, 1
            seq.last_token_time = now
            if len(tokens) >= seq.stop_num_tokens or token == seq.stop_token_id:
                self._finish(seq, _stop_reason(seq, token, self.config.max_model_len), now, finished)
        if run:
            gaps[run_last] = gaps.get(run_last, 0) + run
        if self.record_itl:
            self._record_gaps(now, gaps)
        if len(finished) > num_done:
            self._remove_running(finished[num_done:])
        return finished

    def _remove_running(self, done: list[Sequence]) -> None:
        """Take the finished sequences `done` out of `running` (a few by a scan, many by a rebuild)."""
        if len(done) <= 4:
            for seq in done:
                self.running.remove(seq)  # Sequence compares by identity
        else:
            self.running = [s for s in self.running if s.status is RUNNING]

    def _record_gaps(self, now: float, counts: dict[float, int]) -> None:
        """Tokens sampled at `now` whose previous token came at each time in `counts`."""
        for last, count in counts.items():
            self.itl_gaps.append(now - last)
            self.itl_weights.append(count)

    def _finish(self, seq: Sequence, reason: str, now: float, finished: list[Sequence]) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = now
        self._release(seq)
        self.num_finished += 1
        finished.append(seq)

    # ---- helpers shared by the policies ---------------------------------------------------------
    def _schedule_running(self, step: _StepBuilder) -> None:
        """Grant each running sequence its pending tokens in order (a prefix of `running`: usually plain
        decodes, granted in bulk, then a few others), preempting the newest when blocks run out."""
        running = iter(self.running)
        if not step.seqs:
            first_other = self._schedule_leading_decodes(step, running)
            if first_other is None:
                return
            running = chain((first_other,), running)
        self._schedule_others(step, running)

    def _schedule_leading_decodes(self, step: _StepBuilder, running: Iterator[Sequence]) -> Sequence | None:
        """Grant the plain decodes at the head of `running` to an empty step, in bulk; return the first
        other sequence when the grants may go on with it, else None."""
        bs = self.block_manager.block_size
        computed = step.computed
        add_computed = computed.append
        first_other = None
        # the per-step hot loop, kept flat; preemption pops from the end of `running`, ending it there
        for seq in islice(running, max(step.budget, 0)):
            c = seq.num_computed_tokens
            if len(seq.token_ids) - c != 1:
                first_other = seq
                break
            # only where c opens a block (registering the one the step before filled) is there work
            if not c % bs and not self._grant_blocks(seq, c + 1, step, 1):
                break
            add_computed(c)
        k = len(computed)
        step.seqs = self.running[:k]  # preemption only removes sequences after the granted ones
        step.num_new = [1] * k
        step.num_leading_decodes = k
        step.budget -= k
        return first_other

    def _schedule_others(self, step: _StepBuilder, running: Iterable[Sequence]) -> None:
        """Grant each sequence of `running` its pending tokens, in order, while budget and blocks last."""
        bs = self.block_manager.block_size
        add_seq, add_new, add_computed = step.seqs.append, step.num_new.append, step.computed.append
        budget = step.budget
        for seq in running:
            if budget <= 0:
                break
            c = seq.num_computed_tokens
            n = len(seq.token_ids) - c
            if n == 1:  # a plain decode, as above
                if not c % bs and not self._grant_blocks(seq, c + 1, step, 1):
                    break
            else:
                if n > budget:
                    n = budget
                if not self._grant_blocks(seq, c + n, step, 0):
                    break
            add_seq(seq)
            add_new(n)
            add_computed(c)
            budget -= n
        step.budget = budget

    def _grant_blocks(self, seq: Sequence, num_tokens: int, step: _StepBuilder, num_pending: int) -> bool:
        """Give `seq` the blocks that `num_tokens` computed tokens need, preempting when they run out,
        and register the full blocks of all but its last `num_pending` tokens; False if it cannot run."""
        bm = self.block_manager
        num_slots = len(seq.block_table) * bm.block_size
        if num_tokens > num_slots:
            if num_tokens <= num_slots + bm.block_size and bm.num_free_blocks:
                bm.take_free_blocks(seq.block_table, 1)  # a decode opening one block
            elif not self._allocate_or_preempt(seq, num_tokens, step, num_pending):
                return False
        self._register_known(seq, num_tokens - num_pending)
        return True

    def _register_known(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that the first `num_tokens` tokens of `seq` fill: never by a decode's
        pending token (the last step's sample, which an engine scheduling ahead lacks), so the block a
        decode fills is registered by the next decode, or at finish or preemption (`_release`)."""
        bm = self.block_manager
        if bm.enable_prefix_caching and num_tokens // bm.block_size > seq.num_cached_blocks:
            bm.cache_full_blocks(seq, num_tokens)

    def _release(self, seq: Sequence) -> None:
        """Free the blocks of `seq` (finished or preempted), first registering those it filled."""
        self._register_known(seq, seq.num_computed_tokens)
        self.block_manager.free(seq)

    def schedule_reads_no_token_values(self) -> bool:
        """Whether the next `schedule()` reads no value of the running requests' last tokens, so that
        it may run before they are known (async scheduling): no request waits (admission looks prefixes
        up) and no decode opens a block the free list cannot give (a preempted victim could re-enter)."""
        if self.waiting or not self.running:
            return False
        bs = self.block_manager.block_size
        opens = 0
        for seq in self.running:
            if not seq.num_computed_tokens % bs:  # its pending token opens a block
                opens += 1
        return opens <= self.block_manager.num_free_blocks

    def _allocate_or_preempt(
        self, seq: Sequence, num_tokens: int, step: _StepBuilder, num_pending: int = 0
    ) -> bool:
        bm, running = self.block_manager, self.running
        while not bm.allocate_slots(seq, num_tokens, num_tokens_to_cache=num_tokens - num_pending):
            victim = running.pop()
            if victim is seq and not running:
                # alone in the cache and still out of blocks: it can never continue
                self._finish(seq, "kv_capacity", self.clock(), self._finished_outside_step)
                return False
            self._preempt(victim)
            step.preempted.append(victim.seq_id)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _admit_waiting(self, step: _StepBuilder, chunk_first_only: bool) -> None:
        """Admit waiting requests in FIFO order while budget, sequence slots and blocks last; only the
        first may be chunked if `chunk_first_only` (nano-vllm), else the last takes what is left (vLLM)."""
        bm, waiting, bs = self.block_manager, self.waiting, self.block_manager.block_size
        max_num_seqs = self.config.max_num_seqs
        while waiting and step.budget > 0 and len(self.running) < max_num_seqs:
            seq = waiting[0]
            hits = bm.lookup_prefix(seq)
            num_cached = len(hits) * bs
            n = seq.num_tokens - num_cached
            if n > step.budget:
                if chunk_first_only and step.seqs:
                    break
                n = step.budget
            if not bm.allocate_slots(seq, num_cached + n, hits):
                if not self.running and not step.seqs:  # every block is free and it still does not fit
                    waiting.popleft()
                    self._finish(seq, "kv_capacity", self.clock(), self._finished_outside_step)
                    continue
                break
            waiting.popleft()
            bm.record_prefix_query(seq.num_tokens, num_cached)
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens += num_cached
            seq.status = RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = self.clock()
            self.running.append(seq)
            step.add(seq, n, num_cached)


def can_run_ahead(batch: ScheduledBatch) -> bool:
    """Async scheduling: whether `batch` is a decode step whose requests stop by length only, so that
    it can be postprocessed on placeholders while the device computes its tokens."""
    return batch.kind == "decode" and all(seq.stop_token_id == -1 for seq in batch.seqs)


def follows(prev_seqs: Seq[Sequence], seqs: Seq[Sequence]) -> bool:
    """Whether `seqs` are the first of `prev_seqs`, in order."""
    return len(seqs) <= len(prev_seqs) and all(map(is_, seqs, prev_seqs))


def schedules_ahead(prev_seqs: Seq[Sequence], batch: ScheduledBatch) -> bool:
    """Async scheduling: whether `batch`, scheduled while a step of `prev_seqs` that `can_run_ahead`
    runs, is launched behind it (its inputs are that step's samples, on the device) or waits for it."""
    return can_run_ahead(batch) and follows(prev_seqs, batch.seqs)


def _stop_reason(seq: Sequence, token: int, max_model_len: int) -> str | None:
    """Why `seq` stops after sampling `token`, or None: EOS, max_tokens, max_model_len."""
    if not seq.ignore_eos and token == seq.eos_token_id:
        return "stop"
    if len(seq.token_ids) - seq.num_prompt_tokens >= seq.max_tokens:
        return "length"
    if len(seq.token_ids) >= max_model_len:
        return "max_model_len"
    return None


def _account_unsampled(
    batch: ScheduledBatch, sampled_token_ids: Seq[int | None]
) -> Iterable[tuple[Sequence, int | None]]:
    """Advance the sequences whose step computed part of a prefill (nothing to sample); return the
    (sequence, token) pairs of the others, in batch order (both selected in C by `compress`)."""
    seqs, do_sample = batch.seqs, batch.do_sample
    num_scheduled = batch.num_scheduled_tokens
    num = min(len(seqs), len(sampled_token_ids))
    for i in compress(range(num), map(not_, do_sample)):
        seqs[i].num_computed_tokens += num_scheduled[i]
    return compress(zip(seqs, sampled_token_ids), do_sample)


class Policy:
    """Fills one step. Subclasses differ only in how they order and mix prefills and decodes."""

    def schedule(self, sched: Scheduler) -> _StepBuilder:
        raise NotImplementedError


class ChunkedPolicy(Policy):
    """vLLM v1: running requests first (decodes and unfinished prefill chunks), then waiting
    prefills chunked into the remaining token budget, mixed in one step."""

    def schedule(self, sched: Scheduler) -> _StepBuilder:
        step = _StepBuilder(sched.config.max_num_batched_tokens)
        sched._schedule_running(step)
        if not step.preempted:
            sched._admit_waiting(step, chunk_first_only=False)
        return step


class PrefillFirstPolicy(Policy):
    """nano-vllm: a step is all prefill (unfinished chunk first, then waiting requests; only the
    first may be chunked) or, when there is no prefill to run, all decode."""

    def schedule(self, sched: Scheduler) -> _StepBuilder:
        step = _StepBuilder(sched.config.max_num_batched_tokens)
        for seq in sched.running:
            pending = seq.num_tokens - seq.num_computed_tokens
            if pending > 1:  # an unfinished prefill chunk: at most one exists, it goes first
                n = min(pending, step.budget)
                if sched._allocate_or_preempt(seq, seq.num_computed_tokens + n, step):
                    step.add(seq, n)
                break
        if not step.preempted:  # a chunk that preempted itself must not be re-admitted at once
            sched._admit_waiting(step, chunk_first_only=True)
        if not step.seqs:
            sched._schedule_running(step)
        return step


POLICY_CLASSES: dict[str, type[Policy]] = {"chunked": ChunkedPolicy, "prefill_first": PrefillFirstPolicy}
