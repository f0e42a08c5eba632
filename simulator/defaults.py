"""What kvplan uses when nothing is said: the trace, model and GPU of a bare command, and the latency
model of a configuration (its shipped fitted profile, else the transferred model). Light to import
(no SimPy): the engine's profiler, the CLIs, sweeps and the dashboard all read their defaults here."""

from __future__ import annotations

from pathlib import Path

DEFAULT_TRACE = "azure_conv_2023"
DEFAULT_MODEL = "qwen3-0.6b"
DEFAULT_GPU = "H200"
SHIPPED_PROFILE_DIR = Path(__file__).parent / "profiles"
# The transferred latency model's coefficients (simulator/latency/transfer.py), fitted on the shipped
# H200 sweeps: what a configuration without a fitted profile is priced with.
TRANSFER_MODEL = SHIPPED_PROFILE_DIR / "transfer_h200.json"


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


def default_latency_file(
    model: str, gpu: str, block_size: int, tp: int, async_scheduling: bool = False
) -> Path:
    """The latency model file a configuration runs on when none is named: its shipped fitted profile
    where one matches (`default_profile`), else the transferred model's coefficients
    (`TRANSFER_MODEL`), which price any model, GPU, TP and block size."""
    return default_profile(model, gpu, block_size, tp, async_scheduling) or TRANSFER_MODEL
