"""Tensor-parallel processes. Rank 0 is the caller's process: it runs the scheduler and samples.
`MultiprocExecutor` spawns one worker process per other rank, sends each step's batch (`StepMessage`)
down a pipe, and turns a worker's death into a RuntimeError; every rank's ModelRunner meets the
others in torch.distributed collectives (NCCL on GPU, gloo on CPU). Sharding lives in engine/layers/.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine import envs
from engine.core.scheduler import ScheduledBatch
from engine.memory import check_tp
from engine.model_spec import ModelSpec
from engine.sampling_params import SamplingParams

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PORT_ENV = "KVPLAN_TP_PORT"  # rendezvous port when none is passed (default: a free one; engine/envs.py)
TEST_EXIT_ENV = "KVPLAN_TP_TEST_EXIT"  # tests only: "RANK:STEP" makes that worker exit at that step
TEST_EXIT_CODE = 17
HOST = "127.0.0.1"
_STOP = b""  # the message that ends a worker's loop
_GREEDY = SamplingParams(temperature=0.0)
_DEATH_GRACE_S = 2.0  # after an error on rank 0, how long to wait for a dying worker to be reaped


def check_tp_shapes(spec: ModelSpec, tp: int) -> None:
    """ValueError, before any process starts, unless heads, vocabulary and MLP split over `tp`."""
    check_tp(spec, tp)
    for field in ("vocab_size", "intermediate_size"):
        value = getattr(spec, field)
        if value % tp:
            raise ValueError(f"tensor_parallel_size: {tp} does not divide {field} {value} of {spec.name}")


def resolve_port(port: int | None) -> int:
    """`port`, else $KVPLAN_TP_PORT, else 0 (the rendezvous store binds a free port)."""
    if port is None:
        port = envs.get(PORT_ENV) or 0
    if not 0 <= port <= 65535:
        raise ValueError(f"dist_port: {port} is not in [0, 65535]")
    return port


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: GPU index + rank on CUDA (index None: the current GPU), else `device`."""
    if device.type != "cuda":
        return device
    base = torch.cuda.current_device() if device.index is None else device.index
    return torch.device("cuda", base + rank)


class _TokenWindow:
    """Token ids [start, start + len(tokens)) of a sequence, indexed by absolute position."""

    __slots__ = ("start", "tokens")

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __getitem__(self, key: int | slice) -> int | list[int]:
        if isinstance(key, slice):
            return self.tokens[key.start - self.start : key.stop - self.start]
        return self.tokens[key - self.start]


@dataclass(frozen=True, slots=True)
class WorkerSequence:
    """What a worker's ModelRunner reads of a Sequence: this step's tokens and the block table."""

    token_ids: _TokenWindow
    block_table: list[int]
    sampling_params: SamplingParams = _GREEDY  # workers never sample


@dataclass(frozen=True)
class WorkerBatch:
    """The fields of a ScheduledBatch that ModelRunner.run reads (built from a StepMessage; the
    control plane's totals are rank 0's business)."""

    seqs: tuple[WorkerSequence, ...]
    num_scheduled_tokens: tuple[int, ...]
    num_computed_tokens: tuple[int, ...]
    do_sample: tuple[bool, ...]
    kind: str

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)


