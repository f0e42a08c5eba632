"""Configuration of the engine and the simulator: small frozen dataclasses and pure functions.

Nothing here needs weights, a GPU or torch: `ModelSpec` reads an HF `config.json` as plain JSON, and
derived values (bytes per KV token, KV blocks that fit in memory) are pure functions that the engine,
the simulator and the dashboard all call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
POLICIES = ("chunked", "prefill_first")
GRAPH_MEMORY_RESERVE = 512 << 20  # bytes the engine keeps back for its decode CUDA graphs' pool


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


def check_tp(model: ModelSpec, tp: int) -> None:
    """Raise ValueError unless attention heads split evenly over `tp` ranks."""
    if tp <= 0:
        raise ValueError(f"tensor_parallel_size: must be a positive integer, got {tp}")
    if model.num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size: {tp} does not divide num_heads {model.num_heads} of {model.name}"
        )
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size: {tp} and num_kv_heads {model.num_kv_heads} of {model.name} "
            "must divide one another"
        )


def num_kv_heads_per_rank(model: ModelSpec, tp: int = 1) -> int:
    """KV heads held by one rank (replicated when tp exceeds the number of KV heads)."""
    check_tp(model, tp)
    return max(1, model.num_kv_heads // tp)


def kv_bytes_per_token(model: ModelSpec, tp: int = 1) -> int:
    """Bytes of K and V that one token occupies on one GPU, over all layers."""
    per_rank = num_kv_heads_per_rank(model, tp)
    return 2 * model.num_layers * per_rank * model.head_dim * dtype_bytes(model.dtype)


def kv_block_bytes(model: ModelSpec, block_size: int, tp: int = 1) -> int:
    return block_size * kv_bytes_per_token(model, tp)


def param_count(model: ModelSpec) -> int:
    """Parameters of a Llama/Qwen3-style decoder (Qwen3's q/k norms included)."""
    h, d = model.hidden_size, model.head_dim
    attn = h * model.num_heads * d + 2 * h * model.num_kv_heads * d + model.num_heads * d * h
    mlp = 3 * h * model.intermediate_size
    norms = 2 * h + (2 * d if model.architecture.startswith("Qwen3") else 0)
    embed = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    return model.num_layers * (attn + mlp + norms) + embed + h


def param_bytes(model: ModelSpec, tp: int = 1) -> int:
    """Weight bytes held by one GPU under tensor parallelism (norms replicated, counted once)."""
    return cdiv(param_count(model), tp) * dtype_bytes(model.dtype)


def kv_free_bytes(
    gpu_memory_bytes: int,
    gpu_memory_utilization: float,
    model: ModelSpec,
    tp: int = 1,
    activation_bytes: int = 0,
) -> int:
    """Bytes left for the KV cache on one GPU: the usable share minus weights and activations."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}")
    usable = int(gpu_memory_bytes * gpu_memory_utilization)
    return max(0, usable - param_bytes(model, tp) - activation_bytes)


def kv_cache_bytes(
    gpu_memory_bytes: int,
    gpu_memory_utilization: float,
    weight_bytes: int,
    activation_bytes: int,
    *,
    other_bytes: int = 0,
    cuda_graphs: bool = True,
    prefill_graphs: bool = True,
) -> int:
    """Bytes one GPU gives its KV cache, as the engine sizes it (`ModelRunner.profile_num_blocks`).

    The usable share of the GPU's memory, less what torch holds before the cache (`weight_bytes`:
    the weights and fixed buffers), memory outside torch's allocator (`other_bytes`: CUDA context,
    libraries), one forward's activation peak, the decode graphs' pool (`GRAPH_MEMORY_RESERVE`,
    unless eager) and, with piecewise prefill graphs, a second activation peak (their pool). The
    engine passes what it measured after its warm-up; a plan passes modelled values
    (`default_num_kv_blocks`).
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {gpu_memory_utilization}")
    budget = gpu_memory_bytes * gpu_memory_utilization - other_bytes - weight_bytes - activation_bytes
    if cuda_graphs:
        budget -= GRAPH_MEMORY_RESERVE
    if cuda_graphs and prefill_graphs:
        budget -= activation_bytes
    return max(0, int(budget))


def default_num_kv_blocks(
    model: ModelSpec,
    block_size: int,
    gpu_memory_bytes: int,
    *,
    tp: int = 1,
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int = 16384,
    max_num_seqs: int = 256,
) -> int:
    """KV blocks per GPU when none are asked for: `kv_cache_bytes` of the engine's default settings
    (CUDA graphs, piecewise prefill graphs) on a GPU of `gpu_memory_bytes`, with the weights'
    bytes on one rank and the activation estimate in place of the engine's measurements."""
    activations = activation_bytes_estimate(model, max_num_batched_tokens, max_num_seqs, tp)
    free = kv_cache_bytes(gpu_memory_bytes, gpu_memory_utilization, param_bytes(model, tp), activations)
    return num_kv_blocks(model, free, block_size, tp)


def num_kv_blocks(model: ModelSpec, free_bytes: int, block_size: int, tp: int = 1) -> int:
    """KV cache blocks of `block_size` tokens that fit in `free_bytes` on each GPU."""
    if block_size <= 0:
        raise ValueError(f"block_size: must be a positive integer, got {block_size}")
    return max(0, free_bytes) // kv_block_bytes(model, block_size, tp)


def activation_bytes_estimate(
    model: ModelSpec, max_num_batched_tokens: int, max_num_seqs: int, tp: int = 1
) -> int:
    """A planning estimate of the peak activation memory of one forward pass on one GPU.

    The engine measures the real peak after its warm-up; the simulator and planner, which have no
    GPU, use this: hidden states and MLP intermediates of the largest step plus fp32 logits of the
    sampled rows.
    """
    per_token = 4 * model.hidden_size + 2 * cdiv(model.intermediate_size, tp)
    return max_num_batched_tokens * per_token * dtype_bytes(model.dtype) + max_num_seqs * model.vocab_size * 4
