"""The discrete-event simulation: SimPy is the clock, the engine's own Scheduler decides every step.

One arrival process replays a Trace through a router; one process per replica loops
`schedule -> wait(latency) -> postprocess`, or collapses a run of decode-only steps with the
scheduler's exact `fast_forward` (or, after a step, `postprocess_and_fast_forward`). A replica waits in SimPy only where it could meet an arrival (its
steps that end earlier run back to back, landing on the same times); where the router tells which
arrivals may come to a replica (`RouteAhead`), its runs go on past the others. No scheduling logic
lives here.

With `SimConfig.async_scheduling` a replica follows the engine's async loop (engine/llm.py): a decode
step is launched and the next one scheduled while it runs, so the scheduler sees the requests that
had arrived when the step before started (later ones wait in the replica's inbox one step more).
Whether a step is scheduled ahead ("overlapped") is the engine's decision, asked of the same core:
the step before `can_run_ahead`, `Scheduler.schedule_reads_no_token_values()` held before it was
scheduled, and `schedules_ahead` holds for it. An overlapped step costs what the latency model's
`overlapped_model()` says, without the host's time. Inside a fast-forwarded run those answers do not
change after its first step (no request finishes before its last step, none is admitted or
preempted, and a waiting request waits throughout), so a run takes one view for all its steps.
"""

from __future__ import annotations

import math
import time
from array import array
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter, call

import numpy as np
import pandas as pd
import simpy

from engine.core.scheduler import can_run_ahead, follows, schedules_ahead
from engine.core.sequence import Sequence, SequenceStatus
from engine.records import request_record
from engine.sampling_params import SamplingParams
from simulator.cluster import LeastOutstandingRouter, RoundRobinRouter, least_outstanding_needs, make_router
from simulator.config import SimConfig
from simulator.fast_forward import FastForwardScheduler, RunSpan, accumulate_decode_times, run_used_blocks
from simulator.latency.base import LatencyModel
from simulator.lazy_blocks import LazyBlockManager
from simulator.metrics import ITLBins
from traces.schema import synthetic_vocab_size

SIM_TOKEN_ID = 0
_TOKEN_CHUNK = 256  # the token every simulated decode "samples"; prompts carry the trace's tokens

# How a replica stores each of REQUEST_FIELDS (`TypedRows`): "q" int64, "i" int32 (int64 in the
# table; a larger value fails to append), "d" float64 (None as NaN), "O" a list of the values
REQUEST_COLUMN_TYPES = {
    "request_id": "q",
    "replica": "i",
    "arrival_s": "d",
    "first_scheduled_s": "d",
    "first_token_s": "d",
    "finish_s": "d",
    "prompt_len": "i",
    "output_len": "i",
    "num_output_tokens": "i",
    "num_preemptions": "i",
    "num_cached_tokens": "i",
    "finish_reason": "O",
}
TIMELINE_FIELDS = ("time_s", "replica", "kv_usage", "num_running", "num_waiting")
# A replica's timeline rows hold the KV blocks in use where TIMELINE_FIELDS has kv_usage: `collect`
# divides by the block count of the configuration it reports (see `CapacityUse`).
TIMELINE_COLUMN_TYPES = dict(zip(TIMELINE_FIELDS, ("d", "i", "q", "q", "q")))


class TypedRows:
    """Rows of fixed fields kept column by column in typed arrays (`types`: field -> typecode, as
    REQUEST_COLUMN_TYPES): a replica's per-request rows (`request_record`) cost some 60 bytes a
    request so, where a tuple of Python objects costs some 350. Iterating gives the rows back as
    tuples (None where a float is missing); `rows_frame` builds the table that
    `pd.DataFrame.from_records` of those rows gives."""

    __slots__ = ("types", "columns", "_numeric", "_objects", "_appends")

    def __init__(self, types: dict[str, str]) -> None:
        self.types = types
        self.columns = [[] if k == "O" else array(k) for k in types.values()]
        self._index_columns()

    def _index_columns(self) -> None:
        kinds = list(self.types.values())
        # (position in a row, column) of the typed fields, and of the others; each column's append
        self._numeric = [(i, c) for i, c in enumerate(self.columns) if kinds[i] != "O"]
        self._objects = [(i, c) for i, c in enumerate(self.columns) if kinds[i] == "O"]
        self._appends = [c.append for c in self.columns]

    @classmethod
    def requests(cls) -> TypedRows:
        """Rows of REQUEST_FIELDS."""
        return cls(REQUEST_COLUMN_TYPES)

    def append(self, row: tuple) -> None:
        if None not in row:  # (most rows) each value to its column's append, in C
            list(map(call, self._appends, row))
            return
        for i, column in self._numeric:
            value = row[i]
            column.append(math.nan if value is None else value)
        for i, column in self._objects:
            column.append(row[i])

    def __len__(self) -> int:
        return len(self.columns[0])

    def __iter__(self):
        kinds = self.types.values()
        return zip(
            *([None if v != v else v for v in c] if k == "d" else c for k, c in zip(kinds, self.columns))
        )

    def column(self, name: str) -> np.ndarray:
        """One field's values (of a typed column: a view, no copy)."""
        kind, values = self.types[name], self.columns[list(self.types).index(name)]
        return np.array(values, dtype=object) if kind == "O" else np.frombuffer(values, dtype=kind)

    def release(self, name: str) -> None:
        """Let one field's values go (its column empty: the rows are no longer whole)."""
        i = list(self.types).index(name)
        kind, self.columns[i] = self.types[name], []
        if kind != "O":
            self.columns[i] = array(kind)
        self._index_columns()


