"""BlockTableRows and DeviceTableRows: the block tables a model runner keeps between steps (on the
host, or mirrored on the device by the entries each step wrote) give the very table that building
every row from its list gives (exact rows, row reuse, growth), on a real scheduler too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention.metadata import BlockTableRows, DeviceTableRows, build_step_inputs
from engine.core.block_manager import BlockManager
from engine.core.config import SchedulerConfig
from engine.core.scheduler import Scheduler
from engine.sampling_params import SamplingParams


def reference(tables: list[list[int]], width: int) -> np.ndarray:
    out = np.zeros((len(tables), width), np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t
    return out


def test_rows_extend_reuse_and_grow():
    rows = BlockTableRows(num_rows=2, width=3)
    a, b = [7], [4, 5]
    assert rows.gather([a, b], 2).tolist() == [[7, 0], [4, 5]]
    a.append(9)  # a decode opened a block: only it is written
    assert rows.gather([b, a], 2).tolist() == [[4, 5], [7, 9]]
    assert [rows._entries[id(t)][0] for t in (a, b)] == [0, 1]
    c = [1, 2, 3]  # no free row: b's row, absent from this step, goes to c (zeros after it)
    assert rows.gather([a, c], 3).tolist() == [[7, 9, 0], [1, 2, 3]]
    assert rows._entries[id(c)][0] == 1 and id(b) not in rows._entries
    d = [6, 6, 6, 6]  # wider than the rows, and every row in use: both grow
    assert rows.gather([a, c, d], 4).tolist() == [[7, 9, 0, 0], [1, 2, 3, 0], [6, 6, 6, 6]]
    assert rows.rows.shape == (4, 4)
    e = [8]  # a's sequence freed its blocks and got new ones: a new list, a row of its own
    assert rows.gather([e], 1).tolist() == [[8]]
    with pytest.raises(ValueError, match="num_rows and width"):
        BlockTableRows(0, 4)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_gather_is_the_rebuilt_table(data):
    """Any sequence of steps (tables that grow, are replaced, come and go) reads what a table
    rebuilt from the lists reads, through row reuse and growth."""
    rows = BlockTableRows(
        num_rows=data.draw(st.integers(1, 4)), width=data.draw(st.integers(1, 4)), track_writes=True
    )
    mirror = rows.rows.copy()  # what a copy kept by take_writes alone holds
    live: list[list[int]] = [[]]
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["grow", "replace", "new", "step"]))
        i = data.draw(st.integers(0, len(live) - 1))
        if op == "grow":
            live[i].extend(data.draw(st.lists(st.integers(0, 999), min_size=1, max_size=3)))
        elif op == "replace":  # freed (a new, empty list), then perhaps given blocks again
            live[i] = data.draw(st.lists(st.integers(0, 999), max_size=3))
        elif op == "new":
            live.append(data.draw(st.lists(st.integers(0, 999), max_size=3)))
        chosen = data.draw(st.lists(st.sampled_from(range(len(live))), min_size=1, max_size=6, unique=True))
        tables = [live[j] for j in chosen]
        width = max(1, max(len(t) for t in tables))
        np.testing.assert_array_equal(rows.gather(tables, width), reference(tables, width))
        writes = rows.take_writes()
        if writes is None:  # the rows changed shape: taken whole
            mirror = rows.rows.copy()
        else:
            mirror.reshape(-1)[writes[0]] = writes[1]
        np.testing.assert_array_equal(mirror, rows.rows)


def test_take_writes_gives_exactly_the_entries_written():
    rows = BlockTableRows(num_rows=2, width=4, track_writes=True)
    a, b = [7, 8], [5]
    rows.index([a, b], 2)
    flat, values = rows.take_writes()
    assert flat.tolist() == [0, 1, 4] and values.tolist() == [7, 8, 5]  # a in row 0, b in row 1
    a.append(9)
    rows.index([a, b], 3)
    assert [x.tolist() for x in rows.take_writes()] == [[2], [9]]  # a's new block only
    rows.index([a, b], 3)
    assert [x.tolist() for x in rows.take_writes()] == [[], []]
    c = [1]  # b (absent) gives its row to c: c's one entry over b's one, nothing left to zero
    rows.index([a, c], 3)
    assert [x.tolist() for x in rows.take_writes()] == [[4], [1]]
    e = [3, 3, 3, 3]
    rows.index([c, e], 4)  # a is absent: its row (3 entries) goes to e, nothing past e's 4 to zero
    assert [x.tolist() for x in rows.take_writes()] == [[0, 1, 2, 3], [3, 3, 3, 3]]
    f = [6]
    rows.index([c, f], 1)  # e is absent: its row goes to f, whose one entry leaves three to zero
    assert [x.tolist() for x in rows.take_writes()] == [[0, 1, 2, 3], [6, 0, 0, 0]]
    d = [2, 2, 2, 2, 2]  # wider than the rows: the copy must take them whole
    rows.index([c, f, d], 5)
    assert rows.take_writes() is None
    with pytest.raises(RuntimeError, match="track_writes"):
        BlockTableRows(1, 1).take_writes()


def test_device_rows_follow_reuse_and_growth_on_a_cpu():
    rows = DeviceTableRows(num_rows=1, width=2, device=torch.device("cpu"))
    a, b = [3], [4, 6]
    for tables, width in (([a], 1), ([b], 2), ([a, b], 2), ([b, [1, 1, 1]], 3)):
        index, flat, values = (torch.from_numpy(x) for x in rows.parts(tables, width))
        assert rows.table(index, flat, values, width).tolist() == reference(tables, width).tolist()
        assert torch.equal(rows.device_rows, torch.from_numpy(rows.host.rows))


def test_a_scheduler_run_builds_the_same_inputs_with_and_without_rows():
    """A chunked run with prefix caching and preemptions (a small cache): every step's inputs are
    the same tensors whether the tables come from kept rows (on the host, or gathered from the rows
    a device copy keeps) or are rebuilt."""
    bs = 4
    bm = BlockManager(num_blocks=24, block_size=bs, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=32, max_model_len=96, policy="chunked")
    sched = Scheduler(config, bm, clock=lambda: 0.0)
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 50, 8).tolist()
    for _ in range(10):
        prompt = shared + rng.integers(0, 50, int(rng.integers(1, 20))).tolist()
        sched.add_request(prompt, SamplingParams(max_tokens=int(rng.integers(2, 30)), ignore_eos=True))
    cpu = torch.device("cpu")
    kept = (BlockTableRows(num_rows=2, width=2), DeviceTableRows(num_rows=2, width=2, device=cpu))
    steps = preempted = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        preempted += len(batch.preempted_seq_ids)
        if batch.is_empty:
            break
        want = build_step_inputs(batch, bs, cpu)
        for rows in kept:
            got = build_step_inputs(batch, bs, cpu, table_rows=rows)
            for name in ("input_ids", "positions", "logits_indices"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (steps, name)
            for name in ("block_tables", "slot_mapping", "context_lens", "cu_seqlens_q", "cu_seqlens_k"):
                assert torch.equal(getattr(got.attn, name), getattr(want.attn, name)), (steps, name)
        sched.postprocess(batch, [int(t) for t in rng.integers(0, 50, batch.num_seqs)])
        steps += 1
    assert not sched.has_unfinished() and preempted > 0 and steps > 20
