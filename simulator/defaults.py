"""What kvplan uses when nothing is said: the trace, model and GPU of a bare command, and the latency
model of a configuration (its shipped fitted profile, else the transferred model). Light to import
(no SimPy): the engine's profiler, the CLIs, sweeps and the dashboard all read their defaults here."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

DEFAULT_TRACE = "azure_conv_2023"
DEFAULT_MODEL = "qwen3-0.6b"
DEFAULT_GPU = "H200"
SHIPPED_PROFILE_DIR = Path(__file__).parent / "profiles"
# The transferred latency model's coefficients (simulator/latency/transfer.py), fitted on the shipped
# H200 sweeps: what a configuration without a fitted profile is priced with.
TRANSFER_MODEL = SHIPPED_PROFILE_DIR / "transfer_h200.json"
# Engine choices that change what a step costs and that a profile and a replay record (the engine's
# kernel choices; absent: the engine before the choice existed, i.e. off). A replay is priced on a
# profile of the same choices (`profile_of_engine`).
ENGINE_CHOICES = ("step_graphs", "table_rows", "device_tables")


def default_profile(
    model: str, gpu: str, block_size: int, tp: int, async_scheduling: bool = False
) -> Path | None:
    """The shipped fitted profile for this model, GPU (any of its names), block size and TP, if any.
    With `async_scheduling`, the one calibrated on an engine scheduling asynchronously (`..._async`)
    where there is one, else the synchronous engine's."""
    from simulator.latency.gpus import canonical_gpu_name, get_gpu

    suffixes = ("_async", "") if async_scheduling else ("",)
    for suffix in suffixes:
        for name in dict.fromkeys([gpu, canonical_gpu_name(gpu), *get_gpu(gpu).aliases]):
            stem = f"{model.lower()}_{name.lower()}_tp{tp}_bs{block_size}{suffix}"
            path = SHIPPED_PROFILE_DIR / f"{stem}.json"
            if path.is_file():
                return path
    return None


def default_latency_file(
    model: str, gpu: str, block_size: int, tp: int, async_scheduling: bool = False
) -> Path:
    """The latency model file a configuration runs on when none is named: its shipped fitted profile
    where one matches (`default_profile`), else the transferred model's coefficients
    (`TRANSFER_MODEL`), which price any model, GPU, TP and block size."""
    return default_profile(model, gpu, block_size, tp, async_scheduling) or TRANSFER_MODEL


def profile_of_engine(profile: Path, engine: Mapping) -> Path:
    """`profile`, or where its recorded ENGINE_CHOICES differ from `engine`'s (a replay's run.json),
    the newest superseded profile of the same name (simulator/profiles/superseded/NAME_DATE.json)
    recorded with `engine`'s choices; `profile` itself when none is."""
    want = engine_choices(engine)
    if engine_choices(json.loads(profile.read_text()).get("extra", {})) == want:
        return profile
    dated = re.compile(re.escape(profile.stem) + r"_\d{4}-\d{2}-\d{2}(_\d{4})?\.json")
    matches = []
    for path in (profile.parent / "superseded").glob(f"{profile.stem}_*.json"):
        meta = json.loads(path.read_text())
        if dated.fullmatch(path.name) and engine_choices(meta.get("extra", {})) == want:
            matches.append((meta.get("created", ""), path))
    return max(matches)[1] if matches else profile


def engine_choices(record: Mapping) -> tuple[bool, ...]:
    """ENGINE_CHOICES as a profile's extra or a replay's run.json records them (absent: off)."""
    return tuple(bool(record.get(k)) for k in ENGINE_CHOICES)
