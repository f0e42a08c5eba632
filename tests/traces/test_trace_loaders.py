"""Loaders: format detection, each format's columns, chunked reading, and one clear error per bad input."""

import gzip
import json
import warnings

import numpy as np
import pandas as pd
import pytest

import traces
from traces import TraceError, TraceWarning

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:04.5000000,110,27
2023-11-16 18:17:05.0000001,7,1
"""

MOONCAKE = "\n".join(
    json.dumps(r)
    for r in [
        {"timestamp": 0, "input_length": 1100, "output_length": 6, "hash_ids": [0, 1, 2]},
        {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [0, 3]},
        {"timestamp": 1500, "input_length": 13, "output_length": 1, "hash_ids": [4]},
    ]
)

BURST = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,276,693,API log
133,ChatGPT,1360,0,1360,Conversation log
141.5,GPT-4,1015,64,1079,Conversation log
"""


def err(path, **kw) -> str:
    with pytest.raises(TraceError) as e:
        traces.load(path, **kw)
    return str(e.value)


def check(msg: str, path, line, field) -> None:
    assert str(path) in msg, msg
    if line is not None:
        assert f"line {line}" in msg, msg
    if field is not None:
        assert f"field '{field}'" in msg, msg


# ----------------------------------------------------------------- formats


def test_azure(write):
    p = write("a.csv", AZURE)
    assert traces.detect_format(p) == "azure"
    t = traces.load(p)
    assert t.name == "a"
    assert t.df["request_id"].tolist() == [0, 1, 2, 3]
    assert t.df["prompt_len"].tolist() == [4808, 3180, 110, 7]
    assert t.df["output_len"].tolist() == [10, 8, 27, 1]
    assert np.allclose(t.df["arrival_s"], [0.0, 0.052, 0.5200400, 1.0200401], atol=1e-9, rtol=0)
    assert t.df["arrival_s"].iat[3] == pytest.approx(1.0200401, abs=1e-12)  # 7-digit fraction kept
    assert t.load_report.format == "azure" and t.load_report.rows_read == 4


def test_azure_2024_timezone(write):
    p = write(
        "a24.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-05-10 00:00:00.009930+00:00,100,10\n2024-05-10 00:00:01.509930+00:00,200,20\n",
    )
    t = traces.load(p)
    assert t.df["arrival_s"].tolist() == [0.0, 1.5]


def test_mooncake(write):
    p = write("m.jsonl", MOONCAKE)
    assert traces.detect_format(p) == "mooncake"
    t = traces.load(p)
    assert t.prefix_block_size == 512
    assert t.df["arrival_s"].tolist() == [0.0, 0.0, 1.5]
    assert t.df["prompt_len"].tolist() == [1100, 600, 13]
    assert t.df["prefix_block_ids"].tolist() == [[0, 1, 2], [0, 3], [4]]
    assert t.token_ids(0)[:512] == t.token_ids(1)[:512]
    assert t.token_ids(0)[512:600] != t.token_ids(1)[512:600]


def test_burstgpt_drops_failures_and_reports(write):
    p = write("b.csv", BURST)
    assert traces.detect_format(p) == "burstgpt"
    with pytest.warns(TraceWarning, match=r"dropped 2 of 5 rows: Response tokens == 0"):
        t = traces.load(p)
    assert t.df["request_id"].tolist() == [0, 2, 4]
    assert t.df["arrival_s"].tolist() == [0.0, 113.0, 136.5]
    assert t.df["model"].tolist() == ["ChatGPT", "GPT-4", "GPT-4"]
    assert t.df["log_type"].tolist() == ["Conversation log", "API log", "Conversation log"]
    r = t.load_report
    assert (r.rows_read, r.rows_loaded, sum(r.dropped.values())) == (5, 3, 2)
    assert "dropped 2" in r.summary()
    with pytest.raises(TraceError, match=r"line 3, field 'Response tokens': value 0"):
        traces.load(p, zero_output="error")


