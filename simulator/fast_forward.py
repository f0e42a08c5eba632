"""Exact fast-forward over runs of decode-only steps: the simulator's speed path beside the core.

`FastForwardScheduler` is the control plane's `Scheduler` plus `fast_forward` and
`postprocess_and_fast_forward`, which run in one call the decode steps that stepping would run next,
with the same block ids, evictions, hashes, timestamps and inter-token gaps (the tests in
tests/control_plane/test_fast_forward.py hold it to stepping). The engine never calls them.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from collections.abc import Sequence as Seq
from operator import attrgetter, sub

from engine.core.block_manager import ROOT_HASH
from engine.core.config import cdiv
from engine.core.scheduler import _NO_TIME, ChunkedPolicy, ScheduledBatch, Scheduler, _stop_reason
from engine.core.sequence import Sequence, SequenceStatus
from simulator.lazy_blocks import LazyBlockManager

RUNNING = SequenceStatus.RUNNING


class FastForwardScheduler(Scheduler):
    """The `Scheduler`, able to collapse runs of plain decode steps (`fast_forward`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lazy = isinstance(self.block_manager, LazyBlockManager)  # else the core's eager one
        # fast-forwarded runs' inter-token gaps, kept as their end times (a run's consecutive end
        # times differ by a gap that each of its requests saw): all runs' end times one after the
        # other (8 bytes each), and per run how many and its number of requests
        self.itl_runs = ItlRuns()
        # Decode steps until the first running request finishes, known while every running request is
        # a plain decode: set by a run that finished none, cleared by `schedule` and `postprocess`
        # (nothing else changes the running requests), so the next run need not check them again.
        self._decode_steps_left: int | None = None
        # Every running request is a plain decode (see `_decode_run_limit`): set by any run, cleared
        # by `schedule` and `postprocess` as above.
        self._plain_decodes = False
        # the last run's (num_seqs, num_context_tokens, max_seq_len) at its first step, and its steps
        self.last_run: tuple[int, int, int, int] | None = None
        # Hold a run that the deadline stopped (`_HeldRun`): its steps are applied to the requests and
        # blocks only when something is to read them or the run cannot go on, so a run that the next
        # call continues is applied once. For a simulator in which nothing but this scheduler's own
        # calls and `settle` reads its requests or blocks between its segments.
        self.hold_runs = False
        self._held: _HeldRun | None = None
        # The last run's step end times and the state before it (`RunSpan`): what a simulator needs
        # to read the blocks, running and waiting requests after any of its steps.
        self.run_span: RunSpan | None = None

    def settle(self) -> None:
        """Apply the held run's steps, if any (see `hold_runs`)."""
        if self._held is not None:
            self._apply_held()

    def schedule(self) -> ScheduledBatch:
        if self._held is not None:
            self._apply_held()
        self._decode_steps_left = None
        self._plain_decodes = False
        return super().schedule()

    def postprocess(self, batch: ScheduledBatch, sampled_token_ids: Seq[int | None]) -> list[Sequence]:
        if self._held is not None:
            self._apply_held()
        self._decode_steps_left = None
        self._plain_decodes = False
        return super().postprocess(batch, sampled_token_ids)

    def schedule_reads_no_token_values(self) -> bool:
        if self._held is not None:
            self._apply_held()
        return super().schedule_reads_no_token_values()

    def drain_itl(self) -> tuple[array, array, ItlRuns]:
        """Hand over the recorded inter-token gaps (gaps, weights, fast-forwarded runs) and start
        afresh: a long simulation folds them into a histogram as it goes."""
        drained = (self.itl_gaps, self.itl_weights, self.itl_runs)
        self.itl_gaps, self.itl_weights, self.itl_runs = array("d"), array("q"), ItlRuns()
        return drained

    def itl_histogram(self) -> dict[float, int]:
        """Inter-token gap (s) -> how many tokens saw it, stepped and fast-forwarded steps alike."""
        self.settle()
        hist: dict[float, int] = {}
        for gap, count in zip(self.itl_gaps, self.itl_weights):
            hist[gap] = hist.get(gap, 0) + count
        for times, n in self.itl_runs:
            for a, b in zip(times, times[1:]):
                hist[b - a] = hist.get(b - a, 0) + n
        return hist

    def waiting_blocked(self) -> bool:
        """True when no waiting request can be admitted until a running one finishes or is preempted
        (decode steps only shrink the free blocks, so this stays true while they run)."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return True
        # the budget admission sees: under `chunked` the running decodes take a token each first
        decode_tokens = len(self.running) if isinstance(self.policy, ChunkedPolicy) else 0
        budget = self.config.max_num_batched_tokens - decode_tokens
        if budget <= 0:
            return True
        bm, seq = self.block_manager, self.waiting[0]
        if -(-seq.num_tokens // bm.block_size) <= bm.num_free_blocks:
            # blocks for all its tokens are free: it fits, hits or not (a hit never needs more). The
            # lookup is left to admission, which materializes any lazy chain it finds (when it
            # happens changes no outcome, see LazyBlockManager)
            return False
        hits = bm.lookup_prefix(seq)
        num_cached = len(hits) * bm.block_size
        n = min(seq.num_tokens - num_cached, budget)
        return bm.num_blocks_needed(seq, num_cached + n, hits) > bm.num_free_blocks

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
        held = self._held
        if held is not None:
            if held.goes_on(self, decode_times, start, token_id, max_steps):
                return self._extend_held(deadline)
            self._apply_held()
        running = self.running
        if not running or self._finished_outside_step or (self.waiting and not self.waiting_blocked()):
            return 0, start, []
        k_max = self._decode_run_limit(max_steps)
        if k_max <= 0:
            return 0, start, []
        computed = list(map(_get_num_computed_tokens, running))
        shape = (len(running), sum(computed), max(computed) + 1)
        times = decode_times(*shape, k_max, start, deadline)
        k, near = self._cap_run(len(times) - 1, computed, token_id)
        if k <= 0:
            return 0, start, []
        self.last_run = (*shape, k)
        end = float(times[k])
        if self.hold_runs and k == len(times) - 1 < k_max:  # the deadline stopped it: hold it
            held = self._held = _HeldRun(
                self, decode_times, times, computed, shape, k_max, token_id, max_steps
            )
            self.run_span = held.span(0, k)
            return k, end, []
        self.run_span = (times, 0, k, computed, self.block_manager.num_free_blocks, len(self.waiting))
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
        if not self._finished_outside_step and (not self.waiting or self.waiting_blocked()):
            k_max = self._run_limit_after_step(batch, max_steps, computed)
        if k_max > 0:
            shape = (len(computed), sum(computed), max(computed) + 1)
            times = decode_times(*shape, k_max, now, deadline)
            k, near = self._cap_run(len(times) - 1, computed, token_id)
            if k > 0:
                self.last_run = (*shape, k)
                if self.hold_runs and k == len(times) - 1 < k_max:  # stopped by the deadline
                    self.postprocess(batch, [token_id] * batch.num_seqs)  # none finishes in it
                    held = self._held = _HeldRun(
                        self, decode_times, times, computed, shape, k_max, token_id, max_steps
                    )
                    self.run_span = held.span(0, k)
                    return k, float(times[k]), []
                left = k_max - k if k_max < max_steps else None
                bm = self.block_manager
                self.run_span = (times, 0, k, computed, bm.num_free_blocks, len(self.waiting))
                return self._run_after_step(times[: k + 1], k == k_max, computed, near, token_id, left)
        finished = self.postprocess(batch, [token_id] * batch.num_seqs)
        return 0, now, finished

    def _extend_held(self, deadline: float) -> tuple[int, float, list[Sequence]]:
        """`fast_forward` from the held run's end: its steps priced on, up to `deadline`, then
        capped over the whole run as from its first step; held again where the deadline stops it.
        Returns the steps added (as `fast_forward`)."""
        held = self._held
        times, k0 = held.times, len(held.times) - 1
        start = times[k0]
        n, context, longest = held.shape
        more = held.decode_times(n, context + k0 * n, longest + k0, held.k_max - k0, start, deadline)
        times += more[1:]
        total, near = self._cap_run(len(times) - 1, held.computed, held.token_id)
        k = total - k0
        if k <= 0:  # the run's next step would preempt, or hit the waiting head's prefix
            del times[k0 + 1 :]
            self._apply_held()
            return 0, start, []
        self.last_run = (n, context + k0 * n, longest + k0, k)
        self.run_span = held.span(k0, total)
        end = float(times[total])
        if total == len(times) - 1 < held.k_max:  # the deadline stopped it again
            return k, end, []
        del times[total + 1 :]
        return k, end, self._apply_held(near)

    def _apply_held(self, near: list[int] | None = None) -> list[Sequence]:
        """Apply the held run's steps (`near`: `_near_block_ends` of at least its steps, if known);
        the requests it finished."""
        held, self._held = self._held, None
        times, computed, token_id = held.times, held.computed, held.token_id
        k = len(times) - 1
        if near is None:
            near = _near_block_ends(computed, self.block_manager.block_size, k)
        end = float(times[k])
        done = self._advance_run(times, end, token_id, check_stop=k == held.k_max)
        self._take_and_register_run_blocks(k, computed, near)
        steps_left = held.k_max - k if held.k_max < held.max_steps else None
        return self._finish_run(done, end, token_id, steps_left)

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
            if not seq.ignore_eos or len(seq.block_table) != -(-c // bs):
                return 0
            # registered as `_register_known` leaves a decode's blocks: those full of its computed
            # tokens, but perhaps the last (filled by the step before)
            if caching and not (c - 1) // bs <= seq.num_cached_blocks <= c // bs:
                return 0
            add(c)
        return k_max

    def _cap_run(self, k: int, computed: list[int], token_id: int) -> tuple[int, list[int] | None]:
        """Cap a run of k decode steps of the running requests (`computed` tokens before it) before a
        preemption or a new prefix hit of the waiting head (see `fast_forward`); with the run's
        `near` indices (`_near_block_ends` of k), or None where neither can happen (every request
        opening k // bs + 1 blocks finds them free, and no request waits)."""
        bm = self.block_manager
        if not self.waiting and len(computed) * (k // bm.block_size + 1) <= bm.num_free_blocks:
            return k, None
        near = _near_block_ends(computed, bm.block_size, k)
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
            running = self.running  # the fewest tokens any can still get before its length stop
            return min(
                min(map(sub, map(_get_stop_num_tokens, running), map(len, map(_get_token_ids, running)))),
                max_steps,
            )
        bs = self.block_manager.block_size
        caching = self.block_manager.enable_prefix_caching
        k_max = max_steps
        for seq in self.running:
            c = seq.num_computed_tokens
            n = len(seq.token_ids)
            if n - c != 1 or not seq.ignore_eos or seq.last_token_time is None:
                return 0
            if len(seq.block_table) != -(-c // bs):
                return 0
            if caching and not (c - 1) // bs <= seq.num_cached_blocks <= c // bs:  # registered
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
            # its block h is registered next: it holds h blocks, or h - 1 and a full one (as
            # `_run_limit_after_step` checks)
            if seq.num_cached_blocks != h and not (seq.num_cached_blocks == h - 1 and c == h * bs):
                continue
            # h > 0: the head's lookup materialized the chain of its first block, so a sequence that
            # registers lazily has another first block (and no hash memo to read beyond it)
            if h and ((self._lazy and bm.registers_lazily(seq)) or bm.block_hashes(seq, h)[h - 1] != prev):
                continue
            step = (h + 1) * bs - c + 1  # the step that opens its block h + 1, registering block h
            if step <= k:
                tokens = [*seq.token_ids[h * bs : (h + 1) * bs]]  # a list (the ids may be bytes)
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
        like, num_new = running[0].token_ids, k if sampled_at is None else k + 1
        # of the type of the token lists (extending an array by an array of its type copies bytes)
        new_tokens = (
            array(like.typecode, [token_id]) * num_new if type(like) is array else [token_id] * num_new
        )
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
                self.itl_runs.add(times, len(running))
        return done

    def _take_and_register_run_blocks(self, k: int, computed: list[int], near: list[int] | None) -> None:
        """Allocate and register the blocks of k decode steps after `_advance_run`. `computed`: the
        running requests' computed tokens before the run; `near`: the indices among them that
        `_near_block_ends` gives for at least k steps (the others open and fill no block), or None."""
        bm, running = self.block_manager, self.running
        bs, caching = bm.block_size, bm.enable_prefix_caching
        if near is None:
            near = _near_block_ends(computed, bs, k)
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
        lazy, eager = bm.split_lazy_fills(fills) if self._lazy else ((), fills)
        if eager and self._new_blocks_collide(eager):
            self._apply_block_events(k, computed, near)
            return
        self._take_run_blocks(k, opens)
        if lazy:
            bm.extend_lazy_chains(lazy)  # nothing to hash or register; they touch no other sequence
        for seq, num_tokens in eager:
            bm.cache_full_blocks(seq, num_tokens)

    def _new_blocks_collide(self, eager: list[tuple[Sequence, int]]) -> bool:
        """Whether a block that the next steps fill has a hash already cached or filled twice: only
        then does registering in stepping's order, between allocations, change the outcome.
        `eager`: the (sequence, computed tokens after the steps) that fill blocks and register them
        eagerly; the blocks of a sequence that registers lazily can do neither (see `LazyBlockManager`)."""
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


class ItlRuns:
    """Fast-forwarded runs' end times for their inter-token gaps: `times`, every run's end times one
    after the other (an array of floats), `lengths` and `seqs`, per run how many and its running
    requests. Iterating gives (end times, requests) per run."""

    __slots__ = ("times", "lengths", "seqs")

    def __init__(self) -> None:
        self.times = array("d")
        self.lengths = array("q")
        self.seqs = array("q")

    def add(self, times: Seq[float], num_seqs: int) -> None:
        """A run of len(times) - 1 steps: its end times are times[1:] (times[0] is its start)."""
        ends = times[1:]
        self.times.fromlist(ends if type(ends) is list else list(ends))  # twice as fast as extend
        self.lengths.append(len(times) - 1)
        self.seqs.append(num_seqs)

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        start = 0
        for n, seqs in zip(self.lengths, self.seqs):
            yield self.times[start : start + n], seqs
            start += n


class _HeldRun:
    """A decode run that `FastForwardScheduler.hold_runs` keeps unapplied: its decode times (the
    function, and the end times so far from the run's start), the running requests' computed tokens
    and shape before it, its step limit, token and max_steps, and what it may go on with: the same
    waiting requests (a blocked head whose prefix the run's cap checks, or none)."""

    __slots__ = (
        "decode_times",
        "times",
        "computed",
        "shape",
        "k_max",
        "token_id",
        "max_steps",
        "waiting",
        "num_free_blocks",
    )

    def __init__(self, sched, decode_times, times, computed, shape, k_max, token_id, max_steps) -> None:
        self.decode_times = decode_times
        self.times = list(times)
        self.computed = computed
        self.shape = shape
        self.k_max = k_max
        self.token_id = token_id
        self.max_steps = max_steps
        self.waiting = (len(sched.waiting), sched.waiting[0] if sched.waiting else None)
        self.num_free_blocks = sched.block_manager.num_free_blocks  # before the run's blocks

    def span(self, first: int, last: int) -> RunSpan:
        """The `RunSpan` of this run's steps first + 1 .. last."""
        return (self.times, first, last, self.computed, self.num_free_blocks, self.waiting[0])

    def goes_on(self, sched, decode_times, start: float, token_id: int, max_steps: int) -> bool:
        """Whether a `fast_forward(decode_times, start, ..., token_id, max_steps)` of `sched` is this
        run going on: from its end, with nothing queued or finished outside a step since."""
        waiting = sched.waiting
        return (
            decode_times is self.decode_times
            and start == self.times[-1]
            and token_id == self.token_id
            and max_steps == self.max_steps
            and not sched._finished_outside_step
            and self.waiting == (len(waiting), waiting[0] if waiting else None)
        )


_get_num_computed_tokens = attrgetter("num_computed_tokens")
_get_stop_num_tokens = attrgetter("stop_num_tokens")
_get_token_ids = attrgetter("token_ids")


def _near_block_ends(computed: list[int], block_size: int, k: int) -> list[int]:
    """Indices of the decodes (blocks covering exactly their `computed` tokens) that open or fill a
    block within k steps: those whose next token starts a block or lies in its last k slots."""
    if k <= 0:
        return []
    last = block_size - k
    if last <= 1:  # every slot of a block is within k steps
        return list(range(len(computed)))
    return [i for i, c in enumerate(computed) if not 0 < c % block_size < last]


DecodeTimes = Callable[[int, int, int, int, float, float], Seq[float]]

# Steps first + 1 .. last of a decode run (from its start, step 0) and the state before it:
# (times, first, last, computed, num_free_blocks, num_waiting), `times` the run's step end times
# from its start (times[0]), `computed` the running requests' computed tokens. Inside a run no
# request finishes, is admitted or preempted: after its step j < last these requests run, as many
# wait, and each holds the blocks of its tokens (`run_used_blocks`).
RunSpan = tuple[Seq[float], int, int, list[int], int, int]


def run_used_blocks(span: RunSpan, num_blocks: int, block_size: int, j: int) -> int:
    """Blocks in use (of `num_blocks`) after step j of the run of `span`: those before it, and each
    request's blocks opened by its steps 1..j (a plain decode's blocks cover its computed tokens)."""
    computed = span[3]
    opened = sum(cdiv(c + j, block_size) - cdiv(c, block_size) for c in computed)
    return num_blocks - span[4] + opened


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
