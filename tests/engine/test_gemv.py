"""The small-batch Triton projections (engine/layers/gemv.py), run by Triton's interpreter on CPU
tensors, equal the unfused torch path: the residual sum bit for bit, the projections within float
rounding (the dot product sums in another order than torch). bf16 on the GPU: the gpu-marked test.

The interpreter runs in a subprocess (TRITON_INTERPRET must be set before triton is first imported).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import run_interpreted

from engine.envs import KernelConfig
from engine.layers import gemv
from engine.layers.activation import silu_and_mul
from engine.layers.layernorm import add_rms_norm, rms_norm

pytest.importorskip("triton")

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}

# Every case with the first weight tile loaded before the PDL wait (the default) and without.
WORKER = """
import sys, torch
from engine.envs import KernelConfig
from engine.layers import gemv
assert type(gemv._gemv_kernel).__name__ == "InterpretedFunction", "not interpreted"
out = {}
rule = gemv.block_sizes
for prefetch in (True, False):
    config = KernelConfig(gemv_prefetch=prefetch)
    for name, c in torch.load(sys.argv[1]).items():
        key = (name, prefetch)
        gemv.block_sizes = (lambda *a, t=c["tiles"]: t) if c.get("tiles") else rule
        with config.activate():  # as the model runner launches them
            assert gemv.prefetch_weights() is prefetch
            if c["op"] == "linear":
                out[key] = (gemv.linear(c["x"], c["w"], c["b"], tiles=c.get("tiles")),)
            elif c["op"] == "norm_linear":
                y, summed = gemv.norm_linear(c["x"], c["r"], c["g"], 1e-6, c["w"])
                out[key] = (y, summed, torch.tensor(summed is c["x"]))
            else:
                out[key] = (gemv.silu_linear(c["x"], c["w"]),)
