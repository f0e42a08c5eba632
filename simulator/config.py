"""What one simulation runs: the serving configuration of a cluster of identical replicas.

A frozen dataclass validated on construction; derived values (KV blocks per replica) are pure
functions over the engine's own sizing code, so the simulator sizes caches exactly as the engine does.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.config import CacheConfig, SchedulerConfig
from engine.memory import check_tp, default_num_kv_blocks
from engine.model_spec import ModelSpec

ROUTERS = ("round_robin", "least_outstanding", "prefix_aware")
# Each replica holds its own scheduler and KV block tables (about 5 MB and 30 ms to build for
# Qwen3-0.6B on an H200): beyond this a run would take minutes and gigabytes before its first step.
MAX_REPLICAS = 1024
# Block sizes taken: powers of two, as serving engines use. The engine's torch and FlashAttention-4
# backends serve any size and FlashAttention-2 multiples of 256; shipped profiles are at 16 and 256.
MAX_BLOCK_SIZE = 1024


@dataclass(frozen=True)
class SimConfig:
    """A cluster of `num_replicas` engines, each `tensor_parallel_size` GPUs of type `gpu`."""

    model: ModelSpec
    gpu: str = "H200"
    tensor_parallel_size: int = 1
    num_replicas: int = 1
    block_size: int = 16
    num_kv_blocks: int | None = None  # per replica; None = sized from the GPU's memory
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    policy: str = "chunked"
    router: str = "round_robin"
    fast_forward: bool = True
    timeline_interval_s: float = 1.0
    # The engine's async scheduling (`LLM(async_scheduling=True)`): a decode step is scheduled while
    # the one before it runs, so requests that arrive meanwhile wait one step more, and decode steps
    # scheduled ahead cost only what the latency model's overlapped view says (sim.py).
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        check_tp(self.model, self.tensor_parallel_size)
        if not 0 < self.num_replicas <= MAX_REPLICAS:
            raise ValueError(
                f"SimConfig.num_replicas: must be 1 to {MAX_REPLICAS} (each replica is simulated with its "
                f"own scheduler and KV cache), got {self.num_replicas}"
            )
        bs = self.block_size
        if not (isinstance(bs, int) and 0 < bs <= MAX_BLOCK_SIZE and bs & (bs - 1) == 0):
            raise ValueError(
                f"SimConfig.block_size: must be a power of two from 1 to {MAX_BLOCK_SIZE} tokens, got {bs} "
                "(the engine serves any size with its torch and FlashAttention-4 backends, multiples of "
                "256 with FlashAttention-2)"
            )
        if self.router not in ROUTERS:
            raise ValueError(f"SimConfig.router: {self.router!r} is not one of {list(ROUTERS)}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"SimConfig.async_scheduling: must be true or false, got {self.async_scheduling!r}"
            )
        if self.timeline_interval_s < 0:
            raise ValueError(f"SimConfig.timeline_interval_s: must be >= 0, got {self.timeline_interval_s}")
        self.scheduler_config()  # validates the batch limits and the policy
        self.cache_config()  # validates the block size, block count and memory share

    @property
    def resolved_max_model_len(self) -> int:
        return self.max_model_len or self.model.max_position_embeddings

    @property
    def num_gpus(self) -> int:
        return self.num_replicas * self.tensor_parallel_size

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.resolved_max_model_len,
            policy=self.policy,
        )

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            num_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            gpu_memory_utilization=self.gpu_memory_utilization,
        )


def kv_blocks_per_replica(config: SimConfig, gpu_memory_bytes: int | None = None) -> int:
    """KV blocks one replica holds: the explicit count, else what the engine's sizing gives
    (`engine.memory.default_num_kv_blocks`) on the config's GPU: its measured memory where known,
    else the datasheet's (`GpuSpec.usable_memory_bytes`), or `gpu_memory_bytes` when given."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if gpu_memory_bytes is None:
        from simulator.latency.gpus import get_gpu

        gpu_memory_bytes = get_gpu(config.gpu).usable_memory_bytes
    tp = config.tensor_parallel_size
    blocks = default_num_kv_blocks(
        config.model,
        config.block_size,
        gpu_memory_bytes,
        tp=tp,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
    )
    if blocks <= 0:
        raise ValueError(
            f"{config.model.name} does not fit on {config.gpu} at tp={tp}: no memory is left for the KV cache"
        )
    return blocks
