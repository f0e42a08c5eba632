"""Random-weight HF checkpoints of real shapes (config.json + safetensors) for tests and timing.

Configs are built from explicit fields with transformers' config classes (no hub access); parameter
names and shapes come from the transformers model built on the meta device, so no slow init runs.
Big models are written as several safetensors shards with an index.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
    ),
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "qwen3-8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=1_000_000.0,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    "llama-3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=500_000.0,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
}

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def hf_config(arch: str, preset: str, dtype: str = "bfloat16", **overrides: Any):
    """The transformers config object of `arch` ("qwen3" | "llama") at `preset`'s shapes."""
    from transformers import LlamaConfig, Qwen3Config

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch: {arch!r} is not one of {sorted(ARCHITECTURES)}")
    if preset not in PRESETS:
        raise ValueError(f"preset: {preset!r} is not one of {sorted(PRESETS)}")
    fields = dict(PRESETS[preset])
    if preset == "tiny":
        fields["tie_word_embeddings"] = arch == "qwen3"
        fields["rope_theta"] = 1_000_000.0 if arch == "qwen3" else 500_000.0
        if arch == "llama":  # exercise llama3 frequency scaling
            fields["rope_scaling"] = dict(_LLAMA3_SCALING, original_max_position_embeddings=1024)
    fields.update(overrides)
    cls = Qwen3Config if arch == "qwen3" else LlamaConfig
    config = cls(**fields)
    config.architectures = [ARCHITECTURES[arch]]
    config.dtype = dtype
    return config


def make_random_checkpoint(
    out_dir: str | Path,
    arch: str = "qwen3",
    preset: str = "tiny",
    seed: int = 0,
    dtype: str = "bfloat16",
    init_std: float = 0.02,
    device: str = "cpu",
    max_shard_bytes: int = 4 << 30,
    **overrides: Any,
) -> Path:
    """Write config.json and random safetensors weights of `preset`'s real shapes into `out_dir`.

    Linear and embedding weights ~ N(0, init_std); norm weights ~ 1 + N(0, 0.05) so that the norms
    matter in tests. `device` ("cuda") only speeds up drawing big tensors. Returns `out_dir`.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = hf_config(arch, preset, dtype, **overrides)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    shapes = {n: tuple(p.shape) for n, p in meta.named_parameters()}  # tied lm_head appears once
    gen = torch.Generator(device=device).manual_seed(seed)
    torch_dtype = _DTYPES[dtype]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        t = 1.0 + 0.05 * t if name.endswith("norm.weight") else t * init_std
        t = t.to(torch_dtype).cpu()
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    _write_shards(out, shards)
    (out / "config.json").write_text(config.to_json_string())
    return out


def _write_shards(out: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
