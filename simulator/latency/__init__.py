"""Latency models for the simulator: how long one scheduled step takes.

`RooflineModel` (analytic, from `data/gpus.json`) and `FittedModel` (least squares on engine step
records, stored as a JSON `LatencyProfile`) share one interface: `predict(batch) -> StepTime` and
the scalar `decode_step_time(...)`. No SimPy, scheduling or torch here.
"""

from simulator.latency.base import (
    ZERO_STEP,
    BatchShape,
    LatencyModel,
    LatencyModelBase,
    StepShape,
    StepTime,
    predict_frame,
)
from simulator.latency.fitted import (
    DECODE_FEATURES,
    PREFILL_FEATURES,
    FitError,
    FitSummary,
    FittedModel,
    LinearFit,
    SplitKV,
    StepFloors,
    decode_graph_batch_sizes,
    fit_floor,
    fit_step_records,
    graph_padded_batch_size,
    max_graph_batch_size,
)
from simulator.latency.gpus import GpuSpec, MeasuredCeilings, get_gpu, load_gpu_specs
from simulator.latency.profile import LatencyProfile, fit_profile, load_latency_model
from simulator.latency.roofline import RooflineEfficiency, RooflineModel

__all__ = [
    "DECODE_FEATURES",
    "PREFILL_FEATURES",
    "ZERO_STEP",
    "BatchShape",
    "FitError",
    "FitSummary",
    "FittedModel",
    "GpuSpec",
    "LatencyModel",
    "LatencyModelBase",
    "LatencyProfile",
    "LinearFit",
    "SplitKV",
    "StepFloors",
    "MeasuredCeilings",
    "RooflineEfficiency",
    "RooflineModel",
    "StepShape",
    "StepTime",
    "decode_graph_batch_sizes",
    "fit_floor",
    "fit_profile",
    "fit_step_records",
    "get_gpu",
    "graph_padded_batch_size",
    "load_gpu_specs",
    "load_latency_model",
    "max_graph_batch_size",
    "predict_frame",
]