def rows_frame(
    parts: list[TypedRows],
    order_by: str | None = None,
    scale: dict | None = None,
    release: bool = False,
) -> pd.DataFrame:
    """The table of the rows of `parts` (of the same fields), one after the other; with `order_by`,
    sorted by that column as `sort_values(kind="stable")` sorts, on a fresh index; `scale` (field ->
    divisor) divides a column's values as `value / divisor` does. The columns, dtypes and values of
    `pd.DataFrame.from_records` over the rows (int64; float64 with NaN for None, object where every
    value is None; the inferred string type), built from the typed columns, each column its own
    block (no copy into 2-D blocks). With `release`, each of the parts' columns is emptied once
    the table has it (the parts end with no rows): at most one column is held twice."""
    types = parts[0].types
    parts = [p for p in parts if len(p)]
    if not parts:  # no rows: from_records' own (object) columns
        return pd.DataFrame.from_records([], columns=list(types))
    scale = scale or {}

    def column(name: str) -> np.ndarray:
        values = np.concatenate([p.column(name) for p in parts])
        if release and name != order_by:
            for p in parts:
                p.release(name)
        return values

    order = np.argsort(column(order_by), kind="stable") if order_by is not None else None
    data = {}
    for name, kind in types.items():
        values = column(name)
        if order is not None:
            values = values[order]
        if name in scale:
            values = values / scale[name]
        elif kind == "O":
            values = pd.Series(values)  # the string type from_records infers
        elif kind == "d" and np.isnan(values).all():
            values = np.full(len(values), None, dtype=object)  # all None: from_records keeps object
        elif kind != "d":
            values = values.astype(np.int64, copy=False)
        data[name] = values
    if release and order_by is not None:
        for p in parts:
            p.release(order_by)
    return pd.DataFrame(data, copy=False)


@dataclass
class NextArrival:
    """The arrival process's next request: its trace time `time` (fast-forwards stop before it) and
    `event_time`, the SimPy time its event is scheduled at (replicas wait for SimPy from there on);
    -inf until the arrival process first waits, inf once every request has arrived."""

    time: float = math.inf
    event_time: float = -math.inf


_get_outstanding_tokens = attrgetter("outstanding_tokens")


class RouteAhead:
    """Which arrival a replica's decode runs must stop at, where the router tells before it chooses:
    round_robin sends arrival i to replica i mod R; least_outstanding reads only outstanding tokens,
    which a replica's run leaves as they are until a request finishes, so it cannot choose a replica
    in a run before the others have been sent `least_outstanding_lead` tokens. A replica's runs then
    end at its own next (possible) arrival, not at every arrival; it still waits in SimPy for the
    arrival before a segment that changes its outstanding tokens (the router reads them there).
    Other routers (prefix_aware reads the blocks that runs register), and least_outstanding under
    async scheduling (a request rejected at admission changes outstanding tokens mid-run), stop
    every replica's runs at every arrival. `of` says which applies."""

    def __init__(self, router, replicas: list, arrivals, prompt_lens, output_lens) -> None:
        self.replicas = replicas
        self.arrivals = arrivals
        self.round_robin = isinstance(router, RoundRobinRouter)
        # the SimPy time of each arrival's event, as the arrival process schedules it
        self.event_times = event_times = array("d")
        now = 0.0
        for a in arrivals:
            if a > now:
                now = now + (a - now)
            event_times.append(now)
        self.next_index = 0  # the arrivals before it have been routed
        self.outstanding = [0] * len(replicas)  # each replica's, as the last arrival left them
        self._tokens_before = None  # least_outstanding: prompt + output tokens of arrivals [0, i)
        if not self.round_robin:
            tokens = np.asarray(prompt_lens, dtype=np.int64) + np.asarray(output_lens, dtype=np.int64)
            # an int64 array: bisect reads it as Python ints (a numpy call costs more than the search)
            self._tokens_before = array("q", np.concatenate(([0], np.cumsum(tokens))).tobytes())
        for replica in replicas:
            replica.own = NextArrival()
            if self.round_robin:
                self._set(replica.own, replica.index)
            else:
                replica.route_ahead = self

    @classmethod
    def of(cls, router, replicas: list, arrivals, prompt_lens, output_lens, async_scheduling: bool):
        """The plan for `router`, or None where every arrival stops every replica's runs."""
        if len(replicas) < 2:
            return None  # one replica: its next arrival is the next arrival
        if isinstance(router, RoundRobinRouter) or (
            isinstance(router, LeastOutstandingRouter) and not async_scheduling
        ):
            return cls(router, replicas, arrivals, prompt_lens, output_lens)
        return None

    def _set(self, marker: NextArrival, i: int) -> None:
        if i < len(self.arrivals):
            marker.time, marker.event_time = self.arrivals[i], self.event_times[i]
        else:
            marker.time = marker.event_time = math.inf

    def routed(self, i: int, replica) -> None:
        """Arrival i has been sent to `replica`."""
        self.next_index = i + 1
        if self.round_robin:
            self._set(replica.own, i + len(self.replicas))
        else:
            self.outstanding = list(map(_get_outstanding_tokens, self.replicas))
            replica.own_stale = True

    def refresh(self, replica) -> None:
        """least_outstanding: the first arrival that could be sent to `replica`, as it is now."""
        replica.own_stale = False
        i = self.next_index
        lead, count = least_outstanding_needs(replica.outstanding_tokens, replica.index, self.outstanding)
        if lead > 0:  # the arrivals from i on that bring the others `lead` tokens go elsewhere,
            # and so do the first `count` (one for each replica the router would choose first)
            before = self._tokens_before
            i = max(bisect_left(before, before[i] + lead), i + count)
        self._set(replica.own, i)


