"""ModelSpec from HF config.json, the pure sizing functions and config validation (engine/core/config.py, engine/memory.py).

Expected numbers are derived by hand in each test from the published shapes, never by calling the
function under test twice.
"""

import json

import pytest

from engine.core.config import CacheConfig, ParallelConfig, SchedulerConfig, cdiv
from engine.memory import check_tp, kv_bytes_per_token, kv_free_bytes, num_kv_blocks, param_bytes, param_count
from engine.model_spec import ModelSpec, dtype_bytes

# Qwen/Qwen3-0.6B config.json (abridged to the fields HF ships; extra fields are ignored).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}

# meta-llama/Meta-Llama-3-8B config.json (no head_dim: it is hidden_size / num_attention_heads).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}

QWEN3_PARAMS = 596_049_920
LLAMA3_8B_PARAMS = 8_030_261_248


@pytest.fixture
def qwen3() -> ModelSpec:
    return ModelSpec.from_hf_config(QWEN3_0_6B, name="Qwen3-0.6B")


@pytest.fixture
def llama3() -> ModelSpec:
    return ModelSpec.from_hf_config(LLAMA3_8B, name="Llama-3-8B")


# ---- from_hf_config ---------------------------------------------------------------------------------
def test_qwen3_fields_from_dict(qwen3):
    assert qwen3 == ModelSpec(
        name="Qwen3-0.6B",
        architecture="Qwen3ForCausalLM",
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        hidden_size=1024,
        intermediate_size=3072,
        vocab_size=151936,
        dtype="bfloat16",
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        eos_token_id=151645,
    )


def test_from_model_folder_and_file_agree(tmp_path, qwen3):
    folder = tmp_path / "Qwen3-0.6B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_0_6B))
    from_folder = ModelSpec.from_hf_config(folder)
    from_file = ModelSpec.from_hf_config(folder / "config.json")
    from_str = ModelSpec.from_hf_config(str(folder))
    assert from_folder == from_file == from_str == qwen3  # named after the folder
    assert from_folder.name == "Qwen3-0.6B"


def test_missing_config_json_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelSpec.from_hf_config(tmp_path)


def test_name_defaults_to_name_or_path_then_architecture():
    assert ModelSpec.from_hf_config({**LLAMA3_8B, "_name_or_path": "meta-llama/x"}).name == "meta-llama/x"
    assert ModelSpec.from_hf_config(LLAMA3_8B).name == "LlamaForCausalLM"


def test_llama_head_dim_defaults_to_hidden_over_heads(llama3):
    assert llama3.head_dim == 4096 // 32 == 128
    assert llama3.num_kv_heads == 8
    assert llama3.tie_word_embeddings is False
    assert llama3.eos_token_id == 128001


def test_missing_kv_heads_means_multi_head_attention():
    cfg = {k: v for k, v in LLAMA3_8B.items() if k != "num_key_value_heads"}
    assert ModelSpec.from_hf_config(cfg).num_kv_heads == 32


def test_rope_theta_from_rope_parameters():
    # transformers v5 nests it: {"rope_parameters": {"rope_type": "default", "rope_theta": ...}}
    cfg = {k: v for k, v in QWEN3_0_6B.items() if k != "rope_theta"}
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    assert ModelSpec.from_hf_config(cfg).rope_theta == 1e6
    del cfg["rope_parameters"]
    assert ModelSpec.from_hf_config(cfg).rope_theta == 10000.0


def test_eos_list_takes_the_first_and_dtype_key_is_read():
    cfg = {**LLAMA3_8B, "eos_token_id": [128001, 128008, 128009], "torch_dtype": None, "dtype": "float16"}
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.eos_token_id == 128001
    assert spec.dtype == "float16"


@pytest.mark.parametrize(
    "field",
    [
        "architectures",
        "num_attention_heads",
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "vocab_size",
    ],
)
def test_missing_field_error_names_it(field):
    cfg = {k: v for k, v in QWEN3_0_6B.items() if k != field}
    with pytest.raises(ValueError, match=rf"missing field '{field}'"):
        ModelSpec.from_hf_config(cfg)


def test_missing_field_error_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in QWEN3_0_6B.items() if k != "vocab_size"}))
    with pytest.raises(ValueError, match=r"config\.json: missing field 'vocab_size'"):
        ModelSpec.from_hf_config(path)


# ---- sizes --------------------------------------------------------------------------------------------
def test_qwen3_kv_bytes_per_token(qwen3):
    # K and V, 28 layers, 8 KV heads, head_dim 128, 2 bytes: 2 * 28 * 8 * 128 * 2
    assert kv_bytes_per_token(qwen3) == 114688


