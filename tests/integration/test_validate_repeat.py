"""`kvplan validate --repeat`: a second real run of the same trace and configuration is reported
beside the simulated one (the real system's own spread), and anything else is refused by name."""

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from simulator.cli import main
from simulator.validate import format_table, validate_run

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
    assert header.endswith("repeat  real vs real")


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
