"""The discrete-event simulation: SimPy is the clock, the engine's own Scheduler decides every step.

One arrival process replays a Trace through a router; one process per replica loops
`schedule -> yield timeout(latency) -> postprocess`, or collapses a run of decode-only steps with the
scheduler's exact `fast_forward`. No scheduling logic lives here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import simpy

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler, accumulate_decode_times
from engine.sequence import SamplingParams, Sequence, SequenceStatus, request_record
from simulator.cluster import make_router
from simulator.config import SimConfig
from simulator.latency.base import LatencyModel
from simulator.metrics import ITLBins
from traces.schema import synthetic_vocab_size

SIM_TOKEN_ID = 0
_TOKEN_CHUNK = 256  # the token every simulated decode "samples"; prompts carry the trace's tokens

TIMELINE_FIELDS = ("time_s", "replica", "kv_usage", "num_running", "num_waiting")


@dataclass
class SimCounters:
    num_steps: int = 0
    num_fast_forwards: int = 0
    num_fast_forward_steps: int = 0
    busy_s: float = 0.0


class Replica:
    """One engine: a Scheduler over a BlockManager, advanced by the latency model's step times."""

    def __init__(
        self,
        env: simpy.Environment,
        index: int,
        config: SimConfig,
        num_kv_blocks: int,
        latency: LatencyModel,
        next_arrival: Callable[[], float],
    ) -> None:
        self.env = env
        self.index = index
        self.config = config
        self.latency = latency
        self.decode_times = getattr(latency, "decode_step_times", None) or partial(
            accumulate_decode_times, latency.decode_step_time
        )
        self.clock = 0.0  # exact simulated time of this replica; env.now follows it
        self.block_manager = BlockManager(num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler_config(), self.block_manager, clock=self._now)
        self.next_arrival = next_arrival
        self.outstanding_tokens = 0  # prompt + requested output tokens of unfinished requests
        self.records: list[tuple] = []
        self.timeline: list[tuple] = []
        self.counters = SimCounters()
        self.itl = ITLBins()
        self.batch_log: list[tuple] | None = None  # per-step decisions, when asked (tests)
        self._last_sample = -math.inf
        self._wakeup: simpy.Event | None = None
        self.process = env.process(self.run())

    def _now(self) -> float:
        return self.clock

    def submit(self, request_id: int, prompt: list[int], output_len: int, arrival_s: float) -> Sequence:
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        seq = self.scheduler.add_request(prompt, params, arrival_time=arrival_s)
        seq.user_data = (request_id, output_len)
        if seq.status is SequenceStatus.REJECTED:
            self._record(seq)
            return seq
        self.outstanding_tokens += seq.num_prompt_tokens + output_len
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed(arrival_s)
        return seq

    def run(self):
        env, sched, latency = self.env, self.scheduler, self.latency
        counters = self.counters
        while True:
            if not sched.has_unfinished():
                self._wakeup = env.event()
                arrival_s = yield self._wakeup
                self._wakeup = None
                self.clock = max(self.clock, arrival_s)
            if self.config.fast_forward:
                k, end, finished = sched.fast_forward(
                    self.decode_times, self.clock, self.next_arrival(), SIM_TOKEN_ID
                )
                if k:
                    counters.num_fast_forwards += 1
                    counters.num_fast_forward_steps += k
                    counters.busy_s += end - self.clock
                    yield env.timeout(max(0.0, end - env.now))
                    self.clock = end
                    self._finish_all(finished)
                    self._sample()
                    continue
            batch = sched.schedule()
            if self.batch_log is not None:
                self.batch_log.append(batch_decisions(batch))
            if batch.is_empty:
                self._finish_all(sched.postprocess(batch, ()))
                if sched.has_unfinished() and sched.schedule().is_empty:
                    raise RuntimeError(
                        f"replica {self.index}: the scheduler made no progress at t={self.clock}"
                    )
                continue
            step_s = latency.predict(batch).total
            end = self.clock + step_s
            yield env.timeout(max(0.0, end - env.now))
            self.clock = end
            counters.num_steps += 1
            counters.busy_s += step_s
            self._finish_all(sched.postprocess(batch, [SIM_TOKEN_ID] * batch.num_seqs))
            self._sample()

    def _finish_all(self, finished: list[Sequence]) -> None:
        for seq in finished:
            self.outstanding_tokens -= seq.num_prompt_tokens + seq.user_data[1]
            self._record(seq)

    def _record(self, seq: Sequence) -> None:
        request_id, output_len = seq.user_data
        self.records.append(request_record(seq, request_id, output_len, self.index))
        seq.token_ids = []  # finished: drop what a million-request run cannot afford to keep
        seq.block_hashes = []

    def _sample(self) -> None:
        sched = self.scheduler
        if len(sched.itl_runs) >= 4096 or len(sched.itl_gaps) >= 65536:
            self.itl.fold(sched)
        if self.clock - self._last_sample >= self.config.timeline_interval_s:
            self._last_sample = self.clock
            s = self.scheduler
            self.timeline.append(
                (self.clock, self.index, self.block_manager.usage, s.num_running, s.num_waiting)
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


def simulate(
    trace,
    config: SimConfig,
    latency: LatencyModel,
    num_kv_blocks: int,
    progress: bool = False,
    record_batches: bool = False,
) -> SimRun:
    """Replay `trace` (a traces.Trace) on `config.num_replicas` replicas; return the raw run."""
    t0 = time.perf_counter()
    env = simpy.Environment()
    df = trace.df
    arrivals = df["arrival_s"].to_numpy(dtype=float).tolist()
    output_lens = df["output_len"].to_numpy().tolist()
    request_ids = df["request_id"].to_numpy().tolist()
    state = {"next": arrivals[0] if arrivals else math.inf}
    replicas = [
        Replica(env, i, config, num_kv_blocks, latency, lambda: state["next"])
        for i in range(config.num_replicas)
    ]
    if record_batches:
        for replica in replicas:
            replica.batch_log = []
    router = make_router(config.router, replicas)
    vocab = synthetic_vocab_size(config.model.vocab_size, config.block_size)

    def arrival_process():
        bar = _progress_bar(len(arrivals), progress, trace)
        for i, a in enumerate(arrivals):
            state["next"] = a
            if a > env.now:
                yield env.timeout(a - env.now)
            state["next"] = arrivals[i + 1] if i + 1 < len(arrivals) else math.inf
            if i % _TOKEN_CHUNK == 0:  # prompts of the next arrivals, generated together
                chunk = trace.token_ids_many(i, i + _TOKEN_CHUNK, vocab)
            prompt = chunk[i % _TOKEN_CHUNK]
            replica = router.choose(prompt)
            replica.submit(request_ids[i], prompt, output_lens[i], a)
            if bar is not None and i % 512 == 511:
                bar.update(512)
        if bar is not None:
            bar.update(len(arrivals) % 512)
            bar.close()

    env.process(arrival_process())
    env.run()
    return SimRun(config, replicas, num_kv_blocks, time.perf_counter() - t0, getattr(trace, "name", ""))


def _progress_bar(total: int, enabled: bool, trace):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"simulating {getattr(trace, 'name', '')}".strip(), unit="req", leave=False)
