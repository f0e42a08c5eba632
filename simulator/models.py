"""Model shapes the simulator knows by name (HF config.json files shipped in simulator/data/models).

A name resolves to a shipped preset; anything else is read as a model folder or config.json path.
Shapes only: no weights are needed to simulate.
"""

from __future__ import annotations

from pathlib import Path

from engine.model_spec import ModelSpec

MODELS_DIR = Path(__file__).parent / "data" / "models"

# Names as people write them, mapped onto the shipped preset files.
_ALIASES = {
    "qwen/qwen3-0.6b": "qwen3-0.6b",
    "qwen/qwen3-8b": "qwen3-8b",
    "meta-llama/meta-llama-3-8b": "llama-3-8b",
}


def preset_names() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def resolve_model(name_or_path: str) -> ModelSpec:
    """A shipped preset by name (case-insensitive), or the config.json of a model folder."""
    key = _ALIASES.get(name_or_path.lower(), name_or_path.lower())
    preset = MODELS_DIR / f"{key}.json"
    if preset.is_file():
        return ModelSpec.from_hf_config(preset, name=_display_name(key))
    path = Path(name_or_path)
    if path.exists():
        return ModelSpec.from_hf_config(path)
    raise ValueError(
        f"model: {name_or_path!r} is neither a shipped preset {preset_names()} nor a model folder"
    )


def _display_name(key: str) -> str:
    return {"qwen3-0.6b": "Qwen3-0.6B", "qwen3-8b": "Qwen3-8B", "llama-3-8b": "Llama-3-8B"}.get(key, key)
