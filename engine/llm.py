"""The offline LLM API and the engine loop: `schedule -> ModelRunner.run -> postprocess`, with the
control plane's Scheduler and BlockManager (the very classes the simulator drives) on a
`time.perf_counter` clock, and a StepRecorder timing every step.

`generate()` serves a list of prompts to completion; `add_request` / `step` / `has_unfinished` let a
caller drive the loop itself (real-time trace replay). With `tensor_parallel_size > 1` this process
is rank 0 and a `MultiprocExecutor` (engine/distributed.py) runs the other ranks.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from engine import envs
from engine.attention import select_backend
from engine.core.block_manager import BlockManager
from engine.core.config import CacheConfig, ParallelConfig, SchedulerConfig
from engine.core.scheduler import ScheduledBatch, Scheduler, can_run_ahead, schedules_ahead
from engine.core.sequence import Sequence, SequenceStatus
from engine.decode_splits import split_block, split_unit
from engine.distributed import MultiprocExecutor, check_tp_shapes, rank_device
from engine.envs import KernelConfig
from engine.layers.distributed import AllReduceTimer, time_all_reduces
from engine.loader import read_hf_config
from engine.model_runner import ModelRunner
from engine.model_spec import ModelSpec
from engine.sampling_params import SamplingParams
from engine.step_recorder import StepRecorder

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

COMPILE_CHECK_S = 0.02  # steps at least this long ask whether a kernel variant was compiled
PLACEHOLDER_TOKEN = 0  # what a deferred step's sequences hold until its tokens reach the host


@dataclass
class _InFlight:
    """A decode step launched on the device and postprocessed on placeholder tokens (async
    scheduling): its sampled `tokens` are still on the device (the next step's inputs); `values`
    waits for their copy to the host. `positions`: where each sequence's placeholder is; `stamp`:
    the clock value its postprocess wrote (token and finish times)."""

    batch: ScheduledBatch
    tokens: Any
    values: Callable[[], list[int]]
    timer: Any
    t0: float
    stamp: float
    positions: list[int]
    finished: list[Sequence]
    graph_batch_size: int  # the runner's, as it launched the step (it has launched another since)
    overlapped: bool = False  # scheduled and launched while the step before it still ran
    num_waiting: int = 0  # requests left waiting when it was scheduled


class LLM:
    """An engine over one HF checkpoint folder. Use as `with LLM(path) as llm: llm.generate(...)`.

    Tensor parallelism: `tensor_parallel_size` ranks, one process each (this one is rank 0, the
    others are spawned here and joined by `close()`), rendezvous on `dist_port` (default
    $KVPLAN_TP_PORT, else a free port); a collective that waits longer than `dist_timeout_s` fails.
    `profile_allreduce` records each step's all-reduce time (synchronising around each one; decode
    steps replayed from a CUDA graph record NaN, so profile with `enforce_eager=True`).
    `freeze_gc` (default $KVPLAN_FREEZE_GC, else on; as vLLM does) moves every object alive after
    start-up out of the garbage collector's reach until `close()`, so full collections stop walking
    the kernels' large compile caches in the middle of a step (a one-time pause of 0.33-0.43 s a
    serving process without it: docs/PERF.md, "The real engine's own spread").
    `prefill_graphs` (default $KVPLAN_PREFILL_GRAPHS, else on) runs prefill and mixed steps through
    piecewise CUDA graphs (engine/piecewise.py) whenever decode steps use graphs, and those of at
    most 2,048 tokens as whole-step graphs, attention included, where the backend allows
    ($KVPLAN_STEP_GRAPHS, default on; engine/step_graphs.py).
    `async_scheduling` overlaps the host's work for a decode step (postprocess, schedule, inputs,
    launch) with the device's work for the step before it (see `_InFlight`); tokens, schedules and
    step shapes are those of the synchronous loop. Off by default: the shipped latency profiles were
    recorded without it.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 16384,
        max_model_len: int = 4096,
        policy: str = "chunked",
        enable_prefix_caching: bool = True,
        gpu_memory_utilization: float = 0.9,
        num_kv_blocks: int | None = None,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        prefill_graphs: bool | None = None,
        dtype: str | None = None,
        device: str | None = None,
        tensor_parallel_size: int = 1,
        record_steps: bool = True,
        seed: int = 0,
        dist_port: int | None = None,
        dist_timeout_s: float = 600.0,
        profile_allreduce: bool = False,
        freeze_gc: bool | None = None,
        async_scheduling: bool = False,
    ) -> None:
        self.model_dir = Path(model_dir)
        self._froze_gc = False
        self.freeze_gc = envs.get("KVPLAN_FREEZE_GC") if freeze_gc is None else freeze_gc
        hf_config = read_hf_config(self.model_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.scheduler_config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, policy)
        self.parallel_config = ParallelConfig(tensor_parallel_size)
        spec = ModelSpec.from_hf_config(hf_config, name=self.model_dir.name)
        tp = tensor_parallel_size
        check_tp_shapes(spec, tp)
        torch_dtype = _resolve_dtype(dtype, spec, self.device)
        self.spec = spec
        self.profile_allreduce = profile_allreduce
        kernels = KernelConfig.from_env(prefill_graphs=prefill_graphs)  # read once; arguments win
        backend = select_backend(attention_backend, self.device, block_size, kernels)
        CacheConfig(block_size, num_kv_blocks, enable_prefix_caching, gpu_memory_utilization)  # validates
        runner_kwargs = dict(
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            dtype=torch_dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            num_kv_blocks=num_kv_blocks,
            enforce_eager=enforce_eager,
            kernels=kernels,
            seed=seed,
        )
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.runner: ModelRunner | None = None
        self.executor: MultiprocExecutor | None = None
        if tp > 1:
            self.device = rank_device(self.device, 0)
            self.executor = MultiprocExecutor(
                self.model_dir, hf_config, spec, backend.name, runner_kwargs, self.device, tp,
                port=dist_port, timeout_s=dist_timeout_s, freeze_gc=self.freeze_gc,
            )  # fmt: skip
        try:
            self.runner = ModelRunner(
                self.model_dir, hf_config, spec, backend, device=self.device, tp_rank=0, tp_size=tp,
                **runner_kwargs,
            )  # fmt: skip
            self.cache_config = CacheConfig(
                block_size, self.runner.num_kv_blocks, enable_prefix_caching, gpu_memory_utilization
            )
        except Exception as e:
            self._raise_tp_failure(e, "while starting")
        self._new_control_plane()
        # async scheduling: only one process drives the device (the ranks of TP replay each batch)
        self.async_scheduling = async_scheduling and self.executor is None
        self._inflight: _InFlight | None = None
        self._stamp: float | None = None  # what the scheduler's clock reads while set
        self._last_ready = -math.inf  # perf_counter when the last step's tokens reached the host
        self.num_async_steps = 0  # steps launched while the step before them was still running
        self._num_waiting = 0  # requests the last schedule() left waiting (the step records' num_waiting)
        self.recorder = (
            StepRecorder(tp, block_size, cuda=self.device.type == "cuda") if record_steps else None
        )
        self._compiles = self.runner.compile_count()  # kernel variants compiled before serving
        if self.freeze_gc:  # what start-up built (modules, compiled kernels' objects) is never walked again
            gc.freeze()
            self._froze_gc = True

    @property
    def attention_backend(self) -> str:
        return self.runner.backend.name

    @property
    def kernels(self) -> KernelConfig:
        """The kernels this engine runs where there is a choice (engine/envs.py: read from the
        environment once, at start, with the constructor's arguments winning; resolved for the
        device by the model runner)."""
        return self.runner.kernels

    def kernel_choices(self) -> dict[str, Any]:
        """Which kernels this engine runs where there is a choice, as profiles and replays record
        them: `self.kernels.record()` (one key per KernelConfig field: None where the choice does not
        arise, False where the kernel cannot run here), and whether decode steps are scheduled
        asynchronously."""
        return {**self.kernels.record(), "async_scheduling": self.async_scheduling}

    def decode_split_kv(self) -> dict[str, Any] | None:
        """How decode attention splits each sequence's KV, for the fitted latency model
        (`simulator.latency.SplitKV`): kv heads per rank and the GPU's SMs when decode runs the
        Triton split-KV kernel (`engine.decode_splits`); None for kernels that do not split."""
        backend = self.runner.backend
        if getattr(backend, "decode_kernel", None) != "triton":
            return None
        fields = {
            "num_kv_heads": self.spec.num_kv_heads // self.parallel_config.tensor_parallel_size,
            "num_sms": backend.num_sms(),
        }
        if backend.decode_balanced:
            block_size = self.cache_config.block_size
            fields |= {"block_size": block_size, "balanced": True}
            if split_block(block_size, backend.decode_fine_splits) != block_size:
                fields["split_tokens"] = split_unit(split_block(block_size))
        return fields

    # ---- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Free the model, the KV cache and the graphs; stop and join the other ranks (idempotent)."""
        self._inflight = None
        if self._froze_gc:
            gc.unfreeze()
            self._froze_gc = False
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        if self.executor is not None:
            self.executor.close()
            self.executor = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- step-level API -------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> Sequence:
        """Queue one request; returns its Sequence (REJECTED, with the reason, if it can never run)."""
        token_ids = self.encode(prompt)
        eos = self.spec.eos_token_id
        return self.scheduler.add_request(token_ids, sampling_params or SamplingParams(), arrival_time, eos)

    def step(self) -> list[Sequence]:
        """Run one engine step; returns the sequences that finished in it. With async scheduling a
        decode step may be left running on the device: its tokens reach the host in the next call,
        which returns the sequences it finished, after launching the step behind it when it can."""
        if self.runner is None:
            raise RuntimeError("LLM is closed")
        prev = self._inflight
        t0 = time.perf_counter()
        if prev is None:
            return self._step(t0)
        if not self.scheduler.schedule_reads_no_token_values():
            return self._land(prev) + self._step(t0)
        batch = self.scheduler.schedule()
        self._num_waiting = self.scheduler.num_waiting
        if schedules_ahead(prev.batch.seqs, batch):
            timer = self.recorder.timer() if self.recorder is not None else None
            tokens, _ = self.runner.launch(batch, timer, prev.tokens[: batch.num_seqs])
            values = self.runner.stage_tokens(tokens)
            finished = self._land(prev)
            self._defer(batch, tokens, values, timer, t0, overlapped=True)
            self.num_async_steps += 1
            return finished
        return self._land(prev) + self._step(t0, batch)

    def _step(self, t0: float, batch: ScheduledBatch | None = None) -> list[Sequence]:
        """One step of `batch` (default: one scheduled now): run at once, or launched and left
        running when async scheduling can defer it."""
        if batch is None:
            batch = self.scheduler.schedule()
            self._num_waiting = self.scheduler.num_waiting
        if batch.is_empty:
            return self.scheduler.postprocess(batch, [])
        recorder = self.recorder
        timer = recorder.timer() if recorder is not None else None
        if self._can_defer(batch):
            tokens, _ = self.runner.launch(batch, timer)
            self._defer(batch, tokens, self.runner.stage_tokens(tokens), timer, t0)
            return []
        allreduce = AllReduceTimer(self.device.type == "cuda") if self.profile_allreduce else None
        tokens = self._run(batch, timer, allreduce)
        finished = self.scheduler.postprocess(batch, tokens)
        end = time.perf_counter()
        start = max(t0, self._last_ready)  # a step landed in this call ended after t0
        self._last_ready = end
        if recorder is not None:
            allreduce_s = allreduce.total() if allreduce is not None else math.nan
            self._record(batch, timer, start, end - start, allreduce_s)
        return finished

    def _record(
        self,
        batch: ScheduledBatch,
        timer: Any,
        start: float,
        wall: float,
        allreduce_s: float = math.nan,
        graph_batch_size: int | None = None,
        overlapped: bool = False,
        num_waiting: int | None = None,
    ) -> None:
        """One step record; `graph_batch_size` (default: the runner's last) of a deferred step. (A
        deferred step is a decode: its graph_num_tokens, the runner's last, is 0 whatever ran since.)
        `overlapped`: launched while the step before it ran (see `step`); `num_waiting` (default: as
        the last schedule left them) the requests left waiting when it was scheduled."""
        if graph_batch_size is None:
            graph_batch_size = self.runner.last_graph_batch_size
        compiled = False
        if wall >= COMPILE_CHECK_S:  # compiling a kernel takes far longer: fast steps skip the count
            compiles = self.runner.compile_count()
            compiled, self._compiles = compiles != self._compiles, compiles
        self.recorder.record(
            batch,
            timer,
            wall,
            graph_batch_size,
            compiled,
            allreduce_s,
            start_s=start,
            graph_num_tokens=self.runner.last_graph_num_tokens,
            overlapped=overlapped,
            num_waiting=self._num_waiting if num_waiting is None else num_waiting,
        )

    # ---- async scheduling -----------------------------------------------------------------------
    def _clock(self) -> float:
        return time.perf_counter() if self._stamp is None else self._stamp

    def _can_defer(self, batch: ScheduledBatch) -> bool:
        """A step that can run on placeholders while the device computes its tokens (`can_run_ahead`)."""
        return self.async_scheduling and can_run_ahead(batch)

    def _defer(
        self, batch: ScheduledBatch, tokens: Any, values: Any, timer: Any, t0: float, overlapped: bool = False
    ) -> None:
        """Postprocess a launched decode step on placeholder tokens, stamped with a time that
        `_land` replaces by the time its tokens reach the host. `overlapped`: it was scheduled and
        launched while the step before it still ran."""
        positions = [len(seq.token_ids) for seq in batch.seqs]
        self._stamp = stamp = time.perf_counter()
        try:
            finished = self.scheduler.postprocess(batch, [PLACEHOLDER_TOKEN] * batch.num_seqs)
        finally:
            self._stamp = None
        graph_bs = self.runner.last_graph_batch_size
        self._inflight = _InFlight(
            batch,
            tokens,
            values,
            timer,
            t0,
            stamp,
            positions,
            finished,
            graph_bs,
            overlapped,
            self._num_waiting,
        )

    def _land(self, prev: _InFlight) -> list[Sequence]:
        """Wait for `prev`'s tokens; put them and their time in place of the placeholders; record
        the step. Returns the sequences it finished."""
        self._inflight = None
        values = prev.values()
        ready = time.perf_counter()
        stamp = prev.stamp
        for seq, pos, token in zip(prev.batch.seqs, prev.positions, values):
            seq.token_ids[pos] = token
            if seq.first_token_time == stamp:
                seq.first_token_time = ready
            if seq.last_token_time == stamp:
                seq.last_token_time = ready
            if seq.finish_time == stamp:
                seq.finish_time = ready
        start = max(prev.t0, self._last_ready)  # launched while the step before it still ran
        self._last_ready = ready
        if self.recorder is not None:
            self._record(
                prev.batch,
                prev.timer,
                start,
                ready - start,
                graph_batch_size=prev.graph_batch_size,
                overlapped=prev.overlapped,
                num_waiting=prev.num_waiting,
            )
        return prev.finished

    def _run(self, batch, timer, allreduce: AllReduceTimer | None) -> list[int]:
        """Run the batch on every rank; rank 0's sampled tokens."""
        if self.executor is None:
            with time_all_reduces(allreduce):
                return self.runner.run(batch, timer)
        try:
            self.executor.execute(batch)
            with time_all_reduces(allreduce):
                return self.runner.run(batch, timer)
        except Exception as e:
            self._raise_tp_failure(e, f"during step {self.executor.num_steps - 1}")

    def _raise_tp_failure(self, exc: Exception, when: str) -> None:
        """Close everything after `exc`; raise a RuntimeError naming a dead worker if one died."""
        error = self.executor.failure(exc, when) if self.executor is not None else exc
        self.close()
        if error is exc:
            raise exc
        raise error from exc

    def _new_control_plane(self) -> None:
        cache = self.cache_config
        self.block_manager = BlockManager(cache.num_blocks, cache.block_size, cache.enable_prefix_caching)
        # the engine's per-request timings carry its latencies: no inter-token gap arrays (they would
        # grow for the engine's lifetime, and deferred steps' gaps would use their postprocess time)
        self.scheduler = Scheduler(
            self.scheduler_config, self.block_manager, clock=self._clock, record_itl=False
        )

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, with a fresh scheduler and block manager (their counters start
        again); only while no request is unfinished. Benchmarks that rerun the same prompts call it so
        that no run hits what an earlier one cached."""
        if self.has_unfinished():
            raise RuntimeError("reset_prefix_cache: requests are still unfinished")
        self._new_control_plane()

    def has_unfinished(self) -> bool:
        return self._inflight is not None or self.scheduler.has_unfinished()

    # ---- offline API ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[str] | Seq[Seq[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """Serve every prompt to completion; one dict per prompt, in order: `token_ids` (the output),
        `finish_reason`, and `text` when the checkpoint has a tokenizer."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("generate: pass a list of prompts (strings or token-id lists), not one prompt")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"generate: {len(params)} sampling params for {len(prompts)} prompts")
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        bar.update(sum(s.status is SequenceStatus.REJECTED for s in seqs))
        idle_steps = 0
        while self.has_unfinished():
            finished = self.step()
            bar.update(len(finished))
            idle_steps = 0 if finished or self.scheduler.num_running else idle_steps + 1
            if idle_steps > 1000:
                raise RuntimeError("generate: requests wait but none can be scheduled")
        bar.close()
        return [self._output(s) for s in seqs]

    def _output(self, seq: Sequence) -> dict[str, Any]:
        out: dict[str, Any] = {"token_ids": seq.output_token_ids, "finish_reason": seq.finish_reason}
        if self.tokenizer is not None:
            out["text"] = self.tokenizer.decode(seq.output_token_ids)
        return out

    def encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir}: no tokenizer in the checkpoint folder; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)


def _resolve_dtype(dtype: str | None, spec: ModelSpec, device: torch.device) -> torch.dtype:
    """The asked-for dtype; by default the checkpoint's on a GPU and float32 on a CPU."""
    name = dtype or (spec.dtype if device.type == "cuda" else "float32")
    if name not in _TORCH_DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of {sorted(_TORCH_DTYPES)}")
    return _TORCH_DTYPES[name]


def _load_tokenizer(model_dir: Path):
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
