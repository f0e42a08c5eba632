"""Whole-step CUDA graphs for small prefill and mixed steps: the forward, attention included, as one
replay per (token bucket, sequence bucket), for backends whose varlen kernel sizes itself on device.

A piecewise step (engine/piecewise.py) still launches each layer's attention from Python; at a few
hundred tokens that host work is longer than the kernels, so the step's time follows the host's
speed. Here a step of n tokens over s sequences runs padded to a captured shape (T >= n, B >= s):
rows n..T store nothing (slot -1) and belong to no sequence, sequences s..B have no query and no keys
(cu_seqlens_q repeats n, context length 0). The kernels read every length from device tensors, so
the replay computes the real step; the shapes' host values (T rows, B sequences, max_seqlen_q = T,
max_seqlen_k = the block table's width in tokens) are upper bounds. Only backends with
`step_graph_safe` qualify.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.metadata import AttentionMetadata, StepInputs, set_forward_context
from engine.piecewise import SegmentBuffers

STEP_GRAPH_MAX_TOKENS = 2048  # larger steps keep the piecewise graphs: their kernels outlast the host
STEP_GRAPH_SEQS = (4, 16, 64, 256)  # sequence buckets (each also capped at the token bucket)


def step_graph_shapes(
    token_buckets: list[int], max_num_seqs: int, max_tokens: int = STEP_GRAPH_MAX_TOKENS
) -> list[tuple[int, int]]:
    """(token bucket T, sequence bucket B) of every whole-step graph: the token buckets up to
    `max_tokens`, each with the sequence buckets below it and min(T, max_num_seqs), which holds any
    step of T tokens (a sequence schedules at least one token)."""
    shapes = []
    for t in sorted(b for b in token_buckets if b <= max_tokens):
        top = min(t, max_num_seqs)
        seqs = sorted({min(s, top) for s in (*STEP_GRAPH_SEQS, top)})
        shapes.extend((t, s) for s in seqs)
    return shapes


def pick_shape(shapes: list[tuple[int, int]], num_tokens: int, num_seqs: int) -> tuple[int, int] | None:
    """The smallest captured (T, B) with T >= num_tokens and B >= num_seqs (fewest padded tokens
    first, then fewest padded sequences); None when no graph holds the step."""
    i = bisect.bisect_left(shapes, (num_tokens, num_seqs))
    return next(((t, s) for t, s in shapes[i:] if t >= num_tokens and s >= num_seqs), None)


@dataclass
class StepMetadataBuffers:
    """Static attention metadata the graphs read (first B entries used by sequence bucket B), and
    the longest context a sequence can have (the kernels' host bound)."""

    cu_seqlens_q: torch.Tensor  # [Bmax + 1] int32
    context_lens: torch.Tensor  # [Bmax] int32
    block_tables: torch.Tensor  # [Bmax, width] int32
    max_seqlen_k: int

    @classmethod
    def allocate(
        cls, max_seqs: int, width: int, max_seqlen_k: int, device: torch.device
    ) -> StepMetadataBuffers:
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            cu_seqlens_q=torch.zeros(max_seqs + 1, **i32),
            context_lens=torch.zeros(max_seqs, **i32),
            block_tables=torch.zeros(max_seqs, width, **i32),
            max_seqlen_k=max_seqlen_k,
        )

    def metadata(
        self, slot_mapping: torch.Tensor, num_tokens: int, num_seqs: int, host_lens: tuple = ((), ())
    ) -> AttentionMetadata:
        """Shape (num_tokens, num_seqs)'s metadata over the buffers. The graphs' backends read lengths
        from the device tensors only; `host_lens` (query and context lengths, padded with zeros) is
        for the torch backend of the CPU tests, which loops over them."""
        b = num_seqs
        query_lens, context_lens = (tuple(x) + (0,) * (b - len(x)) for x in host_lens)
        return AttentionMetadata(
            num_seqs=b,
            num_tokens=num_tokens,
            max_seqlen_q=num_tokens,
            max_seqlen_k=self.max_seqlen_k,
            has_context=True,
            cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            cu_seqlens_k=self.cu_seqlens_q[: b + 1],  # unused by the varlen paged kernels
            context_lens=self.context_lens[:b],
            slot_mapping=slot_mapping[:num_tokens],
            block_tables=self.block_tables[:b],
            query_lens_cpu=query_lens,
            context_lens_cpu=context_lens,
        )


