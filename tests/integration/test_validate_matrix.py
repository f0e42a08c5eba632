"""`kvplan validate` with several runs or profiles: the targets each (run, profile) pair meets, the
totals per profile, and names that tell equal file names in different folders apart."""

import shutil
from pathlib import Path

import pandas as pd

from simulator.cli import main
from simulator.validate import TARGETS, format_matrix, path_labels, validation_matrix

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "simulator/data/validation"
LIGHT, HEAVY = RUNS / "h200_qwen3-0.6b_bs256_light", RUNS / "h200_qwen3-0.6b_bs256_x10"
# the block-256 profile those replays were calibrated with (2026-11-30), superseded since
PROFILE = ROOT / "simulator/profiles/superseded/qwen3-0.6b_h200_tp1_bs256_2026-11-30.json"


def test_measured_matrix_of_runs_and_profiles():
    """The block-256 profile of their engine against roofline on a light and a 10x replay: the counts are
    those of test_validation_shipped (light misses TPOT and p50 E2E; 10x every target).
    The counts are pinned to shipped measured data: they detect change, not correctness."""
    m = validation_matrix([LIGHT, HEAVY], [PROFILE, None], progress=False)
    assert list(m["run"]) == [LIGHT.name, HEAVY.name] * 2
    assert list(m["profile"]) == [PROFILE.name] * 2 + ["roofline"] * 2
    assert list(m["targets_met"]) == [5, 0, 2, 0]
    assert set(TARGETS) <= set(m.columns) and m["step_error_median"].between(0.0, 1.0).all()
    text = format_matrix(m).splitlines()
    assert text[0].split() == ["targets", "met", "(of", "7)", PROFILE.name, "roofline"]
    assert text[1].split() == [LIGHT.name, "5", "2"]
    assert text[3].split() == ["total", "(of", "14)", "5", "2"]
    assert text[4].startswith("median error tpot_mean_s")


def test_labels_tell_equal_names_apart():
    assert path_labels(["a/b/x.json", "c/b/x.json", "d/x.json", None, "e/y.json"]) == [
        "a/b/x.json",
        "c/b/x.json",
        "d/x.json",
        "roofline",
        "y.json",
    ]


def test_cli_table_and_csv(tmp_path, capsys):
    """Two copies of one profile under the same file name: identical rows, told apart by folder."""
    copy = tmp_path / "mine" / PROFILE.name
    copy.parent.mkdir()
    shutil.copy(PROFILE, copy)
    argv = [
        "validate",
        "--real",
        str(LIGHT),
        "--profile",
        str(PROFILE),
        str(copy),
        "--out",
        str(tmp_path / "v"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"superseded/{PROFILE.name}" in out and f"mine/{PROFILE.name}" in out
    saved = pd.read_csv(tmp_path / "v" / "validation_matrix.csv")
    assert list(saved["targets_met"]) == [5, 5]
    assert saved["tpot_mean_s"].iloc[0] == saved["tpot_mean_s"].iloc[1]


def test_cli_repeat_takes_one_run(capsys):
    argv = ["validate", "--real", str(LIGHT), str(HEAVY), "--repeat", str(HEAVY)]
    assert main(argv) == 2
    assert "--repeat takes one --real run and one --profile" in capsys.readouterr().err
