"""Trace schema: validation, synthetic token ids (prefix sharing), and round trips through every format."""

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import traces
from traces import Trace, synthetic_token_ids


def frame(**cols):
    base = {
        "request_id": [0, 1, 2],
        "arrival_s": [0.0, 0.5, 1.25],
        "prompt_len": [10, 20, 30],
        "output_len": [1, 2, 3],
    }
    base.update(cols)
    return pd.DataFrame(base)


def test_minimal_trace():
    t = Trace(frame(), name="t")
    assert len(t) == 3
    assert t.duration_s == 1.25
    assert t.name == "t"
    assert list(t.df.columns) == ["request_id", "arrival_s", "prompt_len", "output_len"]
    assert t.df["prompt_len"].dtype == np.int64
    assert t.prefix_block_size is None
    assert not t.has_prefix_ids and not t.has_sessions
    assert "rows=3" in repr(t)


@pytest.mark.parametrize(
    "cols, field, row",
    [
        ({"prompt_len": [10, 0, 30]}, "prompt_len", 1),
        ({"output_len": [1, 2, -3]}, "output_len", 2),
        ({"prompt_len": [10, 2.5, 30]}, "prompt_len", 1),
        ({"prompt_len": [10, "x", 30]}, "prompt_len", 1),
        ({"arrival_s": [0.0, float("nan"), 1.0]}, "arrival_s", 1),
        ({"arrival_s": [0.0, 2.0, 1.0]}, "arrival_s", 2),
        ({"request_id": [0, 1, 1]}, "request_id", 2),
        ({"session_id": [0, None, 1]}, "session_id", 1),
    ],
)
def test_validation_names_column_and_row(cols, field, row):
    with pytest.raises(ValueError) as e:
        Trace(frame(**cols), name="bad")
    msg = str(e.value)
    assert f"column '{field}'" in msg and f"row {row}" in msg and "'bad'" in msg


def test_missing_column():
    with pytest.raises(ValueError, match="column 'output_len'.*missing column"):
        Trace(frame().drop(columns="output_len"))


def test_prefix_ids_need_block_size_and_fit_prompt():
    with pytest.raises(ValueError, match="prefix_block_size"):
        Trace(frame(prefix_block_ids=[[1], [2], [3]]))
    # 30 tokens / 16 per block -> at most 2 blocks
    with pytest.raises(ValueError, match=r"column 'prefix_block_ids', row 2: 3 blocks"):
        Trace(frame(prefix_block_ids=[[1], [2], [3, 4, 5]]), prefix_block_size=16)
    with pytest.raises(ValueError, match=r"row 1: expected integers in the list, got 'a'"):
        Trace(frame(prefix_block_ids=[[1], ["a"], []]), prefix_block_size=16)
    with pytest.raises(ValueError, match=r"row 0"):
        Trace(frame(prefix_block_ids=[[1.5], [2], []]), prefix_block_size=16)
    t = Trace(frame(prefix_block_ids=[[1], None, np.array([1, 2])]), prefix_block_size=16)
    assert t.df["prefix_block_ids"].tolist() == [[1], [], [1, 2]]
    assert t.prefix_ids(2).tolist() == [1, 2]


def test_prompt_token_ids_length_checked_and_used():
    with pytest.raises(ValueError, match=r"column 'prompt_token_ids', row 0: 2 tokens but prompt_len is 10"):
        Trace(frame(prompt_token_ids=[[1, 2], None, None]))
    toks = list(range(10))
    t = Trace(frame(prompt_token_ids=[toks, None, None]))
    assert t.token_ids(0) == toks
    assert len(t.token_ids(1)) == 20  # null -> synthetic


def test_extra_columns_kept():
    t = Trace(frame(model=["a", "b", "c"]))
    assert t.df["model"].tolist() == ["a", "b", "c"]


# ----------------------------------------------------------------- synthetic tokens


def test_synthetic_tokens_exact_values_and_determinism():
    a = synthetic_token_ids(8, [7, 9], 4, request_id=3)
    assert a.tolist() == synthetic_token_ids(8, [7, 9], 4, request_id=99).tolist()  # fully covered
    assert a.dtype == np.int64 and a.min() >= 0 and a.max() < 32000
    # the block with id 9 is the same 4 tokens wherever it appears
    assert synthetic_token_ids(4, [9], 4).tolist() == a[4:].tolist()
    # no prefix ids: tokens depend on request id and salt
    u = synthetic_token_ids(50, request_id=1)
    assert u.tolist() != synthetic_token_ids(50, request_id=2).tolist()
    assert u.tolist() != synthetic_token_ids(50, request_id=1, salt=1).tolist()
    assert synthetic_token_ids(50, request_id=1).tolist() == u.tolist()
    # vocab respected
    assert synthetic_token_ids(1000, [1, 2], 512, vocab_size=7).max() < 7


