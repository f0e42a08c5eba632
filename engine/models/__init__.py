"""Model registry keyed by the checkpoint's `architectures[0]`."""

from __future__ import annotations

from torch import nn

from engine.models.llama import LlamaForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[architecture]


__all__ = ["MODEL_REGISTRY", "model_class"]
