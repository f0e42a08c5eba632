"""Small-batch linear layers in Triton (one-token decode): y = x W^T read at memory speed, with the
op before the projection fused in (RMSNorm with its residual add, or SiLU-and-multiply).

Why: at one token cuBLAS reads Qwen3-0.6B's 1.2 GB of weights at ~1.3 TB/s, and every norm and
activation is a launch of its own; single-stream decode is bound by both. The prologues do the same
arithmetic as triton_ops.py (float32 statistics, rounding where HF rounds), so the projection sees
the same input as the unfused path; only the order of the dot product's sums differs from cuBLAS.
CUDA only (tests run the kernels in Triton's interpreter). The kernel takes any few rows (a runtime
argument; one compiled variant per power-of-two row block and weight shape); the engine gives it one
(`MAX_ROWS`), where it wins.
"""

from __future__ import annotations

import torch

from engine import envs
from engine.layers import pdl

try:
    import triton
    import triton.language as tl

    from engine.layers.pdl import pdl_launch_dependents, pdl_wait
except ImportError:  # CPU-only installs: F.linear serves
    triton = None

# Larger batches go to cuBLAS: on an H200 the kernel beats it at one row on every Qwen3-0.6B projection
# (3.5–5.5 µs against 5.4–12.8), but not at 2–8 rows on the QKV and gate/up shapes (docs/PERF.md).
MAX_ROWS = 1
MAX_WEIGHT_ELEMENTS = 1 << 24  # so do weights of more than 32 MB in bf16 (cuBLAS reads them at speed)
PROLOGUE_NONE, PROLOGUE_NORM, PROLOGUE_SILU = 0, 1, 2


def available() -> bool:
    return triton is not None


def serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the Triton kernels take this projection (small batch, CUDA, a weight of ≤ 32 MB: not
    the LM head, nor an 8B model's MLP, which cuBLAS reads at ~4 TB/s)."""
    return (
        triton is not None
        and x.is_cuda
        and x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and weight.numel() <= MAX_WEIGHT_ELEMENTS
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N]. `tiles`: (BLOCK_N, BLOCK_K, num_warps) in place
    of `block_sizes`' (for tuning them)."""
    return _launch(PROLOGUE_NONE, x, None, None, 0.0, weight, bias, None, tiles)


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight^T, x + residual): RMSNorm (after the residual add when one is
    given) fused into the projection; the sum is written once, by the first column block."""
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else x
    out = _launch(PROLOGUE_NORM, x, residual, norm_weight, eps, weight, bias, summed)
    return out, summed


def silu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] @ weight [N, I]^T: SiLU-and-multiply fused into the projection."""
    return _launch(PROLOGUE_SILU, x, None, None, 0.0, weight, bias, None)


# One-row tiles measured in place (benchmarks/tune_decode_tiles.py: the engine's one-row decode graph,
# under PDL and the weight prefetch, recaptured for each candidate) on an H200 for Qwen3-0.6B: the graph
# took 720 µs with `block_sizes`' rule and 656 µs with these (docs/PERF.md). Keyed by (prologue, N, K).
ONE_ROW_TILES = {
    (PROLOGUE_NORM, 4096, 1024): (2, 1024, 4),  # RMSNorm + QKV
    (PROLOGUE_NONE, 1024, 2048): (2, 2048, 4),  # o_proj (the rule's tile)
    (PROLOGUE_NORM, 6144, 1024): (8, 1024, 2),  # RMSNorm + gate/up
    (PROLOGUE_SILU, 1024, 3072): (4, 4096, 4),  # SiLU-and-multiply + down: the whole row prefetched
}