def test_prefix_and_unique_domains_differ():
    # hash id 5 in the prefix domain vs request id 5 in the unique domain
    assert (
        synthetic_token_ids(64, [5], 64).tolist()
        != synthetic_token_ids(64, None, None, request_id=5).tolist()
    )


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    bs=st.sampled_from([1, 3, 16, 64, 512]),
    shared=st.lists(st.integers(0, 2**40), min_size=0, max_size=6),
    tail_a=st.lists(st.integers(0, 2**40), min_size=1, max_size=4),
    tail_b=st.lists(st.integers(0, 2**40), min_size=1, max_size=4),
    extra_a=st.integers(0, 100),
    extra_b=st.integers(0, 100),
)
def test_shared_prefix_blocks_share_exactly_those_tokens(bs, shared, tail_a, tail_b, extra_a, extra_b):
    if tail_a[0] == tail_b[0]:
        tail_b[0] += 1
    ids_a, ids_b = shared + tail_a, shared + tail_b
    # prompts cover all their blocks (the last block may be partial), possibly with unique tokens after
    len_a = (len(ids_a) - 1) * bs + 1 + (extra_a % bs if bs > 1 else 0)
    len_b = (len(ids_b) - 1) * bs + 1 + (extra_b % bs if bs > 1 else 0)
    t = Trace(
        pd.DataFrame(
            {
                "request_id": [0, 1],
                "arrival_s": [0.0, 1.0],
                "prompt_len": [len_a, len_b],
                "output_len": [1, 1],
                "prefix_block_ids": [ids_a, ids_b],
            }
        ),
        prefix_block_size=bs,
    )
    a, b = np.array(t.token_ids(0)), np.array(t.token_ids(1))
    k = len(shared) * bs
    assert len(a) == len_a and len(b) == len_b
    assert (a[:k] == b[:k]).all()
    # the next block differs (its first token may coincide by chance only for tiny blocks: compare the block)
    m = min(len_a, len_b) - k
    assert m >= 1
    assert not (a[k : k + m] == b[k : k + m]).all() or m == 1 and bs == 1


def test_token_sharing_independent_of_engine_block_size():
    """Requests sharing 3 blocks of 512 share exactly 1536 tokens: any engine block size sees the same."""
    t = Trace(
        pd.DataFrame(
            {
                "request_id": [0, 1],
                "arrival_s": [0.0, 1.0],
                "prompt_len": [2000, 1800],
                "output_len": [1, 1],
                "prefix_block_ids": [[1, 2, 3, 4], [1, 2, 3, 5]],
            }
        ),
        prefix_block_size=512,
    )
    a, b = np.array(t.token_ids(0)), np.array(t.token_ids(1))
    first_diff = int(np.flatnonzero(a[:1800] != b[:1800])[0])
    assert first_diff == 1536
    assert t.token_ids(0) == t.token_ids(0)


def test_token_ids_index_errors():
    t = Trace(frame())
    assert len(t.token_ids(-1)) == 30
    with pytest.raises(IndexError):
        t.token_ids(3)


# ----------------------------------------------------------------- round trips


def rich_trace() -> Trace:
    df = pd.DataFrame(
        {
            "request_id": [5, 6, 7, 9],
            "arrival_s": [0.0, 0.1 + 0.2, 1 / 3, 1e-7 + 2],
            "prompt_len": [1000, 600, 3, 520],
            "output_len": [1, 50, 7, 2],
            "session_id": [0, 0, -1, 3],
            "prefix_block_ids": [[0, 1], [0, 2], [], [0, 1]],
            "prompt_token_ids": [None, None, [1, 2, 3], None],
            "model": ["ChatGPT", "GPT-4", "ChatGPT", "x,y"],
        }
    )
    return Trace(df, name="rich", prefix_block_size=512)


def assert_same(a: Trace, b: Trace) -> None:
    assert a.prefix_block_size == b.prefix_block_size
    assert list(a.df.columns) == list(b.df.columns)
    for c in a.df.columns:
        x, y = a.df[c], b.df[c]
        if isinstance(x.dtype, pd.ArrowDtype):
            assert pa.array(x.array).to_pylist() == pa.array(y.array).to_pylist(), c
        else:
            assert x.tolist() == y.tolist(), c
    for i in range(len(a)):
        assert a.token_ids(i) == b.token_ids(i)


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".jsonl"])
def test_round_trip(tmp_path, suffix):
    t = rich_trace()
    path = traces.save(t, tmp_path / f"rich{suffix}")
    back = traces.load(path)
    assert_same(t, back)
    assert back.name == "rich"
    assert back.df["arrival_s"].tolist() == t.df["arrival_s"].tolist()  # bit-exact floats


