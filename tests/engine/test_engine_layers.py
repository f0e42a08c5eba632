"""Unit checks of the data plane's pieces: tensor-parallel shards recombine to the full layer,
sampler semantics, the model registry's error, sharded random checkpoints load back."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from engine.layers.embed_head import VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.models import model_class
from engine.sampler import Sampler, apply_top_k_top_p


def _load(layer, full, shard_id=None):
    layer.weight.weight_loader(layer.weight, full, shard_id)
    return layer


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_shards_recombine(tp):
    torch.manual_seed(0)
    hidden, d, heads, kv_heads, inter = 32, 8, 8, 2, 48
    x = torch.randn(5, hidden)
    wq, wk, wv = (
        torch.randn(heads * d, hidden),
        torch.randn(kv_heads * d, hidden),
        torch.randn(kv_heads * d, hidden),
    )
    wg, wu, wd = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    q_parts, k_parts, gate_parts, down_sum = [], [], [], 0
    for rank in range(tp):
        qkv = QKVParallelLinear(hidden, d, heads, kv_heads, tp_rank=rank, tp_size=tp)
        for w, sid in ((wq, "q"), (wk, "k"), (wv, "v")):
            _load(qkv, w, sid)
        q, k, _ = qkv(x).split([qkv.num_heads * d, qkv.num_kv_heads * d, qkv.num_kv_heads * d], -1)
        q_parts.append(q)
        k_parts.append(k)
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter], tp_rank=rank, tp_size=tp)
        _load(_load(gate_up, wg, 0), wu, 1)
        gate_parts.append(gate_up(x).chunk(2, -1)[0])
        down = _load(RowParallelLinear(inter, hidden, tp_rank=rank, tp_size=tp), wd)
        shard = inter // tp
        down_sum = down_sum + F.linear(
            torch.ones(5, inter)[:, rank * shard : (rank + 1) * shard], down.weight
        )
    torch.testing.assert_close(torch.cat(q_parts, -1), x @ wq.T)
    torch.testing.assert_close(torch.cat(gate_parts, -1), x @ wg.T)
    torch.testing.assert_close(down_sum, torch.ones(5, inter) @ wd.T)
    kv_per_rank = max(1, kv_heads // tp) * d
    for rank, k in enumerate(k_parts):  # KV heads split, or replicated when tp > kv_heads
        head = (rank // max(1, tp // kv_heads)) * kv_per_rank
        torch.testing.assert_close(k, x @ wk[head : head + kv_per_rank].T)


def test_vocab_parallel_embedding_shards():
    table = torch.randn(16, 4)
    parts = [VocabParallelEmbedding(16, 4, tp_rank=r, tp_size=2) for r in range(2)]
    for p in parts:
        _load(p, table)
    torch.testing.assert_close(torch.cat([p.weight for p in parts]), table)


def test_sampler_greedy_top_k_top_p():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 4.9]])
    sampler = Sampler(torch.Generator().manual_seed(0))
    assert sampler(logits, torch.zeros(2), all_greedy=True).tolist() == [1, 2]
    masked = apply_top_k_top_p(logits, torch.tensor([2, -1]), torch.tensor([1.0, 0.5]))
    assert torch.isinf(masked[0, [0, 3]]).all() and torch.isfinite(masked[0, [1, 2]]).all()
    assert torch.isfinite(masked[1]).sum() == 1  # top_p 0.5 keeps only the best of a near tie
    draws = torch.stack(
        [
            sampler(logits, torch.tensor([1.0, 0.0]), torch.tensor([1, -1]), torch.tensor([1.0, 1.0]))
            for _ in range(20)
        ]
    )
    assert (draws[:, 0] == 1).all() and (draws[:, 1] == 2).all()  # top_k 1 and greedy rows are exact
    hot = torch.stack([sampler(logits, torch.tensor([5.0, 5.0])) for _ in range(200)])
    assert len(set(hot[:, 0].tolist())) > 1  # high temperature explores


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        model_class("MistralForCausalLM")


def test_sharded_checkpoint_loads(tmp_path):
    from engine.checkpoint import make_random_checkpoint
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    path = make_random_checkpoint(tmp_path / "m", "llama", "tiny", max_shard_bytes=200_000, dtype="float32")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    with LLM(path, num_kv_blocks=32, device="cpu") as llm:
        out = llm.generate(
            [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
        )
        assert len(out[0]["token_ids"]) == 4 and "text" not in out[0]


def test_forward_without_kv_cache_is_a_clear_error(tmp_path):
    """A model whose KV cache was released says which layer has none, before any kernel runs."""
    from engine.attention.metadata import build_step_inputs, set_forward_context
    from engine.checkpoint import make_random_checkpoint
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    path = make_random_checkpoint(tmp_path / "m", "qwen3", "tiny", dtype="float32")
    with LLM(path, num_kv_blocks=32, device="cpu") as llm:
        llm.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=1))
        inputs = build_step_inputs(
            llm.scheduler.schedule(), llm.block_manager.block_size, torch.device("cpu")
        )
        model = llm.runner.model
        model.attention_layers()[0].unbind()
        error = pytest.raises(RuntimeError, match="attention layer 0: no KV cache bound")
        with error, torch.inference_mode(), set_forward_context(inputs.attn):
            model(inputs.input_ids, inputs.positions)
