"""Rotary position embedding (neox layout, as HF Llama/Qwen3), with "default", "linear" and "llama3"
frequency scaling read from the checkpoint's config (`rope_parameters` or `rope_scaling`)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.layers import triton_ops
from engine.layers.layernorm import compiled

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Merge transformers-5 `rope_parameters` and older `rope_theta` + `rope_scaling` into one dict
    with at least `rope_type` and `rope_theta`."""
    params = dict(hf_config.get("rope_parameters") or {})
    params.update(hf_config.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type: {params['rope_type']!r} is not supported (supported: {list(SUPPORTED_ROPE_TYPES)})"
        )
    return params


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = params["rope_type"]
    if kind == "linear":
        return inv_freq / float(params["factor"])
    if kind == "llama3":
        return _llama3_scaling(inv_freq, params)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] by their positions; cos_sin is [max_pos, D] float32."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.float())
        cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(torch.float32)
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)
        self.impl = "torch"  # or "compile" / "triton": see layernorm.py

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.impl == "triton":
            return triton_ops.qk_norm_rotary(positions, q, k, self.cos_sin_cache, None, None, 0.0)
        fn = compiled(apply_rotary) if self.impl == "compile" else apply_rotary
        return fn(positions, q, k, self.cos_sin_cache)
