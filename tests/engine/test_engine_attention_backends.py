"""The FA2 and FA4 backends build their kernel calls right: fakes written from the libraries'
documented semantics (plain torch, explicit softmax) replace the kernels, and each backend's output
must equal the torch reference backend's on the same caches and metadata, for decode, plain prefill,
chunked prefill over cached context and mixed batches."""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention import select_backend
from engine.attention.fa2 import FlashAttnBackend
from engine.attention.fa4 import FlashAttnCuteBackend
from engine.attention.metadata import build_step_inputs
from engine.attention.torch_sdpa import TorchSDPABackend
from engine.core.scheduler import make_batch
from engine.core.sequence import Sequence
from engine.kv_cache import store_kv_cache
from engine.sampling_params import SamplingParams

H, HKV, D = 4, 2, 16


def _attend(q, keys, values, scale, causal=True):
    """Explicit softmax attention; causal mask aligned to the bottom right (FA >= 2.1)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys.double()) * scale
    if causal:
        lq, lk = q.shape[0], keys.shape[0]
        allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.double()).to(q.dtype)


def _pages(cache, table, n):
    return cache[table.long()].flatten(0, 1)[:n]


def fake_fa4_varlen(q, k, v, cu_seqlens_q=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None,
                    page_table=None, softmax_scale=None, causal=False, cu_seqlens_k=None, **_):  # fmt: skip
    """flash_attn.cute.flash_attn_varlen_func: q (total_q, h, d); k/v (num_pages, page, hkv, d) with
    page_table (batch, max_pages) int32 and seqused_k (batch,); returns (out, lse)."""
    assert cu_seqlens_k is None and page_table.dtype == torch.int32 and seqused_k.dtype == torch.int32
    assert (
        cu_seqlens_q.dtype == torch.int32
        and page_table.shape[0] == seqused_k.shape[0] == len(cu_seqlens_q) - 1
    )
    assert k.dim() == 4 and q.shape[0] == cu_seqlens_q[-1]
    out = torch.full_like(q, math.nan)
    for b in range(page_table.shape[0]):
        s, e, n = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
        assert e - s <= max_seqlen_q and (max_seqlen_k is None or n <= max_seqlen_k)
        out[s:e] = _attend(
            q[s:e], _pages(k, page_table[b], n), _pages(v, page_table[b], n), softmax_scale, causal
        )
    return out, None


def fake_fa2_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                    causal=False, block_table=None, **_):  # fmt: skip
    """flash_attn.flash_attn_varlen_func: k/v (total_k, hkv, d), or paged (num_blocks, page, hkv, d)
    with block_table (batch, max_blocks) and page a multiple of 256; lengths from cu_seqlens_k."""
    out = torch.full_like(q, math.nan)
    for b in range(len(cu_seqlens_q) - 1):
        s, e = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        assert e - s <= max_seqlen_q and ke - ks <= max_seqlen_k
        if block_table is None:
            keys, values = k[ks:ke], v[ks:ke]
        else:
            assert k.shape[1] % 256 == 0 and block_table.dtype == torch.int32
            keys, values = _pages(k, block_table[b], ke - ks), _pages(v, block_table[b], ke - ks)
        out[s:e] = _attend(q[s:e], keys, values, softmax_scale, causal)
    return out


def fake_fa2_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None,
                          causal=False, **_):  # fmt: skip
    """flash_attn.flash_attn_with_kvcache: q (batch, seqlen_q, h, d); paged caches; (batch, seqlen_q, h, d)."""
    assert q.dim() == 4 and k_cache.shape[1] % 256 == 0 and cache_seqlens.dtype == torch.int32
    out = torch.full_like(q, math.nan)
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b])
        out[b] = _attend(
            q[b],
            _pages(k_cache, block_table[b], n),
            _pages(v_cache, block_table[b], n),
            softmax_scale,
            causal,
        )
    return out


def _batch(shapes, block_size, num_blocks, seed=0):
    """(context after the step, computed before it) per sequence, blocks drawn at random."""
    gen = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for i, (n, _) in enumerate(shapes):
        seq = Sequence(i, torch.randint(0, 100, (n,), generator=gen).tolist(), SamplingParams(temperature=0))
        seq.block_table = [free.pop() for _ in range(-(-n // block_size))]
        seqs.append(seq)
    return make_batch(seqs, [n - c for n, c in shapes], [c for _, c in shapes], [0] * len(seqs), [], 0)


def _compare(backend, shapes, block_size, num_blocks=24, seed=0):
    batch = _batch(shapes, block_size, num_blocks, seed)
    inputs = build_step_inputs(batch, block_size, torch.device("cpu"))
    md = inputs.attn
    gen = torch.Generator().manual_seed(seed + 1)
    k_cache = torch.randn(num_blocks, block_size, HKV, D, generator=gen)  # earlier steps' KV
    v_cache = torch.randn(num_blocks, block_size, HKV, D, generator=gen)
    q = torch.randn(md.num_tokens, H, D, generator=gen)
    k = torch.randn(md.num_tokens, HKV, D, generator=gen)
    v = torch.randn(md.num_tokens, HKV, D, generator=gen)
    store_kv_cache(k, v, k_cache, v_cache, md.slot_mapping)
    ref = TorchSDPABackend().forward(q, k, v, k_cache, v_cache, md, D**-0.5)
    out = backend.forward(q, k, v, k_cache, v_cache, md, D**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    return md


MIXED = [(37, 36), (5, 0), (300, 280), (600, 599), (40, 16)]  # decode, prefill, chunk, decode, chunk
PREFILL = [(3, 0), (70, 0), (300, 0)]
DECODE = [(1, 0), (257, 256), (513, 512)]


@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("shapes", [MIXED, PREFILL, DECODE], ids=["mixed", "prefill", "decode"])
def test_fa4_call_matches_torch(block_size, shapes):
    _compare(FlashAttnCuteBackend(varlen_fn=fake_fa4_varlen), shapes, block_size, num_blocks=80)


@pytest.mark.parametrize("shapes", [MIXED, PREFILL, DECODE], ids=["mixed", "prefill", "decode"])
def test_fa2_call_matches_torch(shapes):
    md = _compare(FlashAttnBackend(fake_fa2_varlen, fake_fa2_with_kvcache), shapes, 256, num_blocks=12)
    assert md.is_decode == (shapes is DECODE)
    assert md.has_context == (shapes is not PREFILL)


def test_metadata_slots_and_positions():
    batch = _batch([(37, 36), (20, 0), (40, 16)], 16, 24)
    inputs = build_step_inputs(batch, 16, torch.device("cpu"))
    md = inputs.attn
    assert md.cu_seqlens_q.tolist() == [0, 1, 21, 45]
    assert md.cu_seqlens_k.tolist() == [0, 37, 57, 97]
    assert md.context_lens.tolist() == [37, 20, 40] and md.max_seqlen_q == 24 and md.max_seqlen_k == 40
    assert inputs.positions.tolist() == [36, *range(20), *range(16, 40)]
    expected = [s.block_table[p // 16] * 16 + p % 16 for s, p in [(batch.seqs[0], 36)]]
    expected += [batch.seqs[1].block_table[p // 16] * 16 + p % 16 for p in range(20)]
    expected += [batch.seqs[2].block_table[p // 16] * 16 + p % 16 for p in range(16, 40)]
    assert md.slot_mapping.tolist() == expected
    assert inputs.input_ids.tolist() == [
        batch.seqs[0].token_ids[36],
        *batch.seqs[1].token_ids,
        *batch.seqs[2].token_ids[16:],
    ]
    assert inputs.logits_indices.tolist() == [0, 20, 44]


def test_select_backend_errors():
    cpu = torch.device("cpu")
    assert select_backend("auto", cpu, 16).name == "torch"
    with pytest.raises(ValueError, match="CUDA"):
        select_backend("flash_attn", cpu, 256)
    with pytest.raises(ValueError, match="CUDA"):
        select_backend("flash_attn_cute", cpu, 16)
    with pytest.raises(ValueError, match="not one of"):
        select_backend("xformers", cpu, 16)
    assert not FlashAttnBackend.supports_block_size(16) and FlashAttnBackend.supports_block_size(512)
    assert FlashAttnCuteBackend.supports_block_size(16)
