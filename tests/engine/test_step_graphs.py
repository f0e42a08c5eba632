"""Whole-step graphs' shapes and padding (engine/step_graphs.py) on CPU: a step run padded to a larger
shape, over stale buffers, gives the model's own forward and stores only its own rows' keys."""

from __future__ import annotations

import pytest
import torch

from engine.attention.metadata import build_step_inputs, set_forward_context
from engine.envs import KernelConfig
from engine.llm import LLM
from engine.piecewise import SegmentBuffers, token_buckets
from engine.sampling_params import SamplingParams
from engine.step_graphs import StepGraphs, StepMetadataBuffers, pick_shape, step_graph_shapes


def test_step_graph_shapes():
    assert step_graph_shapes([16, 32, 64, 128, 256, 512], 256, max_tokens=256) == [
        (16, 4), (16, 16), (32, 4), (32, 16), (32, 32), (64, 4), (64, 16), (64, 64),
        (128, 4), (128, 16), (128, 64), (128, 128), (256, 4), (256, 16), (256, 64), (256, 256),
    ]  # fmt: skip
    assert step_graph_shapes([16, 32, 64, 100], 8) == [
        (16, 4),
        (16, 8),
        (32, 4),
        (32, 8),
        (64, 4),
        (64, 8),
        (100, 4),
        (100, 8),
    ]
    assert step_graph_shapes(token_buckets(8192), 512)[-5:] == [
        (2048, 4),
        (2048, 16),
        (2048, 64),
        (2048, 256),
        (2048, 512),
    ]
    assert len(step_graph_shapes(token_buckets(8192), 256)) == 2 + 3 + 3 + 4 + 4 * 8


def test_pick_shape():
    shapes = step_graph_shapes([16, 32, 64, 128], 64)
    assert pick_shape(shapes, 10, 3) == (16, 4)
    assert pick_shape(shapes, 16, 5) == (16, 16)
    assert pick_shape(shapes, 17, 17) == (32, 32)
    assert pick_shape(shapes, 40, 20) == (64, 64)
    assert pick_shape(shapes, 128, 64) == (128, 64)
    assert pick_shape(shapes, 129, 1) is None


def test_step_graphs_switch(monkeypatch):
    monkeypatch.delenv("KVPLAN_STEP_GRAPHS", raising=False)
    assert KernelConfig.from_env().step_graphs is True
    monkeypatch.setenv("KVPLAN_STEP_GRAPHS", "0")
    assert KernelConfig.from_env().step_graphs is False
    monkeypatch.setenv("KVPLAN_STEP_GRAPHS", "2")
    with pytest.raises(ValueError, match="KVPLAN_STEP_GRAPHS"):
        KernelConfig.from_env()


def _step_graphs(llm: LLM, shapes: list[tuple[int, int]]) -> StepGraphs:
    model, width = llm.runner.model, 16
    buffers = SegmentBuffers.allocate(model, max(t for t, _ in shapes), torch.float32, torch.device("cpu"))
    meta = StepMetadataBuffers.allocate(max(s for _, s in shapes), width, width * 16, torch.device("cpu"))
    return StepGraphs(model, buffers, meta, shapes)


def _mixed_step(llm: LLM):
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)
    llm.add_request(list(range(3, 43)), params)
    llm.add_request(list(range(50, 70)), params)
    llm.step()  # two prompts, one token out each
    llm.add_request(list(range(100, 130)), params)
    batch = llm.scheduler.schedule()
    assert batch.kind == "mixed" and (batch.num_seqs, batch.total_num_scheduled_tokens) == (3, 32)
    return build_step_inputs(batch, 16, torch.device("cpu"))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_padded_step_matches_forward(checkpoints, arch):
    """Two decodes beside a 30-token prompt, run in shapes (32, 4) and (64, 16) over buffers full of
    stale values: the model's forward on the step's own rows."""
    llm = LLM(checkpoints[arch], device="cpu", block_size=16, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=16,
              max_model_len=256, attention_backend="torch")  # fmt: skip
    inputs = _mixed_step(llm)
    with torch.inference_mode(), set_forward_context(inputs.attn):
        expected = llm.runner.model(inputs.input_ids, inputs.positions)
    graphs = _step_graphs(llm, [(32, 4), (64, 16)])
    assert graphs.shape_for(inputs) == (32, 4)
    for shape in ((32, 4), (64, 16)):
        for t in (
            graphs.buf.input_ids,
            graphs.buf.positions,
            graphs.meta.cu_seqlens_q,
            graphs.meta.context_lens,
        ):
            t.fill_(5)  # stale values of an earlier step
        graphs.buf.slot_mapping.fill_(7)
        hidden = graphs.forward(inputs, shape, eager=True)
        assert hidden.shape == expected.shape
        torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
        assert graphs.meta.cu_seqlens_q[: shape[1] + 1].tolist() == [0, 1, 2, 32] + [32] * (shape[1] - 3)
        assert graphs.meta.context_lens[: shape[1]].tolist() == [41, 21, 30] + [0] * (shape[1] - 3)
        assert graphs.buf.slot_mapping[32 : shape[0]].tolist() == [-1] * (shape[0] - 32)
    llm.close()


def test_padded_step_stores_only_its_rows(checkpoints):
    llm = LLM(checkpoints["qwen3"], device="cpu", block_size=16, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=16,
              max_model_len=256, attention_backend="torch")  # fmt: skip
    inputs = _mixed_step(llm)
    graphs = _step_graphs(llm, [(64, 16)])
    graphs.buf.slot_mapping.fill_(3)  # a stale slot in every row
    layers = [layer.self_attn.attn for layer in llm.runner.model.model.layers]
    before = [a.k_cache.clone() for a in layers]
    graphs.forward(inputs, (64, 16), eager=True)
    for a, old in zip(layers, before):
        changed = (a.k_cache != old).flatten(2).any(-1).flatten()  # per slot
        assert changed.nonzero().flatten().tolist() == inputs.attn.slot_mapping.tolist()
    llm.close()
