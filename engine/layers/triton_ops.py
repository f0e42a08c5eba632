"""Fused Triton kernels for the per-token layers: RMSNorm (with the residual add before it), Qwen3's
per-head q/k RMSNorm fused with rotary, and SiLU-and-multiply. One launch each, the same arithmetic
as the torch functions in layernorm.py, rotary.py and activation.py (float32 statistics, results
rounded to the input dtype where HF rounds).

Why: an eager prefill or mixed step calls these ~170 times per forward; through torch.compile each
costs ~150 µs of host time (guards, wrappers), which made a prefill step of any size cost ≥ 35 ms on
an H200. A Triton launch costs ~10 µs. CUDA only (tests run the kernels in Triton's interpreter);
no integer argument that varies from step to step is specialised on, so no step compiles mid-run.
"""

from __future__ import annotations

import torch

from engine.layers import pdl

try:
    import triton
    import triton.language as tl

    from engine.layers.pdl import pdl_prologue
except ImportError:  # CPU-only installs: the torch functions serve
    triton = None


def available() -> bool:
    return triton is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [T, N] (rows may be strided; the last dim contiguous)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(x, None, weight, eps, out, None)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype first."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch_rms_norm(x, residual, weight, eps, out, summed)
    return out, summed


def _launch_rms_norm(x, residual, weight, eps, out, summed) -> None:
    """Rows of x [..., N]: a 2-D x may have strided rows; more dims are flattened (copied if need be)."""
    n = x.shape[-1]
    if x.dim() != 2:
        x = x.reshape(-1, n)
        residual = residual.reshape(-1, n) if residual is not None else None
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError(f"rms_norm: the last dim of {tuple(x.shape)} must be contiguous")
    rows = x.shape[0]
    if rows == 0:
        return
    has_res = residual is not None
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x,
        x.stride(0),
        residual if has_res else x,
        residual.stride(0) if has_res else 0,
        weight,
        out,
        summed if has_res else out,
        eps,
        N=n,
        BLOCK=block,
        HAS_RESIDUAL=has_res,
        num_warps=_num_warps(block),
        **pdl.launch_kwargs(x.device, rows),
    )


KVStore = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # v, k_cache, v_cache, slots


def qk_norm_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    kv_store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [T, H, D] and k [T, Hkv, D] (when weights are given: Qwen3), then rotary
    (neox halves) by `positions`; cos_sin [max_pos, D] float32 (cos | sin). New contiguous q, k.
    With `kv_store` the same launch also writes the rotated keys and the values into their cache
    slots (what `store_kv_cache` does; slot -1 skips the token)."""
    t, h, d = q.shape
    hkv = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or d % 2 or triton.next_power_of_2(d) != d:
        raise ValueError(f"qk_norm_rotary: head_dim {d} must be a power of two, heads contiguous")
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    has_norm = q_weight is not None
    store = kv_store is not None
    v, k_cache, v_cache, slots = kv_store if store else (k, k_out, k_out, positions)
    if store:
        _check_kv_store(v, k_cache, v_cache, hkv, d)
    _qk_norm_rotary_kernel[(t, h + hkv * (2 if store else 1))](
        positions,
        q,
        q.stride(0),
        q.stride(1),
        k,
        k.stride(0),
        k.stride(1),
        q_out,
        k_out,
        cos_sin,
        q_weight if has_norm else cos_sin,
        k_weight if has_norm else cos_sin,
        eps,
        v,
        v.stride(0),
        v.stride(1),
        k_cache,
        v_cache,
        slots,
        NUM_HEADS=h,
        NUM_KV_HEADS=hkv,
        HALF=d // 2,
        HAS_NORM=has_norm,
        STORE_KV=store,
        num_warps=1 if d <= 128 else 2,
        **pdl.launch_kwargs(q.device, t),
    )
    return q_out, k_out


def _check_kv_store(v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, hkv: int, d: int) -> None:
    """The caches must be [blocks, block_size, Hkv, D] and contiguous (a slot is one Hkv * D row)."""
    shape_ok = k_cache.dim() == 4 and k_cache.shape[2:] == (hkv, d) and v_cache.shape == k_cache.shape
    if not (shape_ok and k_cache.is_contiguous() and v_cache.is_contiguous()) or v.stride(-1) != 1:
        raise ValueError(
            f"qk_norm_rotary: KV caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} must be contiguous "
            f"[blocks, block_size, {hkv}, {d}] and values' heads contiguous"
        )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I], each product rounded as torch rounds it."""
    t, two_i = x.shape
    inter = two_i // 2
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul: the last dim must be contiguous")
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
        x,
        x.stride(0),
        out,
        INTER=inter,
        BLOCK=block,
        num_warps=_num_warps(block),
        **pdl.launch_kwargs(x.device, t),
    )
    return out


