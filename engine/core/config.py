"""Configuration of the KV cache, the scheduler and parallelism: small frozen dataclasses, validated
on construction. The model's shapes are engine/model_spec.py's, its memory sizing engine/memory.py's."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("chunked", "prefill_first")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def check_positive(obj: object, *names: str) -> None:
    """Raise ValueError unless each field `names` of `obj` is a positive integer."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(obj).__name__}.{name}: must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size in tokens, number of blocks (None = sized from memory)."""

    block_size: int = 16
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        check_positive(self, "block_size")
        if self.num_blocks is not None:
            check_positive(self, "num_blocks")
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
        check_positive(self, "max_num_seqs", "max_num_batched_tokens", "max_model_len")
        if self.policy not in POLICIES:
            raise ValueError(f"SchedulerConfig.policy: {self.policy!r} is not one of {list(POLICIES)}")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split: tensor-parallel degree."""

    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_positive(self, "tensor_parallel_size")
