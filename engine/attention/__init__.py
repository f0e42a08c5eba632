"""Attention behind one interface: `torch` (reference, CPU), `flash_attn` (FA2) and
`flash_attn_cute` (FA4). `select_backend` resolves "auto" and fails early, with the reason, when
the asked-for backend cannot run or does not support the block size."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.fa2 import FlashAttnBackend
from engine.attention.fa4 import FlashAttnCuteBackend
from engine.attention.torch_sdpa import TorchSDPABackend
from engine.envs import KernelConfig

BACKENDS: dict[str, type[AttentionBackend]] = {
    "flash_attn_cute": FlashAttnCuteBackend,
    "flash_attn": FlashAttnBackend,
    "torch": TorchSDPABackend,
}


def select_backend(
    name: str, device: torch.device, block_size: int, kernels: KernelConfig | None = None
) -> AttentionBackend:
    """The backend called `name` ("auto": FA4 if it can run, else FA2 if the block size suits it,
    else torch), constructed with the engine's kernel config `kernels` (None: the environment's);
    ValueError naming the reason when it cannot serve this setup."""
    if name == "auto":
        for candidate in ("flash_attn_cute", "flash_attn"):
            cls = BACKENDS[candidate]
            if cls.unavailable_reason(device) is None and cls.supports_block_size(block_size):
                return cls.from_config(kernels)
        return TorchSDPABackend.from_config(kernels)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend: {name!r} is not one of {['auto', *BACKENDS]}")
    cls = BACKENDS[name]
    reason = cls.unavailable_reason(device)
    if reason:
        raise ValueError(f"attention_backend {name!r}: {reason}")
    if not cls.supports_block_size(block_size):
        raise ValueError(f"attention_backend {name!r}: block_size {block_size} is not supported")
    return cls.from_config(kernels)


__all__ = ["BACKENDS", "AttentionBackend", "select_backend"]
