"""The interface every attention backend implements: paged attention over the KV cache of one layer.

The attention layer stores the step's K/V into the cache first, then calls `forward` with the new
tokens' q/k/v, that layer's cache and the step's `AttentionMetadata`.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from engine.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from engine.envs import KernelConfig


def module_available(name: str) -> bool:
    """Whether `name` can be imported here (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


class AttentionBackend:
    name = "base"
    graph_safe = False  # True when forward() can be captured in a CUDA graph
    reads_new_kv = True  # False when forward() reads keys/values only from the cache, never k/v
    # True when a whole prefill/mixed step can be captured at padded host shapes (engine/step_graphs.py):
    # its varlen kernel takes every length from device tensors, host values only as upper bounds,
    # and sequences without queries or keys compute nothing
    step_graph_safe = False

    @classmethod
    def from_config(cls, kernels: KernelConfig | None = None) -> AttentionBackend:
        """The backend as the engine builds it, with the engine's kernel config (`engine.envs`; None:
        the environment's); a backend without kernel choices ignores it."""
        return cls()

    @staticmethod
    def supports_block_size(block_size: int) -> bool:
        raise NotImplementedError

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on `device`, or None when it can."""
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D] new tokens' queries
        k: torch.Tensor,  # [T, Hkv, D] new tokens' keys (already stored in the cache)
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        raise NotImplementedError

    def compile_count(self) -> int:
        """Kernel variants compiled so far (grows when a step hits a new variant)."""
        return 0