def block_sizes(rows: int, n: int, k: int, prologue: int = PROLOGUE_NONE) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for `rows` rows of a projection to n features from k, after
    `prologue`: a tuned one-row tile of ONE_ROW_TILES where there is one (unless the kernel config's
    `gemv_tuned_tiles` is off: $KVPLAN_GEMV_TUNED_TILES=0), else the rule: two output features a
    program (thousands of programs spread the read over every SM), at most 4k products a tile so the
    [rows, BLOCK_N, BLOCK_K] product stays in registers (the best of benchmarks/bench_gemv.py --sweep at one row, one kernel at a time)."""
    if rows == 1 and (prologue, n, k) in ONE_ROW_TILES and tuned_tiles():
        return ONE_ROW_TILES[prologue, n, k]
    block_n = 2
    block_k = min(_next_power_of_2(k), max(64, 4096 // (block_n * _next_power_of_2(rows))))
    return block_n, block_k, 2 if block_n * block_k <= 2048 else 4


def tuned_tiles() -> bool:
    """Whether one-row projections take ONE_ROW_TILES: the active kernel config's `gemv_tuned_tiles`
    (engine/envs.py; $KVPLAN_GEMV_TUNED_TILES=0 turns them off)."""
    return envs.current("gemv_tuned_tiles")


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _launch(prologue, x, residual, norm_weight, eps, weight, bias, summed, tiles=None) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    k_in = 2 * weight.shape[1] if prologue == PROLOGUE_SILU else weight.shape[1]
    if k != k_in:
        raise ValueError(f"gemv: input {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    if x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("gemv: the input's rows and the weight must be contiguous")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = tiles or block_sizes(m, n, weight.shape[1], prologue)
    has_res = residual is not None
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        x.stride(0),
        residual if has_res else x,
        residual.stride(0) if has_res else 0,
        norm_weight if norm_weight is not None else weight,
        summed if has_res else out,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        eps,
        N=n,
        K=weight.shape[1],
        BLOCK_M=_next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PROLOGUE=prologue,
        HAS_RESIDUAL=has_res,
        HAS_BIAS=bias is not None,
        PREFETCH_W=prefetch_weights(),
        num_warps=warps,
        **pdl.launch_kwargs(x.device, m),
    )
    return out


def prefetch_weights() -> bool:
    """Whether a kernel launched early by PDL loads its first weight tile before it waits for the
    kernel before it (weights are never written during a step): the active kernel config's
    `gemv_prefetch` (engine/envs.py; $KVPLAN_GEMV_PREFETCH=0 turns it off)."""
    return envs.current("gemv_prefetch")


def compiled_variants() -> int:
    """Kernel variants compiled so far (0 under the interpreter)."""
    if triton is None:
        return 0
    return sum(len(entry[0]) for entry in getattr(_gemv_kernel, "device_caches", {}).values())


if triton is not None:

    @triton.jit
    def _load_rows(x_ptr, x_stride, res_ptr, res_stride, offs_m, offs_k, mask, HAS_RESIDUAL: tl.constexpr):
        """Rows of x (plus the residual, the sum rounded to x's dtype) at columns offs_k."""
        x = tl.load(x_ptr + offs_m[:, None] * x_stride + offs_k[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + offs_m[:, None] * res_stride + offs_k[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        return x

    @triton.jit
    def _inv_rms(x_ptr, x_stride, res_ptr, res_stride, offs_m, m_mask, eps, K, BLOCK_K, HAS_RESIDUAL):
        """1 / rms of each row (of x + residual), float32."""
        sq = tl.zeros([offs_m.shape[0]], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = m_mask[:, None] & (offs_k[None, :] < K)
            xf = _load_rows(x_ptr, x_stride, res_ptr, res_stride, offs_m, offs_k, mask, HAS_RESIDUAL)
            xf = xf.to(tl.float32)
            sq += tl.sum(xf * xf, axis=1)
        return tl.math.rsqrt(sq / K + eps)

    @triton.jit
    def _load_weight_tile(w_ptr, offs_n, n_mask, k0, K, BLOCK_K: tl.constexpr):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        return tl.load(
            w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :]
        )

    @triton.jit(do_not_specialize=["x_stride", "res_stride", "M", "eps"])
    def _gemv_kernel(
        x_ptr,
        x_stride,
        res_ptr,
        res_stride,
        norm_w_ptr,
        sum_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,
        M,
        eps,
        N: tl.constexpr,
        K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PROLOGUE: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        PREFETCH_W: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """Program: BLOCK_N output features of every row. Under PDL with PREFETCH_W the first weight
        tile is loaded before waiting for the previous kernel, so the weight read overlaps its tail."""
        pdl_launch_dependents(USE_PDL)
        pid = tl.program_id(0)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        m_mask, n_mask = offs_m < M, offs_n < N
        if PREFETCH_W:
            w_first = _load_weight_tile(w_ptr, offs_n, n_mask, 0, K, BLOCK_K)
        pdl_wait(USE_PDL)
        if PROLOGUE == 1:
            rstd = _inv_rms(
                x_ptr, x_stride, res_ptr, res_stride, offs_m, m_mask, eps, K, BLOCK_K, HAS_RESIDUAL
            )
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            mask = m_mask[:, None] & k_mask[None, :]
            if PREFETCH_W and k0 == 0:
                w = w_first
            else:
                w = _load_weight_tile(w_ptr, offs_n, n_mask, k0, K, BLOCK_K)
            if PROLOGUE == 1:  # RMSNorm (of x + residual), rounded as triton_ops._rms_norm_kernel rounds
                x = _load_rows(x_ptr, x_stride, res_ptr, res_stride, offs_m, offs_k, mask, HAS_RESIDUAL)
                if HAS_RESIDUAL and pid == 0:
                    tl.store(sum_ptr + offs_m[:, None] * K + offs_k[None, :], x, mask=mask)
                g = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
                xn = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32) * g[None, :]
                x = xn.to(x.dtype)
            elif PROLOGUE == 2:  # SiLU(gate) * up, rounded as triton_ops._silu_and_mul_kernel rounds
                row = x_ptr + offs_m[:, None] * x_stride + offs_k[None, :]
                gate = tl.load(row, mask=mask, other=0.0)
                up = tl.load(row + K, mask=mask, other=0.0)
                gf = gate.to(tl.float32)
                act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype)
                x = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
            else:
                x = tl.load(x_ptr + offs_m[:, None] * x_stride + offs_k[None, :], mask=mask, other=0.0)
            prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            acc += tl.sum(prod, axis=2)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out_mask = m_mask[:, None] & n_mask[None, :]
        tl.store(
            out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask
        )
