"""A replica's per-request rows and timeline are kept column by column (`TypedRows`): the rows read
back as they were appended, and `rows_frame` builds the very table that `pd.DataFrame.from_records`
of those rows gives (columns, dtypes, values), as `collect` built it before."""

import numpy as np
import pandas as pd
import pytest

import traces
from engine.records import REQUEST_FIELDS
from simulator.latency.roofline import RooflineModel
from simulator.sim import TIMELINE_COLUMN_TYPES, TIMELINE_FIELDS, TypedRows, rows_frame, simulate


def _from_rows(parts: list[TypedRows]) -> pd.DataFrame:
    """The table as `collect` built it from tuples before the rows were kept in columns."""
    rows = [r for p in parts for r in p]
    return pd.DataFrame.from_records(rows, columns=list(REQUEST_FIELDS))


def _sorted(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values("request_id", kind="stable").reset_index(drop=True)


def _assert_same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a, b, check_dtype=True, check_index_type=True, check_column_type=True)
    assert a.dtypes.to_dict() == b.dtypes.to_dict()
    assert a.columns.dtype == b.columns.dtype


@pytest.fixture(scope="module")
def long_prompts():
    """Rejected prompts (too long; more than the cache) among served ones, and preemptions."""
    rng = np.random.default_rng(11)
    n = 240
    prompt = rng.integers(20, 1500, n)
    prompt[::5] = 3000  # > max_model_len
    prompt[3::7] = 1900  # more blocks than the cache
    df = pd.DataFrame(
        {
            "request_id": rng.permutation(n) * 3 + 1_000_000,
            "arrival_s": np.cumsum(rng.exponential(1 / 30, n)),
            "prompt_len": prompt,
            "output_len": rng.integers(1, 300, n),
        }
    )
    return traces.Trace(df, name="long_prompts")


@pytest.mark.parametrize(
    "replicas,router,async_scheduling",
    [(1, "round_robin", False), (3, "least_outstanding", False), (2, "round_robin", True)],
)
def test_requests_frame_equals_the_table_of_the_rows(
    long_prompts, small_config, replicas, router, async_scheduling
):
    config = small_config(
        num_replicas=replicas,
        router=router,
        async_scheduling=async_scheduling,
        max_model_len=2048,
        num_kv_blocks=100,
        max_num_batched_tokens=2048,
    )
    latency = RooflineModel(config.model, config.gpu, config.tensor_parallel_size)
    run = simulate(long_prompts, config, latency, config.num_kv_blocks)
    parts = [r.records for r in run.replicas]
    assert sum(len(p) for p in parts) == len(long_prompts)
    frame = rows_frame(parts)
    _assert_same(frame, _from_rows(parts))
    _assert_same(rows_frame(parts, order_by="request_id"), _sorted(_from_rows(parts)))
    timeline = rows_frame([r.timeline for r in run.replicas], scale={"kv_usage": config.num_kv_blocks})
    old_timeline = pd.DataFrame.from_records(
        [(t, i, used / config.num_kv_blocks, n, w) for r in run.replicas for t, i, used, n, w in r.timeline],
        columns=list(TIMELINE_FIELDS),
    )
    assert len(timeline) > 10
    _assert_same(timeline, old_timeline)
    reasons = set(frame["finish_reason"])
    assert {"rejected_prompt_too_long", "rejected_kv_capacity", "length"} <= reasons
    assert frame["first_token_s"].isna().any() and frame["num_preemptions"].sum() > 0
    for part in parts:  # missing times read back as None, as request_record gives them
        for row in part:
            assert len(row) == len(REQUEST_FIELDS)
            if row[-1].startswith("rejected"):
                assert row[3] is None and row[4] is None


def _row(request_id, first_token, reason="length"):
    return (request_id, 0, 0.5, first_token, first_token, 1.0, 10, 4, 4, 0, 0, reason)


@pytest.mark.parametrize(
    "rows",
    [
        [],  # no request: from_records' object columns
        [_row(3, None, "rejected_prompt_too_long"), _row(1, None, "rejected_kv_capacity")],  # all None
        [_row(2, 0.75), _row(5, None, "rejected_kv_capacity")],
        [_row(2**40, 0.25), _row(7, 0.5), _row(2**40, 0.125), _row(-3, 0.5)],  # ties keep their order
    ],
)
def test_requests_frame_edge_cases(rows):
    parts = [TypedRows.requests(), TypedRows.requests()]
    for k, row in enumerate(rows):
        parts[k % 2].append(row)
    assert [r for p in parts for r in p] == [r for k in (0, 1) for r in rows[k::2]]
    _assert_same(rows_frame(parts), _from_rows(parts))
    _assert_same(rows_frame(parts, order_by="request_id"), _sorted(_from_rows(parts)))


def test_an_empty_timeline_is_from_records_own():
    parts = [TypedRows(TIMELINE_COLUMN_TYPES) for _ in range(2)]
    _assert_same(rows_frame(parts), pd.DataFrame.from_records([], columns=list(TIMELINE_FIELDS)))


def test_values_that_a_column_cannot_hold_fail_loudly():
    records = TypedRows.requests()
    with pytest.raises(TypeError):
        records.append((None, *_row(1, 0.5)[1:]))  # an integer field is never missing
    with pytest.raises(OverflowError):  # the token counts are int32 columns
        records.append((*_row(1, 0.5)[:6], 2**31, *_row(1, 0.5)[7:]))


def test_a_released_run_gives_the_same_tables(long_prompts, small_config):
    """`collect(run, release=True)` (as `run_simulation` collects): the tables and summary of a run
    collected and kept; the replicas' rows, schedulers and block managers let go."""
    from simulator.run import collect, simulate_config

    config = small_config(
        num_replicas=3,
        router="least_outstanding",
        max_model_len=2048,
        num_kv_blocks=100,
        max_num_batched_tokens=2048,
    )
    latency = RooflineModel(config.model, config.gpu, config.tensor_parallel_size)
    kept = collect(simulate_config(long_prompts, config, latency=latency))
    run = simulate_config(long_prompts, config, latency=latency)
    released = collect(run, release=True)
    _assert_same(released.requests, kept.requests)
    _assert_same(released.timeline, kept.timeline)
    skip = {"sim_wall_s", "sim_speedup"}
    assert {k: v for k, v in released.summary.items() if k not in skip} == {
        k: v for k, v in kept.summary.items() if k not in skip
    }
    assert all(len(r.records) == 0 and r.scheduler is None and r.block_manager is None for r in run.replicas)