@dataclass
class CapacityUse:
    """How close one replica's run came to its capacity limits (simulator/share.py reads them):
    the most tokens a step was granted, plus the waiting head's prompt where one waited after it;
    the most running requests; the most KV blocks its unfinished requests could ever hold at once
    (each request's prompt + output tokens in blocks, summed from its arrival to its finish; the
    peak also counts each arrival that was rejected, on top of the others)."""

    max_step_tokens: int = 0
    max_running: int = 0
    max_kv_blocks: int = 0
    kv_blocks: int = 0  # that sum now
    num_empty_steps: int = 0  # steps scheduled with nothing in them (a run that was stuck)


@dataclass
class SimCounters:
    num_steps: int = 0
    num_fast_forwards: int = 0
    num_fast_forward_steps: int = 0
    num_overlapped_steps: int = 0  # async scheduling: decode steps scheduled while the one before ran
    busy_s: float = 0.0


class LaggedDecodeTimes:
    """A run's decode step times under async scheduling: a request that arrives during a decode step
    is seen only when the step after it ends (that one was scheduled before it arrived), so a run
    that the next arrival would stop goes on one step past it. Keeps the times it returned last.
    `step_time`, the latency model's `decode_step_time` if given, prices that step (a run's end
    times add each step's `decode_step_time` in order: the same float), else `decode_times` does."""

    __slots__ = ("decode_times", "step_time", "times")

    def __init__(self, decode_times, step_time=None) -> None:
        self.decode_times = decode_times
        self.step_time = step_time
        self.times: list[float] = []

    def __call__(self, num_seqs, num_context_tokens, max_seq_len, max_steps, start, deadline):
        times = self.decode_times(num_seqs, num_context_tokens, max_seq_len, max_steps, start, deadline)
        k = len(times) - 1
        if k < max_steps:  # stopped by the deadline: the step starting at or after it runs too,
            # priced from times[k] as the run would (step k + 1 reads k * num_seqs more tokens)
            context, longest = num_context_tokens + k * num_seqs, max_seq_len + k
            if self.step_time is not None:
                times.append(times[k] + self.step_time(num_seqs, context, longest))
            else:
                times += self.decode_times(num_seqs, context, longest, 1, times[k], math.inf)[1:]
        self.times = times
        return times


class HostFirstDecodeTimes:
    """Async scheduling: the decode times of a run whose first step is scheduled once the step before
    has ended (it pays the host: `first`, the latency model's `decode_step_time`) and whose others
    are scheduled ahead (`rest`, a `LaggedDecodeTimes` of the overlapped view), as stepping would
    run them: that step, then the run that `postprocess_and_fast_forward` would run after it. The
    run goes past its first step only where stepping's would in the same segment: `allow_rest` (no
    request in the inbox that the next step's scheduler sees first), no wait in SimPy at the step's
    end (the replica's SimPy time `now` stays before `wait_at`) and no timeline sample due there
    (`last_sample`, `interval`). Keeps the times it returned last and its first step's time."""

    __slots__ = (
        "first",
        "rest",
        "times",
        "first_s",
        "now",
        "wait_at",
        "last_sample",
        "interval",
        "allow_rest",
    )

    def __init__(self, first, rest: LaggedDecodeTimes) -> None:
        self.first = first
        self.rest = rest
        self.times: list[float] = []
        self.first_s = 0.0
        self.now = self.wait_at = self.last_sample = self.interval = 0.0
        self.allow_rest = False

    def __call__(self, num_seqs, num_context_tokens, max_seq_len, max_steps, start, deadline):
        step_s = self.first_s = self.first(num_seqs, num_context_tokens, max_seq_len)
        t = start + step_s
        times = [start, t]
        now = self.now
        if (
            max_steps > 1
            and self.allow_rest
            and now + max(0.0, t - now) < self.wait_at
            and t - self.last_sample < self.interval
        ):
            times += self.rest(
                num_seqs, num_context_tokens + num_seqs, max_seq_len + 1, max_steps - 1, t, deadline
            )[1:]
        self.times = times
        return times


