"""The fused Triton layer kernels (RMSNorm with and without the residual add, per-head q/k RMSNorm +
rotary, SiLU-and-multiply), run by Triton's interpreter on CPU tensors, equal the torch functions
they replace: on strided views as the model passes them, in float32 (within float rounding) and
float16 (bit-exact: every rounding step is where torch rounds). bf16 is not checked here: the
interpreter converts to bf16 by truncation (Triton 3.9), not by rounding; the GPU tests cover bf16.

The interpreter runs in a subprocess (TRITON_INTERPRET must be set before triton is first imported).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import run_interpreted

from engine.kv_cache import store_kv_cache_torch
from engine.layers.activation import silu_and_mul
from engine.layers.layernorm import add_rms_norm, rms_norm
from engine.layers.rotary import RotaryEmbedding, apply_rotary

pytest.importorskip("triton")

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=0, atol=0)}

WORKER = """
import sys, torch
from engine.layers import triton_ops as T
assert type(T._rms_norm_kernel).__name__ == "InterpretedFunction", "not interpreted"
out = {}
for name, c in torch.load(sys.argv[1]).items():
    if c["op"] == "rms_norm":
        out[name] = (T.rms_norm(c["x"], c["w"], 1e-6),)
    elif c["op"] == "add_rms_norm":
        out[name] = T.add_rms_norm(c["x"], c["r"], c["w"], 1e-6)
    elif c["op"] == "qk_norm_rotary":
        out[name] = T.qk_norm_rotary(c["pos"], c["q"], c["k"], c["cos_sin"], c["qw"], c["kw"], 1e-6)
    elif c["op"] == "qk_norm_rotary_store":
        kv = (c["v"], c["k_cache"], c["v_cache"], c["slots"])
        q, k = T.qk_norm_rotary(c["pos"], c["q"], c["k"], c["cos_sin"], c["qw"], c["kw"], 1e-6, kv_store=kv)
        out[name] = (q, k, c["k_cache"], c["v_cache"])
    else:
        out[name] = (T.silu_and_mul(c["x"]),)
