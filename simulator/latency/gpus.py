"""GPU spec table: `GpuSpec` records loaded from the versioned `simulator/data/gpus.json`.

Datasheet figures (memory, bandwidth, dense bf16 FLOP/s, link bandwidth, an hourly price) plus
optional measured ceilings. Pure data and lookup; no latency arithmetic lives here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

GPUS_JSON = Path(__file__).resolve().parent.parent / "data" / "gpus.json"
SUPPORTED_VERSION = 1


@dataclass(frozen=True)
class MeasuredCeilings:
    """Ceilings measured on a real machine (BENCHMARKS.md recipes); None where not measured."""

    memory_bandwidth_Bps: float | None = None  # device-to-device copy, bytes read + written per s
    bf16_flops: float | None = None  # large bf16 matrix product
    memory_bytes: int | None = None  # total memory the CUDA runtime reports
    date: str = ""
    source: str = ""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's datasheet figures. All rates are per GPU, in bytes or FLOPs per second."""

    name: str
    memory_bytes: int  # HBM/GDDR capacity (datasheet "GB" read as GiB, see data/README.md)
    memory_bandwidth_Bps: float
    bf16_flops: float  # dense (no sparsity) bf16 tensor-core FLOP/s
    interconnect_bandwidth_Bps: float  # per GPU, both directions summed, as vendors quote it
    price_per_hour_usd: float
    interconnect: str = ""
    sources: tuple[dict[str, str], ...] = ()
    aliases: tuple[str, ...] = ()
    measured: MeasuredCeilings | None = field(default=None)

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "memory_bandwidth_Bps", "bf16_flops", "interconnect_bandwidth_Bps"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"GpuSpec {self.name}.{name}: must be > 0, got {value!r}")
        if self.price_per_hour_usd < 0:
            raise ValueError(
                f"GpuSpec {self.name}.price_per_hour_usd: must be >= 0, got {self.price_per_hour_usd}"
            )

    @property
    def link_bandwidth_Bps(self) -> float:
        """One direction of the per-GPU link: what a ring all-reduce step can send while receiving."""
        return self.interconnect_bandwidth_Bps / 2

    @property
    def usable_memory_bytes(self) -> int:
        """Measured total memory when known (what the runtime sizes the KV cache from), else datasheet."""
        if self.measured is not None and self.measured.memory_bytes:
            return self.measured.memory_bytes
        return self.memory_bytes


def normalize_gpu_name(name: str) -> str:
    """Lower case, spaces/underscores as '-', without a leading 'nvidia-': 'NVIDIA H200' -> 'h200'."""
    key = "-".join(name.strip().lower().replace("_", " ").replace("-", " ").split())
    return key.removeprefix("nvidia-")


def _parse(path: Path, raw: dict[str, Any]) -> dict[str, GpuSpec]:
    version = raw.get("version")
    if version != SUPPORTED_VERSION:
        raise ValueError(f"{path}: version {version!r} is not supported (expected {SUPPORTED_VERSION})")
    gpus = raw.get("gpus")
    if not isinstance(gpus, dict) or not gpus:
        raise ValueError(f"{path}: 'gpus' must be a non-empty object of name -> spec")
    specs: dict[str, GpuSpec] = {}
    for name, entry in gpus.items():
        try:
            measured = entry.get("measured")
            specs[name] = GpuSpec(
                name=name,
                memory_bytes=int(entry["memory_bytes"]),
                memory_bandwidth_Bps=float(entry["memory_bandwidth_Bps"]),
                bf16_flops=float(entry["bf16_flops"]),
                interconnect_bandwidth_Bps=float(entry["interconnect_bandwidth_Bps"]),
                price_per_hour_usd=float(entry["price_per_hour_usd"]),
                interconnect=str(entry.get("interconnect", "")),
                sources=tuple(dict(s) for s in entry["sources"]),
                aliases=tuple(entry.get("aliases", ())),
                measured=MeasuredCeilings(**measured) if measured else None,
            )
        except KeyError as e:
            raise ValueError(f"{path}: GPU {name!r} is missing field {e.args[0]!r}") from None
        except TypeError as e:
            raise ValueError(f"{path}: GPU {name!r}: {e}") from None
        if not specs[name].sources:
            raise ValueError(f"{path}: GPU {name!r} has no sources")
    return specs


def _load(path: str | Path | None) -> tuple[dict[str, GpuSpec], dict[str, str]]:
    p = Path(path or GPUS_JSON).resolve()
    if not p.is_file():
        raise FileNotFoundError(f"{p}: no GPU spec table here")
    return _load_cached(str(p), p.stat().st_mtime_ns)


@lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int) -> tuple[dict[str, GpuSpec], dict[str, str]]:
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    specs = _parse(p, raw)
    index: dict[str, str] = {}
    for name, spec in specs.items():
        for key in (name, *spec.aliases):
            norm = normalize_gpu_name(key)
            if index.get(norm, name) != name:
                raise ValueError(f"{p}: name or alias {key!r} is used by both {index[norm]} and {name}")
            index[norm] = name
    return specs, index


def load_gpu_specs(path: str | Path | None = None) -> dict[str, GpuSpec]:
    """All GPUs of the table at `path` (default: the packaged gpus.json), keyed by canonical name."""
    specs, _ = _load(path)
    return dict(specs)


def get_gpu(name: str | GpuSpec, path: str | Path | None = None) -> GpuSpec:
    """Look a GPU up by name or alias, case-insensitively ('h100' -> H100-SXM, 'NVIDIA H200' -> H200-SXM)."""
    if isinstance(name, GpuSpec):
        return name
    specs, index = _load(path)
    canonical = index.get(normalize_gpu_name(name))
    if canonical is None:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(sorted(specs))}")
    return specs[canonical]


def canonical_gpu_name(name: str | GpuSpec) -> str:
    """The table's name for a GPU when it is known, else the name as given (stripped)."""
    if isinstance(name, GpuSpec):
        return name.name
    try:
        return get_gpu(name).name
    except ValueError:
        return name.strip()
