"""Piecewise forward (engine/piecewise.py) on CPU: the segments with attention run between them give
the model's own forward, bit for bit at the bucket size and within rounding when padded."""

from __future__ import annotations

import pytest
import torch

from engine.attention.metadata import build_step_inputs, set_forward_context
from engine.envs import KernelConfig
from engine.llm import LLM
from engine.piecewise import PiecewiseForward, SegmentBuffers, Segments, token_buckets
from engine.sampling_params import SamplingParams


def test_token_buckets():
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(600) == [16, 32, 64, 128, 256, 512, 600]
    assert len(token_buckets(8192)) == 5 + 30 + 1


def test_prefill_graphs_switch(monkeypatch):
    monkeypatch.delenv("KVPLAN_PREFILL_GRAPHS", raising=False)
    assert KernelConfig.from_env().prefill_graphs is True
    monkeypatch.setenv("KVPLAN_PREFILL_GRAPHS", "0")
    assert KernelConfig.from_env().prefill_graphs is False
    assert KernelConfig.from_env(prefill_graphs=True).prefill_graphs is True  # LLM(prefill_graphs=True)
    monkeypatch.setenv("KVPLAN_PREFILL_GRAPHS", "yes")
    with pytest.raises(ValueError, match="KVPLAN_PREFILL_GRAPHS"):
        KernelConfig.from_env()


def _piecewise(llm: LLM, buckets: list[int], copy_kv: bool = True) -> PiecewiseForward:
    model = llm.runner.model
    buffers = SegmentBuffers.allocate(model, max(buckets), torch.float32, torch.device("cpu"))
    return PiecewiseForward(Segments(model, buffers, copy_kv), buckets)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_piecewise_matches_forward(checkpoints, arch):
    """A chunked prefill beside a cached prefix and a decode: the second step has context, prefill
    rows and a decode row."""
    llm = LLM(checkpoints[arch], device="cpu", block_size=16, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=8,
              max_model_len=256, attention_backend="torch")  # fmt: skip
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)
    llm.add_request(list(range(3, 43)), params)
    llm.step()  # the 40-token prompt, one token out
    llm.add_request(list(range(100, 190)), params)
    batch = llm.scheduler.schedule()
    assert batch.kind == "mixed" and batch.total_num_scheduled_tokens == 64
    inputs = build_step_inputs(batch, 16, torch.device("cpu"))
    with torch.inference_mode(), set_forward_context(inputs.attn):
        expected = llm.runner.model(inputs.input_ids, inputs.positions)
    hidden, t = _piecewise(llm, [64]).forward(inputs, eager=True)
    assert t == 64
    assert torch.equal(hidden, expected)
    assert llm.runner.backend.reads_new_kv is False  # the torch backend reads pages only
    uncopied, _ = _piecewise(llm, [64], copy_kv=False).forward(inputs, eager=True)
    assert torch.equal(uncopied, expected)
    padded, t = _piecewise(llm, [16, 80]).forward(inputs, eager=True)
    assert t == 80 and padded.shape == expected.shape
    torch.testing.assert_close(padded, expected, rtol=1e-5, atol=1e-5)
    llm.close()


def test_padded_rows_store_nothing(checkpoints):
    """Rows past the step's tokens get slot -1: the KV cache holds only the real rows' keys."""
    llm = LLM(checkpoints["qwen3"], device="cpu", block_size=16, num_kv_blocks=8, max_num_batched_tokens=64, max_num_seqs=8,
              max_model_len=128, attention_backend="torch")  # fmt: skip
    llm.add_request(list(range(5, 25)), SamplingParams(temperature=0, max_tokens=1))
    batch = llm.scheduler.schedule()
    inputs = build_step_inputs(batch, 16, torch.device("cpu"))
    pw = _piecewise(llm, [64])
    pw.segments.buf.slot_mapping.fill_(3)  # stale slots from an earlier, longer step
    before = [a.k_cache.clone() for a in pw.attn_layers]
    pw.forward(inputs, eager=True)
    for a, old in zip(pw.attn_layers, before):
        changed = (a.k_cache != old).flatten(2).any(-1).flatten()  # per slot
        assert changed.nonzero().flatten().tolist() == inputs.attn.slot_mapping.tolist()
    llm.close()