class TableDeltas:
    """Rank 0's record of the block tables the workers hold (`WorkerTables`): per sequence id, the
    table list last sent and how many of its entries. A step then sends each sequence only the blocks
    it added since (all of its table where the list is new: first seen, or replaced when its blocks
    were freed), and, once more than `keep` sequences are held, the ids the workers may forget (those
    absent from the step)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._sent: dict[int, tuple[list[int], int]] = {}  # seq id -> (its list, entries sent)

    def parts(
        self, seqs: tuple
    ) -> tuple[tuple[int, ...], list[list[int]], tuple[bool, ...], tuple[int, ...]]:
        """(sequence ids, each one's blocks to send, whether those are its whole table, ids to forget)."""
        sent, ids, parts, whole = self._sent, [], [], []
        for seq in seqs:
            table, entry = seq.block_table, sent.get(seq.seq_id)
            if entry is not None and entry[0] is table:  # the same list: it only grew
                parts.append(table[entry[1] :])
                whole.append(False)
            else:
                parts.append(list(table))
                whole.append(True)
            sent[seq.seq_id] = (table, len(table))
            ids.append(seq.seq_id)
        forget: tuple[int, ...] = ()
        if len(sent) > self.keep:
            now = set(ids)
            forget = tuple(k for k in sent if k not in now)
            for k in forget:
                del sent[k]
        return tuple(ids), parts, tuple(whole), forget


class WorkerTables:
    """A worker's block tables, rebuilt from rank 0's `TableDeltas` messages and kept between steps:
    a sequence keeps its list while rank 0 keeps its own (so the worker's `BlockTableRows` keeps the
    row), and gets a new list when rank 0 sends its whole table."""

    def __init__(self) -> None:
        self._tables: dict[int, list[int]] = {}

    def apply(self, ids, parts, whole, forget) -> list[list[int]]:
        tables = self._tables
        for k in forget:
            tables.pop(k, None)
        out = []
        for seq_id, part, is_whole in zip(ids, parts, whole):
            if is_whole:
                table = tables[seq_id] = list(part)
            else:
                table = tables[seq_id]
                table.extend(part)
            out.append(table)
        return out


@dataclass(frozen=True)
class StepMessage:
    """One step's batch as the workers need it, per sequence: the token ids computed this step, the
    tokens already cached before them, its id and block table (whole, or with `TableDeltas` the
    blocks added since the step before: `table_whole` says which) and whether a token is sampled
    (every rank computes its vocabulary shard of the sampled rows' logits); the step's kind; and the
    sequence ids whose tables the workers may forget."""

    token_ids: list[list[int]]
    num_computed_tokens: tuple[int, ...]
    seq_ids: tuple[int, ...]
    block_tables: list[list[int]]
    table_whole: tuple[bool, ...]
    do_sample: tuple[bool, ...]
    kind: str
    forget: tuple[int, ...] = ()

    @classmethod
    def from_batch(cls, batch: ScheduledBatch, deltas: TableDeltas | None = None) -> StepMessage:
        """The batch's message; with `deltas`, tables as the blocks added since the last message."""
        grants = zip(batch.seqs, batch.num_computed_tokens, batch.num_scheduled_tokens)
        if deltas is not None:
            ids, tables, whole, forget = deltas.parts(batch.seqs)
        else:
            ids, tables = tuple(s.seq_id for s in batch.seqs), [s.block_table for s in batch.seqs]
            whole, forget = (True,) * batch.num_seqs, ()
        return cls(
            token_ids=[s.token_ids[c : c + n] for s, c, n in grants],
            num_computed_tokens=tuple(batch.num_computed_tokens),
            seq_ids=ids,
            block_tables=tables,
            table_whole=whole,
            do_sample=tuple(batch.do_sample),
            kind=batch.kind,
            forget=forget,
        )

    def to_batch(self, tables: WorkerTables | None = None) -> WorkerBatch:
        """The worker's batch; `tables` (required where the message carries deltas) keeps the tables."""
        if tables is not None:
            block_tables = tables.apply(self.seq_ids, self.block_tables, self.table_whole, self.forget)
        elif all(self.table_whole):
            block_tables = self.block_tables
        else:
            raise ValueError(
                "StepMessage.to_batch: a message of table deltas needs the worker's WorkerTables"
            )
        seqs = tuple(
            WorkerSequence(_TokenWindow(c, t), table)
            for t, c, table in zip(self.token_ids, self.num_computed_tokens, block_tables)
        )
        num_new = tuple(len(t) for t in self.token_ids)
        return WorkerBatch(seqs, num_new, self.num_computed_tokens, self.do_sample, self.kind)


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker process needs to join the group and build its rank's ModelRunner (picklable)."""

    model_dir: Path
    hf_config: dict[str, Any]
    spec: ModelSpec
    attention_backend: str  # the name rank 0 resolved
    runner_kwargs: dict[str, Any]  # ModelRunner keywords but device, tp_rank, tp_size
    device: torch.device  # rank 0's (with its index on CUDA)
    tp_size: int
    port: int
    timeout_s: float
    num_threads: int
    freeze_gc: bool = False  # rank 0's LLM(freeze_gc=...): the worker freezes what its start built

    @property
    def dist_backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def _test_exit_step(rank: int) -> int | None:
    spec = envs.get(TEST_EXIT_ENV)
    if spec is None:
        return None
    exit_rank, step = spec
    return step if exit_rank == rank else None


def worker_main(rank: int, args: WorkerArgs, conn: Any) -> None:
    """A worker's life: join the process group, build this rank's ModelRunner (start-up collectives
    in lockstep with rank 0), then run every batch rank 0 sends until it sends the stop message."""
    from engine.attention import select_backend
    from engine.model_runner import ModelRunner

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle; it stops us
    try:
        if args.dist_backend == "nccl":
            for key, value in NCCL_ENV.items():
                os.environ.setdefault(key, value)
        torch.set_num_threads(args.num_threads)
        device = rank_device(args.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=args.timeout_s)
        store = dist.TCPStore(HOST, args.port, args.tp_size, is_master=False, timeout=timeout)
        store.set(_ready_key(rank), "1")
        dist.init_process_group(
            args.dist_backend, store=store, rank=rank, world_size=args.tp_size, timeout=timeout
        )
        kwargs = args.runner_kwargs  # with rank 0's kernel config: every rank runs the same kernels
        backend = select_backend(args.attention_backend, device, kwargs["block_size"], kwargs.get("kernels"))
        runner = ModelRunner(
            args.model_dir, args.hf_config, args.spec, backend,
            device=device, tp_rank=rank, tp_size=args.tp_size, **args.runner_kwargs,
        )  # fmt: skip
        if args.freeze_gc:  # as rank 0 does: a full collection would stall every rank's collectives
            gc.freeze()
        exit_at, step, tables = _test_exit_step(rank), 0, WorkerTables()
        while (payload := _receive(conn)) != _STOP:
            if step == exit_at:
                os._exit(TEST_EXIT_CODE)
            runner.run(pickle.loads(payload).to_batch(tables))
            step += 1
        runner.close()
        dist.destroy_process_group()
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send_bytes(traceback.format_exc()[-8000:].encode())
        raise


def _ready_key(rank: int) -> str:
    return f"kvplan/worker/{rank}/ready"


def _receive(conn: Any) -> bytes:
    try:
        return conn.recv_bytes()
    except EOFError:  # rank 0 is gone
        return _STOP


class MultiprocExecutor:
    """Rank 0's side of tensor parallelism: spawns ranks 1..tp-1 ('spawn' start method), joins the
    default process group as rank 0 (rendezvous on a free port unless one is given), sends each
    step's batch, and reports a worker that died. `close()` stops and joins them."""

    def __init__(
        self,
        model_dir: Path,
        hf_config: dict[str, Any],
        spec: ModelSpec,
        attention_backend: str,
        runner_kwargs: dict[str, Any],
        device: torch.device,
        tp_size: int,
        port: int | None = None,
        timeout_s: float = 600.0,
        join_timeout_s: float = 30.0,
        freeze_gc: bool = False,
    ) -> None:
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(
                "tensor_parallel_size > 1: torch.distributed is already initialised in this process; "
                "the engine starts and owns its process group (one tensor-parallel LLM per process)"
            )
        self.tp_size, self.join_timeout_s = tp_size, join_timeout_s
        self.num_steps = 0
        # the block tables the workers hold: each step sends the blocks added since
        self._tables = TableDeltas(keep=2 * runner_kwargs["max_num_seqs"])
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._closed = False
        self._stop_watch = threading.Event()
        self._watchdog: threading.Thread | None = None
        self.dist_backend = "nccl" if device.type == "cuda" else "gloo"
        if self.dist_backend == "nccl":
            for key, value in NCCL_ENV.items():  # rank 0 joins the NCCL communicators too
                os.environ.setdefault(key, value)
        timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(
            HOST, resolve_port(port), tp_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        args = WorkerArgs(
            model_dir, hf_config, spec, attention_backend, runner_kwargs, device, tp_size,
            port=self.store.port, timeout_s=timeout_s, num_threads=torch.get_num_threads(),
            freeze_gc=freeze_gc,
        )  # fmt: skip
        try:
            ctx = mp.get_context("spawn")
            for rank in range(1, tp_size):
                ours, theirs = ctx.Pipe(duplex=True)
                proc = ctx.Process(
                    target=worker_main, args=(rank, args, theirs), name=f"kvplan-tp{rank}", daemon=True
                )
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(ours)
            self._wait_until_ready(timeout_s)
            dist.init_process_group(
                self.dist_backend, store=self.store, rank=0, world_size=tp_size, timeout=timeout
            )
        except BaseException as e:
            error = self.failure(e, "while starting")
            if error is e:
                raise
            raise error from e
        if self.dist_backend == "nccl":
            self._watchdog = threading.Thread(target=self._watch, name="kvplan-tp-watchdog", daemon=True)
            self._watchdog.start()

    def _wait_until_ready(self, timeout_s: float) -> None:
        """Wait until every worker reaches the rendezvous, failing fast when one dies first."""
        keys = [_ready_key(rank) for rank in range(1, self.tp_size)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if any(p.exitcode is not None for p in self.procs):
                raise RuntimeError("a worker exited before the rendezvous")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workers did not reach the rendezvous within {timeout_s:.0f} s")
            time.sleep(0.02)

    def _watch(self) -> None:
        """NCCL only: a dead peer leaves rank 0 blocked on the GPU rather than failing; abort the
        communicators so the blocked call raises (and `failure` then names the worker)."""
        while not self._stop_watch.wait(0.5):
            if any(p.exitcode is not None for p in self.procs):
                abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
                if abort is not None:
                    with contextlib.suppress(Exception):  # best effort; the collective timeout remains
                        abort()
                return

    # ---- per step -------------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch) -> None:
        """Send the batch to every worker (rank 0 then runs it too)."""
        message = StepMessage.from_batch(batch, self._tables)
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.num_steps += 1
        for conn in self.conns:
            conn.send_bytes(payload)

    # ---- failure and shutdown -------------------------------------------------------------------
    def dead_workers(self) -> list[str]:
        """One line per worker that has exited: its rank, pid, exit code or signal, last error line."""
        lines = []
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns), start=1):
            code = proc.exitcode
            if code is None:
                continue
            how = f"exited with code {code}" if code >= 0 else f"was killed by {signal.Signals(-code).name}"
            lines.append(f"rank {rank} (pid {proc.pid}) {how}{_last_error(conn)}")
        return lines

    def failure(self, exc: BaseException, when: str) -> BaseException:
        """After `exc` on rank 0: stop every worker, and return what to raise: a RuntimeError naming
        the worker(s) that died when one did (`exc` is then its symptom on rank 0), else `exc`."""
        deadline = time.monotonic() + _DEATH_GRACE_S
        while not any(p.exitcode is not None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        dead = self.dead_workers()
        self.close(abort=True)
        if not dead:
            return exc
        return RuntimeError(
            f"tensor parallelism: worker {'; '.join(dead)} {when}; rank 0 saw: {type(exc).__name__}: {exc}"
        )

    def close(self, abort: bool = False) -> None:
        """Stop the workers (a stop message; SIGTERM when `abort` or when one outlives the join
        timeout), join them and leave the process group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_watch.set()
        if self._watchdog is not None:
            self._watchdog.join()
        if not abort:
            for conn in self.conns:
                with contextlib.suppress(OSError):  # already gone
                    conn.send_bytes(_STOP)
        deadline = time.monotonic() + (0.0 if abort else self.join_timeout_s)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        self.store = None


def _last_error(conn: Any) -> str:
    """': <last line of the traceback the worker sent>', or '' when it sent none."""
    text = ""
    try:
        while conn.poll(0):
            text = conn.recv_bytes().decode(errors="replace")
    except (EOFError, OSError):
        pass
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return f": {lines[-1].strip()}" if lines else ""
