"""Prompts that the scheduler would reject are never generated (`Trace.token_ids_many(skip=...)`):
the same request table as a run whose prompts are all built, and the kept prompts unchanged."""

import numpy as np
import pandas as pd
import pytest

import traces
from simulator.latency.roofline import RooflineModel
from simulator.run import run_simulation
from simulator.sim import _rejects, trace_prompts
from traces.schema import synthetic_vocab_size


@pytest.fixture(scope="module")
def long_prompts():
    """Every fifth prompt exceeds a max_model_len of 2,048, every seventh the whole KV cache."""
    rng = np.random.default_rng(5)
    n = 300
    prompt = rng.integers(20, 1500, n)
    prompt[::5] = 3000  # > max_model_len
    prompt[3::7] = 1900  # <= max_model_len, more blocks than the cache (100 x 16 tokens)
    df = pd.DataFrame(
        {
            "request_id": np.arange(n),
            "arrival_s": np.cumsum(rng.exponential(1 / 30, n)),
            "prompt_len": prompt,
            "output_len": rng.integers(5, 100, n),
        }
    )
    return traces.Trace(df, name="long_prompts")


@pytest.mark.parametrize(
    "replicas,router,async_scheduling",
    [
        (1, "round_robin", False),
        (3, "least_outstanding", False),
        (2, "round_robin", True),
        (2, "prefix_aware", False),
    ],
)
def test_rejected_prompts_are_not_built_and_change_nothing(
    long_prompts, small_config, monkeypatch, replicas, router, async_scheduling
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
    vocab = synthetic_vocab_size(config.model.vocab_size, config.block_size)
    built = run_simulation(long_prompts, config, latency=latency, prompts=trace_prompts(long_prompts, vocab))
    generated = []
    many = traces.Trace.token_ids_many

    def counting(self, start, stop, vocab_size=32000, salt=0, skip=None, **kwargs):
        rows = many(self, start, stop, vocab_size, salt, skip, **kwargs)
        generated.extend(len(r) for r in rows if r is not None)
        return rows

    monkeypatch.setattr(traces.Trace, "token_ids_many", counting)
    skipped = run_simulation(long_prompts, config, latency=latency)
    pd.testing.assert_frame_equal(built.requests, skipped.requests, check_exact=True)
    reasons = skipped.requests["finish_reason"].value_counts().to_dict()
    assert reasons["rejected_prompt_too_long"] == 60 - 9  # 9 of them hold 1,900 tokens
    assert reasons["rejected_kv_capacity"] == 43
    rejected = skipped.requests["finish_reason"].str.startswith("rejected")
    kept_tokens = int(long_prompts.df["prompt_len"][~rejected.to_numpy()].sum())
    if router == "prefix_aware":  # it reads every prompt: all are built
        assert sum(generated) == int(long_prompts.df["prompt_len"].sum())
    else:
        assert sum(generated) == kept_tokens


def test_skipped_rows_are_none_and_the_rest_unchanged(long_prompts, small_config):
    from engine.core.block_manager import BlockManager
    from simulator.fast_forward import FastForwardScheduler

    config = small_config(max_model_len=2048, num_kv_blocks=100)
    rejects = _rejects(FastForwardScheduler(config.scheduler_config(), BlockManager(100, 16, True)))
    assert [rejects(n) for n in (1600, 1601, 2048, 2049)] == [False, True, True, True]
    rows = long_prompts.token_ids_many(0, 40, 256, skip=lambda n: n > 2048)
    assert [i for i, r in enumerate(rows) if r is None] == [0, 5, 15, 20, 25, 30, 35]  # 10 holds 1,900
    assert all(r == long_prompts.token_ids(i, 256) for i, r in enumerate(rows) if r is not None)
    assert long_prompts.prompt_num_tokens(5) == len(long_prompts.token_ids(5, 256)) == 3000
