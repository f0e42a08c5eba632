"""The scheduler: which requests compute how many tokens in the next step, and what happens after it.

One control plane for both clocks: the GPU engine and the SimPy simulator drive this same class,
differing only in the injected `clock` and in who turns a `ScheduledBatch` into sampled tokens.
Torch-free. Policies (`chunked`, `prefill_first`) are small strategy objects over shared helpers.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import chain, compress, islice
from operator import attrgetter, is_, not_, sub

from engine.block_manager import ROOT_HASH, BlockManager
from engine.config import SchedulerConfig, cdiv
from engine.sequence import SamplingParams, Sequence, SequenceStatus

RUNNING = SequenceStatus.RUNNING
_NO_TIME = object()  # a sentinel no token time is


# One row per engine step (engine/step_recorder.py writes them; the fitted latency model reads them):
# the batch totals below, plus how the step ran and what it cost.
STEP_RECORD_COLUMNS = (
    "step",
    "kind",
    "num_seqs",
    "num_prefill_seqs",
    "num_decode_seqs",
    "total_num_scheduled_tokens",
    "num_prefill_tokens",
    "total_num_cached_tokens",
    "num_context_tokens",
    "max_seq_len",
    "prefill_attn_work",
    "num_kv_blocks_used",
    "graph_batch_size",
    "tp",
    "block_size",
    "gpu_time_s",
    "wall_time_s",
    "compiled",
    "allreduce_time_s",
    "idle_before_s",
    "graph_num_tokens",
    "overlapped",
    "num_waiting",
)


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
    all_decodes: bool = False,
    num_leading_decodes: int = 0,
) -> ScheduledBatch:
    """Build a ScheduledBatch and its totals from the per-sequence grants of one step.

    The caller may say what it knows: `all_decodes`, every grant is one token that completes its
    sequence (a decode: no prefix hit); `num_leading_decodes`, the first that many grants are (only
    the rest are inspected).
    """
    k = len(seqs) if all_decodes else num_leading_decodes
    if k == len(seqs) and seqs:
        return _decode_batch(seqs, computed, preempted, num_kv_blocks_used)
    # The leading decodes need no look; the rest (usually a prefill chunk or two) in one pass.
    tail_prefill: list[bool] = []
    tail_sample: list[bool] = []
    prefill_terms: list[float] = []  # new * (computed + (new + 1) / 2) of each prefill
    num_prefill_tokens = 0
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


def _decode_batch(
    seqs: list[Sequence], computed: list[int], preempted: list[int], num_kv_blocks_used: int
) -> ScheduledBatch:
    """make_batch for a step of plain decodes only (the hot path)."""
    n = len(seqs)
    return ScheduledBatch(
        seqs=tuple(seqs),
        num_scheduled_tokens=(1,) * n,
        num_computed_tokens=tuple(computed),
        is_prefill=(False,) * n,
        do_sample=(True,) * n,
        num_cached_tokens=(0,) * n,
        preempted_seq_ids=tuple(preempted),
        num_kv_blocks_used=num_kv_blocks_used,
        kind="decode",
        num_prefill_seqs=0,
        total_num_scheduled_tokens=n,
        num_prefill_tokens=0,
        total_num_cached_tokens=0,
        num_context_tokens=sum(computed),
        max_seq_len=max(computed) + 1,
        prefill_attn_work=0.0,
    )


class _StepBuilder:
    """Accumulates one step's grants while a policy schedules."""

    __slots__ = (
        "seqs",
        "num_new",
        "computed",
        "cached",
        "preempted",
        "budget",
        "num_leading_decodes",
    )

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
        # Inter-token gaps: (gap, tokens that saw it) per step, in compact arrays, and fast-forwarded
        # runs as (end times, number of sequences), the times as the run computed them (a list:
        # no conversion per run; a long simulation drains them often); merged by `itl_histogram`.
        self.itl_gaps = array("d")
        self.itl_weights = array("q")
        self.itl_runs: list[tuple[Seq[float], int]] = []  # fast-forwarded (end times, num seqs)
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_rejected = 0
        self._next_seq_id = 0
        self._finished_outside_step: list[Sequence] = []
        # Decode steps until the first running request finishes, known while every running request is
        # a plain decode: set by a run that finished none, cleared by `schedule` and `postprocess`
        # (nothing else changes the running requests), so the next run need not check them again.
        self._decode_steps_left: int | None = None
        # Every running request is a plain decode (see `_decode_run_limit`): set by any run, cleared
        # by `schedule` and `postprocess` as above.
        self._plain_decodes = False

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        eos_token_id: int | None = None,
    ) -> Sequence:
        """Queue a request; one that can never run comes back REJECTED with its reason."""
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        now = self.clock() if arrival_time is None else arrival_time
        seq = Sequence(seq_id, prompt_token_ids, sampling_params, now, eos_token_id)
        seq.stop_num_tokens = min(seq.stop_num_tokens, self.config.max_model_len)
        reason = self._rejection_reason(seq)
        if reason:
            seq.status = SequenceStatus.REJECTED
            seq.finish_reason = reason
            seq.finish_time = now
            self.num_rejected += 1
        else:
            self.waiting.append(seq)
        return seq

    def _rejection_reason(self, seq: Sequence) -> str | None:
        """A finish reason from a fixed vocabulary (the prompt's length, the limit and the cache's
        size are in the request's row and the configuration)."""
        n, bm = seq.num_prompt_tokens, self.block_manager
        if n > self.config.max_model_len:
            return "rejected_prompt_too_long"  # longer than max_model_len
        if cdiv(n, bm.block_size) > bm.num_blocks:
            return "rejected_kv_capacity"  # needs more KV blocks than the whole cache has
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
        self._decode_steps_left = None
        self._plain_decodes = False
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
        self._decode_steps_left = None
        self._plain_decodes = False
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
        """Take the sequences `done` (finished, in `running` order) out of `running`: a few found by
        a scan in C, many by rebuilding the list."""
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

    def drain_itl(self) -> tuple[array, array, list[tuple[Seq[float], int]]]:
        """Hand over the recorded inter-token gaps (gaps, weights, fast-forwarded runs) and start
        afresh: a long simulation folds them into a histogram as it goes."""
        drained = (self.itl_gaps, self.itl_weights, self.itl_runs)
        self.itl_gaps, self.itl_weights, self.itl_runs = array("d"), array("q"), []
        return drained

    def itl_histogram(self) -> dict[float, int]:
        """Inter-token gap (s) -> how many tokens saw it, stepped and fast-forwarded steps alike."""
        hist: dict[float, int] = {}
        for gap, count in zip(self.itl_gaps, self.itl_weights):
            hist[gap] = hist.get(gap, 0) + count
        for times, n in self.itl_runs:
            for a, b in zip(times, times[1:]):
                hist[b - a] = hist.get(b - a, 0) + n
        return hist

    def _finish(self, seq: Sequence, reason: str, now: float, finished: list[Sequence]) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = now
        self._release(seq)
        self.num_finished += 1
        finished.append(seq)

    # ---- helpers shared by the policies ---------------------------------------------------------
    def _schedule_running(self, step: _StepBuilder) -> None:
        """Grant each running sequence its pending tokens (1 for a decode) in order, preempting the
        newest running sequences (recompute) when blocks run out.

        Every granted sequence is the next of `running`, and the grants stop at the first that is
        refused, so an empty step's grants are a prefix of `running`: usually a run of plain decodes
        (granted in bulk) then a few others, such as a prefill chunk.
        """
        running = iter(self.running)
        if not step.seqs:
            first_other = self._schedule_leading_decodes(step, running)
            if first_other is None:
                return
            running = chain((first_other,), running)
        self._schedule_others(step, running)

    def _schedule_leading_decodes(self, step: _StepBuilder, running: Iterator[Sequence]) -> Sequence | None:
        """Grant the plain decodes at the head of `running` to an empty step, in bulk. Returns the
        first sequence that is not a plain decode when the grants may go on with it, else None."""
        bs = self.block_manager.block_size
        computed = step.computed
        add_computed = computed.append
        first_other = None
        # The per-step hot loop, kept flat: one grant of budget each (islice stops where the budget
        # does, consuming no more of `running`). Preemption pops from the end of `running`, which
        # ends the iteration there, as it must.
        for seq in islice(running, max(step.budget, 0)):
            c = seq.num_computed_tokens
            if len(seq.token_ids) - c != 1:
                first_other = seq
                break
            # c % bs == 0: c opens a block (and registers the one the step before filled); elsewhere
            # there is nothing to do
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
        """Give `seq` the blocks that `num_tokens` computed tokens need, preempting when blocks run
        out, and register the full blocks of all but its last `num_pending` tokens (see
        `_register_known`); False when `seq` cannot run this step."""
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
        """Register the blocks that the first `num_tokens` tokens of `seq` fill.

        A step registers the blocks full of tokens whose values the host has: a prefill chunk's (the
        prompt's, or a preempted request's landed tokens), but not a decode's pending token, the
        sample of the step before, which an engine scheduling ahead does not have yet. So the
        block a decode fills is registered one step later, by the decode that opens the next block,
        or when its request finishes or is preempted (`_release`): one rule for both clocks, which
        leaves a schedule that runs ahead no token value to read (`schedule_reads_no_token_values`).
        """
        bm = self.block_manager
        if bm.enable_prefix_caching and num_tokens // bm.block_size > seq.num_cached_blocks:
            bm.cache_full_blocks(seq, num_tokens)

    def _release(self, seq: Sequence) -> None:
        """Free the blocks of `seq` (finished or preempted), first registering those its computed
        tokens fill (the last a decode filled waits for this, see `_register_known`)."""
        self._register_known(seq, seq.num_computed_tokens)
        self.block_manager.free(seq)

    def schedule_reads_no_token_values(self) -> bool:
        """Whether the next `schedule()` reads no value of the running requests' last tokens, so that
        it may run before they are known (the engine's async scheduling). It would where a request
        waits (admission looks prefixes up) and where a decode opens a block the free list cannot
        give (preemption: the victim could be admitted again in the same step). Registration never
        reads them: a decode's pending token is hashed one step later (`_register_known`)."""
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
                # Alone in the cache and still out of blocks: it can never continue.
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
        """Admit waiting requests in FIFO order while budget, sequence slots and blocks last.

        With `chunk_first_only` (nano-vllm) only the first prefill of the step may be cut to the
        budget; otherwise (vLLM v1) the last admitted prefill takes whatever budget is left.
        """
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

    def waiting_blocked(self) -> bool:
        """True when no waiting request can be admitted until a running one finishes or is preempted
        (decode steps only shrink the free blocks, so this stays true while they run)."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return True
        budget = self.config.max_num_batched_tokens - self.policy.decode_tokens_before_admission(self)
        if budget <= 0:
            return True
        bm, seq = self.block_manager, self.waiting[0]
        if -(-seq.num_tokens // bm.block_size) <= bm.num_free_blocks:
            # blocks for all its tokens are free: it fits, hits or not (a hit never needs more). The
            # lookup is left to admission, which materializes any lazy chain it finds (when it
            # happens changes no outcome, see BlockManager)
            return False
        hits = bm.lookup_prefix(seq)
        num_cached = len(hits) * bm.block_size
        n = min(seq.num_tokens - num_cached, budget)
        return bm.num_blocks_needed(seq, num_cached + n, hits) > bm.num_free_blocks

    # ---- exact fast-forward over decode-only steps -----------------------------------------------
    def fast_forward(
        self,
        decode_times: DecodeTimes,
        start: float,
        deadline: float,
        token_id: int = 0,
        max_steps: int = 1 << 30,
    ) -> tuple[int, float, list[Sequence]]:
        """Run, in one call, the decode-only steps that stepping one by one would run next, up to the
        first step in which a request finishes, while none is admitted or preempted and none arrives
        (steps start before `deadline`).

        `decode_times(num_seqs, num_context_tokens, max_seq_len, max_steps, start, deadline)` gives
        the step end times as `accumulate_decode_times` defines them (a stepwise run adds each step's
        time to its clock in the same order), so timestamps, block ids, evictions, hashes and ITL
        are identical to stepping. Every sequence gets `token_id` at each step.
        Returns (steps run, end time, requests finished in the last step).
        """
        running = self.running
        if not running or self._finished_outside_step or not self.waiting_blocked():
            return 0, start, []
        k_max = self._decode_run_limit(max_steps)
        if k_max <= 0:
            return 0, start, []
        computed = list(map(_get_num_computed_tokens, running))
        times = decode_times(len(running), sum(computed), max(computed) + 1, k_max, start, deadline)
        k, near = self._cap_run(len(times) - 1, computed, token_id)
        if k <= 0:
            return 0, start, []
        end = float(times[k])
        done = self._advance_run(times[: k + 1], end, token_id, check_stop=k == k_max)
        self._take_and_register_run_blocks(k, computed, near)
        return k, end, self._finish_run(done, end, token_id, k_max - k if k_max < max_steps else None)

    def postprocess_and_fast_forward(
        self,
        batch: ScheduledBatch,
        decode_times: DecodeTimes,
        deadline: float,
        token_id: int = 0,
        max_steps: int = 1 << 30,
    ) -> tuple[int, float, list[Sequence]]:
        """`postprocess(batch, [token_id] * n)`, then `fast_forward(decode_times, now, deadline,
        token_id, max_steps)` from the clock's time now, the step's end: in one pass over the
        running requests when all of them sample in the step and a run follows it (a mixed step's
        decodes and the prompts it completed go on as plain decodes).
        Returns (steps run after the step, end time, requests finished: in the step when no step
        ran after it, else in the run's last step)."""
        now = self.clock()
        computed: list[int] = []  # after the step
        k_max = 0
        if not self._finished_outside_step and self.waiting_blocked():
            k_max = self._run_limit_after_step(batch, max_steps, computed)
        if k_max > 0:
            times = decode_times(len(computed), sum(computed), max(computed) + 1, k_max, now, deadline)
            k, near = self._cap_run(len(times) - 1, computed, token_id)
            if k > 0:
                left = k_max - k if k_max < max_steps else None
                return self._run_after_step(times[: k + 1], k == k_max, computed, near, token_id, left)
        finished = self.postprocess(batch, [token_id] * batch.num_seqs)
        return 0, now, finished

    def _run_limit_after_step(self, batch: ScheduledBatch, max_steps: int, computed: list[int]) -> int:
        """`_decode_run_limit` of the state after `batch` is postprocessed: 0 unless every running
        request samples in it (then it becomes a plain decode, barring EOS and its blocks); fills
        `computed` with their computed tokens after it."""
        running = self.running
        if len(batch.seqs) != len(running) or batch.preempted_seq_ids or not all(batch.do_sample):
            return 0  # (without preemption the step's requests are all the running ones, in order)
        bs = self.block_manager.block_size
        caching = self.block_manager.enable_prefix_caching
        k_max = max_steps
        add = computed.append
        for seq in running:
            c = len(seq.token_ids)  # a sampling step computes every pending token
            left = seq.stop_num_tokens - c - 1  # steps after this one's sample (0: it finishes)
            if left < k_max:
                if left <= 0:
                    return 0
                k_max = left
            if not seq.ignore_eos:
                return 0
            if len(seq.block_table) != -(-c // bs) or (caching and not _registered(seq, c, bs)):
                return 0
            add(c)
        return k_max

    def _cap_run(self, k: int, computed: list[int], token_id: int) -> tuple[int, list[int]]:
        """Cap a run of k decode steps of the running requests (`computed` tokens before it) before a
        preemption or a new prefix hit of the waiting head (see `fast_forward`); with the run's
        `near` indices (`_near_block_ends` of k)."""
        near = _near_block_ends(computed, self.block_manager.block_size, k)
        k = self._steps_before_preemption(k, near, computed)
        if self.waiting and self.block_manager.enable_prefix_caching:
            k = self._stop_before_new_hit(k, token_id, near, computed)
        return k, near

    def _run_after_step(
        self,
        times: Seq[float],
        check_stop: bool,
        computed: list[int],
        near: list[int],
        token_id: int,
        steps_left: int | None,
    ) -> tuple[int, float, list[Sequence]]:
        """Postprocess a step ending at times[0] in which every running request sampled and none
        finished, and run the len(times) - 1 decode steps after it (`computed`, `near`: as for
        `_take_and_register_run_blocks`; `steps_left`: as for `_finish_run`)."""
        k, end = len(times) - 1, float(times[-1])
        done = self._advance_run(times, end, token_id, check_stop, sampled_at=times[0])
        self._take_and_register_run_blocks(k, computed, near)
        return k, end, self._finish_run(done, end, token_id, steps_left)

    def _finish_run(
        self, done: list[Sequence], end: float, token_id: int, steps_left: int | None
    ) -> list[Sequence]:
        """Finish the requests a run ending at `end` finished; remember that the others are plain
        decodes, and `steps_left`, the steps they can still run, if none finished (None: not known)."""
        self._decode_steps_left = None if done else steps_left
        self._plain_decodes = True
        finished: list[Sequence] = []
        if done:
            max_model_len = self.config.max_model_len
            for seq in done:
                self._finish(seq, _stop_reason(seq, token_id, max_model_len), end, finished)
            self.running = [s for s in self.running if s.status is RUNNING]
        return finished

    def _decode_run_limit(self, max_steps: int) -> int:
        """Decode steps that can run until (and with) the first in which a request finishes; 0 unless
        every running request is a plain decode (one pending token, a token already out, EOS
        ignored, blocks covering exactly its computed tokens, cache registered)."""
        if self._decode_steps_left is not None:  # nothing changed since a run checked them
            return min(self._decode_steps_left, max_steps)
        if self._plain_decodes:  # the survivors of a run: only their length stops are unknown
            return min(_fewest_tokens_left(self.running), max_steps)
        bs = self.block_manager.block_size
        caching = self.block_manager.enable_prefix_caching
        k_max = max_steps
        for seq in self.running:
            c = seq.num_computed_tokens
            n = len(seq.token_ids)
            if n - c != 1 or not seq.ignore_eos or seq.last_token_time is None:
                return 0
            if len(seq.block_table) != -(-c // bs) or (caching and not _registered(seq, c, bs)):
                return 0
            left = seq.stop_num_tokens - n  # add_request capped it at max_model_len
            if left < k_max:
                k_max = left
        return k_max

    def _steps_before_preemption(self, k: int, near: list[int], computed: list[int]) -> int:
        """Cap a run of k decode steps before the first step whose new block finds the free list
        empty (stepping would preempt there). `near`: running indices, `_near_block_ends` of k;
        `computed`: the running requests' computed tokens before the run.

        A sequence whose blocks cover its c computed tokens opens its next block at step
        len(block_table) * bs - c + 1, in 1..bs, and one more every bs steps; so stepping allocates
        in rounds of one block per sequence, each round in the order of that first step."""
        bm, running = self.block_manager, self.running
        bs, free = bm.block_size, bm.num_free_blocks
        if len(near) * (k // bs + 1) <= free:
            return k  # each opens at most k // bs + 1 blocks: enough are free (the usual case)
        need = 0
        for idx in near:
            more = -(-(computed[idx] + k) // bs) - len(running[idx].block_table)
            if more > 0:
                need += more
        if need <= free:
            return k
        firsts = sorted(len(s.block_table) * bs - c + 1 for s, c in zip(running, computed))
        rounds, i = divmod(free, len(running))
        return firsts[i] + rounds * bs - 1  # the step before allocation number `free` (from 0)

    def _stop_before_new_hit(self, k: int, token_id: int, near: list[int], computed: list[int]) -> int:
        """Cap a run of k steps before the step in which a running request would register the
        block that extends the waiting head's cached prefix (stepping would re-check admission).
        `near`: running indices, `_near_block_ends` of k (the others fill no block); `computed`:
        the running requests' computed tokens before the run (tokens past the end of a request's
        list are `token_id`, as the run samples)."""
        bm, head = self.block_manager, self.waiting[0]
        bs = bm.block_size
        h = len(bm.lookup_prefix(head))
        if h >= (head.num_tokens - 1) // bs:
            return k  # no further full block of the head could hit
        hashes = bm.block_hashes(head, h + 1)
        prev = hashes[h - 1] if h else ROOT_HASH
        running = self.running
        for idx in near:
            seq, c = running[idx], computed[idx]
            # its block h is registered next: it holds h blocks, or h - 1 and a full one (see `_registered`)
            if seq.num_cached_blocks != h and not (seq.num_cached_blocks == h - 1 and c == h * bs):
                continue
            # h > 0: the head's lookup materialized the chain of its first block, so a sequence that
            # registers lazily has another first block (and no hash memo to read beyond it)
            if h and (bm.registers_lazily(seq) or bm.block_hashes(seq, h)[h - 1] != prev):
                continue
            step = (h + 1) * bs - c + 1  # the step that opens its block h + 1, registering block h
            if step <= k:
                tokens = seq.token_ids[h * bs : (h + 1) * bs]
                tokens += [token_id] * (bs - len(tokens))
                if hash((prev, tuple(tokens))) == hashes[h]:
                    k = step - 1
        return k

    def _advance_run(
        self,
        times: Seq[float],
        end: float,
        token_id: int,
        check_stop: bool,
        sampled_at: float | None = None,
    ) -> list[Sequence]:
        """Give every running request the tokens of len(times) - 1 decode steps ending at
        `times[1:]` and record their inter-token gaps (blocks: `_take_and_register_run_blocks`).
        With `sampled_at`, the end of a step just run in which every running request computed all
        its pending tokens, each first gets that step's token `token_id` (a request's first token
        if it had none). With `check_stop`, return the requests that the run finished, in running
        order."""
        k = len(times) - 1
        running = self.running
        new_tokens = [token_id] * (k if sampled_at is None else k + 1)
        first_time = float(times[1]) if sampled_at is None else sampled_at  # of each first new token
        gaps: dict[float, int] = {}  # previous token time -> tokens that had it
        run_last: object = _NO_TIME  # the previous token time of a run of sequences (most share one)
        run = 0
        done: list[Sequence] = []
        for seq in running:
            tokens = seq.token_ids
            tokens.extend(new_tokens)
            n = len(tokens)
            seq.num_computed_tokens = n - 1  # every token but the one sampled last
            last = seq.last_token_time
            if last is run_last:
                run += 1
            elif last is None:
                seq.first_token_time = first_time
            else:
                if run:
                    gaps[run_last] = gaps.get(run_last, 0) + run
                run_last, run = last, 1
            seq.last_token_time = end
            if check_stop and n >= seq.stop_num_tokens:  # EOS is ignored (run limit)
                done.append(seq)
        if run:
            gaps[run_last] = gaps.get(run_last, 0) + run
        if self.record_itl:
            self._record_gaps(first_time, gaps)
            if sampled_at is not None:  # the run's first step: every token's previous came then
                self.itl_gaps.append(float(times[1]) - sampled_at)
                self.itl_weights.append(len(running))
            if k > 1:
                self.itl_runs.append((times[1:], len(running)))
        return done

    def _take_and_register_run_blocks(self, k: int, computed: list[int], near: list[int]) -> None:
        """Allocate and register the blocks of k decode steps after `_advance_run`. `computed`: the
        running requests' computed tokens before the run; `near`: the indices among them that
        `_near_block_ends` gives for at least k steps (the others open and fill no block)."""
        bm, running = self.block_manager, self.running
        bs, caching = bm.block_size, bm.enable_prefix_caching
        opens: list[tuple[int, int]] = []  # (the step that opens the sequence's next block, index)
        fills: list[tuple[Sequence, int]] = []  # (sequence, computed tokens after the steps)
        for idx in near:  # one pass: the blocks each sequence opens and whether it fills one
            seq = running[idx]
            c = computed[idx]
            first = len(seq.block_table) * bs - c + 1
            if first <= k:
                opens.append((first, idx))
            if caching and (c + k - 1) // bs > seq.num_cached_blocks:  # see `_register_known`
                fills.append((seq, c + k - 1))
        if not fills:
            self._take_run_blocks(k, opens)
            return
        lazy, eager = bm.split_lazy_fills(fills)
        if eager and self._new_blocks_collide(eager):
            self._apply_block_events(k, computed, near)
            return
        self._take_run_blocks(k, opens)
        bm.extend_lazy_chains(lazy)  # nothing to hash or register; they touch no other sequence
        for seq, num_tokens in eager:
            bm.cache_full_blocks(seq, num_tokens)

    def _new_blocks_collide(self, eager: list[tuple[Sequence, int]]) -> bool:
        """Whether a block that the next steps fill has a hash already cached or filled twice: only
        then does registering in stepping's order, between allocations, change the outcome.
        `eager`: the (sequence, computed tokens after the steps) that fill blocks and register them
        eagerly; the blocks of a sequence that registers lazily can do neither (see `BlockManager`)."""
        bm = self.block_manager
        bs = bm.block_size
        new_hashes: list[int] = []
        for seq, num_tokens in eager:
            num_full = num_tokens // bs
            new_hashes += bm.block_hashes(seq, num_full)[seq.num_cached_blocks : num_full]
        return bm.any_registered(new_hashes) or len(set(new_hashes)) < len(new_hashes)

    def _take_run_blocks(self, k: int, opens: list[tuple[int, int]]) -> None:
        """Give each running sequence the blocks that the next k steps open, taken from the free list
        in stepping's order (see `_steps_before_preemption`): one call, then dealt out by slicing.
        `opens`: (the step that opens the sequence's next block, running index) of those that do."""
        if not opens:
            return
        running, bm = self.running, self.block_manager
        bs = bm.block_size
        opens.sort()
        if k <= bs:  # (first steps from 1) one block each
            block_ids: list[int] = []
            bm.take_free_blocks(block_ids, len(opens))
            for (_, idx), block_id in zip(opens, block_ids):
                running[idx].block_table.append(block_id)
            return
        # every sequence opens m or m + 1 blocks (first steps lie within bs), the latter at the front
        counts = [(k - first) // bs + 1 for first, _ in opens]
        n, m = len(opens), counts[-1]
        block_ids = []
        bm.take_free_blocks(block_ids, sum(counts))
        for i, (_, idx) in enumerate(opens):
            table = running[idx].block_table
            table += block_ids[i : m * n : n]  # one block from each of the m full rounds
            if counts[i] > m:
                table.append(block_ids[m * n + i])

    def _apply_block_events(self, k: int, computed: list[int], near: list[int]) -> None:
        """Allocate and register block by block, in the order stepping would (by step, then running
        index, an allocation before a registration: a decode registers the block the step before it
        filled when it opens the next, see `_register_known`)."""
        running, bm = self.running, self.block_manager
        bs = bm.block_size
        events: list[tuple[int, int, int]] = []
        for idx in near:
            seq = running[idx]
            c = computed[idx]
            events += [(j, idx, 0) for j in range(len(seq.block_table) * bs - c + 1, k + 1, bs)]
            events += [(j, idx, 1) for j in range((seq.num_cached_blocks + 1) * bs - c + 1, k + 1, bs)]
        events.sort()
        for j, idx, register in events:
            seq = running[idx]
            if register:
                bm.cache_full_blocks(seq, computed[idx] + j - 1)
            else:
                bm.take_free_blocks(seq.block_table, 1)


def can_run_ahead(batch: ScheduledBatch) -> bool:
    """Async scheduling: whether `batch` is a decode step whose requests stop by length only (EOS
    ignored). Postprocessing it needs no token value, so an engine may postprocess it on
    placeholders while the device computes its tokens, and schedule the next step meanwhile."""
    return batch.kind == "decode" and all(seq.stop_token_id == -1 for seq in batch.seqs)


def follows(prev_seqs: Seq[Sequence], seqs: Seq[Sequence]) -> bool:
    """Whether `seqs` are the first of `prev_seqs`, in order."""
    return len(seqs) <= len(prev_seqs) and all(map(is_, seqs, prev_seqs))


def schedules_ahead(prev_seqs: Seq[Sequence], batch: ScheduledBatch) -> bool:
    """Async scheduling: whether `batch`, scheduled while a step of `prev_seqs` that
    `can_run_ahead` still runs (and `Scheduler.schedule_reads_no_token_values` held), is launched
    behind it: a step that can run ahead too, of the first of `prev_seqs` in order (`follows`), whose
    input tokens are then the first of that step's samples, still on the device. Else the engine
    waits for that step's tokens and runs `batch` after it. Both clocks decide overlap with this."""
    return can_run_ahead(batch) and follows(prev_seqs, batch.seqs)


_get_num_computed_tokens = attrgetter("num_computed_tokens")
_get_stop_num_tokens = attrgetter("stop_num_tokens")
_get_token_ids = attrgetter("token_ids")


def _fewest_tokens_left(seqs: list[Sequence]) -> int:
    """The fewest tokens any of `seqs` can still get before its length stop (in C)."""
    return min(map(sub, map(_get_stop_num_tokens, seqs), map(len, map(_get_token_ids, seqs))))


def _registered(seq: Sequence, num_computed: int, block_size: int) -> bool:
    """Whether a decode with `num_computed` tokens has its blocks registered as `_register_known`
    leaves them: those full of its computed tokens, but perhaps the last (filled by the step before)."""
    return (num_computed - 1) // block_size <= seq.num_cached_blocks <= num_computed // block_size


def _near_block_ends(computed: list[int], block_size: int, k: int) -> list[int]:
    """Indices of the decodes (blocks covering exactly their `computed` tokens) that open or fill a
    block within k steps: those whose next token starts a block or lies in its last k slots."""
    if k <= 0:
        return []
    last = block_size - k
    if last <= 1:  # every slot of a block is within k steps
        return list(range(len(computed)))
    return [i for i, c in enumerate(computed) if not 0 < c % block_size < last]


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
    (sequence, token) pairs of the others, in batch order. Those are most of a step: both passes
    select in C (`compress`), only the few unsampled sequences are visited here."""
    seqs, do_sample = batch.seqs, batch.do_sample
    num_scheduled = batch.num_scheduled_tokens
    num = min(len(seqs), len(sampled_token_ids))
    for i in compress(range(num), map(not_, do_sample)):
        seqs[i].num_computed_tokens += num_scheduled[i]
    return compress(zip(seqs, sampled_token_ids), do_sample)


DecodeTimes = Callable[[int, int, int, int, float, float], Seq[float]]


def accumulate_decode_times(
    decode_step_time: Callable[[int, int, int], float],
    num_seqs: int,
    num_context_tokens: int,
    max_seq_len: int,
    max_steps: int,
    start: float,
    deadline: float,
) -> list[float]:
    """End times of up to `max_steps` consecutive decode steps of `num_seqs` sequences, each step
    starting before `deadline`: times[0] = start, times[j] = times[j-1] + step j's time, where step j
    reads num_context_tokens + (j-1) * num_seqs cached tokens. The reference for `DecodeTimes`."""
    times = [start]
    t = start
    while len(times) <= max_steps and t < deadline:
        t = t + decode_step_time(num_seqs, num_context_tokens, max_seq_len)
        times.append(t)
        num_context_tokens += num_seqs
        max_seq_len += 1
    return times


class Policy:
    """Fills one step. Subclasses differ only in how they order and mix prefills and decodes."""

    def schedule(self, sched: Scheduler) -> _StepBuilder:
        raise NotImplementedError

    def decode_tokens_before_admission(self, sched: Scheduler) -> int:
        """Budget that running decodes take before waiting requests are considered."""
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

    def decode_tokens_before_admission(self, sched: Scheduler) -> int:
        return len(sched.running)


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

    def decode_tokens_before_admission(self, sched: Scheduler) -> int:
        return 0


POLICY_CLASSES: dict[str, type[Policy]] = {"chunked": ChunkedPolicy, "prefill_first": PrefillFirstPolicy}
