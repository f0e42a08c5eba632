"""The simulator's generated prompts are byte arrays (`Trace.token_ids_many(compact=True)`): the same
values as the lists, and a simulation on them gives exactly the requests, ITL and summary of one on
the prompts built as lists (`trace_prompts`, copied into lists of ints)."""

from array import array

import pandas as pd
import pytest

import traces
from simulator.latency.roofline import RooflineModel
from simulator.run import run_simulation
from simulator.sim import trace_prompts
from traces.schema import synthetic_vocab_size


def test_compact_rows_are_bytes_of_the_same_values():
    plain = traces.generate(num_requests=40, seed=5, prompt={"kind": "uniform", "low": 1, "high": 90})
    for vocab in (256, 100, 2):
        rows = plain.token_ids_many(0, 40, vocab, compact=True)
        assert all(type(r) is array and r.typecode == "B" for r in rows)
        assert [list(r) for r in rows] == plain.token_ids_many(0, 40, vocab)
    skipped = plain.token_ids_many(0, 40, 256, skip=lambda n: n > 45, compact=True)
    assert [r is None for r in skipped] == [n > 45 for n in plain.df["prompt_len"]]
    assert [list(r) for r in skipped if r is not None] == [
        plain.token_ids(i, 256) for i, n in enumerate(plain.df["prompt_len"]) if n <= 45
    ]
    # tokens that are not bytes, and prompts with shared prefixes, stay lists
    assert plain.token_ids_many(0, 5, 1000, compact=True) == plain.token_ids_many(0, 5, 1000)
    shared = traces.generate(num_requests=20, seed=5, shared_prefix={"num_prefixes": 2, "prefix_len": 32})
    assert shared.token_ids_many(0, 20, 256, compact=True) == [shared.token_ids(i, 256) for i in range(20)]


@pytest.mark.parametrize(
    "replicas,router,async_scheduling,caching",
    [
        (1, "round_robin", False, True),
        (1, "round_robin", True, True),
        (1, "round_robin", False, False),
        (3, "least_outstanding", False, True),
        (2, "prefix_aware", False, True),  # it reads the prompts: lists (see `compact` in sim.py)
    ],
)
def test_byte_prompts_simulate_exactly_as_lists(
    small_config, monkeypatch, replicas, router, async_scheduling, caching
):
    trace = traces.generate(
        num_requests=400, seed=11, rate=40.0, prompt={"kind": "uniform", "low": 20, "high": 900}
    )
    config = small_config(
        num_replicas=replicas,
        router=router,
        async_scheduling=async_scheduling,
        enable_prefix_caching=caching,
        num_kv_blocks=300,
    )
    latency = RooflineModel(config.model, config.gpu, config.tensor_parallel_size)
    vocab = synthetic_vocab_size(config.model.vocab_size, config.block_size)
    built = run_simulation(trace, config, latency=latency, prompts=trace_prompts(trace, vocab))
    kinds = set()
    many = traces.Trace.token_ids_many

    def noting(self, *args, **kwargs):
        rows = many(self, *args, **kwargs)
        kinds.update(type(r) for r in rows if r is not None)
        return rows

    monkeypatch.setattr(traces.Trace, "token_ids_many", noting)
    generated = run_simulation(trace, config, latency=latency)
    assert kinds == ({list} if router == "prefix_aware" else {array})
    pd.testing.assert_frame_equal(built.requests, generated.requests, check_exact=True)
    pd.testing.assert_frame_equal(built.timeline, generated.timeline, check_exact=True)
    assert [list(x) for x in generated.itl] == [list(x) for x in built.itl]
    timing = {"sim_wall_s", "sim_speedup"}  # the run's own wall time
    assert {k: v for k, v in generated.summary.items() if k not in timing} == {
        k: v for k, v in built.summary.items() if k not in timing
    }
    assert built.summary["sim_steps"] > 400
