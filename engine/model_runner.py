"""ModelRunner: turns a `ScheduledBatch` into sampled token ids on one device (one rank).

It owns the model, the KV cache, the sampler and the CUDA graphs (whole decode steps per batch size;
prefill and mixed steps piecewise per token bucket, attention eager: engine/piecewise.py; small ones
whole per token and sequence bucket where the backend allows: engine/step_graphs.py). At start
it loads the weights (this rank's shard), sizes the KV cache from the memory a warm-up forward leaves
(CUDA; the smallest over the ranks) or takes the given block count (CPU), compiles every kernel
variant a run can hit, and captures the graphs. Under tensor parallelism every rank runs the same start-up and
the same batches in lockstep; only rank 0 gets logits and samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.attention import AttentionBackend
from engine.attention.metadata import (
    AttentionMetadata,
    BlockTableRows,
    DeviceTableRows,
    StepInputs,
    build_step_inputs,
    set_forward_context,
)
from engine.core.config import cdiv
from engine.core.scheduler import ScheduledBatch, make_batch
from engine.core.sequence import Sequence
from engine.envs import KernelConfig
from engine.kv_cache import KVCache
from engine.layers import argmax, gemv, graph_inputs, head_argmax, pdl, triton_ops
from engine.layers.distributed import min_over_ranks
from engine.layers.layernorm import LAYER_IMPLS
from engine.loader import load_weights
from engine.memory import kv_cache_bytes, num_kv_blocks
from engine.model_spec import ModelSpec
from engine.models import model_class
from engine.piecewise import PiecewiseForward, SegmentBuffers, Segments, token_buckets
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.staging import StagingRing
from engine.step_graphs import StepGraphs, StepMetadataBuffers, step_graph_shapes

DEFAULT_CPU_KV_BLOCKS = 512


def layer_impl(device: torch.device, requested: str | None = "auto") -> str:
    """Kernels of the per-token layers (norms, rotary, SiLU): `requested` (the kernel config's
    `layer_kernels`, $KVPLAN_LAYER_IMPL); "auto" (or None) is "triton" on CUDA where Triton is
    installed ("compile" without it), "torch" on CPU."""
    choice = requested or "auto"
    if choice == "auto":
        if device.type != "cuda":
            return "torch"
        return "triton" if triton_ops.available() else "compile"
    if choice not in LAYER_IMPLS:
        raise ValueError(f"KVPLAN_LAYER_IMPL: {choice!r} is not one of {['auto', *LAYER_IMPLS]}")
    if choice == "triton" and not (triton_ops.available() and device.type == "cuda"):
        raise ValueError("KVPLAN_LAYER_IMPL=triton needs a CUDA device and the triton package")
    return choice


def resolve_kernels(
    asked: KernelConfig, backend: AttentionBackend, device: torch.device, tp_size: int, use_graphs: bool
) -> KernelConfig:
    """What runs of the kernel config `asked` (engine/envs.py) on `device`, with `backend` (built
    from `asked`) and `tp_size` ranks, decode steps through CUDA graphs or not (`use_graphs`): "auto"
    resolved; a switch False where its kernel cannot run (CPU, no Triton, tensor parallelism for the
    fused head, no decode graphs for the piecewise ones); the decode fields None unless the backend
    chooses a decode kernel, the split fields None unless that kernel is Triton's."""
    cuda = device.type == "cuda"
    decode = getattr(backend, "decode_kernel", None)
    split = decode == "triton"
    return KernelConfig(
        decode_kernel=decode,
        decode_balanced=backend.decode_balanced if split else None,
        decode_fine_splits=backend.decode_fine_splits if split else None,
        layer_kernels=layer_impl(device, asked.layer_kernels),
        prefill_graphs=use_graphs and bool(asked.prefill_graphs),
        step_graphs=use_graphs
        and bool(asked.prefill_graphs and asked.step_graphs)
        and backend.step_graph_safe,
        pdl=pdl.enabled(device, bool(asked.pdl)),
        gemv_prefetch=cuda and bool(asked.gemv_prefetch),
        triton_argmax=cuda and argmax.available() and bool(asked.triton_argmax),
        graph_copy_kernel=cuda and graph_inputs.available() and bool(asked.graph_copy_kernel),
        gemv_tuned_tiles=cuda and bool(asked.gemv_tuned_tiles),
        fused_head_argmax=cuda and tp_size == 1 and head_argmax.available() and bool(asked.fused_head_argmax),
        table_rows=bool(asked.table_rows),
        device_tables=bool(asked.table_rows and asked.device_tables),
    )


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    return [b for b in (1, 2, 4, 8) if b <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))


