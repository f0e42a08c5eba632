"""Load an HF checkpoint folder's *.safetensors into a model, one tensor at a time (safe_open).

Each checkpoint tensor goes through its parameter's `weight_loader` (which keeps this rank's shard);
q/k/v and gate/up are routed into the merged parameters via the model's `packed_modules_mapping`.
Only safetensors are read: no pickle, no remote code. Missing or unknown tensors are errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected an HF checkpoint folder)")
    return json.loads(path.read_text())


def safetensors_files(model_dir: str | Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files (only safetensors are loaded)")
    return files


def _default_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def _target(name: str, mapping: dict[str, tuple[str, object]]) -> tuple[str, object]:
    for src, (dst, shard_id) in mapping.items():
        part = f".{src}."
        if part in name:
            return name.replace(part, f".{dst}."), shard_id
    return name, None


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Fill every parameter of `model` from the checkpoint in `model_dir`."""
    params = dict(model.named_parameters())
    mapping = getattr(model, "packed_modules_mapping", {})
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                    continue
                target, shard_id = _target(name, mapping)
                if target not in params:
                    raise ValueError(f"{file}: tensor {name!r} has no parameter in {type(model).__name__}")
                param = params[target]
                loader = getattr(param, "weight_loader", _default_loader)
                try:
                    with torch.no_grad():
                        loader(param, f.get_tensor(name), shard_id)
                except (RuntimeError, ValueError) as e:
                    raise ValueError(f"{file}: tensor {name!r} -> {target}: {e}") from None
                loaded.add(target)
    missing = sorted(set(params) - loaded - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks {len(missing)} parameters, e.g. {missing[:5]}")
