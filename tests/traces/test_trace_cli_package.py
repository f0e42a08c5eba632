"""CLI (`traces stats`, `traces gen` through register()), shipped data files, and package hygiene."""

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import traces
from traces.cli import register

PKG = Path(traces.__file__).resolve().parent


def run(argv):
    parser = argparse.ArgumentParser(prog="kvplan")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_stats_text_and_json(capsys):
    assert run(["traces", "stats", "azure_conv_2023"]) == 0
    out = capsys.readouterr().out
    assert "19,366" in out and "CV 1.094" in out
    assert run(["traces", "stats", str(traces.shipped("mooncake_synthetic")), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["rows"] == 3993 and round(d["prefix"]["token_reuse"], 3) == 0.651


def test_gen_then_stats(tmp_path, capsys):
    out = tmp_path / "g.jsonl"
    argv = [
        "traces",
        "gen",
        "--out",
        str(out),
        "--arrival",
        "gamma",
        "--rate",
        "5",
        "--cv",
        "2",
        "--num-requests",
        "300",
        "--prompt",
        "uniform:10:20",
        "--output",
        "7",
        "--seed",
        "3",
        "--shared-prefixes",
        "2",
        "--prefix-len",
        "64",
        "--turns",
        "2",
    ]
    assert run(argv) == 0
    assert "wrote 300 requests" in capsys.readouterr().out
    t = traces.load(out)
    assert len(t) == 300 and t.prefix_block_size == 64 and t.has_sessions and t.name == "g"
    assert (t.df["output_len"] == 7).all()
    assert run(["traces", "stats", str(out)]) == 0
    assert "prefix reuse" in capsys.readouterr().out


def test_gen_spec_file(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "rate: 2\nnum_requests: 10\nprompt: {kind: lognormal, p50: 100, p90: 400}\nname: fromyaml\n"
    )
    out = tmp_path / "s.parquet"
    assert run(["traces", "gen", "--spec", str(spec), "--out", str(out), "--num-requests", "20"]) == 0
    t = traces.load(out)
    assert len(t) == 20 and t.name == "fromyaml"


def test_cli_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,abc,1\n")
    assert run(["traces", "stats", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "line 2, field 'ContextTokens'" in err
    assert run(["traces", "gen", "--out", str(tmp_path / "x.parquet"), "--rate", "1"]) == 2
    assert "num_requests" in capsys.readouterr().err


def test_shipped_files_are_byte_identical_and_documented():
    expect = {
        "azure_code_2023.csv": "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
        "azure_conv_2023.csv": "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
        "mooncake_synthetic.jsonl": "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
    }
    for name, digest in expect.items():
        assert hashlib.sha256((PKG / "data" / name).read_bytes()).hexdigest() == digest
    readme = (PKG / "data" / "README.md").read_text()
    for word in (
        "CC-BY 4.0",
        "Splitwise",
        "Apache-2.0",
        "Poisson",
        "790921015d50dd6aae7f7e47f39ba0e235ad6b08",
        "3cca71daccf2a7afb8fe3f0295358f70e3a69fdb",
    ):
        assert word in readme


def test_no_torch_and_module_docstrings():
    for py in PKG.rglob("*.py"):
        text = py.read_text()
        assert "import torch" not in text and "from torch" not in text, py
        assert text.startswith('"""'), f"{py} should open with a docstring"
    code = "import sys, traces; traces.load_shipped('mooncake_synthetic'); print('torch' in sys.modules)"
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent, check=True
    )
    assert res.stdout.strip() == "False"


@pytest.mark.parametrize("name", traces.__all__)
def test_public_api_exists(name):
    assert hasattr(traces, name)