torch.save(out, sys.argv[2])
"""


def _qkv(t: int, h: int, hkv: int, d: int, dtype: torch.dtype, g: torch.Generator):
    """q, k as the attention layer makes them: strided views into one qkv row per token."""
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dtype)
    q, k, _ = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, h, d), k.view(t, hkv, d)


def _cases() -> tuple[dict, dict]:
    """(inputs sent to the interpreter, torch references) per case name."""
    g = torch.Generator().manual_seed(0)
    rope = RotaryEmbedding(64, 4096, {"rope_theta": 10000.0, "rope_type": "default"})
    cases, refs = {}, {}
    for dtype in (torch.float32, torch.float16):
        tag = str(dtype).removeprefix("torch.")
        wide = torch.randn(5, 200, generator=g).to(dtype)  # rows with a stride > N; N not a power of 2
        x, r = wide[:, :96], torch.randn(5, 96, generator=g).to(dtype)
        w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
        cases[f"rms_{tag}"] = dict(op="rms_norm", x=x, w=w)
        refs[f"rms_{tag}"] = (rms_norm(x, w, 1e-6),)
        heads = torch.randn(3, 4, 96, generator=g).to(dtype)  # [T, H, D]: rows flattened
        cases[f"rms_3d_{tag}"] = dict(op="rms_norm", x=heads, w=w)
        refs[f"rms_3d_{tag}"] = (rms_norm(heads, w, 1e-6),)
        cases[f"add_rms_{tag}"] = dict(op="add_rms_norm", x=x, r=r, w=w)
        refs[f"add_rms_{tag}"] = add_rms_norm(x, r, w, 1e-6)
        q, k = _qkv(7, 4, 2, 64, dtype, g)
        pos = torch.tensor([0, 1, 5, 17, 300, 4000, 9], dtype=torch.int32)
        qw, kw = ((1 + 0.1 * torch.randn(64, generator=g)).to(dtype) for _ in range(2))
        cs = rope.cos_sin_cache
        cases[f"qk_norm_rope_{tag}"] = dict(op="qk_norm_rotary", pos=pos, q=q, k=k, cos_sin=cs, qw=qw, kw=kw)
        refs[f"qk_norm_rope_{tag}"] = apply_rotary(pos, rms_norm(q, qw, 1e-6), rms_norm(k, kw, 1e-6), cs)
        cases[f"rope_{tag}"] = dict(op="qk_norm_rotary", pos=pos, q=q, k=k, cos_sin=cs, qw=None, kw=None)
        refs[f"rope_{tag}"] = apply_rotary(pos, q, k, cs)
        for norm in (True, False):
            name = f"{'qk_norm_rope' if norm else 'rope'}_store_{tag}"
            cases[name], refs[name] = _store_case(
                pos, q, k, cs, qw if norm else None, kw if norm else None, g
            )
        gate_up = torch.randn(3, 2 * 1300, generator=g).to(dtype)  # two column blocks, a ragged one
        cases[f"silu_{tag}"] = dict(op="silu_and_mul", x=gate_up)
        refs[f"silu_{tag}"] = (silu_and_mul(gate_up),)
    return cases, refs


def _store_case(pos, q, k, cs, qw, kw, g):
    """q/k norm + rotary that also stores k and v: 7 tokens into a 4-block x 4-slot cache, one token
    skipped (slot -1); the rest of the cache keeps its (random) contents."""
    t, hkv, d = k.shape
    v = torch.randn(t, 2 * hkv, d, generator=g).to(k.dtype)[:, ::2]  # strided heads, as qkv.split gives
    k_cache, v_cache = (torch.randn(4, 4, hkv, d, generator=g).to(k.dtype) for _ in range(2))
    slots = torch.tensor([3, 0, 15, -1, 8, 9, 4], dtype=torch.int32)
    case = dict(op="qk_norm_rotary_store", pos=pos, q=q, k=k, cos_sin=cs, qw=qw, kw=kw, v=v)
    case.update(k_cache=k_cache.clone(), v_cache=v_cache.clone(), slots=slots)
    normed = (rms_norm(q, qw, 1e-6), rms_norm(k, kw, 1e-6)) if qw is not None else (q, k)
    q_ref, k_ref = apply_rotary(pos, *normed, cs)
    store_kv_cache_torch(k_ref, v, k_cache, v_cache, slots)
    return case, (q_ref, k_ref, k_cache, v_cache)


def test_triton_layer_kernels_match_torch(tmp_path):
    cases, refs = _cases()
    got = run_interpreted(WORKER, cases, tmp_path)
    assert sorted(got) == sorted(refs)
    for name, expected in refs.items():
        for g_t, e_t in zip(got[name], expected, strict=True):
            assert g_t.dtype == e_t.dtype and g_t.shape == e_t.shape, name
            assert g_t.is_contiguous(), name
            torch.testing.assert_close(g_t, e_t, **TOL[e_t.dtype], msg=name)


def test_layer_impl_choice():
    from engine.model_runner import layer_impl

    assert layer_impl(torch.device("cpu")) == "torch"
    assert layer_impl(torch.device("cpu"), "compile") == "compile"
    with pytest.raises(ValueError, match="KVPLAN_LAYER_IMPL: 'fast'"):
        layer_impl(torch.device("cpu"), "fast")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        layer_impl(torch.device("cpu"), "triton")


@pytest.mark.gpu
def test_triton_layer_kernels_on_gpu_bf16():
    """On the GPU in bf16, as served: within one bf16 rounding of the torch functions."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from engine.layers import triton_ops as T

    g = torch.Generator().manual_seed(1)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    x, r = (torch.randn(300, 1024, generator=g).to(dev, bf16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(1024, generator=g)).to(dev, bf16)
    q, k = (t.to(dev) for t in _qkv(300, 16, 8, 128, bf16, g))
    qw, kw = ((1 + 0.1 * torch.randn(128, generator=g)).to(dev, bf16) for _ in range(2))
    pos = torch.randint(0, 4000, (300,), generator=g, dtype=torch.int32).to(dev)
    cs = RotaryEmbedding(128, 4096, {"rope_theta": 1e6, "rope_type": "default"}).cos_sin_cache.to(dev)
    gate_up = torch.randn(300, 2 * 3072, generator=g).to(dev, bf16)
    pairs = [
        (T.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)),
        *zip(T.add_rms_norm(x, r, w, 1e-6), add_rms_norm(x, r, w, 1e-6)),
        *zip(
            T.qk_norm_rotary(pos, q, k, cs, qw, kw, 1e-6),
            apply_rotary(pos, rms_norm(q, qw, 1e-6), rms_norm(k, kw, 1e-6), cs),
        ),
        (T.silu_and_mul(gate_up), silu_and_mul(gate_up)),
    ]
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1.6e-2)
        assert (got != want).float().mean() < 0.02  # nearly all bit-equal