def test_llama3_kv_bytes_per_token(llama3):
    assert kv_bytes_per_token(llama3) == 2 * 32 * 8 * 128 * 2 == 131072
    assert kv_bytes_per_token(llama3, tp=2) == 131072 // 2  # 4 KV heads per rank
    assert kv_bytes_per_token(llama3, tp=8) == 131072 // 8  # 1 KV head per rank


def test_kv_heads_replicate_when_tp_exceeds_them(qwen3):
    # tp 16 > 8 KV heads: every rank keeps one (replicated) KV head
    assert kv_bytes_per_token(qwen3, tp=16) == 2 * 28 * 1 * 128 * 2 == 14336


def test_qwen3_param_count_by_hand(qwen3):
    h, d, layers = 1024, 128, 28
    q_proj, o_proj = h * 16 * d, 16 * d * h  # 2_097_152 each
    k_proj = v_proj = h * 8 * d  # 1_048_576 each
    mlp = 3 * h * 3072  # gate, up, down: 9_437_184
    norms = 2 * h + 2 * d  # input + post-attention RMSNorm, Qwen3's q_norm and k_norm
    per_layer = q_proj + k_proj + v_proj + o_proj + mlp + norms
    assert per_layer == 15_730_944
    embed = 151936 * h  # tied: the LM head shares it
    final_norm = h
    expected = layers * per_layer + embed + final_norm
    assert expected == QWEN3_PARAMS  # ~596M: 440M in the layers, 156M in the embedding
    assert param_count(qwen3) == QWEN3_PARAMS
    assert param_bytes(qwen3) == 2 * QWEN3_PARAMS


def test_llama3_param_count_by_hand(llama3):
    h, d, layers = 4096, 128, 32
    attn = h * 32 * d + 2 * h * 8 * d + 32 * d * h  # q, k, v, o
    mlp = 3 * h * 14336
    norms = 2 * h  # no q/k norms outside Qwen3
    embed_and_head = 2 * 128256 * h  # untied
    expected = layers * (attn + mlp + norms) + embed_and_head + h
    assert expected == LLAMA3_8B_PARAMS
    assert param_count(llama3) == LLAMA3_8B_PARAMS
    assert param_bytes(llama3) == 2 * LLAMA3_8B_PARAMS
    assert param_bytes(llama3, tp=2) == LLAMA3_8B_PARAMS  # cdiv(count, 2) * 2 bytes, count even
    assert param_bytes(llama3, tp=3) == cdiv(LLAMA3_8B_PARAMS, 3) * 2


def test_qwen3_untied_adds_an_lm_head():
    spec = ModelSpec.from_hf_config({**QWEN3_0_6B, "tie_word_embeddings": False})
    assert param_count(spec) == QWEN3_PARAMS + 151936 * 1024


def test_dtype_bytes():
    assert [dtype_bytes(d) for d in ("bfloat16", "float16", "float32")] == [2, 2, 4]
    with pytest.raises(ValueError, match="dtype"):
        dtype_bytes("int8")


def test_num_kv_blocks_exact(qwen3, llama3):
    qwen_block = 16 * 114688  # 1_835_008 bytes per 16-token block
    assert num_kv_blocks(qwen3, 1000 * qwen_block, 16) == 1000
    assert num_kv_blocks(qwen3, 1000 * qwen_block - 1, 16) == 999
    assert num_kv_blocks(qwen3, 1000 * qwen_block + qwen_block - 1, 16) == 1000
    assert num_kv_blocks(qwen3, 0, 16) == 0
    assert num_kv_blocks(qwen3, -5, 16) == 0
    assert num_kv_blocks(llama3, 10 * 2**30, 16) == 10 * 2**30 // (16 * 131072) == 5120
    assert num_kv_blocks(llama3, 10 * 2**30, 16, tp=2) == 10240
    assert num_kv_blocks(llama3, 10 * 2**30, 1) == 81920
    with pytest.raises(ValueError, match="block_size"):
        num_kv_blocks(qwen3, 2**30, 0)