class Replica:
    """One engine: a Scheduler over a BlockManager, advanced by the latency model's step times."""

    # Compute the steps that end before the next arrival event without waiting for SimPy between
    # them (see `_serve`); False waits after every step (the reference the tests compare with).
    chain_steps = True
    # Where the router reads no replica's requests or blocks: hold a run that another replica's
    # possible arrival stops, so that it is applied once (`FastForwardScheduler.hold_runs`); False
    # applies every run as it stops (the reference the tests compare with).
    hold_runs = True

    def __init__(
        self,
        env: simpy.Environment,
        index: int,
        config: SimConfig,
        num_kv_blocks: int,
        latency: LatencyModel,
        arrival: NextArrival,
        copy_prompts: bool = True,
    ) -> None:
        self.env = env
        self.index = index
        self.config = config
        self.latency = latency
        self.decode_times = _decode_times(latency)
        self.async_scheduling = config.async_scheduling
        overlapped = getattr(latency, "overlapped_model", None)
        self.overlapped_latency = overlapped() if overlapped is not None else latency
        # async: requests arrived but not yet seen by the scheduler, (arrival_s, id, prompt, output_len)
        self.inbox: deque[tuple[float, int, list[int], int]] = deque()
        # async: the start and requests of the last step when it ran ahead (`can_run_ahead`), else None
        self._deferred_start: float | None = None
        self._deferred_seqs: tuple[Sequence, ...] | list[Sequence] | None = None
        self._lagged = LaggedDecodeTimes(self.decode_times, latency.decode_step_time)
        self._lagged_overlapped = LaggedDecodeTimes(
            _decode_times(self.overlapped_latency), self.overlapped_latency.decode_step_time
        )
        self._host_first = HostFirstDecodeTimes(latency.decode_step_time, self._lagged_overlapped)
        self.clock = 0.0  # exact simulated time of this replica; env.now follows it
        self.block_manager = LazyBlockManager(num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = FastForwardScheduler(config.scheduler_config(), self.block_manager, clock=self._now)
        self.arrival = arrival  # the next arrival, wherever it goes
        # the next arrival that may come here (`RouteAhead`; else `arrival`): where runs stop
        self.own = arrival
        self.route_ahead: RouteAhead | None = None  # least_outstanding: refreshes `own`
        self.own_stale = False  # least_outstanding: `own` is to be refreshed
        self.outstanding_tokens = 0  # prompt + requested output tokens of unfinished requests
        self.records = TypedRows.requests()
        self.timeline = TypedRows(TIMELINE_COLUMN_TYPES)
        self.counters = SimCounters()
        self.capacity = CapacityUse()
        self.itl = ITLBins()
        self.batch_log: list[tuple] | None = None  # per-step decisions, when asked (tests)
        self.overlap_log: list[bool] | None = None  # per step of batch_log: scheduled ahead
        self._last_sample = -math.inf
        self._wakeup: simpy.Event | None = None
        self._params: dict[int, SamplingParams] = {}
        # False where each submitted prompt is a list of its own, used nowhere after: the request's
        # Sequence takes it as its token list instead of a copy
        self.copy_prompts = copy_prompts
        self.process = env.process(self.run())

    def _now(self) -> float:
        return self.clock

    def submit(
        self, request_id: int, prompt: list[int], output_len: int, arrival_s: float
    ) -> Sequence | None:
        """Queue one request; its Sequence (None with async scheduling: it waits in the inbox until
        the scheduler can see it)."""
        if self.async_scheduling:
            self.outstanding_tokens += len(prompt) + output_len
            self.inbox.append((arrival_s, request_id, prompt, output_len))
            seq = None
        else:
            seq = self._add(request_id, prompt, output_len, arrival_s)
        self.own_stale = True  # more outstanding tokens (see `RouteAhead`)
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed(arrival_s)
        return seq

    def _admit(self, cutoff: float) -> None:
        """Async scheduling: hand the scheduler the inbox's requests that arrived by `cutoff`."""
        inbox = self.inbox
        while inbox and inbox[0][0] <= cutoff:
            arrival_s, request_id, prompt, output_len = inbox.popleft()
            self.outstanding_tokens -= len(prompt) + output_len
            self._add(request_id, prompt, output_len, arrival_s)

    def _deadline(self) -> float:
        """The time a run of decode steps must stop at: the next request the scheduler will see."""
        inbox = self.inbox
        return min(self.own.time, inbox[0][0]) if inbox else self.own.time

    def _add(self, request_id: int, prompt: list[int], output_len: int, arrival_s: float) -> Sequence:
        params = self._params.get(output_len)
        if params is None:  # frozen: one per output length serves every request of that length
            params = self._params[output_len] = SamplingParams(max_tokens=output_len, ignore_eos=True)
        seq = self.scheduler.add_request(prompt, params, arrival_s, copy_prompt=self.copy_prompts)
        seq.user_data = (request_id, output_len)
        use = self.capacity
        num_blocks = -(-(seq.num_prompt_tokens + output_len) // self.config.block_size)
        if use.kv_blocks + num_blocks > use.max_kv_blocks:  # a rejected request's too: see CapacityUse
            use.max_kv_blocks = use.kv_blocks + num_blocks
        if seq.status is SequenceStatus.REJECTED:
            self._record(seq)
            return seq
        use.kv_blocks += num_blocks
        self.outstanding_tokens += seq.num_prompt_tokens + output_len
        return seq

    def run(self):
        env, sched = self.env, self.scheduler
        while True:
            if not sched.has_unfinished():
                if not self.inbox:
                    self._wakeup = env.event()
                    arrival_s = yield self._wakeup
                    self._wakeup = None
                    self.clock = max(self.clock, arrival_s)
                if self.inbox:  # async: an idle engine sees every request that has arrived
                    self.clock = max(self.clock, self.inbox[0][0])
                    self._deferred_start = self._deferred_seqs = None
                    self._admit(self.clock)
            yield from self._serve()

    def _serve(self):
        """Steps and fast-forwards while there is work.

        A replica meets the rest of the simulation only at arrival events, so a step or run that ends
        before the pending one is not waited for in SimPy: the next is computed at once. `now`
        follows the time SimPy would be at after each wait (now + max(0, end - now)); as soon as it
        reaches the event time of the next arrival that may come here (`own`, a tie included), the
        replica takes the waits it owes and lands on exactly that time, as if it had waited for every
        step; with least_outstanding also before a segment that may change its outstanding tokens
        (a step, a run that finishes requests) once it reaches the next arrival's (`RouteAhead`).
        The waits go one by one where an arrival comes before the last one starts, so that SimPy
        orders the replica and the arrivals at a tie as waiting after every step does. A step's postprocess
        also runs the decode steps that `fast_forward` would run next (nothing happens in between
        but a timeline sample, so not where one is due): that run is the next segment."""
        env, sched, counters = self.env, self.scheduler, self.counters
        fast_forward = sched.fast_forward if self.config.fast_forward else None
        fuse = fast_forward is not None  # a step's postprocess and the run after it in one call
        arrival, chain, interval = self.arrival, self.chain_steps, self.config.timeline_interval_s
        route_ahead = self.route_ahead  # least_outstanding: refreshes `own`; waits before changes
        async_ = self.async_scheduling
        latency, decode_times = self.latency, self.decode_times
        now, owed, segments = env.now, [], 0
        last = now  # SimPy's time before the last wait owed
        pending = None  # (steps, end, finished) of a run that a step's postprocess ran: the next segment
        pending_overlapped = False  # async: that run's steps were scheduled ahead
        count_run = getattr(self.latency, "count_run", None)
        ahead = False  # async: the next step is scheduled while the one before runs, if it chains
        host_first = self._host_first
        while pending is not None or sched.has_unfinished():
            if self.own_stale and route_ahead is not None:
                route_ahead.refresh(self)
            own = self.own
            start = self.clock
            batch, k, stepped = None, 0, False  # stepped: a run's first step, timed as a step
            if async_ and pending is None:
                ahead, decode_times = self._async_views(start)
            if pending is not None:
                (k, end, finished), pending = pending, None
                run_overlapped = pending_overlapped
            elif fast_forward is not None and decode_times is not None:
                deadline = self._deadline() if async_ else own.time
                run_seqs = tuple(sched.running) if async_ else None  # the run's, for the next step
                if decode_times is host_first:  # where stepping's segment would end after the step
                    host_first.now, host_first.last_sample = now, self._last_sample
                    host_first.interval = interval
                    wait_at = own.event_time if chain else -math.inf
                    if route_ahead is not None and arrival.event_time < wait_at:
                        wait_at = arrival.event_time
                    host_first.wait_at = wait_at
                    host_first.allow_rest = not (self.inbox and self.inbox[0][0] <= start)
                k, end, finished = fast_forward(decode_times, start, deadline, SIM_TOKEN_ID)
                run_overlapped = decode_times is self._lagged_overlapped
                if k and async_:
                    self._deferred_start, self._deferred_seqs = decode_times.times[k - 1], run_seqs
                    if decode_times is host_first:
                        # its first step is a segment of its own, as the step stepping schedules
                        # there; the others are the next segment, as the run after that step
                        stepped, step_s = True, host_first.first_s
                        self._note_decode_capacity(len(run_seqs))
                        if k > 1:
                            pending, finished = (k - 1, end, finished), []
                            pending_overlapped = True
                        elif count_run is not None:
                            count_run(*sched.last_run)
                        end, k = host_first.times[1], 0
            if k:
                if count_run is not None:  # steps priced outside the profile's fit (the run's shape)
                    count_run(*sched.last_run)
                if run_overlapped:
                    counters.num_overlapped_steps += k
                counters.num_fast_forwards += 1
                counters.num_fast_forward_steps += k
                counters.busy_s += end - start
            elif not stepped:
                batch = sched.schedule()
                self._note_capacity(batch)
                if self.batch_log is not None:
                    self.batch_log.append(batch_decisions(batch))
                if batch.is_empty:
                    self.capacity.num_empty_steps += 1
                    self._finish_all(sched.postprocess(batch, ()))
                    if sched.has_unfinished() and sched.schedule().is_empty:
                        raise RuntimeError(
                            f"replica {self.index}: the scheduler made no progress at t={self.clock}"
                        )
                    continue
                overlapped = ahead and schedules_ahead(self._deferred_seqs, batch)
                if self.overlap_log is not None:
                    self.overlap_log.append(overlapped)
                if overlapped:
                    counters.num_overlapped_steps += 1
                    step_s = self.overlapped_latency.predict(batch).total
                else:
                    step_s = latency.predict(batch).total
                end = start + step_s
            delay = max(0.0, end - now)
            last = now
            now += delay
            owed.append(delay)
            if (
                now >= own.event_time
                or not chain
                or (
                    route_ahead is not None
                    and now >= arrival.event_time
                    and (batch is not None or stepped or finished)
                )
            ):
                yield from self._wait(owed, now, arrival.event_time > last)
                owed = []
                if now >= own.event_time:  # it may come here now: `own` is to be refreshed
                    self.own_stale = True
            self.clock = end
            if batch is None:
                if k > 1:  # timeline rows due at the run's steps before its last (see `_sample_run`)
                    span = sched.run_span
                    if span[0][span[2] - 1] - self._last_sample >= interval:
                        self._sample_run(span)
                if stepped:
                    counters.num_steps += 1
                    counters.busy_s += step_s
                if finished:
                    self._finish_all(finished)
            else:
                counters.num_steps += 1
                counters.busy_s += step_s
                run_times = self._run_after(batch, start) if async_ else self.decode_times
                # with the run after the step where no timeline sample is due between them
                if fuse and run_times is not None and end - self._last_sample < interval:
                    num, run_end, finished = sched.postprocess_and_fast_forward(
                        batch, run_times, self._deadline() if async_ else own.time, SIM_TOKEN_ID
                    )
                    if num:
                        pending, finished = (num, run_end, finished), []
                        pending_overlapped = run_times is self._lagged_overlapped
                        if async_:  # the run's requests are the step's (none finished in it)
                            self._deferred_start = run_times.times[num - 1]
                else:
                    finished = sched.postprocess(batch, [SIM_TOKEN_ID] * batch.num_seqs)
                self._finish_all(finished)
            segments += 1
            # a timeline sample when one is due; the ITL's size every 256 steps and runs (binning
            # sooner or later gives the same integer counts)
            if end - self._last_sample >= interval or not segments & 255:
                self._sample()
        if owed:
            yield from self._wait(owed, now, arrival.event_time > last)

    def _note_capacity(self, batch) -> None:
        """Note the tokens and running requests of a step just scheduled (see `CapacityUse`)."""
        use, sched = self.capacity, self.scheduler
        tokens = batch.total_num_scheduled_tokens
        if sched.waiting:
            tokens += sched.waiting[0].num_tokens
        if tokens > use.max_step_tokens:
            use.max_step_tokens = tokens
        if len(sched.running) > use.max_running:
            use.max_running = len(sched.running)

    def _note_decode_capacity(self, num_seqs: int) -> None:
        """`_note_capacity` of a decode step of all `num_seqs` running requests, none waiting."""
        use = self.capacity
        if num_seqs > use.max_step_tokens:
            use.max_step_tokens = num_seqs
        if num_seqs > use.max_running:
            use.max_running = num_seqs

    def _async_views(self, start: float):
        """Async scheduling, before the segment starting at `start`: hand the scheduler the requests
        it sees now; return (whether the next step is scheduled ahead if `schedules_ahead` holds for
        it, the decode times of a run from here). The engine asks `schedule_reads_no_token_values`
        before it schedules (engine/llm.py `step`)."""
        sched, deferred = self.scheduler, self._deferred_start
        if self.inbox:  # what had arrived when this step's scheduling began
            self._admit(start if deferred is None else deferred)
        if deferred is None or not sched.schedule_reads_no_token_values():
            # the step is scheduled after the one before has ended: it pays the host, and so do the
            # others of a run where a request waits throughout it; else they are scheduled ahead
            return False, self._lagged if sched.waiting else self._host_first
        if not follows(self._deferred_seqs, sched.running):  # a run's first step is all of them
            return True, self._host_first  # this step pays the host (see `schedules_ahead`)
        return True, self._lagged_overlapped

    def _run_after(self, batch, start: float):
        """Async scheduling: the decode times of a run right after `batch` (which started at
        `start`), or None where none may follow it in the same call. Notes whether it ran ahead."""
        if not can_run_ahead(batch):  # a prefill or mixed step runs synchronously
            self._deferred_start = self._deferred_seqs = None
            return None
        self._deferred_start, self._deferred_seqs = start, batch.seqs
        if self.inbox and self.inbox[0][0] <= start:  # the next step's scheduler sees them first
            return None
        # the run's first step: schedule_reads_no_token_values holds unless a request waits (the
        # run stops before a preemption) and it follows the step (none of whose requests finished)
        return self._lagged if self.scheduler.waiting else self._lagged_overlapped

    def _wait(self, delays: list[float], until: float, at_once: bool = True):
        """Wait in SimPy until `until`, the time that waiting `delays` one after the other reaches:
        in one timeout when that lands exactly there and `at_once` (no arrival comes before the
        last delay starts), else one by one."""
        env = self.env
        total = until - env.now
        if at_once and len(delays) > 1 and env.now + total == until:  # SimPy schedules at now + delay
            yield env.timeout(total)
            return
        for delay in delays:
            yield env.timeout(delay)

    def _finish_all(self, finished: list[Sequence]) -> None:
        bs, use = self.config.block_size, self.capacity
        if finished:
            self.own_stale = True  # fewer outstanding tokens (see `RouteAhead`)
        for seq in finished:
            num_tokens = seq.num_prompt_tokens + seq.user_data[1]
            self.outstanding_tokens -= num_tokens
            use.kv_blocks -= -(-num_tokens // bs)
            self._record(seq)

    def _record(self, seq: Sequence) -> None:
        request_id, output_len = seq.user_data
        self.records.append(request_record(seq, request_id, output_len, self.index))
        seq.token_ids = []  # finished: drop what a million-request run cannot afford to keep
        seq.block_hashes = []

    def _sample(self) -> None:
        """Bin the recorded inter-token gaps once they are many; a timeline row once one is due.

        Rows go at the first step end at least `timeline_interval_s` after the row before, as a
        simulation that steps one by one takes them: after a segment here, and inside the runs that
        cross that time (`_sample_run`), so where runs stop changes no row."""
        sched = self.scheduler
        if len(sched.itl_runs.times) >= 1 << 16 or len(sched.itl_gaps) >= 65536:
            self.itl.fold(sched)
        if self.clock - self._last_sample >= self.config.timeline_interval_s:
            sched.settle()  # the blocks a held run takes
            self._timeline_row(
                self.clock, self.block_manager.num_used_blocks, sched.num_running, sched.num_waiting
            )

    def _sample_run(self, span: RunSpan) -> None:
        """The timeline rows due at the steps of the run of `span` before its last step (the state
        after each, from `span`: see `RunSpan`)."""
        times, first, last = span[0], span[1], span[2]
        interval, bm = self.config.timeline_interval_s, self.block_manager
        num_running = len(span[3])
        j = first + 1
        while j < last:
            since = self._last_sample
            j = bisect_left(times, True, j, last, key=lambda t: t - since >= interval)
            if j == last:
                return
            used = run_used_blocks(span, bm.num_blocks, bm.block_size, j)
            self._timeline_row(float(times[j]), used, num_running, span[5])
            j += 1

    def _timeline_row(self, time_s: float, used_blocks: int, num_running: int, num_waiting: int) -> None:
        """A timeline row at `time_s` (`num_waiting`: the scheduler's waiting requests then)."""
        self._last_sample = time_s
        if self.inbox:  # async: requests that arrived before, which the scheduler has not seen
            # yet, wait too (one arriving at `time_s` itself is not counted: the row then does not
            # depend on the order in which SimPy runs the arrival and this replica's step end)
            num_waiting += sum(1 for r in self.inbox if r[0] < time_s)
        self.timeline.append((time_s, self.index, used_blocks, num_running, num_waiting))


def _decode_times(latency):
    """The latency model's decode-run times (`DecodeTimes`), or the reference loop over its steps."""
    return getattr(latency, "decode_step_times", None) or partial(
        accumulate_decode_times, latency.decode_step_time
    )


def batch_decisions(batch) -> tuple:
    """What the scheduler decided in one step: who runs, how many tokens, prefix hits, preemptions."""
    return (
        tuple(s.seq_id for s in batch.seqs),
        batch.num_scheduled_tokens,
        batch.num_cached_tokens,
        batch.preempted_seq_ids,
    )


@dataclass
class SimRun:
    """Raw output of one run; `simulator.metrics` turns it into tables and a summary."""

    config: SimConfig
    replicas: list[Replica]
    num_kv_blocks: int
    wall_s: float
    trace_name: str = ""
    extra: dict = field(default_factory=dict)
    latency: LatencyModel | None = None  # the model that timed the steps


def simulate(
    trace,
    config: SimConfig,
    latency: LatencyModel,
    num_kv_blocks: int,
    progress: bool = False,
    record_batches: bool = False,
    prompts: list[list[int]] | None = None,
) -> SimRun:
    """Replay `trace` (a traces.Trace) on `config.num_replicas` replicas; return the raw run.

    `prompts`, when given, are `trace_prompts(trace, ...)` of this configuration's vocabulary, built
    once for several runs; else they are built as requests arrive."""
    t0 = time.perf_counter()
    env = simpy.Environment()
    df = trace.df
    # the trace's columns as typed views (indexing gives Python floats and ints)
    arrivals = _column(df["arrival_s"], "d")
    output_lens = _column(df["output_len"], "q")
    request_ids = _column(df["request_id"], "q")
    if prompts is not None and len(prompts) != len(arrivals):
        raise ValueError(f"prompts: {len(prompts)} given for a trace of {len(arrivals)} requests")
    arrival = NextArrival(arrivals[0] if arrivals else math.inf)
    # prompts built here are one list a request; given ones serve other runs, so they are copied
    replicas = [
        Replica(env, i, config, num_kv_blocks, latency, arrival, copy_prompts=prompts is not None)
        for i in range(config.num_replicas)
    ]
    if record_batches:
        for replica in replicas:
            replica.batch_log, replica.overlap_log = [], []
    router = make_router(config.router, replicas)
    route_ahead = RouteAhead.of(
        router,
        replicas,
        arrivals,
        df["prompt_len"].to_numpy(),
        df["output_len"].to_numpy(),
        config.async_scheduling,
    )
    if route_ahead is not None and not config.async_scheduling:
        # the router reads no replica's requests or blocks (only outstanding tokens, or nothing)
        for replica in replicas:
            replica.scheduler.hold_runs = replica.hold_runs
    vocab = synthetic_vocab_size(config.model.vocab_size, config.block_size)
    # the prompts the scheduler would reject are not generated (but for a router that reads them):
    # a list of that many placeholder tokens stands in, dropped once the request is recorded
    rejects = None if router.reads_prompt else _rejects(replicas[0].scheduler)
    # byte tokens (`array("B")`) where nothing but the requests' own sequences reads them: every
    # simulated request's token list is then one (its blocks compare only with each other's)
    compact = not router.reads_prompt

    only = replicas[0] if len(replicas) == 1 else None  # where there is no choice to make

    def arrival_process():
        bar = _progress_bar(len(arrivals), progress, trace)
        for i, a in enumerate(arrivals):
            arrival.time = a
            if a > env.now:
                delay = a - env.now
                arrival.event_time = env.now + delay  # where SimPy schedules the timeout
                yield env.timeout(delay)
            arrival.time = arrivals[i + 1] if i + 1 < len(arrivals) else math.inf
            if prompts is not None:
                prompt = prompts[i]
            else:
                if i % _TOKEN_CHUNK == 0:  # prompts of the next arrivals, generated together
                    chunk = trace.token_ids_many(i, i + _TOKEN_CHUNK, vocab, skip=rejects, compact=compact)
                prompt = chunk[i % _TOKEN_CHUNK]
                if prompt is None:
                    prompt = [SIM_TOKEN_ID] * trace.prompt_num_tokens(i)
            replica = only or router.choose(prompt)
            replica.submit(request_ids[i], prompt, output_lens[i], a)
            if route_ahead is not None:
                route_ahead.routed(i, replica)
            if bar is not None and i % 512 == 511:
                bar.update(512)
        arrival.event_time = math.inf
        if bar is not None:
            bar.update(len(arrivals) % 512)
            bar.close()

    env.process(arrival_process())
    env.run()
    for replica in replicas:
        replica.scheduler.settle()
        # its process waits for an arrival that never comes: let it go (its frame holds the scheduler)
        replica.process = replica._wakeup = None
    for replica in replicas:  # the run is over: let its per-arrival arrays go (24 MB a million)
        replica.route_ahead = None
    return SimRun(config, replicas, num_kv_blocks, time.perf_counter() - t0, getattr(trace, "name", ""))


def _column(series: pd.Series, typecode: str) -> memoryview:
    """`series` as a flat view of `typecode` ("d": float64, "q": int64) values, indexing to Python
    floats and ints: over the frame's own buffer where it has that type (no copy)."""
    return memoryview(np.ascontiguousarray(series.to_numpy(), dtype=typecode))


def _rejects(scheduler):
    """Whether `scheduler` (every replica's is configured alike) rejects a prompt of n tokens: its
    own rule (`Scheduler.rejection_reason`)."""
    rule = scheduler.rejection_reason
    return lambda n: rule(n) is not None


def trace_prompts(trace, vocab_size: int) -> list[list[int]]:
    """The prompt token ids of every row of `trace`, as a simulation builds them (a configuration's
    vocabulary size is `synthetic_vocab_size(model vocab, block size)`)."""
    prompts: list[list[int]] = []
    for i in range(0, len(trace), _TOKEN_CHUNK):
        prompts += trace.token_ids_many(i, i + _TOKEN_CHUNK, vocab_size)
    return prompts


def _progress_bar(total: int, enabled: bool, trace):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"simulating {getattr(trace, 'name', '')}".strip(), unit="req", leave=False)