@dataclasses.dataclass
class _GraphBuffers:
    """Static inputs the decode graphs read; a replay copies the step's values into them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    block_tables: torch.Tensor

    def metadata(self, bs: int, max_model_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_seqs=bs,
            num_tokens=bs,
            max_seqlen_q=1,
            max_seqlen_k=max_model_len,
            has_context=True,
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            cu_seqlens_k=self.cu_seqlens_q[: bs + 1],  # unused by decode kernels
            context_lens=self.context_lens[:bs],
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
        )


class ModelRunner:
    def __init__(
        self,
        model_dir: str | Path,
        hf_config: dict[str, Any],
        spec: ModelSpec,
        backend: AttentionBackend,
        *,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        gpu_memory_utilization: float = 0.9,
        num_kv_blocks: int | None = None,
        enforce_eager: bool = False,
        kernels: KernelConfig | None = None,
        seed: int = 0,
        tp_rank: int | None = None,
        tp_size: int = 1,
    ) -> None:
        """`kernels`: the kernel config asked for, the one `backend` was built from (default: what
        the environment asks for); `self.kernels` is what runs of it here (`resolve_kernels`)."""
        self.spec, self.backend, self.device, self.dtype = spec, backend, device, dtype
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        self.max_num_batched_tokens, self.max_model_len = max_num_batched_tokens, max_model_len
        self.tp_size = tp_size
        self.cuda = device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_sizes: list[int] = []
        self.graph_outputs: dict[int, torch.Tensor] = {}
        self.graph_buffers: _GraphBuffers | None = None
        self.last_graph_batch_size = 0
        self.last_graph_num_tokens = 0
        self.piecewise: PiecewiseForward | None = None
        self.step_graphs: StepGraphs | None = None
        use_graphs = self.cuda and not enforce_eager and getattr(backend, "graph_safe", False)
        self.kernels = resolve_kernels(
            kernels or KernelConfig.from_env(), backend, device, tp_size, use_graphs
        )
        # the decode graphs' inputs copied in one Triton launch (unless graph_copy_kernel is off)
        self.triton_graph_copy = self.kernels.graph_copy_kernel
        self.use_prefill_graphs = self.kernels.prefill_graphs
        self.kv_cache: KVCache | None = None
        self.model = self._load_model(model_dir, hf_config, tp_rank, tp_size)
        generator = torch.Generator(device=device).manual_seed(seed)
        self.sampler = Sampler(generator, triton_argmax=self.kernels.triton_argmax)
        # one-row all-greedy steps: the LM head and the argmax in one pass (unless fused_head_argmax is off)
        self.fused_head = self.kernels.fused_head_argmax
        # pinned buffers for the steps' input copies, used in turn (engine/staging.py)
        self._staging = self._staging_ring()
        # the stream every step runs on (looked up once), and async scheduling's token copies, in turn
        self._stream = torch.cuda.current_stream(device) if self.cuda else None
        self._token_buffers = self._token_host_buffers()
        self._num_staged = 0
        # the running sequences' block tables, kept between steps (unless table_rows is off)
        self._table_rows = self._kept_tables(max_num_seqs, cdiv(max_model_len, block_size))
        with self.kernels.activate():  # what start-up launches and captures runs under the config
            self.kv_cache = self._allocate_kv_cache(num_kv_blocks, gpu_memory_utilization, enforce_eager)
            self.kv_cache.bind(self.model.attention_layers(), backend)
            self.warmup()
            if use_graphs:
                self.capture_cudagraphs()
            if self.use_prefill_graphs:
                self.capture_piecewise()

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    # ---- start-up -------------------------------------------------------------------------------
    def _load_model(self, model_dir, hf_config, tp_rank, tp_size) -> torch.nn.Module:
        cls = model_class(self.spec.architecture)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(hf_config, self.spec, tp_rank, tp_size)
        finally:
            torch.set_default_dtype(previous)
        load_weights(model, model_dir)
        model.eval()
        impl = self.kernels.layer_kernels
        for module in model.modules():
            if hasattr(module, "impl"):
                module.impl = impl
        self.layer_impl = impl
        return model

    def _kept_tables(self, max_num_seqs: int, width: int) -> BlockTableRows | DeviceTableRows | None:
        """The block-table rows kept between steps, on the host or mirrored on the device (the
        kernel config's table_rows and device_tables), or None (each step's table rebuilt)."""
        if not self.kernels.table_rows:
            return None
        if self.kernels.device_tables:
            return DeviceTableRows(2 * max_num_seqs, width, self.device)
        return BlockTableRows(2 * max_num_seqs, width)

    def _staging_ring(self, num_buffers: int = 2) -> StagingRing:
        if not self.cuda:
            return StagingRing([None] * num_buffers, [None] * num_buffers)
        width = cdiv(self.max_model_len, self.block_size)
        n = 3 * (self.max_num_batched_tokens + self.max_num_seqs) + self.max_num_seqs * (width + 8) + 16
        buffers = [torch.empty(n, dtype=torch.int32, pin_memory=True) for _ in range(num_buffers)]
        return StagingRing(buffers, [torch.cuda.Event() for _ in range(num_buffers)])

    def _token_host_buffers(self) -> tuple[tuple[torch.Tensor, Any], ...]:
        if not self.cuda:
            return ()
        return tuple(
            (torch.empty(self.max_num_seqs, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
            for _ in range(2)
        )

    def stage_tokens(self, tokens: torch.Tensor) -> Callable[[], list[int]]:
        """Queue the copy of sampled `tokens` to the host now (behind the step that samples them, ahead
        of any step launched later); returns what waits for that copy alone and gives the values.
        `.tolist()` would wait for everything queued before it, the next step included. Two pinned
        buffers in turn: a step's values are read before the step after next is launched."""
        if not self._token_buffers:
            return tokens.tolist
        buf, event = self._token_buffers[self._num_staged & 1]
        self._num_staged += 1
        host = buf[: tokens.numel()]
        host.copy_(tokens, non_blocking=True)
        event.record(self._stream)

        def values() -> list[int]:
            event.synchronize()
            return host.tolist()

        return values

    def _allocate_kv_cache(self, num_blocks: int | None, utilization: float, enforce_eager: bool) -> KVCache:
        if num_blocks is None:
            num_blocks = (
                self.profile_num_blocks(utilization, enforce_eager) if self.cuda else DEFAULT_CPU_KV_BLOCKS
            )
            num_blocks = min_over_ranks(num_blocks, self.tp_size, self.device)  # one block table for all
        return self._new_kv_cache(num_blocks)

    def _new_kv_cache(self, num_blocks: int) -> KVCache:
        attn = self.model.attention_layers()[0]
        return KVCache(
            self.spec.num_layers,
            num_blocks,
            self.block_size,
            attn.num_kv_heads,
            attn.head_dim,
            self.dtype,
            self.device,
        )

    def profile_num_blocks(self, utilization: float, enforce_eager: bool) -> int:
        """Run a forward of max_num_batched_tokens on a scratch cache, then size the real cache from
        what is left of `utilization` x the GPU's memory."""
        lengths = _split(self.max_num_batched_tokens, self.max_model_len)
        scratch = self._new_kv_cache(sum(cdiv(n, self.block_size) for n in lengths) + self.max_num_seqs + 1)
        scratch.bind(self.model.attention_layers(), self.backend)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        self.run(self._dummy_prefill(lengths, scratch.num_blocks, sample_rows=self.max_num_seqs))
        torch.cuda.synchronize()
        activation = torch.cuda.max_memory_allocated() - base
        scratch.release(self.model.attention_layers())
        del scratch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        non_torch = (total - free) - torch.cuda.memory_reserved()
        # the piecewise graphs' pool holds about one step's activations (see `kv_cache_bytes`)
        budget = kv_cache_bytes(
            total,
            utilization,
            torch.cuda.memory_allocated(),
            activation,
            other_bytes=non_torch,
            cuda_graphs=not enforce_eager,
            prefill_graphs=self.use_prefill_graphs,
        )
        spec = dataclasses.replace(self.spec, dtype=str(self.dtype).removeprefix("torch."))
        blocks = num_kv_blocks(spec, budget, self.block_size, self.tp_size)
        if blocks <= 0:
            raise RuntimeError(
                f"no memory left for the KV cache: {total * utilization / 2**30:.1f} GiB usable, weights "
                f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB, activations {activation / 2**30:.1f} GiB"
            )
        return blocks

    # ---- warm-up --------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Run one step of each kind the scheduler can produce (prefill, prefill over a cached prefix,
        short chunks, mixed, decode; greedy and random sampling) so their kernels compile now."""
        bs, n_blocks = self.block_size, self.kv_cache.num_blocks
        long_len = min(self.max_model_len, self.max_num_batched_tokens, 2 * bs + 100, n_blocks * bs // 2)
        for batch in self._warmup_batches(long_len):
            if max(len(s.block_table) for s in batch.seqs) > n_blocks:
                continue
            self.run(batch)
        if self.cuda and self.sampler.triton_argmax:  # every sampler argmax variant: logits, probs
            argmax.warmup(self.spec.vocab_size, {self.dtype, torch.float32}, self.max_num_seqs, self.device)
        if self.fused_head:
            head_argmax.warmup(self.model.lm_head.weight)
        if self.cuda:
            torch.cuda.synchronize()

    def _warmup_batches(self, long_len: int) -> list[ScheduledBatch]:
        bs, greedy, sampled = self.block_size, SamplingParams(temperature=0), SamplingParams(temperature=1.0)
        topk = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
        prefix = (long_len // 2) // bs * bs
        batches = [
            self._dummy_prefill([long_len, max(1, long_len // 3)], self.kv_cache.num_blocks, params=greedy),
            self._dummy_batch([(long_len, prefix)], params=sampled),  # prefill over a cached prefix
            self._dummy_batch([(min(long_len, prefix + 32), prefix), (prefix + 1, prefix)], params=topk),
            self._dummy_batch([(long_len, long_len - 1), (long_len, prefix)], params=greedy),  # mixed
        ]
        for n in sorted({1, 2, min(self.max_num_seqs, 64), self.max_num_seqs}):
            batches.append(self._dummy_batch([(long_len, long_len - 1)] * n, params=greedy))
        return batches

    def _dummy_prefill(
        self, lengths: list[int], num_blocks: int, sample_rows: int = 0, params: SamplingParams | None = None
    ) -> ScheduledBatch:
        greedy = SamplingParams(temperature=0)
        batch = self._dummy_batch([(n, 0) for n in lengths], params or greedy, num_blocks)
        if sample_rows > len(lengths):  # also size the logits of a full decode batch
            extra = [(2, 1)] * (sample_rows - len(lengths))
            batch = _concat(batch, self._dummy_batch(extra, SamplingParams(temperature=1.0), num_blocks))
        return batch

    def _dummy_batch(
        self, shapes: list[tuple[int, int]], params: SamplingParams, num_blocks: int | None = None
    ) -> ScheduledBatch:
        """(tokens, computed) per sequence; each sequence gets its own run of blocks from block 0
        (wrapping around `num_blocks`, by default the KV cache's)."""
        num_blocks = num_blocks or self.kv_cache.num_blocks
        seqs, next_block = [], 0
        for i, (n, _) in enumerate(shapes):
            seq = Sequence(i, [(7 * i + j) % self.spec.vocab_size for j in range(n)], params)
            nb = cdiv(n, self.block_size)
            seq.block_table = [(next_block + j) % num_blocks for j in range(nb)]
            next_block += nb
            seqs.append(seq)
        computed = [c for _, c in shapes]
        return make_batch(seqs, [n - c for n, c in shapes], computed, [0] * len(seqs), [], next_block)

    # ---- CUDA graphs ----------------------------------------------------------------------------
    def capture_cudagraphs(self) -> None:
        sizes = graph_batch_sizes(self.max_num_seqs)
        if not sizes:
            return
        max_bs, width = sizes[-1], cdiv(self.max_model_len, self.block_size)
        i32 = dict(dtype=torch.int32, device=self.device)
        buf = _GraphBuffers(
            input_ids=torch.zeros(max_bs, **i32),
            positions=torch.zeros(max_bs, **i32),
            slot_mapping=torch.full((max_bs,), -1, **i32),
            context_lens=torch.ones(max_bs, **i32),
            cu_seqlens_q=torch.arange(max_bs + 1, **i32),
            block_tables=torch.zeros(max_bs, width, **i32),
        )
        pool = None
        with torch.inference_mode():
            for bs in reversed(sizes):
                with set_forward_context(buf.metadata(bs, self.max_model_len)):
                    self.model(buf.input_ids[:bs], buf.positions[:bs])  # compile outside the capture
                    self.graphs[bs], self.graph_outputs[bs], pool = self._capture(bs, buf, pool)
        self.graph_buffers = buf
        self.graph_sizes = sorted(self.graphs)
        self._warmup_graph_copy()

    def _warmup_graph_copy(self) -> None:
        """Copy a dummy decode step's inputs for every graph size, so the copy kernel's variants (its
        launches with and without PDL) compile before serving; the graph buffers keep no state."""
        greedy = SamplingParams(temperature=0)
        for bs in self.graph_sizes:
            batch = self._dummy_batch([(2, 1)] * bs, greedy)
            self._copy_graph_inputs(build_step_inputs(batch, self.block_size, self.device), bs)

    def _capture(self, bs: int, buf: _GraphBuffers, pool: Any) -> tuple[Any, torch.Tensor, Any]:
        """Capture the decode forward of `bs` sequences; returns (graph, its output, memory pool)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.model(buf.input_ids[:bs], buf.positions[:bs])
        torch.cuda.synchronize()
        return graph, out, graph.pool() if pool is None else pool

    def capture_piecewise(self) -> None:
        """Piecewise graphs of prefill/mixed steps for every token bucket (engine/piecewise.py), and
        whole-step graphs of the small ones where the kernels allow (engine/step_graphs.py)."""
        buckets = token_buckets(self.max_num_batched_tokens)
        buffers = SegmentBuffers.allocate(self.model, buckets[-1], self.dtype, self.device)
        segments = Segments(self.model, buffers, copy_kv=self.backend.reads_new_kv)
        self.piecewise = PiecewiseForward(segments, buckets)
        pool = self.piecewise.capture()
        if self.kernels.step_graphs:
            shapes = step_graph_shapes(buckets, self.max_num_seqs)
            width = cdiv(self.max_model_len, self.block_size)
            meta = StepMetadataBuffers.allocate(
                max(s for _, s in shapes), width, width * self.block_size, self.device
            )
            self.step_graphs = StepGraphs(self.model, buffers, meta, shapes)
            self.step_graphs.capture(pool)

    def _graph_size(self, batch: ScheduledBatch) -> int:
        if not self.graphs or batch.kind != "decode" or not all(batch.do_sample):
            return 0
        return next((bs for bs in self.graph_sizes if bs >= batch.num_seqs), 0)

    def _copy_graph_inputs(self, inputs: StepInputs, bs: int) -> None:
        """The step's inputs into the graph buffers' first rows; rows up to `bs` pad (slot -1)."""
        buf, md = self.graph_buffers, inputs.attn
        src = (inputs.input_ids, inputs.positions, md.slot_mapping, md.context_lens, md.block_tables)
        dst = (buf.input_ids, buf.positions, buf.slot_mapping, buf.context_lens, buf.block_tables)
        copy = graph_inputs.copy_triton if self.triton_graph_copy else graph_inputs.copy_torch
        copy(src, dst, bs)

    def _replay(self, inputs: StepInputs, bs: int) -> torch.Tensor:
        self._copy_graph_inputs(inputs, bs)
        self.graphs[bs].replay()
        return self.graph_outputs[bs][: inputs.attn.num_seqs]

    # ---- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, timer: Any = None) -> list[int]:
        """Compute the batch's tokens; returns one token id per sequence (-1 where none is sampled, and
        everywhere on a tensor-parallel rank other than 0)."""
        tokens, sampled = self.launch(batch, timer)
        out = [-1] * batch.num_seqs
        if tokens is not None:
            for i, t in zip(sampled, tokens.tolist()):
                out[i] = t
        return out

    @torch.inference_mode()
    def launch(
        self, batch: ScheduledBatch, timer: Any = None, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, tuple[int, ...]]:
        """Queue the batch's forward and sampling without waiting for them: (the sampled token ids on
        the device, or None; which sequences of the batch they belong to). `input_ids`: the step's
        input tokens on the device (async scheduling: the previous step's samples, not yet on the
        host), replacing those the sequences hold."""
        with self.kernels.activate():
            if timer is not None:
                timer.start()
            hidden, inputs = self.forward(batch, input_ids)
            tokens = self._sample(hidden, inputs) if inputs.sampled_seq_indices else None
            if timer is not None:
                timer.stop()
        return tokens, inputs.sampled_seq_indices

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor | None:
        """The sampled token ids of the rows of `hidden` (None on a tensor-parallel rank other than 0):
        a one-row greedy step through the fused head + argmax, others through logits and the sampler."""
        head = self.model.lm_head.weight
        if inputs.all_greedy and self.fused_head and head_argmax.serves(hidden, head):
            return head_argmax.head_argmax(hidden, head)
        logits = self.model.compute_logits(hidden)
        if logits is None:
            return None
        top_ks = inputs.top_ks if inputs.needs_top_k_top_p else None
        top_ps = inputs.top_ps if inputs.needs_top_k_top_p else None
        return self.sampler(logits, inputs.temperatures, top_ks, top_ps, all_greedy=inputs.all_greedy)

    @torch.inference_mode()
    def compute_logits(
        self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, StepInputs]:
        """Forward the batch; logits of the rows that sample, in batch order (None when no row samples,
        or on a tensor-parallel rank other than 0). `input_ids`: as for `launch`."""
        with self.kernels.activate():
            hidden, inputs = self.forward(batch, input_ids)
            logits = self.model.compute_logits(hidden) if inputs.sampled_seq_indices else None
        return logits, inputs

    @torch.inference_mode()
    def forward(
        self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, StepInputs]:
        """Forward the batch (decode through a CUDA graph when one fits): the final hidden states of
        the rows that sample, in batch order. `input_ids`: as for `launch`. (Its kernels read the
        kernel config that `launch` and `compute_logits` activate.)"""
        staging = self._staging.acquire()
        inputs = build_step_inputs(batch, self.block_size, self.device, staging, self._table_rows)
        self._staging.copied(self._stream)
        if input_ids is not None:
            inputs.input_ids.copy_(input_ids, non_blocking=True)
        graph_bs = self._graph_size(batch)
        self.last_graph_num_tokens = 0
        if graph_bs:
            hidden = self._replay(inputs, graph_bs)
        elif (shape := self._step_graph_shape(inputs)) is not None:
            hidden = self.step_graphs.forward(inputs, shape)[inputs.logits_indices]
            self.last_graph_num_tokens = shape[0]
        elif self.piecewise is not None and inputs.attn.num_tokens <= self.piecewise.max_num_tokens:
            hidden, self.last_graph_num_tokens = self.piecewise.forward(inputs)
            hidden = hidden[inputs.logits_indices]
        else:
            with set_forward_context(inputs.attn):
                hidden = self.model(inputs.input_ids, inputs.positions)
            hidden = hidden[inputs.logits_indices]
        self.last_graph_batch_size = graph_bs
        return hidden, inputs

    def _step_graph_shape(self, inputs: StepInputs) -> tuple[int, int] | None:
        return None if self.step_graphs is None else self.step_graphs.shape_for(inputs)

    def compile_count(self) -> int:
        """Kernel variants compiled so far (attention backend, the Triton kernels, torch.compile graphs)."""
        count = self.backend.compile_count() + triton_ops.compiled_variants() + gemv.compiled_variants()
        count += (
            argmax.compiled_variants() + graph_inputs.compiled_variants() + head_argmax.compiled_variants()
        )
        if self.cuda:
            from torch._dynamo.utils import counters

            count += counters["stats"]["unique_graphs"]
        return count

    def close(self) -> None:
        if self.piecewise is not None:
            self.piecewise.close()
            self.piecewise = None
        if self.step_graphs is not None:
            self.step_graphs.close()
            self.step_graphs = None
        self.graphs.clear()
        self.graph_sizes = []
        self.graph_outputs.clear()
        self.graph_buffers = None
        if self.kv_cache is not None:
            self.kv_cache.release(self.model.attention_layers())
        self.kv_cache = None
        self.model = None
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def _split(total: int, max_len: int) -> list[int]:
    """`total` tokens as sequences of at most `max_len`."""
    full, rest = divmod(total, max_len)
    return [max_len] * full + ([rest] if rest else [])


def _concat(a: ScheduledBatch, b: ScheduledBatch) -> ScheduledBatch:
    """One dummy batch of both (b's sequences renumbered after a's blocks)."""
    offset = a.num_kv_blocks_used
    for s in b.seqs:
        s.block_table = [x + offset for x in s.block_table]
    return make_batch(
        list(a.seqs) + list(b.seqs),
        list(a.num_scheduled_tokens) + list(b.num_scheduled_tokens),
        list(a.num_computed_tokens) + list(b.num_computed_tokens),
        [0] * (a.num_seqs + b.num_seqs),
        [],
        offset + b.num_kv_blocks_used,
    )
