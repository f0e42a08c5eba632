"""Llama-family decoder (Llama 3 style: GQA, SwiGLU, RMSNorm, rotary with config scaling) over a flat
batch of tokens; Qwen3 reuses it with per-head q/k RMSNorm. Parameter names follow HF checkpoints,
with q/k/v and gate/up merged (`packed_modules_mapping` tells the loader how)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention.metadata import get_forward_context
from engine.layers import gemv, triton_ops
from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.distributed import resolve_tp
from engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.model_spec import ModelSpec


class LlamaAttention(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        spec: ModelSpec,
        rotary: RotaryEmbedding,
        bias: bool,
        qk_norm: bool,
        tp: tuple[int, int],
    ) -> None:
        super().__init__()
        d = spec.head_dim
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, d, spec.num_heads, spec.num_kv_heads, bias, *tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size, self.head_dim = self.num_heads * d, self.num_kv_heads * d, d
        self.o_proj = RowParallelLinear(spec.num_heads * d, spec.hidden_size, bias, *tp)
        self.rotary_emb = rotary
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, d, d**-0.5)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        md = get_forward_context()
        q, k, v = self.project(positions, hidden_states, md.slot_mapping)
        return self.o_proj(self.attn.attend(q, k, v, md))

    def project(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, slot_mapping: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, Hkv, D] of the tokens (projection, q/k norm for Qwen3, rotary),
        k and v also stored into their cache slots."""
        return self.split_heads(positions, self.qkv_proj(hidden_states), slot_mapping)

    def split_heads(
        self, positions: torch.Tensor, qkv: torch.Tensor, slot_mapping: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the projected rows qkv [T, (H + 2 Hkv) D] (q/k norm for Qwen3, rotary), k and v
        stored into the cache slots `slot_mapping` (-1: not stored): on the Triton layers in the same
        launch as the norm and rotary."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.rotary_emb.impl == "triton":  # norm, rotary and the K/V store in one launch
            qn, kn = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
            q, k = triton_ops.qk_norm_rotary(
                positions,
                q,
                k,
                self.rotary_emb.cos_sin_cache,
                qn.weight if qn is not None else None,
                kn.weight if kn is not None else None,
                qn.eps if qn is not None else 0.0,
                kv_store=(v, *self.attn.caches(), slot_mapping),
            )
            return q, k, v
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        self.attn.store(k, v, slot_mapping)
        return q, k, v


class LlamaMLP(nn.Module):
    def __init__(self, spec: ModelSpec, bias: bool, tp: tuple[int, int]) -> None:
        super().__init__()
        inter = spec.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, [inter, inter], bias, *tp)
        self.down_proj = RowParallelLinear(inter, spec.hidden_size, bias, *tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, layer_idx: int, spec: ModelSpec, rotary: RotaryEmbedding, cfg: dict[str, Any], qk_norm: bool, tp
    ) -> None:
        super().__init__()
        attn_bias = bool(cfg.get("attention_bias", False))
        self.self_attn = LlamaAttention(layer_idx, spec, rotary, attn_bias, qk_norm, tp)
        self.mlp = LlamaMLP(spec, bool(cfg.get("mlp_bias", False)), tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        md = get_forward_context()
        q, k, v, residual = self.pre_attention(positions, hidden_states, residual, md.slot_mapping)
        return self.post_attention(self.self_attn.attn.attend(q, k, v, md), residual)

    # the layer cut at its attention kernel (piecewise CUDA graphs capture the two halves)
    def pre_attention(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm (adding the residual), q/k/v, and k/v stored at `slot_mapping`: (q, k, v, residual)."""
        if self.fused_small_batch(hidden_states):  # norm fused into the QKV projection
            norm, proj = self.input_layernorm, self.self_attn.qkv_proj
            qkv, residual = gemv.norm_linear(
                hidden_states, residual, norm.weight, norm.eps, proj.weight, proj.bias
            )
            return *self.self_attn.split_heads(positions, qkv, slot_mapping), residual
        if residual is None:
            hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        q, k, v = self.self_attn.project(positions, hidden_states, slot_mapping)
        return q, k, v, residual

    def post_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output projection, post-attention norm (adding the residual) and MLP: (hidden, residual)."""
        hidden_states = self.self_attn.o_proj(attn_out)
        if self.fused_small_batch(hidden_states):  # norm fused into gate/up, SiLU into down
            norm, mlp = self.post_attention_layernorm, self.mlp
            gate_up, residual = gemv.norm_linear(
                hidden_states, residual, norm.weight, norm.eps, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias
            )
            return mlp.down_proj.silu_forward(gate_up), residual
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual

    def fused_small_batch(self, hidden_states: torch.Tensor) -> bool:
        """Small batches on the Triton layers take the fused GEMV kernels (engine/layers/gemv.py)."""
        return self.input_layernorm.impl == "triton" and gemv.serves(
            hidden_states, self.mlp.gate_up_proj.weight
        )


class LlamaModel(nn.Module):
    def __init__(self, spec: ModelSpec, cfg: dict[str, Any], qk_norm: bool, tp: tuple[int, int]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, *tp)
        rotary = RotaryEmbedding(spec.head_dim, spec.max_position_embeddings, rope_parameters(cfg))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(i, spec, rotary, cfg, qk_norm, tp) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """HF `LlamaForCausalLM`: `forward(input_ids, positions)` -> hidden states of every token,
    `compute_logits(hidden)` -> logits over the full vocabulary (on tensor-parallel rank 0; None on
    the other ranks)."""

    qk_norm = False
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        hf_config: dict[str, Any],
        spec: ModelSpec,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        check_supported(hf_config)
        tp = resolve_tp(tp_rank, tp_size)
        self.model = LlamaModel(spec, hf_config, self.qk_norm, tp)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size, *tp)
        self.tie_word_embeddings = spec.tie_word_embeddings
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden_states)

    def attention_layers(self) -> list[Attention]:
        """The attention layers in layer-index order (what the KV cache binds to)."""
        return [layer.self_attn.attn for layer in self.model.layers]


def check_supported(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
    if cfg.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=true is not supported")
    rope_parameters(cfg)  # raises on an unsupported rope_type
