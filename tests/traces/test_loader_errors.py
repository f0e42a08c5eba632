"""Bad trace files get one located TraceError: truncated or oversized compressed files, rows too
long to simulate, and a missing column named as the file would need it."""

from __future__ import annotations

import bz2
import gzip
import lzma

import pytest

import traces
from traces.schema import MAX_TOKENS, TraceError

ROWS = b"".join(b"%d,%d,%d\n" % (i, 100 + i % 97, 1 + i % 13) for i in range(20_000))
CSV = b"arrival_s,prompt_len,output_len\n" + ROWS
JSONL = b"".join(
    b'{"arrival_s": %d, "prompt_len": %d, "output_len": %d}\n' % (i, 5 + i % 7, 3) for i in range(20_000)
)


@pytest.mark.parametrize("name,data", [("t.csv.gz", CSV), ("t.jsonl.gz", JSONL)])
def test_truncated_gzip_is_a_trace_error(tmp_path, name, data):
    whole = gzip.compress(data)
    path = tmp_path / name
    path.write_bytes(whole[: len(whole) * 2 // 3])
    with pytest.raises(TraceError, match=r"t\.(csv|jsonl)\.gz: truncated or corrupt gzip file"):
        traces.load(path)


@pytest.mark.parametrize("compress", [bz2.compress, lzma.compress])
def test_truncated_bz2_and_xz_are_trace_errors(tmp_path, compress):
    whole = compress(CSV)
    path = tmp_path / "t.csv.z"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TraceError, match="truncated or corrupt"):
        traces.load(path)


def test_whole_compressed_files_still_load(tmp_path):
    for name, data in (("a.csv.gz", CSV), ("b.jsonl.gz", JSONL)):
        path = tmp_path / name
        path.write_bytes(gzip.compress(data))
        assert len(traces.load(path)) == 20_000


def test_decompression_is_capped(tmp_path):
    """A small gzip that expands past 100 times its size (and 16 MiB) is refused before it fills memory."""
    path = tmp_path / "bomb.csv.gz"
    path.write_bytes(gzip.compress(b"arrival_s,prompt_len,output_len\n" + b"0,1,1\n" * 4_000_000))
    assert path.stat().st_size < 100_000
    with pytest.raises(TraceError, match=r"bomb\.csv\.gz: decompresses to more than 16\.0 MiB"):
        traces.load(path)
    with pytest.raises(TraceError, match="decompresses to more than"):
        traces.load(path, max_decompressed_bytes=10_000)


def test_decompression_cap_can_be_raised(tmp_path):
    path = tmp_path / "small.csv.gz"
    path.write_bytes(gzip.compress(CSV))
    with pytest.raises(TraceError, match="decompresses to more than 0.0 MiB"):
        traces.load(path, max_decompressed_bytes=1_000)
    assert len(traces.load(path, max_decompressed_bytes=len(CSV))) == 20_000
    with pytest.raises(ValueError, match="max_decompressed_bytes must be >= 1"):
        traces.load(path, max_decompressed_bytes=0)


@pytest.mark.parametrize("column", ["prompt_len", "output_len"])
def test_a_row_beyond_the_token_cap_is_refused_by_row(tmp_path, column):
    path = tmp_path / "huge.csv"
    big = "1000000000"
    row = f"1,{big},3" if column == "prompt_len" else f"1,5,{big}"
    path.write_text(f"arrival_s,prompt_len,output_len\n0,5,3\n{row}\n")
    with pytest.raises(
        TraceError,
        match=rf"huge\.csv, line 3, field '{column}': value 1,000,000,000 \(must be <= 10,000,000\)",
    ):
        traces.load(path)
    path.write_text(f"arrival_s,prompt_len,output_len\n0,{MAX_TOKENS},{MAX_TOKENS}\n")
    assert int(traces.load(path).df["prompt_len"].iloc[0]) == MAX_TOKENS


def test_token_cap_holds_for_frames_too():
    import pandas as pd

    df = pd.DataFrame(
        {"request_id": [0], "arrival_s": [0.0], "prompt_len": [MAX_TOKENS + 1], "output_len": [1]}
    )
    with pytest.raises(ValueError, match="prompt_len"):
        traces.Trace(df)


def test_missing_column_names_the_column_that_is_missing(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("arrival_s,prompt_len\n0,5\n")
    with pytest.raises(TraceError, match=r"m\.csv, line 1, field 'output_len': .*lacks output_len") as e:
        traces.load(path)
    assert e.value.field == "output_len"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:17:03,5\n")
    with pytest.raises(TraceError, match="read as azure, it lacks GeneratedTokens") as e:
        traces.load(path)
    assert e.value.field == "GeneratedTokens"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(TraceError, match="lacks arrival_s, prompt_len, output_len") as e:
        traces.load(path)
    assert e.value.field == "arrival_s"


def test_traces_gen_refuses_zero_requests(tmp_path, capsys):
    from traces.cli import main

    out = tmp_path / "z.parquet"
    assert main(["gen", "--out", str(out), "--num-requests", "0"]) == 2
    assert "--num-requests: must be a positive number of requests, got 0" in capsys.readouterr().err
    assert not out.exists()
    assert main(["gen", "--out", str(out), "--num-requests", "3"]) == 0
    assert len(traces.load(out)) == 3


def test_traces_gen_checks_the_output_suffix_first(tmp_path, capsys, monkeypatch):
    import traces.cli

    monkeypatch.setattr(traces.cli, "generate", lambda spec: pytest.fail("generated"))
    assert traces.cli.main(["gen", "--out", str(tmp_path / "t.txt"), "--num-requests", "3"]) == 2
    assert "--out: " in capsys.readouterr().err