def copy_step_inputs(
    buf: SegmentBuffers, meta: StepMetadataBuffers, inputs: StepInputs, num_tokens: int, num_seqs: int
) -> None:
    """The step's inputs into the static buffers of shape (num_tokens, num_seqs), padded: rows past the
    step's tokens store nothing, sequences past its own have no query and no keys."""
    md = inputs.attn
    n, s = md.num_tokens, md.num_seqs
    buf.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
    buf.positions[:n].copy_(inputs.positions, non_blocking=True)
    buf.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
    if num_tokens > n:
        buf.slot_mapping[n:num_tokens].fill_(-1)
    meta.cu_seqlens_q[: s + 1].copy_(md.cu_seqlens_q, non_blocking=True)
    meta.context_lens[:s].copy_(md.context_lens, non_blocking=True)
    if num_seqs > s:
        meta.cu_seqlens_q[s + 1 : num_seqs + 1].fill_(n)
        meta.context_lens[s:num_seqs].fill_(0)
    meta.block_tables[:s, : md.block_tables.shape[1]].copy_(md.block_tables, non_blocking=True)


class StepGraphs:
    """The model's whole forward per captured shape over static buffers (the piecewise graphs'
    token buffers, shared: steps run one after another on one stream): `forward(inputs, shape)`
    copies the step in, replays, and returns its rows' final hidden states."""

    def __init__(
        self, model: Any, buffers: SegmentBuffers, meta: StepMetadataBuffers, shapes: list[tuple[int, int]]
    ) -> None:
        self.model, self.buf, self.meta = model, buffers, meta
        self.shapes = sorted(shapes)
        self.graphs: dict[tuple[int, int], Any] = {}

    def shape_for(self, inputs: StepInputs) -> tuple[int, int] | None:
        return pick_shape(self.shapes, inputs.attn.num_tokens, inputs.attn.num_seqs)

    @torch.inference_mode()
    def run(self, num_tokens: int, num_seqs: int, host_lens: tuple = ((), ())) -> None:
        """The forward of shape (num_tokens, num_seqs) on the buffers, its hidden states into `hidden`."""
        b = self.buf
        with set_forward_context(self.meta.metadata(b.slot_mapping, num_tokens, num_seqs, host_lens)):
            hidden = self.model(b.input_ids[:num_tokens], b.positions[:num_tokens])
        b.hidden[:num_tokens].copy_(hidden)

    def forward(self, inputs: StepInputs, shape: tuple[int, int], eager: bool = False) -> torch.Tensor:
        """Hidden [n, hidden] of the step's tokens, run in `shape` (a replay; `eager`: the same
        padded forward without the graph, as the CPU tests run it)."""
        copy_step_inputs(self.buf, self.meta, inputs, *shape)
        if eager:
            self.run(*shape, (inputs.attn.query_lens_cpu, inputs.attn.context_lens_cpu))
        else:
            self.graphs[shape].replay()
        return self.buf.hidden[: inputs.attn.num_tokens]

    def capture(self, pool: Any = None) -> Any:
        """Capture every shape, largest first, into `pool` (shared with the piecewise graphs: nothing
        a graph allocates outlives its replay). Each shape runs once eagerly first (kernels compile
        outside the capture) over sequences without queries, so nothing is written. Returns the pool."""
        b, m = self.buf, self.meta
        b.slot_mapping.fill_(-1)
        m.cu_seqlens_q.zero_()
        m.context_lens.zero_()
        stream = torch.cuda.Stream()
        for shape in reversed(self.shapes):
            self.run(*shape)
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=pool)
                try:
                    self.run(*shape)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(stream)
            pool = graph.pool() if pool is None else pool
            self.graphs[shape] = graph
        torch.cuda.synchronize()
        return pool

    def close(self) -> None:
        self.graphs.clear()
