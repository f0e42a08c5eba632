"""Sweep specs: parsing, unknown-key errors at every level, value checks and grid expansion.

No simulation runs here; only the spec and (for trace options) small generated traces.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.sweep import AXES, AXIS_DEFAULTS, OPTIONAL_AXES, SweepSpec, TraceSpec

REPO = Path(__file__).resolve().parents[2]
GEN = {"arrival": "poisson", "rate": 2.0, "num_requests": 20, "prompt": 64, "output": 8}


def spec(**over) -> dict:
    base = {"trace": {"source": "azure_conv_2023", "limit": 50}, "model": "qwen3-0.6b", "grid": {}}
    base.update(over)
    return base


def test_grid_is_the_product_of_axes_in_a_fixed_order():
    s = SweepSpec.from_dict(
        spec(
            grid={
                "gpu": ["H100", "H200"],
                "tp": [1, 2],
                "block_size": [16, 32, 64],
                "prefix_caching": [True, False],
            }
        )
    )
    points = s.points()
    assert len(points) == 2 * 2 * 3 * 2
    assert all(list(p) == [a for a in AXES if a not in OPTIONAL_AXES] for p in points)
    assert points[0] == {**AXIS_DEFAULTS, "gpu": "H100", "tp": 1, "block_size": 16, "prefix_caching": True}
    assert points[-1]["gpu"] == "H200" and points[-1]["prefix_caching"] is False
    assert len({s.point_key(p) for p in points}) == len(points)


def test_scalars_are_one_value_and_missing_axes_take_simconfig_defaults():
    s = SweepSpec.from_dict(spec(grid={"replicas": 3, "router": "least_outstanding"}))
    (point,) = s.points()
    assert point["replicas"] == 3 and point["router"] == "least_outstanding"
    assert point["block_size"] == 16 and point["max_num_seqs"] == 256 and point["policy"] == "chunked"


def test_empty_grid_is_one_point_and_trace_may_be_a_plain_name():
    s = SweepSpec.from_dict({"trace": "azure_code_2023"})
    assert s.trace == TraceSpec(source="azure_code_2023")
    assert len(s.points()) == 1


@pytest.mark.parametrize(
    ("raw", "where", "key"),
    [
        (spec(modle="x"), "sweep spec", "modle"),
        (spec(trace={"source": "azure_conv_2023", "rate": 2}), "trace", "rate"),
        (spec(grid={"tp": [1], "blocksize": [16]}), "grid", "blocksize"),
        (spec(trace={"generate": {**GEN, "promt": 5}}), "trace.generate", "promt"),
        (
            spec(trace={"generate": {**GEN, "shared_prefix": {"num_prefixes": 2, "len": 64}}}),
            "shared_prefix",
            "len",
        ),
    ],
)
def test_unknown_keys_anywhere_name_the_key_and_the_allowed_ones(raw, where, key):
    with pytest.raises(ValueError) as e:
        SweepSpec.from_dict(raw)
    msg = str(e.value)
    assert where in msg and repr(key) in msg and "allowed" in msg


def test_unknown_top_level_key_lists_the_allowed_keys():
    with pytest.raises(ValueError, match=r"allowed: \['trace', 'model', 'profile', 'slo', 'grid'\]"):
        SweepSpec.from_dict(spec(extra=1))


@pytest.mark.parametrize(
    ("grid", "match"),
    [
        ({"tp": ["two"]}, "grid.tp: 'two' is not a int"),
        ({"tp": [True]}, "grid.tp: True is not a int"),
        ({"prefix_caching": [1]}, "grid.prefix_caching: 1 is not a bool"),
        ({"router": ["random"]}, "grid.router: 'random' is not one of"),
        ({"policy": ["fifo"]}, "grid.policy: 'fifo' is not one of"),
        ({"gpu": ["H900"]}, "unknown GPU 'H900'"),
        ({"block_size": []}, "grid.block_size: needs at least one value"),
    ],
)
def test_bad_axis_values_are_errors(grid, match):
    with pytest.raises(ValueError, match=match):
        SweepSpec.from_dict(spec(grid=grid))


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"trace": {"source": "azure_conv_2023", "generate": GEN}}, "exactly one of 'source'"),
        ({"trace": {"source": "no_such_trace.csv"}}, "neither a shipped trace"),
        ({"trace": {"source": "azure_conv_2023", "limit": 0}}, "trace.limit"),
        ({"trace": {"source": "azure_conv_2023", "rate_scale": -1}}, "trace.rate_scale"),
        ({"slo": "ttft_p42=2s"}, "unknown objective"),
        ({"model": "gpt-17"}, "neither a shipped preset"),
        ({"profile": "missing.json"}, "not 'auto', 'roofline' or a file"),
    ],
)
def test_bad_trace_model_profile_slo(over, match):
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        SweepSpec.from_dict(spec(**over))


def test_missing_trace_is_an_error():
    with pytest.raises(ValueError, match="missing key 'trace'"):
        SweepSpec.from_dict({"model": "qwen3-0.6b"})


def test_yaml_file_paths_are_relative_to_the_spec_and_errors_name_the_file(tmp_path):
    import traces

    traces.save(traces.generate(GEN), tmp_path / "t.csv")
    (tmp_path / "ok.yaml").write_text("trace: {source: t.csv, limit: 5}\ngrid: {block_size: [16, 32]}\n")
    s = SweepSpec.load(tmp_path / "ok.yaml")
    assert s.trace.source == str(tmp_path / "t.csv")
    assert len(s.trace.load()) == 5 and len(s.points()) == 2
    (tmp_path / "bad.yaml").write_text("trace: t.csv\ngrid: {bloc_size: [16]}\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: grid: unknown key\(s\) \['bloc_size'\]"):
        SweepSpec.load(tmp_path / "bad.yaml")


def test_trace_window_limit_and_rate_scale_apply_in_that_order():
    t = TraceSpec(generate=GEN, window_s=(1.0, None), limit=5, rate_scale=2.0).load()
    full = TraceSpec(generate=GEN).load()
    first = full.df[full.df["arrival_s"] >= 1.0].iloc[:5]
    assert len(t) == 5
    assert t.df["arrival_s"].tolist() == pytest.approx(((first["arrival_s"] - 1.0) / 2.0).tolist())


def test_the_example_spec_in_docs_parses():
    s = SweepSpec.load(REPO / "docs" / "sweep-example.yaml")
    assert len(s.points()) == 2 * 2 * 2 * 2 * 2
    assert s.slo == "ttft_p99=2s,tpot_p99=80ms"
