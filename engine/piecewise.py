"""Piecewise CUDA graphs for prefill and mixed steps: the forward pass cut at its attention kernels.

An eager prefill step is host-bound (about 170 kernel launches per layer's worth of Python, ~25 ms for
a 1,024-token prefill of Qwen3-0.6B on an H200 against ~3 ms of kernels). Here a step of n tokens
runs padded to the smallest token bucket T >= n: segment 0 (embedding, layer 0 up to its attention)
and segment i (layer i-1 after its attention, layer i up to its attention; the last one ends with the
final norm) replay from graphs captured per bucket, and only the attention kernels run eagerly, on
the n real rows, between them. Segments exchange tensors through static buffers; padded rows store
no KV (slot -1) and their results are never read.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.metadata import StepInputs


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Padded token counts a piecewise graph is captured for: 16…256 by doubling, then every 256,
    and max_num_batched_tokens itself (at most 255 padded rows above 256 tokens)."""
    small = [t for t in (16, 32, 64, 128, 256) if t < max_num_batched_tokens]
    large = list(range(512, max_num_batched_tokens, 256))
    return small + large + [max_num_batched_tokens]


@dataclass
class SegmentBuffers:
    """Static tensors the segments read and write (first T rows used by bucket T)."""

    input_ids: torch.Tensor  # [Tmax] int32
    positions: torch.Tensor  # [Tmax] int32
    slot_mapping: torch.Tensor  # [Tmax] int32, -1 on padded rows
    q: torch.Tensor  # [Tmax, H, D]
    k: torch.Tensor  # [Tmax, Hkv, D]
    v: torch.Tensor  # [Tmax, Hkv, D]
    attn_out: torch.Tensor  # [Tmax, H * D]
    residual: torch.Tensor  # [Tmax, hidden]
    hidden: torch.Tensor  # [Tmax, hidden]: the final norm's output

    @classmethod
    def allocate(
        cls, model: Any, max_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> SegmentBuffers:
        attn = model.attention_layers()[0]
        h, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        hidden = model.model.norm.weight.shape[0]
        i32 = dict(dtype=torch.int32, device=device)
        f = dict(dtype=dtype, device=device)
        return cls(
            input_ids=torch.zeros(max_tokens, **i32),
            positions=torch.zeros(max_tokens, **i32),
            slot_mapping=torch.full((max_tokens,), -1, **i32),
            q=torch.zeros(max_tokens, h, d, **f),
            k=torch.zeros(max_tokens, hkv, d, **f),
            v=torch.zeros(max_tokens, hkv, d, **f),
            attn_out=torch.zeros(max_tokens, h * d, **f),
            residual=torch.zeros(max_tokens, hidden, **f),
            hidden=torch.zeros(max_tokens, hidden, **f),
        )


class Segments:
    """The model's forward as `num_segments` pieces over the static buffers: piece i of T rows."""

    def __init__(self, model: Any, buffers: SegmentBuffers, copy_kv: bool = True) -> None:
        self.inner = model.model  # embed_tokens, layers (pre_attention / post_attention), norm
        self.layers = list(self.inner.layers)
        self.buf = buffers
        self.copy_kv = copy_kv  # the backend reads this step's k/v, not only the cache
        self.num_segments = len(self.layers) + 1

    @torch.inference_mode()
    def run(self, i: int, num_tokens: int) -> None:
        b, t = self.buf, num_tokens
        if i == 0:
            hidden, residual = self.inner.embed_tokens(b.input_ids[:t]), None
        else:
            hidden, residual = self.layers[i - 1].post_attention(b.attn_out[:t], b.residual[:t])
        if i == len(self.layers):
            hidden, _ = self.inner.norm(hidden, residual)
            b.hidden[:t].copy_(hidden)
            return
        layer = self.layers[i]
        q, k, v, residual = layer.pre_attention(b.positions[:t], hidden, residual, b.slot_mapping[:t])
        b.q[:t].copy_(q)
        if self.copy_kv:
            b.k[:t].copy_(k)
            b.v[:t].copy_(v)
        b.residual[:t].copy_(residual)


class PiecewiseForward:
    """Runs a step's forward segment by segment: `run_segment(i, T)` (a graph replay, or the eager
    segment itself), the attention of each layer eagerly in between. Returns the n rows' hidden."""

    def __init__(self, segments: Segments, buckets: list[int]) -> None:
        self.segments = segments
        self.buckets = sorted(buckets)
        self.max_num_tokens = self.buckets[-1]
        self.attn_layers = [layer.self_attn.attn for layer in segments.layers]
        self.graphs: dict[int, list[Any]] = {}

    def bucket(self, num_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    def forward(self, inputs: StepInputs, eager: bool = False) -> tuple[torch.Tensor, int]:
        """(hidden [n, hidden] of the step's tokens, the bucket it ran in)."""
        md, b = inputs.attn, self.segments.buf
        n = md.num_tokens
        t = self.bucket(n)
        b.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        b.positions[:n].copy_(inputs.positions, non_blocking=True)
        b.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
        if t > n:
            b.slot_mapping[n:t].fill_(-1)
        run = self.segments.run if eager else self._replay
        run(0, t)
        for i, attn in enumerate(self.attn_layers):
            b.attn_out[:n].copy_(attn.attend(b.q[:n], b.k[:n], b.v[:n], md))
            run(i + 1, t)
        return b.hidden[:n], t

    def _replay(self, i: int, num_tokens: int) -> None:
        self.graphs[num_tokens][i].replay()

    def capture(self, pool: Any = None) -> Any:
        """Capture every segment of every bucket, largest bucket first, sharing one memory pool (the
        segments replay in capture order). Returns the pool. Uses the raw capture calls: the
        `torch.cuda.graph` context collects garbage at each of its (here ~1,000) entries."""
        b, segments = self.segments.buf, self.segments
        b.slot_mapping.fill_(-1)  # the eager warm runs below must not write into the KV cache
        stream = torch.cuda.Stream()
        for t in reversed(self.buckets):
            graphs = []
            for i in range(segments.num_segments):
                segments.run(i, t)  # compile / initialise outside the capture
                stream.wait_stream(torch.cuda.current_stream())
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.stream(stream):
                    graph.capture_begin(pool=pool)
                    try:
                        segments.run(i, t)
                    finally:
                        graph.capture_end()
                torch.cuda.current_stream().wait_stream(stream)
                pool = graph.pool() if pool is None else pool
                graphs.append(graph)
            self.graphs[t] = graphs
        torch.cuda.synchronize()
        return pool

    def close(self) -> None:
        self.graphs.clear()
