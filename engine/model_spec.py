"""A model's shapes, read from an HF `config.json` as plain JSON: no weights, GPU or torch.
Enough to size its KV cache and weights (engine/memory.py) and to build its layers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.core.config import check_positive

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ModelSpec:
    """The shapes of a decoder-only transformer, enough to size its KV cache and its weights."""

    name: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        check_positive(
            self,
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "hidden_size",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        )
        dtype_bytes(self.dtype)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec.num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}"
            )

    @classmethod
    def from_hf_config(cls, source: str | Path | dict[str, Any], name: str | None = None) -> ModelSpec:
        """Read an HF `config.json` (a model folder, the file itself, or the parsed dict)."""
        if isinstance(source, dict):
            cfg, where = source, "config dict"
        else:
            path = Path(source)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise FileNotFoundError(f"{path}: no config.json here")
            cfg, where = json.loads(path.read_text()), str(path)
            name = name or path.parent.name
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            eos = cfg.get("eos_token_id")
            return cls(
                name=name or cfg.get("_name_or_path") or cfg["architectures"][0],
                architecture=cfg["architectures"][0],
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=int(cfg.get("head_dim") or hidden // num_heads),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                rope_theta=float(
                    cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4)
                ),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                eos_token_id=eos[0] if isinstance(eos, list) else eos,
            )
        except KeyError as e:
            raise ValueError(f"{where}: missing field {e.args[0]!r}") from None
