"""When the engine's Triton kernels are launched with programmatic dependent launch: CUDA on sm_90+
with a Triton that supports it, launches over at most MAX_ROWS rows, unless $KVPLAN_PDL=0 or under
the interpreter (the kernels' numbers do not depend on it: the GPU tests run with it on)."""

from __future__ import annotations

import pytest
import torch

from engine.layers import pdl

CUDA = torch.device("cuda", 0)


@pytest.fixture
def hopper(monkeypatch):
    if not pdl.HAS_GDC:
        pytest.skip("this Triton has no grid dependency control")
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    monkeypatch.delenv("KVPLAN_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_small_launches_on_a_capable_gpu_use_pdl(hopper):
    assert pdl.launch_kwargs(CUDA, 1) == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.launch_kwargs(CUDA, pdl.MAX_ROWS) == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.launch_kwargs(CUDA, pdl.MAX_ROWS + 1) == {"USE_PDL": False}


@pytest.mark.parametrize("env", [("KVPLAN_PDL", "0"), ("TRITON_INTERPRET", "1")])
def test_switched_off_by_the_environment(hopper, monkeypatch, env):
    monkeypatch.setenv(*env)
    assert pdl.launch_kwargs(CUDA, 1) == {"USE_PDL": False}


def test_never_on_a_cpu():
    assert pdl.launch_kwargs(torch.device("cpu"), 1) == {"USE_PDL": False}


def test_bad_pdl_setting_is_an_error(hopper, monkeypatch):
    monkeypatch.setenv("KVPLAN_PDL", "no")
    with pytest.raises(ValueError, match="KVPLAN_PDL: 'no' is not 0 or 1"):
        pdl.launch_kwargs(CUDA, 1)