def _num_warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def compiled_variants() -> int:
    """Kernel variants compiled so far by this module's kernels (0 under the interpreter)."""
    if triton is None:
        return 0
    kernels = (_rms_norm_kernel, _qk_norm_rotary_kernel, _silu_and_mul_kernel)
    caches = [getattr(k, "device_caches", {}) for k in kernels]
    return sum(len(entry[0]) for cache in caches for entry in cache.values())


if triton is not None:

    @triton.jit(do_not_specialize=["x_stride", "res_stride", "eps"])
    def _rms_norm_kernel(
        x_ptr,
        x_stride,
        res_ptr,
        res_stride,
        w_ptr,
        out_ptr,
        sum_ptr,
        eps,
        N: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_prologue(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(sum_ptr + row * N + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
        tl.store(out_ptr + row * N + offs, y.to(x.dtype), mask=mask)

    @triton.jit
    def _norm_rotate_head(
        src,
        w_ptr,
        cos,
        sin,
        eps,
        HALF: tl.constexpr,
        HAS_NORM: tl.constexpr,
    ):
        """The two rotated halves of the head at `src`, in its dtype."""
        offs = tl.arange(0, HALF)
        x1 = tl.load(src + offs)
        x2 = tl.load(src + HALF + offs)
        dtype = x1.dtype
        if HAS_NORM:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            ms = (tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / (2 * HALF)
            rstd = tl.math.rsqrt(ms + eps)
            w1 = tl.load(w_ptr + offs).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + offs).to(tl.float32)
            x1 = ((f1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype)
            x2 = ((f2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        return (f1 * cos - f2 * sin).to(dtype), (f2 * cos + f1 * sin).to(dtype)

    @triton.jit
    def _store_halves(dst, y1, y2, HALF: tl.constexpr):
        offs = tl.arange(0, HALF)
        tl.store(dst + offs, y1.to(dst.dtype.element_ty))
        tl.store(dst + HALF + offs, y2.to(dst.dtype.element_ty))

    @triton.jit(
        do_not_specialize=[
            "pos_ptr", "q_stride_t", "q_stride_h", "k_stride_t", "k_stride_h", "eps",
            "v_stride_t", "v_stride_h", "slot_ptr",
        ]
    )  # fmt: skip
    def _qk_norm_rotary_kernel(
        pos_ptr,
        q_ptr,
        q_stride_t,
        q_stride_h,
        k_ptr,
        k_stride_t,
        k_stride_h,
        q_out_ptr,
        k_out_ptr,
        cos_sin_ptr,
        q_w_ptr,
        k_w_ptr,
        eps,
        v_ptr,
        v_stride_t,
        v_stride_h,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HALF: tl.constexpr,
        HAS_NORM: tl.constexpr,
        STORE_KV: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """Program (token, head): heads [0, H) are queries, [H, H + Hkv) keys, and with STORE_KV
        [H + Hkv, H + 2 Hkv) values, copied into the value cache."""
        pdl_prologue(USE_PDL)
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        row = 2 * HALF
        if head >= NUM_HEADS + NUM_KV_HEADS:  # a value head: cache copy only
            slot = tl.load(slot_ptr + token).to(tl.int64)
            if slot >= 0:
                vh = head - NUM_HEADS - NUM_KV_HEADS
                offs = tl.arange(0, 2 * HALF)
                val = tl.load(v_ptr + token * v_stride_t + vh * v_stride_h + offs)
                dst = v_cache_ptr + (slot * NUM_KV_HEADS + vh) * row + offs
                tl.store(dst, val.to(v_cache_ptr.dtype.element_ty))
        else:
            pos = tl.load(pos_ptr + token).to(tl.int64)
            offs = tl.arange(0, HALF)
            cos = tl.load(cos_sin_ptr + pos * row + offs)
            sin = tl.load(cos_sin_ptr + pos * row + HALF + offs)
            if head < NUM_HEADS:
                src = q_ptr + token * q_stride_t + head * q_stride_h
                y1, y2 = _norm_rotate_head(src, q_w_ptr, cos, sin, eps, HALF, HAS_NORM)
                _store_halves(q_out_ptr + (token * NUM_HEADS + head) * row, y1, y2, HALF)
            else:
                kh = head - NUM_HEADS
                src = k_ptr + token * k_stride_t + kh * k_stride_h
                y1, y2 = _norm_rotate_head(src, k_w_ptr, cos, sin, eps, HALF, HAS_NORM)
                _store_halves(k_out_ptr + (token * NUM_KV_HEADS + kh) * row, y1, y2, HALF)
                if STORE_KV:
                    slot = tl.load(slot_ptr + token).to(tl.int64)
                    if slot >= 0:
                        _store_halves(k_cache_ptr + (slot * NUM_KV_HEADS + kh) * row, y1, y2, HALF)

    @triton.jit(do_not_specialize=["x_stride"])
    def _silu_and_mul_kernel(
        x_ptr, x_stride, out_ptr, INTER: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
    ):
        pdl_prologue(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < INTER
        gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * x_stride + INTER + offs, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        tl.store(
            out_ptr + row * INTER + offs, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask
        )
