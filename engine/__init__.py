"""kvplan's engine: a torch-free control plane (config, sequence, block manager, scheduler) shared
with the simulator, and a torch data plane (models, attention, model runner) that runs it on a GPU.

Importing this package imports no torch; `engine.LLM` loads the data plane on first use.
"""

from engine.core.block_manager import BlockManager
from engine.core.config import CacheConfig, ParallelConfig, SchedulerConfig
from engine.core.scheduler import ScheduledBatch, Scheduler
from engine.core.sequence import Sequence, SequenceStatus
from engine.model_spec import ModelSpec
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "BlockManager",
    "CacheConfig",
    "ModelSpec",
    "ParallelConfig",
    "SamplingParams",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "SequenceStatus",
]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