def test_kv_free_bytes_and_blocks_on_an_80_gib_gpu(qwen3):
    gpu = 80 * 2**30  # 85_899_345_920
    usable = 77_309_411_328  # int(gpu * 0.9)
    free = usable - 2 * QWEN3_PARAMS  # 76_117_311_488
    assert kv_free_bytes(gpu, 0.9, qwen3) == free
    assert kv_free_bytes(gpu, 0.9, qwen3, activation_bytes=2**30) == free - 2**30
    assert num_kv_blocks(qwen3, free, 16) == free // 1_835_008 == 41480
    assert kv_free_bytes(2**30, 0.5, qwen3) == 0  # weights do not fit: clamped at zero
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_free_bytes(gpu, 0.0, qwen3)


def test_cdiv():
    assert [cdiv(a, 4) for a in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


# ---- validation ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cls", "kwargs", "field"),
    [
        (SchedulerConfig, {"max_num_seqs": 0}, "SchedulerConfig.max_num_seqs"),
        (SchedulerConfig, {"max_num_batched_tokens": -1}, "SchedulerConfig.max_num_batched_tokens"),
        (SchedulerConfig, {"max_model_len": 0}, "SchedulerConfig.max_model_len"),
        (SchedulerConfig, {"max_num_seqs": True}, "SchedulerConfig.max_num_seqs"),
        (SchedulerConfig, {"policy": "x"}, "SchedulerConfig.policy"),
        (CacheConfig, {"block_size": 0}, "CacheConfig.block_size"),
        (CacheConfig, {"block_size": 16.0}, "CacheConfig.block_size"),
        (CacheConfig, {"num_blocks": 0}, "CacheConfig.num_blocks"),
        (CacheConfig, {"gpu_memory_utilization": 1.5}, "CacheConfig.gpu_memory_utilization"),
        (CacheConfig, {"gpu_memory_utilization": 0.0}, "CacheConfig.gpu_memory_utilization"),
        (ParallelConfig, {"tensor_parallel_size": 0}, "ParallelConfig.tensor_parallel_size"),
    ],
)
def test_config_validation_names_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        cls(**kwargs)


def test_config_defaults_are_valid_and_frozen():
    assert CacheConfig() == CacheConfig(16, None, True, 0.9)
    assert SchedulerConfig() == SchedulerConfig(256, 16384, 4096, "chunked")
    assert SchedulerConfig(policy="prefill_first").policy == "prefill_first"
    assert CacheConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    with pytest.raises(AttributeError):
        SchedulerConfig().max_num_seqs = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"num_hidden_layers": 0}, "ModelSpec.num_layers"),
        ({"num_attention_heads": 0}, "ModelSpec.num_heads"),
        ({"vocab_size": -1}, "ModelSpec.vocab_size"),
        ({"num_key_value_heads": 3}, "ModelSpec.num_kv_heads"),  # 3 does not divide 16
        ({"torch_dtype": "int4"}, "dtype"),
    ],
)
def test_model_spec_validation_names_the_field(override, field):
    with pytest.raises(ValueError, match=field):
        ModelSpec.from_hf_config({**QWEN3_0_6B, **override})


def test_check_tp(qwen3, llama3):
    for tp in (1, 2, 4, 8, 16):
        check_tp(qwen3, tp)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: 3 does not divide num_heads 16"):
        check_tp(qwen3, 3)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: .*0"):
        check_tp(qwen3, 0)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        kv_bytes_per_token(llama3, tp=5)
    # 12 heads, 4 KV heads: tp 6 divides the heads, but 6 and 4 do not divide one another
    odd = ModelSpec("odd", "LlamaForCausalLM", 2, 12, 4, 64, 768, 2048, 1000)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: 6 and num_kv_heads 4"):
        check_tp(odd, 6)


def test_kv_cache_bytes_is_the_engines_budget():
    from engine.memory import GRAPH_MEMORY_RESERVE, kv_cache_bytes

    gpu, weights, act = 10**10, 10**9, 10**8
    # 0.5 x 1e10 - 1e9 weights - 1e8 activations - 536_870_912 graph pool - 1e8 prefill graphs' pool
    assert kv_cache_bytes(gpu, 0.5, weights, act) == 3_263_129_088
    assert kv_cache_bytes(gpu, 0.5, weights, act, other_bytes=10**7) == 3_253_129_088
    assert kv_cache_bytes(gpu, 0.5, weights, act, prefill_graphs=False) == 3_363_129_088
    assert kv_cache_bytes(gpu, 0.5, weights, act, cuda_graphs=False) == 3_900_000_000  # eager: neither pool
    assert GRAPH_MEMORY_RESERVE == 536_870_912
    assert kv_cache_bytes(100, 0.9, 10, 5) == 0  # nothing left: clamped at zero
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_bytes(gpu, 1.5, weights, act)
