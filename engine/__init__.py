"""kvplan's engine: a torch-free control plane (config, sequence, block manager, scheduler) shared
with the simulator, and a torch data plane (models, attention, model runner) that runs it on a GPU.

Importing this package imports no torch; `engine.LLM` loads the data plane on first use.
"""

from engine.block_manager import BlockManager
from engine.config import CacheConfig, ParallelConfig, SchedulerConfig
from engine.model_spec import ModelSpec
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence, SequenceStatus

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