def test_burstgpt_session_ids(write):
    p = write(
        "bs.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type,Session ID\n"
        "1,ChatGPT,10,5,15,Conversation log,abc\n2,ChatGPT,30,5,35,Conversation log,\n"
        "3,ChatGPT,50,5,55,Conversation log,abc\n",
    )
    t = traces.load(p)
    assert t.df["session_id"].tolist() == [0, -1, 0]


def test_generic_csv_with_column_map_and_units(write):
    p = write("g.csv", "t,in,out,extra\n1500,10,3,x\n2500,20,4,y\n")
    t = traces.load(p, column_map={"arrival_s": "t", "prompt_len": "in", "output_len": "out"}, time_unit="ms")
    assert t.df["arrival_s"].tolist() == [0.0, 1.0]
    assert list(t.df.columns) == ["request_id", "arrival_s", "prompt_len", "output_len"]
    t = traces.load(p, column_map={"arrival_s": "t", "prompt_len": "in", "output_len": "out"}, rebase=False)
    assert t.df["arrival_s"].tolist() == [1500.0, 2500.0]


def test_generic_datetime_text_column(write):
    p = write("d.csv", "when,p,o\n2024-01-01T00:00:00Z,5,5\n2024-01-01T00:00:02.5Z,5,5\n")
    t = traces.load(p, column_map={"arrival_s": "when", "prompt_len": "p", "output_len": "o"})
    assert t.df["arrival_s"].tolist() == [0.0, 2.5]


def test_generic_jsonl_and_parquet(tmp_path, write):
    p = write(
        "g.jsonl",
        '{"t": 0.5, "in": 10, "out": 3, "blocks": [1, 2]}\n{"t": 1.0, "in": 20, "out": 4, "blocks": [1]}\n',
    )
    cmap = {"arrival_s": "t", "prompt_len": "in", "output_len": "out", "prefix_block_ids": "blocks"}
    assert traces.detect_format(p) == "jsonl"
    t = traces.load(p, column_map=cmap, prefix_block_size=8)
    assert t.df["arrival_s"].tolist() == [0.0, 0.5]
    assert t.df["prefix_block_ids"].tolist() == [[1, 2], [1]]
    q = tmp_path / "g.parquet"
    pd.DataFrame({"t": [3.0, 4.0], "in": [1, 2], "out": [5, 6]}).to_parquet(q)
    assert traces.detect_format(q) == "parquet"
    t = traces.load(q, column_map={"arrival_s": "t", "prompt_len": "in", "output_len": "out"})
    assert t.df["output_len"].tolist() == [5, 6]


def test_format_override_and_gzip(tmp_path):
    p = tmp_path / "azure.csv.gz"
    with gzip.open(p, "wt") as f:
        f.write(AZURE)
    assert traces.detect_format(p) == "azure"
    t = traces.load(p, format="azure")
    assert len(t) == 4 and t.name == "azure"
    # a mooncake file read as generic jsonl needs a column map
    m = tmp_path / "m.jsonl"
    m.write_text(MOONCAKE)
    t = traces.load(
        m,
        format="jsonl",
        column_map={"arrival_s": "timestamp", "prompt_len": "input_length", "output_len": "output_length"},
        time_unit="ms",
    )
    assert t.df["arrival_s"].tolist() == [0.0, 0.0, 1.5] and not t.has_prefix_ids


def test_chunked_reading_is_identical(write):
    p = write("a.csv", AZURE)
    whole = traces.load(p)
    small = traces.load(p, chunksize=1)
    pd.testing.assert_frame_equal(whole.df, small.df)


