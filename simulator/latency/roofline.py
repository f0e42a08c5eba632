"""Analytic roofline latency model: step time from a GPU's datasheet and a model's shapes.

For GPUs or models that were never profiled. Each term is max(bytes / bandwidth, FLOPs / FLOP/s)
scaled by efficiency factors, plus TP all-reduces and fixed overheads. It is not fitted to anything;
`fitted.py` is the model to trust where step records exist.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from engine.core.config import cdiv
from engine.memory import check_tp, kv_bytes_per_token, param_bytes, param_count
from engine.model_spec import ModelSpec, dtype_bytes
from simulator.latency.base import (
    BatchShape,
    LatencyModelBase,
    StepTime,
    arange_int64,
    decode_context_tokens,
)
from simulator.latency.gpus import GpuSpec, get_gpu


@dataclass(frozen=True)
class RooflineEfficiency:
    """Fractions of datasheet peaks that real kernels reach, and fixed costs.

    Defaults come from the H200 figures in BENCHMARKS.md: a device copy reaches 4.25 of 4.8 TB/s
    (0.89) and FlashAttention-4 paged decode 3.7-4.0 TB/s (0.77-0.83); a bf16 8192^3 GEMM reaches
    797 of 989 TFLOP/s (0.81); FA4 causal prefill 368 TFLOP/s (0.37). The overheads match
    nano-vllm's decode steps (2.4 ms at batch <= 8, where the GPU work is ~0.3 ms). NCCL ring
    all-reduce on NVLink typically reaches ~80% of the one-way link rate, ~10 us per call.
    """

    weight_bandwidth: float = 0.85  # streaming weights through the GEMMs
    kv_bandwidth: float = 0.80  # reading the paged KV cache in attention
    gemm_flops: float = 0.80  # dense bf16 GEMM throughput
    attention_flops: float = 0.37  # attention kernels' query-key work
    link_bandwidth: float = 0.80  # all-reduce bus bandwidth / one-way link bandwidth
    allreduce_latency_s: float = 10e-6  # fixed cost of one all-reduce call
    step_overhead_s: float = 2.0e-3  # fixed cost of any step (scheduling, launches, sampling)
    seq_overhead_s: float = 10e-6  # per sequence in the step (metadata, sampling, postprocess)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s"):
                if not value >= 0:
                    raise ValueError(f"RooflineEfficiency.{f.name}: must be >= 0 seconds, got {value!r}")
            elif not 0 < value <= 1:
                raise ValueError(f"RooflineEfficiency.{f.name}: must be in (0, 1], got {value!r}")


class RooflineModel(LatencyModelBase):
    """Per-GPU roofline of one tensor-parallel rank of `model` on `gpu`.

    Per step, with T new tokens, S sequences, C cached context tokens, P = prefill_attn_work:
      linear     = max(weight bytes / bw, (2 * body params * T + 2 * lm-head params * S) / flops)
      attention  = max((C + T) * KV bytes per token / bw, 4 * head_dim * heads * layers * pairs / flops),
                   pairs = P + decode context + decode seqs
      comm       = 2 * layers all-reduces of T * hidden * dtype bytes (ring: 2 (tp-1)/tp * bytes / link)
                   + per-call latency; zero at tp = 1
      overhead   = step_overhead_s + seq_overhead_s * S
    Weights read per step exclude an untied input embedding (only its looked-up rows are read); the
    LM head runs on one row per sequence. The TP embedding all-reduce and logits gather are omitted.
    FLOP/s is the GPU's dense bf16 rate whatever the model's dtype (fp16 runs at the same rate;
    for float32 models it is optimistic).
    """

    def __init__(
        self,
        model: ModelSpec,
        gpu: GpuSpec | str,
        tp: int = 1,
        efficiency: RooflineEfficiency | None = None,
    ) -> None:
        check_tp(model, tp)
        self.model = model
        self.gpu = get_gpu(gpu)
        self.tp = tp
        self.efficiency = eff = efficiency or RooflineEfficiency()
        gpu_spec = self.gpu
        db = dtype_bytes(model.dtype)
        vocab_params = model.vocab_size * model.hidden_size
        # Per-rank quantities. param_count holds the embedding once if tied, twice otherwise.
        embed_rank_bytes = 0 if model.tie_word_embeddings else cdiv(vocab_params, tp) * db
        self.weight_bytes: int = param_bytes(model, tp) - embed_rank_bytes
        body_params = param_count(model) - vocab_params * (1 if model.tie_word_embeddings else 2)
        self.linear_flops_per_token: float = 2 * body_params / tp
        self.lm_head_flops_per_seq: float = 2 * vocab_params / tp
        self.kv_bytes_per_token: int = kv_bytes_per_token(model, tp)
        self.attention_flops_per_pair: float = 4 * model.head_dim * (model.num_heads // tp) * model.num_layers
        self.allreduce_calls: int = 2 * model.num_layers if tp > 1 else 0
        self.allreduce_bytes_per_token: int = model.hidden_size * db if tp > 1 else 0

        bw, flops = gpu_spec.memory_bandwidth_Bps, gpu_spec.bf16_flops
        self._t_weights = self.weight_bytes / (bw * eff.weight_bandwidth)
        self._t_token_flops = self.linear_flops_per_token / (flops * eff.gemm_flops)
        self._t_seq_lm_head = self.lm_head_flops_per_seq / (flops * eff.gemm_flops)
        self._t_kv_token = self.kv_bytes_per_token / (bw * eff.kv_bandwidth)
        self._t_pair = self.attention_flops_per_pair / (flops * eff.attention_flops)
        if tp > 1:
            ring = 2 * (tp - 1) / tp
            link = gpu_spec.link_bandwidth_Bps * eff.link_bandwidth
            self._t_comm_fixed = self.allreduce_calls * eff.allreduce_latency_s
            self._t_comm_token = self.allreduce_calls * ring * self.allreduce_bytes_per_token / link
        else:
            self._t_comm_fixed = 0.0
            self._t_comm_token = 0.0
        self._t_step = eff.step_overhead_s
        self._t_seq = eff.seq_overhead_s
        # Decode: T = S new tokens, S LM-head rows; C + S KV tokens read and query-key pairs.
        self._t_decode_seq_flops = self._t_token_flops + self._t_seq_lm_head
        self._t_decode_ctx = max(self._t_kv_token, self._t_pair)

    def __repr__(self) -> str:
        return f"RooflineModel({self.model.name}, {self.gpu.name}, tp={self.tp})"

    def decode_step_time(self, num_seqs: int, num_context_tokens: int, max_seq_len: int) -> float:
        linear = self._t_decode_seq_flops * num_seqs
        if linear < self._t_weights:
            linear = self._t_weights
        return (
            linear
            + self._t_decode_ctx * (num_context_tokens + num_seqs)
            + (self._t_comm_fixed + self._t_comm_token * num_seqs)
            + (self._t_step + self._t_seq * num_seqs)
        )

    def _leading_decode_times(
        self,
        num_seqs: int,
        num_context_tokens: int,
        max_seq_len: int,
        max_steps: int,
        start: float,
        deadline: float,
    ) -> list[float]:
        """The reference loop with `decode_step_time` inlined: the same float operations in the same
        order ((linear + ctx_cost * (ctx + n)) + comm) + overhead, the terms that do not change with
        the context computed once."""
        linear = self._t_decode_seq_flops * num_seqs
        if linear < self._t_weights:
            linear = self._t_weights
        per_token = self._t_decode_ctx
        comm = self._t_comm_fixed + self._t_comm_token * num_seqs
        overhead = self._t_step + self._t_seq * num_seqs
        times = [start]
        append = times.append
        # token counts as floats: integers, exact, and float * float is the interpreter's fast path
        t, tokens, step = start, float(num_context_tokens + num_seqs), float(num_seqs)
        if comm == 0.0:  # tp = 1: adding 0.0 to a positive float changes nothing
            for _ in range(max_steps):
                if t >= deadline:
                    break
                t = t + (linear + per_token * tokens + overhead)
                append(t)
                tokens += step
            return times
        for _ in range(max_steps):
            if t >= deadline:
                break
            t = t + (linear + per_token * tokens + comm + overhead)
            append(t)
            tokens += step
        return times

    def _decode_step_array(
        self, num_seqs: int, num_context_tokens: int, max_seq_len: int, num_steps: int
    ) -> np.ndarray:
        linear = self._t_decode_seq_flops * num_seqs
        if linear < self._t_weights:
            linear = self._t_weights
        steps = arange_int64(num_context_tokens + num_seqs, num_steps, num_seqs) * self._t_decode_ctx
        # in place, in decode_step_time's order (a sum's two terms commute exactly)
        steps += linear
        steps += self._t_comm_fixed + self._t_comm_token * num_seqs
        steps += self._t_step + self._t_seq * num_seqs
        return steps

    def _decode_parts(
        self, num_seqs: int, num_context_tokens: int, max_seq_len: int
    ) -> tuple[float, float, float, float]:
        linear = self._t_decode_seq_flops * num_seqs
        if linear < self._t_weights:
            linear = self._t_weights
        return (
            linear,
            self._t_decode_ctx * (num_context_tokens + num_seqs),
            self._t_comm_fixed + self._t_comm_token * num_seqs,
            self._t_step + self._t_seq * num_seqs,
        )

    def _predict_prefill(self, batch: BatchShape) -> StepTime:
        tokens, seqs = batch.total_num_scheduled_tokens, batch.num_seqs
        linear = max(self._t_weights, self._t_token_flops * tokens + self._t_seq_lm_head * seqs)
        pairs = batch.prefill_attn_work + decode_context_tokens(batch) + batch.num_decode_seqs
        attention = max(
            self._t_kv_token * (batch.num_context_tokens + tokens),
            self._t_pair * pairs,
        )
        comm = self._t_comm_fixed + self._t_comm_token * tokens
        overhead = self._t_step + self._t_seq * seqs
        return StepTime(linear, attention, comm, overhead, linear + attention + comm + overhead)
