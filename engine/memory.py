"""Memory sizing of a model on GPUs: weight bytes, KV bytes per token, KV blocks that fit.
Pure functions of a `ModelSpec` that the engine, the simulator and the dashboard all call; no torch.
"""

from __future__ import annotations

from engine.core.config import cdiv
from engine.model_spec import ModelSpec, dtype_bytes

GRAPH_MEMORY_RESERVE = 512 << 20  # bytes the engine keeps back for its decode CUDA graphs' pool


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
