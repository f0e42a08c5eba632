"""RooflineModel: every term on a small hand-computed case, TP communication, efficiency checks."""

from __future__ import annotations

import pytest

from engine.core.scheduler import make_batch
from engine.core.sequence import Sequence
from engine.model_spec import ModelSpec
from engine.sampling_params import SamplingParams
from simulator.latency import RooflineEfficiency, RooflineModel, StepShape, StepTime
from simulator.latency.gpus import GpuSpec, get_gpu

# A toy GPU with round numbers: 1 TB/s, 10 TFLOP/s, 200 GB/s link (100 GB/s each way).
TOY_GPU = GpuSpec(
    name="toy",
    memory_bytes=1 << 30,
    memory_bandwidth_Bps=1e12,
    bf16_flops=1e13,
    interconnect_bandwidth_Bps=2e11,
    price_per_hour_usd=1.0,
    sources=({"title": "test", "url": "https://example.invalid", "date": "2026-11-29"},),
)
UNIT = RooflineEfficiency(
    weight_bandwidth=1.0,
    kv_bandwidth=1.0,
    gemm_flops=1.0,
    attention_flops=1.0,
    link_bandwidth=1.0,
    allreduce_latency_s=5e-6,
    step_overhead_s=1e-3,
    seq_overhead_s=1e-5,
)


def toy_model() -> ModelSpec:
    # 2 layers, 4 heads of 8, 2 KV heads, hidden 32, MLP 64, vocab 100, untied, bf16.
    return ModelSpec("toy", "LlamaForCausalLM", 2, 4, 2, 8, 32, 64, 100)


def test_static_terms_by_hand() -> None:
    # param_count: per layer attn 3*1024 + 2*32*2*8 ... = 3072, mlp 6144, norms 64 -> 9280 * 2 layers
    # + embedding and LM head 2 * 3200 + final norm 32 = 24,992 params = 49,984 bytes.
    r = RooflineModel(toy_model(), TOY_GPU, tp=1, efficiency=UNIT)
    assert r.weight_bytes == 49_984 - 6_400  # the untied input embedding is not streamed
    assert r.linear_flops_per_token == 2 * 18_592  # body params (no embedding, no LM head)
    assert r.lm_head_flops_per_seq == 2 * 3_200
    assert r.kv_bytes_per_token == 2 * 2 * 2 * 8 * 2  # K+V, layers, kv heads, head_dim, bytes
    assert r.attention_flops_per_pair == 4 * 8 * 4 * 2  # 4 * head_dim * heads * layers
    assert r.allreduce_calls == 0


def test_decode_step_by_hand() -> None:
    r = RooflineModel(toy_model(), TOY_GPU, tp=1, efficiency=UNIT)
    st = r.predict(StepShape.decode(num_seqs=4, num_context_tokens=1000, max_seq_len=401))
    # linear: weights 43,584 B / 1e12 = 4.3584e-8 s > FLOPs (37,184 + 6,400) * 4 / 1e13 = 1.74e-8 s
    assert st.linear == pytest.approx(4.3584e-8, rel=1e-12)
    # attention: KV (1000 + 4) * 128 B / 1e12 = 1.28512e-7 s > 1004 pairs * 256 / 1e13
    assert st.attention == pytest.approx(1.28512e-7, rel=1e-12)
    assert st.communication == 0.0
    assert st.overhead == pytest.approx(1e-3 + 4 * 1e-5, rel=1e-12)
    assert st.total == pytest.approx(4.3584e-8 + 1.28512e-7 + 1.04e-3, rel=1e-12)
    assert st.total == st.linear + st.attention + st.communication + st.overhead


def test_prefill_step_by_hand() -> None:
    r = RooflineModel(toy_model(), TOY_GPU, tp=1, efficiency=UNIT)
    # Two prefills: 500 new tokens from scratch, 300 new after 100 cached.
    work = 500 * (0 + 501 / 2) + 300 * (100 + 301 / 2)
    assert work == 200_400
    st = r.predict(StepShape("prefill", 2, 2, 800, 800, 100, 400, work))
    # linear: FLOPs 37,184 * 800 + 6,400 * 2 = 29,760,000 / 1e13 = 2.976e-6 s > weights 4.36e-8 s
    assert st.linear == pytest.approx(2.976e-6, rel=1e-12)
    # attention: 200,400 pairs * 256 / 1e13 = 5.130e-6 s > KV (100 + 800) * 128 / 1e12 = 1.15e-7 s
    assert st.attention == pytest.approx(5.130_24e-6, rel=1e-12)
    assert st.overhead == pytest.approx(1e-3 + 2e-5, rel=1e-12)
    assert st.total == pytest.approx(2.976e-6 + 5.13024e-6 + 1.02e-3, rel=1e-12)