def test_unsorted_arrivals_sorted_with_warning(write):
    p = write(
        "u.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:00:02.0,1,1\n2023-11-16 18:00:01.0,2,2\n2023-11-16 18:00:03.0,3,3\n"
        "2023-11-16 18:00:00.5,4,4\n",
    )
    with pytest.warns(TraceWarning, match=r"2 of 4 rows arrive earlier than a row before them"):
        t = traces.load(p)
    assert t.df["request_id"].tolist() == [3, 1, 0, 2]
    assert t.df["arrival_s"].tolist() == [0.0, 0.5, 1.5, 2.5]
    assert t.load_report.out_of_order == 2


def test_sorted_file_gives_no_warning(write):
    p = write("a.csv", AZURE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        traces.load(p)


def test_shipped():
    assert traces.shipped_names() == ["azure_code_2023", "azure_conv_2023", "mooncake_synthetic"]
    assert traces.shipped("azure_conv_2023").name == "azure_conv_2023.csv"
    assert traces.shipped("mooncake_synthetic.jsonl").is_file()
    with pytest.raises(ValueError, match="azure_code_2023, azure_conv_2023, mooncake_synthetic"):
        traces.shipped("nope")
    t = traces.load_shipped("azure_code_2023")
    assert t.name == "azure_code_2023" and len(t) == 8819


# ----------------------------------------------------------------- bad input: one clear error each


@pytest.mark.parametrize(
    "text, line, field, words",
    [
        (AZURE.replace("3180", "abc"), 3, "ContextTokens", "not a number: 'abc'"),
        (AZURE.replace(",8\n", ",-8\n"), 3, "GeneratedTokens", "negative value -8"),
        (AZURE.replace(",27\n", ",2.5\n"), 4, "GeneratedTokens", "not an integer"),
        (AZURE.replace(",110,", ",,"), 4, "ContextTokens", "missing value"),
        (
            AZURE.replace("2023-11-16 18:17:04.5000000", "yesterday"),
            4,
            "TIMESTAMP",
            "unparseable time 'yesterday'",
        ),
        (
            AZURE.replace("2023-11-16 18:17:04.5000000", "2023-13-45 99:00:00"),
            4,
            "TIMESTAMP",
            "unparseable time",
        ),
        (AZURE.replace(",27\n", ",0\n"), 4, "GeneratedTokens", "value 0"),
        (AZURE.replace("4808", "0"), 2, "ContextTokens", "value 0 (must be >= 1)"),
    ],
)
def test_azure_bad_values(write, text, line, field, words):
    p = write("bad.csv", text)
    msg = err(p)
    check(msg, p, line, field)
    assert words in msg


def test_bad_value_line_counts_blank_lines_and_chunks(write):
    text = AZURE.replace("\n2023-11-16 18:17:04.5", "\n\n\n2023-11-16 18:17:04.5").replace(",7,1", ",x,1")
    p = write("blank.csv", text)
    for chunksize in (1, 2, 500_000):
        check(err(p, chunksize=chunksize), p, 7, "ContextTokens")


def test_azure_missing_column(write):
    p = write("bad.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.9799600,4808\n")
    msg = err(p, format="azure")
    check(msg, p, 1, "GeneratedTokens")
    assert "missing column" in msg


@pytest.mark.parametrize(
    "lines, line, field, words",
    [
        (
            [
                '{"timestamp": 0, "input_length": 10, "output_length": 6, "hash_ids": [0]}',
                '{"timestamp": 5, "input_length": "many", "output_length": 6, "hash_ids": [1]}',
            ],
            2,
            "input_length",
            "not a number: 'many'",
        ),
        (
            ['{"timestamp": 0, "input_length": 10, "output_length": -6, "hash_ids": [0]}'],
            1,
            "output_length",
            "negative value -6",
        ),
        (
            [
                '{"timestamp": 0, "input_length": 10, "output_length": 6, "hash_ids": [0]}',
                '{"timestamp": 5, "input_length": 10, "output_length": 6, "hash_ids": [1]',
                '{"timestamp": 5, "input_length": 10, "output_length": 6, "hash_ids": [1]}',
            ],
            2,
            None,
            "not valid JSON",
        ),
        (
            [
                '{"timestamp": 0, "input_length": 10, "output_length": 6, "hash_ids": [0]}',
                "",
                '{"timestamp": 5, "output_length": 6, "hash_ids": [1]}',
            ],
            3,
            "input_length",
            "missing value",
        ),
        (
            ['{"timestamp": 0, "input_length": 10.5, "output_length": 6, "hash_ids": [0]}'],
            1,
            "input_length",
            "not an integer",
        ),
        (
            [
                '{"timestamp": 0, "input_length": 10, "output_length": 6, "hash_ids": [0]}',
                '{"timestamp": "soon", "input_length": 10, "output_length": 6, "hash_ids": [0]}',
            ],
            2,
            "timestamp",
            "not a number",
        ),
        (
            ['{"timestamp": 0, "input_length": 600, "output_length": 6, "hash_ids": [0, 1, 2]}'],
            1,
            "hash_ids",
            "3 blocks of 512",
        ),
        (
            ['{"timestamp": 0, "input_length": 600, "output_length": 6, "hash_ids": [0, "x"]}'],
            1,
            "hash_ids",
            "'x'",
        ),
        (
            [
                '{"timestamp": 0, "input_length": 600, "output_length": 6, "hash_ids": [0]}',
                '{"timestamp": 0, "input_length": 600, "output_length": 6}',
            ],
            2,
            "hash_ids",
            "missing value",
        ),
    ],
)
def test_mooncake_bad_lines(write, lines, line, field, words):
    p = write("bad.jsonl", "\n".join(lines) + "\n")
    msg = err(p, format="mooncake")
    check(msg, p, line, field)
    assert words in msg


def test_parquet_bad_value_names_row(tmp_path):
    q = tmp_path / "bad.parquet"
    pd.DataFrame(
        {"arrival_s": [0.0, 1.0, 2.0], "prompt_len": [1, -2, 3], "output_len": [1, 1, 1]}
    ).to_parquet(q)
    msg = err(q)
    assert str(q) in msg and "row 2" in msg and "field 'prompt_len'" in msg


def test_malformed_csv_row(write):
    p = write("bad.csv", AZURE + "2023-11-16 18:17:06.0,1,2,3\n")
    msg = err(p)
    check(msg, p, 6, None)


def test_empty_and_header_only(write, tmp_path):
    for name, text in [("empty.csv", ""), ("blank.jsonl", "\n\n")]:
        p = write(name, text)
        msg = err(p)
        assert str(p) in msg and "empty file" in msg
    p = write("header.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert "no data rows" in err(p)


def test_wrong_format(write, tmp_path):
    p = write("other.csv", "name,age\nbob,3\n")
    msg = err(p)
    check(msg, p, 1, "arrival_s")
    assert "cannot tell the trace format" in msg and "column_map" in msg
    p = write("m.jsonl", MOONCAKE)
    msg = err(p, format="azure")
    check(msg, p, 1, "TIMESTAMP")
    p = write("a.csv", AZURE)
    check(err(p, format="mooncake"), p, 1, None)
    assert "not valid JSON" in err(p, format="mooncake")
    b = tmp_path / "bin.dat"
    b.write_bytes(b"\x00\x01\x02garbage")
    assert "binary content" in err(b)
    p = write("arr.json", '[{"a": 1}]')
    assert "JSON array" in err(p)
    with pytest.raises(FileNotFoundError, match="no such trace file"):
        traces.load(tmp_path / "missing.csv")
    with pytest.raises(ValueError, match="format must be one of"):
        traces.load(p, format="xml")


def test_trace_error_attributes(write):
    p = write("bad.csv", AZURE.replace("3180", "abc"))
    with pytest.raises(TraceError) as e:
        traces.load(p)
    assert (e.value.path, e.value.line, e.value.field) == (str(p), 3, "ContextTokens")
    assert isinstance(e.value, ValueError)
