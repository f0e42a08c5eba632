"""`kvplan validate --repeat`: a second real run of the same trace and configuration is reported
beside the simulated one (the real system's own spread), and anything else is refused by name."""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from simulator.cli import main
from simulator.validate import format_table, in_band, validate_run

RUN = Path(__file__).resolve().parents[2] / "simulator/data/validation/h200_qwen3-0.6b_bs256_light"


@pytest.fixture(scope="module")
def repeat(tmp_path_factory) -> Path:
    """The shipped run again, every first token and finish 10 ms later."""
    out = tmp_path_factory.mktemp("repeat") / "run"
    shutil.copytree(RUN, out)
    requests = pd.read_parquet(out / "requests.parquet")
    requests["first_token_s"] += 0.01
    requests["finish_s"] += 0.01
    requests.to_parquet(out / "requests.parquet", index=False)
    return out


def test_repeat_columns(repeat):
    v = validate_run(RUN, None, repeat)
    table = v.table.set_index("metric")
    for metric in ("ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "e2e_mean_s"):
        real = table.loc[metric, "real"]
        assert table.loc[metric, "repeat"] == pytest.approx(real + 0.01, abs=1e-9)
        assert table.loc[metric, "repeat_error"] == pytest.approx(0.01 / real, rel=1e-6)
    assert table.loc["tpot_mean_s", "repeat_error"] == pytest.approx(0.0, abs=1e-9)
    assert list(v.table.columns[:6]) == ["metric", "real", "sim", "rel_error", "target", "ok"]
    latency, header = format_table(v).splitlines()[:2]
    assert latency == "latency: roofline"  # validate_run(RUN, None, ...): no profile
    assert header.endswith("repeat  real vs real  band")


def test_repeat_must_share_configuration_and_trace(repeat, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(repeat, other)
    meta = json.loads((other / "run.json").read_text())
    json.dump({**meta, "max_num_seqs": 7}, (other / "run.json").open("w"))
    with pytest.raises(ValueError, match=r"other/run.json: max_num_seqs is 7, the run it repeats has 256"):
        validate_run(RUN, None, other)
    json.dump(meta, (other / "run.json").open("w"))
    trace = pd.read_parquet(other / "trace.parquet")
    trace.iloc[:-1].to_parquet(other / "trace.parquet", index=False)
    with pytest.raises(ValueError, match=r"other/trace.parquet: not the trace of the run it repeats"):
        validate_run(RUN, None, other)


def test_cli_validate_with_repeat(repeat, tmp_path, capsys):
    argv = ["validate", "--real", str(RUN), "--repeat", str(repeat), "--out", str(tmp_path / "v")]
    assert main([*argv, "--no-fail"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "latency: roofline"
    assert "real vs real" in out.splitlines()[1]
    saved = json.loads((tmp_path / "v" / "validation.json").read_text())
    assert {"repeat", "repeat_error"} <= set(saved["metrics"][0])


def test_in_band_spans_the_two_real_runs_widened_by_the_target():
    assert in_band(1.0, 2.0, 1.5, 0.05) is True  # between the runs
    assert in_band(2.0, 1.0, 1.5, 0.05) is True  # either order
    assert in_band(1.0, 2.0, 2.1, 0.05) is True  # 2 + 5 %
    assert in_band(1.0, 2.0, 2.11, 0.05) is False
    assert in_band(1.0, 2.0, 0.95, 0.05) is True  # 1 - 5 %
    assert in_band(1.0, 2.0, 0.94, 0.05) is False
    assert in_band(1.0, 2.0, 1.5, None) is None  # no target
    assert in_band(1.0, float("nan"), 1.0, 0.05) is None


def test_repeat_band_column(repeat):
    """Real TTFT p50 and its repeat 10 ms apart: a roofline simulation is in the band of a metric
    exactly where it is within the target of one of the runs or between them."""
    table = validate_run(RUN, None, repeat).table.set_index("metric")
    for metric, r in table.iterrows():
        if pd.isna(r["target"]):
            assert r["in_band"] is None
            continue
        lo, hi = sorted((r["real"], r["repeat"]))
        expected = lo * (1 - r["target"]) <= r["sim"] <= hi * (1 + r["target"])
        assert r["in_band"] is expected, metric
        assert not r["ok"] or r["in_band"], metric  # a met target is in the band