def test_tensor_parallel_terms_by_hand() -> None:
    r = RooflineModel(toy_model(), TOY_GPU, tp=2, efficiency=UNIT)
    assert r.weight_bytes == 24_992 - 3_200  # half the params, less half the embedding, 2 bytes each
    assert r.kv_bytes_per_token == 64  # one KV head per rank
    assert r.attention_flops_per_pair == 128  # two query heads per rank
    assert r.allreduce_calls == 4 and r.allreduce_bytes_per_token == 64
    st = r.predict(StepShape("prefill", 2, 2, 800, 800, 100, 400, 200_400.0))
    # 4 all-reduces of 800 * 64 B; ring 2 (tp-1)/tp = 1; 100 GB/s one way; 5 us each.
    assert st.communication == pytest.approx(4 * 5e-6 + 4 * 800 * 64 / 1e11, rel=1e-12)
    dec = r.predict(StepShape.decode(8, 4000, 600))
    assert dec.communication == pytest.approx(4 * 5e-6 + 4 * 8 * 64 / 1e11, rel=1e-12)


def test_tp_three_ring_factor() -> None:
    model = ModelSpec("tp3", "LlamaForCausalLM", 2, 6, 3, 8, 48, 64, 99)
    r = RooflineModel(model, TOY_GPU, tp=3, efficiency=UNIT)
    st = r.predict(StepShape.decode(10, 100, 11))
    assert st.communication == pytest.approx(4 * 5e-6 + 4 * (4 / 3) * 10 * 48 * 2 / 1e11, rel=1e-12)


def test_mixed_batch_counts_only_decode_context_as_decode_pairs() -> None:
    r = RooflineModel(toy_model(), TOY_GPU, tp=1, efficiency=UNIT)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    pre = Sequence(0, [1] * 600, params)
    dec = Sequence(1, [1] * 51, params)
    pre.num_computed_tokens, dec.num_computed_tokens = 200, 50
    batch = make_batch([dec, pre], [1, 400], [50, 200], [0, 0], [], 0)
    assert batch.kind == "mixed" and batch.num_decode_seqs == 1
    work = 400 * (200 + 401 / 2)
    st = r.predict(batch)
    assert st.attention == pytest.approx((work + 50 + 1) * 256 / 1e13, rel=1e-12)
    # From totals alone the decode context is unknown: all 250 context tokens count (upper bound).
    loose = r.predict(StepShape.of(batch))
    assert loose.attention == pytest.approx((work + 250 + 1) * 256 / 1e13, rel=1e-12)


def test_empty_batch_is_free_and_bad_kind_is_refused() -> None:
    r = RooflineModel(toy_model(), TOY_GPU)
    assert r.predict(StepShape("empty", 0, 0, 0, 0, 0, 0)) == StepTime(0.0, 0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="kind"):
        StepShape("warmup", 1, 0, 1, 0, 0, 1)


def test_defaults_on_h200_near_nano_vllm_decode_measurements(model: ModelSpec) -> None:
    # BENCHMARKS.md (nano-vllm, Qwen3-0.6B, H200): decode 2.4 ms at batch <= 8 and 13 ms at batch 512
    # with 68k context tokens. The roofline's defaults land within a factor of 1.5 of both.
    r = RooflineModel(model, get_gpu("H200"))
    small = r.decode_step_time(8, 8 * 1000, 1001)
    large = r.decode_step_time(512, 68_000, 500)
    assert 2.4e-3 / 1.5 < small < 2.4e-3 * 1.5
    assert 13e-3 / 1.5 < large < 13e-3 * 1.5


def test_efficiency_and_tp_are_validated(model: ModelSpec) -> None:
    with pytest.raises(ValueError, match=r"RooflineEfficiency.gemm_flops: must be in \(0, 1\]"):
        RooflineEfficiency(gemm_flops=1.5)
    with pytest.raises(ValueError, match="step_overhead_s"):
        RooflineEfficiency(step_overhead_s=-1.0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        RooflineModel(model, "h200", tp=3)
    with pytest.raises(ValueError, match="unknown GPU"):
        RooflineModel(model, "h300")
