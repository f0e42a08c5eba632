"""Calibration, engine to simulator: a sweep's device time estimated on a shipped profile, the sweep run
through the LLM it is given (engine/profiling.py), its step records fitted and written as a profile."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from engine.launch import package_version
from engine.profiling import PHASES, SERVING_S, SweepLimits, Workload, plan_steps, run_sweep, sweep
from simulator.defaults import default_profile
from simulator.latency.base import StepShape
from simulator.latency.fitted import SplitKV
from simulator.latency.profile import LatencyProfile, fit_profile


def step_seconds(steps: pd.DataFrame, model) -> np.ndarray:
    """Each planned step's predicted time on a fitted latency model (`FittedModel`): a decode step
    scheduled while the one before it ran on its `overlapped_model()`, the others on the model."""
    overlapped = model.overlapped_model() if hasattr(model, "overlapped_model") else model
    out = np.empty(len(steps))
    for j, row in enumerate(steps.itertuples(index=False)):
        m = overlapped if row.overlapped and row.kind == "decode" else model
        if row.kind == "decode":
            out[j] = m.decode_step_time(row.num_seqs, row.num_context_tokens, row.max_seq_len)
        else:
            out[j] = m.predict(StepShape.of(row)).total
    return out


def estimate_seconds(steps: pd.DataFrame, model, serving: bool = True) -> dict[str, float]:
    """Estimated device seconds per phase (PHASES; `total` too): the planned steps priced by
    `step_seconds`, and the serving replays at SERVING_S (they run in real time)."""
    seconds = pd.Series(step_seconds(steps, model), index=steps.index).groupby(steps["phase"]).sum()
    out = {phase: float(seconds.get(phase, 0.0)) for phase in PHASES if phase != "serving"}
    out["serving"] = SERVING_S if serving else 0.0
    out["total"] = sum(out.values())
    return out


def estimator_profile(model: str, gpu: str, block_size: int, tp: int = 1, async_scheduling: bool = False):
    """The shipped profile that prices a sweep of `model` on `gpu`: the one of its TP and block size
    (the `_async` one under async scheduling, where it ships), else the same at another shipped block
    size; None when none ships."""
    for size in dict.fromkeys((block_size, 16, 256)):
        try:
            path = default_profile(model, gpu, size, tp, async_scheduling)
        except (KeyError, ValueError):
            return None
        if path is not None:
            return path
    return None


def _gpu_name() -> str:
    import torch

    from engine.replay import gpu_name

    return gpu_name(torch.cuda.get_device_name()) if torch.cuda.is_available() else "H200"


def check_budget(estimate: dict[str, float], budget_s: float, flag: str = "--time-budget") -> None:
    """A ValueError naming `flag` when the estimated device time is over `budget_s`."""
    if estimate["total"] > budget_s:
        phases = ", ".join(f"{k} {v:.0f} s" for k, v in estimate.items() if k != "total")
        raise ValueError(
            f"{flag}: the sweep is estimated at {estimate['total']:.0f} s of device time ({phases}), "
            f"over the budget of {budget_s:.0f} s"
        )


def format_estimate(estimate: dict[str, float], steps: pd.DataFrame, source: str) -> str:
    counts = steps.groupby("phase").size()
    parts = [
        f"{k} {v:.1f} s ({int(counts.get(k, 0)):,} steps)"
        for k, v in estimate.items()
        if k not in ("total", "serving")
    ]
    return (
        f"profile: estimated device time {estimate['total']:.0f} s on {source}: "
        + ", ".join(parts)
        + f", serving {estimate['serving']:.0f} s"
    )


@dataclass
class SweepPlan:
    """A sweep for one engine: its workloads, their planned steps and the estimate priced on `model`."""

    limits: SweepLimits
    work: list[Workload]
    steps: pd.DataFrame
    estimate: dict[str, float] = field(default_factory=dict)
    source: str = ""
    seed: int = 0


def plan_sweep(llm, model=None, seed: int = 0, serving: bool = True, gpu: str | None = None) -> SweepPlan:
    """The sweep of `llm` (its limits: `SweepLimits.of_llm`), planned and priced (`plan_limits`;
    `model` None: the shipped profile of its model on `gpu`, default the one here, else the roofline
    model of that GPU)."""
    limits = SweepLimits.of_llm(llm)
    if model is None:
        gpu, tp = gpu or _gpu_name(), llm.parallel_config.tensor_parallel_size
        model = estimator_profile(llm.spec.name, gpu, limits.block_size, tp, limits.async_scheduling)
        if model is None:  # a model or GPU without a shipped profile: the analytic model's estimate
            from simulator.latency.roofline import RooflineModel

            model = RooflineModel(llm.spec, gpu, tp)
    return plan_limits(limits, llm.spec, model, seed, serving)


def plan_limits(limits: SweepLimits, spec, model, seed: int = 0, serving: bool = True) -> SweepPlan:
    """The sweep of an engine of `limits` serving `spec` (a ModelSpec: its vocabulary and EOS), its
    steps planned (`plan_steps`) and priced on `model` (a fitted latency model or a profile path)."""
    work = sweep(limits)
    steps = plan_steps(work, limits, min(spec.vocab_size, 100_000), spec.eos_token_id, seed)
    if not hasattr(model, "decode_step_time"):
        source = Path(model).name
        model = LatencyProfile.load(model).to_latency_model()
    elif getattr(model, "profile", None) is not None:
        source = model.profile.describe()
    else:
        source = f"the roofline model ({model.gpu.name})" if hasattr(model, "gpu") else type(model).__name__
    return SweepPlan(limits, work, steps, estimate_seconds(steps, model, serving), source, seed)


def run_profile(
    llm,
    seed: int = 0,
    time_budget_s: float = 300.0,
    progress: bool = True,
    serving: bool = True,
    estimator=None,
    plan: SweepPlan | None = None,
    budget_flag: str = "--time-budget",
) -> pd.DataFrame:
    """Run the sweep on `llm` (then, with `serving`, two short synthetic-traffic replays); return its
    step records. First plans it and prints its estimated device time (`plan_sweep`, priced on
    `estimator`, unless `plan` is given); a ValueError naming `budget_flag` when that is over
    `time_budget_s`. While running, stops (saying what was left) past twice the budget, should the
    estimate be far off (`engine.profiling.run_sweep`). The workloads' prompts come from the plan's seed."""
    plan = plan or plan_sweep(llm, estimator, seed, serving)
    print(format_estimate(plan.estimate, plan.steps, plan.source), flush=True)
    check_budget(plan.estimate, time_budget_s, budget_flag)
    return run_sweep(llm, plan.work, plan.limits, plan.seed, time_budget_s, progress, serving)


def split_kv(llm) -> SplitKV | None:
    """The engine's decode split policy as the fitted model takes it (None: no split-KV kernel)."""
    fields = llm.decode_split_kv()
    return SplitKV(**fields) if fields else None


def fit_llm_profile(
    records: pd.DataFrame,
    llm,
    gpu: str,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    tp: int,
    block_size: int,
    target: str = "wall_time_s",
    loss: str = "median",
    extra: dict[str, Any] | None = None,
) -> LatencyProfile:
    """`fit_profile` of step records `llm` measured: its model, attention backend, KV cache and decode
    split policy (`split_kv`), with this package's version; with the span term where the split
    policy gives the GPU's SMs."""
    split = split_kv(llm)
    return fit_profile(
        records,
        model=llm.spec,
        gpu=gpu,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        tp=tp,
        block_size=block_size,
        attention_backend=llm.attention_backend,
        engine_version=package_version(),
        num_kv_blocks=llm.cache_config.num_blocks,
        target=target,
        loss=loss,
        split_kv=split,
        span=split is not None,
        extra=extra,
    )