def test_round_trip_plain_and_from_parquet(tmp_path):
    t = Trace(frame(arrival_s=[0.5, 0.75, 2.0]), name="plain")
    for suffix in (".parquet", ".csv", ".jsonl"):
        back = traces.load(traces.save(t, tmp_path / f"plain{suffix}"))
        assert_same(t, back)  # canonical files are not rebased
    assert_same(t, Trace.from_parquet(tmp_path / "plain.parquet"))
    with pytest.raises(ValueError, match="unknown output suffix"):
        traces.save(t, tmp_path / "x.txt")


@st.composite
def random_traces(draw):
    n = draw(st.integers(1, 12))
    gaps = draw(st.lists(st.floats(0, 1e4, allow_nan=False, allow_infinity=False), min_size=n, max_size=n))
    prompt = draw(st.lists(st.integers(1, 5000), min_size=n, max_size=n))
    bs = draw(st.sampled_from([None, 1, 16, 512]))
    cols = {
        "request_id": draw(st.permutations(list(range(n)))),
        "arrival_s": np.cumsum(gaps).tolist(),
        "prompt_len": prompt,
        "output_len": draw(st.lists(st.integers(1, 10**6), min_size=n, max_size=n)),
    }
    if draw(st.booleans()):
        cols["session_id"] = draw(st.lists(st.integers(-1, 2**40), min_size=n, max_size=n))
    if bs is not None:
        cols["prefix_block_ids"] = [
            draw(st.lists(st.integers(0, 2**62), max_size=min(5, -(-p // bs)))) for p in prompt
        ]
    return Trace(pd.DataFrame(cols), name="h", prefix_block_size=bs)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(t=random_traces(), suffix=st.sampled_from([".parquet", ".csv", ".jsonl"]))
def test_round_trip_property(tmp_path_factory, t, suffix):
    path = traces.save(t, tmp_path_factory.mktemp("rt") / f"h{suffix}")
    assert_same(t, traces.load(path))


def test_from_csv_and_jsonl(tmp_path):
    t = rich_trace()
    assert_same(t, Trace.from_csv(t.to_csv(tmp_path / "r.csv")))
    assert_same(t, Trace.from_jsonl(t.to_jsonl(tmp_path / "r.jsonl")))


def test_token_ids_many_equals_token_ids_row_by_row():
    import traces as tr

    plain = tr.generate(num_requests=40, seed=5, prompt={"kind": "uniform", "low": 1, "high": 90})
    assert plain.token_ids_many(3, 37, 1000) == [plain.token_ids(i, 1000) for i in range(3, 37)]
    assert plain.token_ids_many(38, 100, 1000) == [plain.token_ids(i, 1000) for i in range(38, 40)]
    shared = tr.generate(num_requests=20, seed=5, shared_prefix={"num_prefixes": 2, "prefix_len": 32})
    assert shared.token_ids_many(0, 20, 500) == [shared.token_ids(i, 500) for i in range(20)]


def test_small_vocab_tokens_are_bytes_of_one_hash_per_eight_positions():
    # exact values pin the definition: the simulator and the engine replay must draw the same prompts
    assert synthetic_token_ids(10, request_id=3, vocab_size=256).tolist() == [
        197, 235, 57, 212, 95, 136, 145, 115, 67, 34,
    ]  # fmt: skip
    # a prefix block of 4 tokens, then the request's own tokens from position 4 on
    assert synthetic_token_ids(10, [7], 4, request_id=3, vocab_size=256).tolist() == [
        99, 145, 90, 145, 95, 136, 145, 115, 67, 34,
    ]  # fmt: skip
    assert synthetic_token_ids(10, request_id=3, vocab_size=100).tolist() == [
        97, 35, 57, 12, 95, 36, 45, 15, 67, 34,
    ]  # fmt: skip
    assert synthetic_token_ids(5000, [1, 2], 512, vocab_size=7).max() == 6


def test_token_ids_many_equals_token_ids_in_byte_mode():
    import traces as tr

    plain = tr.generate(num_requests=40, seed=5, prompt={"kind": "uniform", "low": 1, "high": 90})
    for vocab in (256, 100, 2):
        assert plain.token_ids_many(0, 40, vocab) == [plain.token_ids(i, vocab) for i in range(40)]


def test_synthetic_vocab_size():
    from traces import synthetic_vocab_size

    assert synthetic_vocab_size(151936, 16) == 256
    assert synthetic_vocab_size(151936, 8) == 256
    assert synthetic_vocab_size(151936, 4) == 151936  # a block of 4 bytes would collide by chance
    assert synthetic_vocab_size(100, 16) == 100
