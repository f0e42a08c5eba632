"""Configuration of the engine and the simulator: small frozen dataclasses, validated on construction.
No weights, GPU or torch: `ModelSpec` reads an HF `config.json` as plain JSON (sizing: engine/memory.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
POLICIES = ("chunked", "prefill_first")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(obj).__name__}.{name}: must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    """The shapes of a decoder-only transformer, enough to size its KV cache and its weights."""

    name: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        _positive(
            self,
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "hidden_size",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        )
        dtype_bytes(self.dtype)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec.num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}"
            )

    @classmethod
    def from_hf_config(cls, source: str | Path | dict[str, Any], name: str | None = None) -> ModelSpec:
        """Read an HF `config.json` (a model folder, the file itself, or the parsed dict)."""
        if isinstance(source, dict):
            cfg, where = source, "config dict"
        else:
            path = Path(source)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no config.json here")
            cfg, where = json.loads(path.read_text()), str(path)
            name = name or path.parent.name
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            return cls(
                name=name or cfg.get("_name_or_path") or cfg["architectures"][0],
                architecture=cfg["architectures"][0],
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                rope_theta=float(
                    cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)
                ),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                eos_token_id=eos[0] if isinstance(eos, list) else eos,
            )
        except KeyError as e:
            raise ValueError(f"{where}: missing field {e.args[0]!r}") from None


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size in tokens, number of blocks (None = sized from memory)."""

    block_size: int = 16
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        _positive(self, "block_size")
        if self.num_blocks is not None:
            _positive(self, "num_blocks")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"CacheConfig.gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits and the scheduling policy ("chunked": vLLM v1, "prefill_first": nano-vllm)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int = 4096
    policy: str = "chunked"

    def __post_init__(self) -> None:
        _positive(self, "max_num_seqs", "max_num_batched_tokens", "max_model_len")
        if self.policy not in POLICIES:
            raise ValueError(f"SchedulerConfig.policy: {self.policy!r} is not one of {list(POLICIES)}")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split: tensor-parallel degree."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _positive(self, "tensor_parallel_size")
