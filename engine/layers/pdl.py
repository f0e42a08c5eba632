"""Programmatic dependent launch (PDL) for the engine's Triton kernels: on Hopper and later a kernel is
launched while the one before it finishes, and waits for it (griddepcontrol.wait) before it reads or
writes anything; the launches overlap the tails of the short kernels of a one-token decode step.

Every kernel that takes `USE_PDL` calls `pdl_prologue(USE_PDL)` first: it waits for the previous
kernel (so one that never reads its output still completes after it, which keeps the chain ordered),
then lets the next one launch. The GEMV instead lets the next one launch, loads weights (never
written during a step), then waits (`pdl_launch_dependents`, `pdl_wait`): every kernel still waits
before it reads or writes step data, so the chain stays ordered. On by default where the GPU and
Triton support it; the kernel config's `pdl` ($KVPLAN_PDL=0, engine/envs.py) turns it off; never
under Triton's interpreter; only for launches over at most `MAX_ROWS` tokens or sequences (on an
H200 it took a one-token decode step from 0.975 to 0.904 ms, but cost the 256-request throughput
benchmark 1.5 %: docs/PERF.md).
"""

from __future__ import annotations

import functools
import os

import torch

from engine import envs

MAX_ROWS = 16

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_GDC = True
except ImportError:  # no Triton, or one without grid dependency control
    HAS_GDC = False


def _triton_launches_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9 and _triton_launches_pdl()


def enabled(device: torch.device, switch: bool | None = None) -> bool:
    """Whether kernels launched on `device` use PDL (CUDA, sm_90+, a Triton that launches with it)
    under the kernel config's switch `switch` (default: the active one's, `envs.current`)."""
    if not HAS_GDC or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if not (envs.current("pdl") if switch is None else switch):
        return False
    return _device_supports(device.index if device.index is not None else torch.cuda.current_device())


def launch_kwargs(device: torch.device, rows: int) -> dict:
    """The keyword arguments of a kernel launch over `rows` tokens or sequences: USE_PDL, and
    launch_pdl where it is on."""
    if rows <= MAX_ROWS and enabled(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


if triton is not None:

    @triton.jit
    def pdl_prologue(USE_PDL: tl.constexpr):
        if USE_PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def pdl_launch_dependents(USE_PDL: tl.constexpr):
        """Let the next kernel launch now; this one must still `pdl_wait` before it touches anything
        an earlier kernel writes (the next kernel's wait then covers this one's predecessors too)."""
        if USE_PDL:
            gdc_launch_dependents()

    @triton.jit
    def pdl_wait(USE_PDL: tl.constexpr):
        if USE_PDL:
            gdc_wait()
