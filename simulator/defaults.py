"""What kvplan uses when nothing is said: the trace, model and GPU of a bare command, and the shipped
fitted profile of a configuration. Light to import (no SimPy): the engine's profiler, the CLIs,
sweeps and the dashboard all read their defaults here."""

from __future__ import annotations

from pathlib import Path

DEFAULT_TRACE = "azure_conv_2023"
DEFAULT_MODEL = "qwen3-0.6b"
DEFAULT_GPU = "H200"
SHIPPED_PROFILE_DIR = Path(__file__).parent / "profiles"


def default_profile(
    model: str, gpu: str, block_size: int, tp: int, async_scheduling: bool = False
) -> Path | None:
    """The shipped fitted profile for this model, GPU (any of its names), block size and TP, if any.
    With `async_scheduling`, the one calibrated on an engine scheduling asynchronously (`..._async`)
    where there is one, else the synchronous engine's."""
    from simulator.latency.gpus import canonical_gpu_name, get_gpu

    suffixes = ("_async", "") if async_scheduling else ("",)
    for suffix in suffixes:
        for name in dict.fromkeys([gpu, canonical_gpu_name(gpu), *get_gpu(gpu).aliases]):
            stem = f"{model.lower()}_{name.lower()}_tp{tp}_bs{block_size}{suffix}"
            path = SHIPPED_PROFILE_DIR / f"{stem}.json"
            if path.is_file():
                return path
    return None
