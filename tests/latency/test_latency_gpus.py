"""gpus.json: loads, every entry is complete and sourced, names and aliases resolve."""

from __future__ import annotations

import json
import re

import pytest

from simulator.latency.gpus import GPUS_JSON, canonical_gpu_name, get_gpu, load_gpu_specs

REQUIRED = ("H100-SXM", "H200-SXM", "A100-80GB-SXM", "B200", "L40S")


def test_table_loads_with_required_gpus_and_sources() -> None:
    raw = json.loads(GPUS_JSON.read_text())
    assert raw["version"] == 1
    specs = load_gpu_specs()
    assert set(REQUIRED) <= set(specs)
    for name, spec in specs.items():
        assert spec.memory_bytes > 0 and spec.memory_bandwidth_Bps > 0 and spec.bf16_flops > 0, name
        assert spec.interconnect_bandwidth_Bps > 0 and spec.price_per_hour_usd > 0, name
        assert spec.sources, f"{name} has no sources"
        for source in spec.sources:
            assert source["title"] and source["url"].startswith("https://"), (name, source)
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", source["date"]), (name, source)
        assert any("price" in s["title"].lower() for s in spec.sources), f"{name}: no source for its price"


def test_datasheet_figures() -> None:
    h200 = get_gpu("H200")
    assert h200.memory_bandwidth_Bps == 4.8e12 and h200.bf16_flops == 989.4e12
    assert h200.link_bandwidth_Bps == 450e9  # 900 GB/s both directions
    assert get_gpu("h100").memory_bandwidth_Bps == 3.35e12
    assert get_gpu("a100").bf16_flops == 312e12
    assert get_gpu("b200").bf16_flops == 2250e12
    assert get_gpu("l40s").memory_bandwidth_Bps == 864e9


def test_h200_measured_ceilings_from_benchmarks() -> None:
    measured = get_gpu("H200-SXM").measured
    assert measured is not None
    assert measured.memory_bandwidth_Bps == 4.25e12
    assert measured.bf16_flops == 797e12
    assert get_gpu("h200").usable_memory_bytes == measured.memory_bytes < get_gpu("h200").memory_bytes


@pytest.mark.parametrize(
    ("asked", "canonical"),
    [
        ("h100", "H100-SXM"),
        ("H100 SXM", "H100-SXM"),
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("h200", "H200-SXM"),
        ("NVIDIA H200", "H200-SXM"),
        ("h200_sxm", "H200-SXM"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB-SXM"),
        ("a100", "A100-80GB-SXM"),
        ("NVIDIA B200", "B200"),
        ("l40s", "L40S"),
    ],
)
def test_names_and_aliases_resolve(asked: str, canonical: str) -> None:
    assert get_gpu(asked).name == canonical
    assert canonical_gpu_name(asked) == canonical


def test_unknown_gpu_lists_known_names() -> None:
    with pytest.raises(
        ValueError, match=r"unknown GPU 'TPU-v5'.*A100-80GB-SXM, B200, H100-SXM, H200-SXM, L40S"
    ):
        get_gpu("TPU-v5")


def test_bad_tables_are_refused(tmp_path) -> None:
    raw = json.loads(GPUS_JSON.read_text())
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({**raw, "version": 2}))
    with pytest.raises(ValueError, match="version 2 is not supported"):
        load_gpu_specs(path)
    broken = json.loads(GPUS_JSON.read_text())
    del broken["gpus"]["L40S"]["memory_bandwidth_Bps"]
    path.write_text(json.dumps(broken))
    with pytest.raises(ValueError, match="'L40S' is missing field 'memory_bandwidth_Bps'"):
        load_gpu_specs(path)
    unsourced = json.loads(GPUS_JSON.read_text())
    unsourced["gpus"]["B200"]["sources"] = []
    path.write_text(json.dumps(unsourced))
    with pytest.raises(ValueError, match="'B200' has no sources"):
        load_gpu_specs(path)