torch.save(out, sys.argv[2])
"""


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear in float32, rounded to x's dtype (what the kernel computes)."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def _cases() -> tuple[dict, dict]:
    """(inputs sent to the interpreter, references) per case name: K not a power of two, rows 1 and 3
    (a masked row block), x as a strided view."""
    g = torch.Generator().manual_seed(0)
    cases, refs = {}, {}
    for dtype in (torch.float32, torch.float16):
        tag = str(dtype).removeprefix("torch.")
        for rows in (1, 3):
            key = f"{tag}_{rows}"
            x = torch.randn(rows, 200, generator=g).to(dtype)[:, :96]
            r = torch.randn(rows, 96, generator=g).to(dtype)
            w, b = torch.randn(40, 96, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
            norm_w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
            cases[f"linear_{key}"] = dict(op="linear", x=x, w=w, b=b)
            refs[f"linear_{key}"] = (_linear(x, w, b),)
            cases[f"linear_tiles_{key}"] = dict(op="linear", x=x, w=w, b=b, tiles=(4, 32, 1))  # 3 K blocks
            refs[f"linear_tiles_{key}"] = refs[f"linear_{key}"]
            normed, summed = add_rms_norm(x, r, norm_w, 1e-6)
            cases[f"add_norm_{key}"] = dict(op="norm_linear", x=x, r=r, g=norm_w, w=w)
            refs[f"add_norm_{key}"] = (_linear(normed, w), summed, torch.tensor(False))
            cases[f"norm_{key}"] = dict(op="norm_linear", x=x, r=None, g=norm_w, w=w)
            refs[f"norm_{key}"] = (_linear(rms_norm(x, norm_w, 1e-6), w), x, torch.tensor(True))
            gate_up, w_down = (
                torch.randn(rows, 2 * 70, generator=g).to(dtype),
                torch.randn(24, 70, generator=g),
            )
            cases[f"silu_{key}"] = dict(op="silu", x=gate_up, w=w_down.to(dtype))
            refs[f"silu_{key}"] = (_linear(silu_and_mul(gate_up), w_down.to(dtype)),)
            # tiles shaped as ONE_ROW_TILES' (8 features a program; one K block wider than K, masked)
            cases[f"add_norm_tiles_{key}"] = dict(cases[f"add_norm_{key}"], tiles=(8, 128, 2))
            refs[f"add_norm_tiles_{key}"] = refs[f"add_norm_{key}"]
            cases[f"silu_tiles_{key}"] = dict(cases[f"silu_{key}"], tiles=(4, 128, 1))
            refs[f"silu_tiles_{key}"] = refs[f"silu_{key}"]
    return cases, refs


def test_gemv_kernels_match_torch(tmp_path):
    cases, refs = _cases()
    got = run_interpreted(WORKER, cases, tmp_path)
    assert sorted(got) == sorted((name, prefetch) for name in refs for prefetch in (False, True))
    for (name, _), (y, *rest) in got.items():
        expected = refs[name]
        assert y.dtype == expected[0].dtype and y.shape == expected[0].shape, name
        torch.testing.assert_close(y, expected[0], **TOL[y.dtype], msg=name)
        if rest:  # the residual sum: exact, and the input itself when there is no residual
            assert torch.equal(rest[0], expected[1]), name
            assert bool(rest[1]) == bool(expected[2]), name


def test_block_sizes():
    norm, silu, none = gemv.PROLOGUE_NORM, gemv.PROLOGUE_SILU, gemv.PROLOGUE_NONE
    # Qwen3-0.6B at one row: the tiles tuned in place
    assert gemv.block_sizes(1, 4096, 1024, norm) == (2, 1024, 4)  # QKV
    assert gemv.block_sizes(1, 1024, 2048, none) == (2, 2048, 4)  # o_proj
    assert gemv.block_sizes(1, 6144, 1024, norm) == (8, 1024, 2)  # gate/up
    assert gemv.block_sizes(1, 1024, 3072, silu) == (4, 4096, 4)  # down: one K block, its last quarter masked
    # the rule: other shapes, prologues, row counts
    assert gemv.block_sizes(1, 4096, 1024) == (2, 1024, 2)
    assert gemv.block_sizes(1, 1024, 3072, none) == (2, 2048, 4)  # two K blocks, the second masked
    assert gemv.block_sizes(1, 40, 96) == (2, 128, 2)
    assert gemv.block_sizes(3, 4096, 1024, norm) == (2, 512, 2)
    assert gemv.block_sizes(8, 6144, 1024, norm) == (2, 256, 2)


def test_tuned_tiles_switch(monkeypatch):
    for value, tiles in (("0", (2, 1024, 2)), ("1", (8, 1024, 2))):
        monkeypatch.setenv("KVPLAN_GEMV_TUNED_TILES", value)
        assert gemv.block_sizes(1, 6144, 1024, gemv.PROLOGUE_NORM) == tiles
        with KernelConfig(gemv_tuned_tiles=value == "0").activate():  # an engine's config wins
            assert gemv.block_sizes(1, 6144, 1024, gemv.PROLOGUE_NORM) != tiles


def test_clear_errors():
    with pytest.raises(ValueError, match=r"input \(1, 8\) does not fit weight \(4, 6\)"):
        gemv.linear(torch.zeros(1, 8), torch.zeros(4, 6))
    with pytest.raises(ValueError, match="must be contiguous"):
        gemv.linear(torch.zeros(1, 8), torch.zeros(8, 4).t())


def test_serves_only_one_cuda_row_and_small_weights():
    w = torch.zeros(4, 8)
    assert not gemv.serves(torch.zeros(1, 8), w)  # CPU: F.linear
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert gemv.serves(torch.zeros(1, 8, device=cuda), w.to(cuda))
        assert not gemv.serves(torch.zeros(2, 8, device=cuda), w.to(cuda))
        assert not gemv.serves(torch.zeros(1, 1024, device=cuda), torch.empty(151936, 1024, device=cuda))


@pytest.mark.gpu
def test_gemv_on_gpu_bf16_and_in_the_decode_layer():
    """bf16 at Qwen3-0.6B's shapes: within bf16 rounding of the unfused kernels."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.layers import triton_ops

    g = torch.Generator().manual_seed(2)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    x, r = (torch.randn(1, 1024, generator=g).to(dev, bf16) for _ in range(2))
    norm_w = (1 + 0.1 * torch.randn(1024, generator=g)).to(dev, bf16)
    w_qkv = (0.02 * torch.randn(4096, 1024, generator=g)).to(dev, bf16)
    w_down = (0.02 * torch.randn(1024, 3072, generator=g)).to(dev, bf16)
    gate_up = torch.randn(1, 6144, generator=g).to(dev, bf16)
    normed, summed = triton_ops.add_rms_norm(x, r, norm_w, 1e-6)
    y, s = gemv.norm_linear(x, r, norm_w, 1e-6, w_qkv)
    assert torch.equal(s, summed)
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, F.linear(normed, w_qkv), **tol)
    torch.testing.assert_close(
        gemv.silu_linear(gate_up, w_down), F.linear(silu_and_mul(gate_up), w_down), **tol
    )
    w_o = w_down[:, :1024].contiguous()
    torch.testing.assert_close(gemv.linear(x, w_o), F.linear(x, w_o), **tol)
    with pytest.raises(ValueError, match="must be contiguous"):
        gemv.linear(x, w_down[:, :1024])
