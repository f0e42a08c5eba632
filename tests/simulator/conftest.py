"""Shared fixtures for simulator tests: small seeded traces and configurations."""

import pytest

import traces
from simulator.config import SimConfig
from simulator.models import resolve_model


@pytest.fixture(scope="session")
def qwen06():
    return resolve_model("qwen3-0.6b")


@pytest.fixture(scope="session")
def prefix_trace():
    """400 requests over 8 shared system prompts: prefix hits, and preemptions with a small cache."""
    return traces.generate(
        num_requests=400,
        rate=40.0,
        seed=7,
        prompt={"kind": "uniform", "low": 20, "high": 400},
        output={"kind": "uniform", "low": 5, "high": 200},
        shared_prefix={"num_prefixes": 8, "prefix_len": 256, "zipf": 1.0},
    )


@pytest.fixture()
def small_config(qwen06):
    def make(**kw):
        base = dict(model=qwen06, num_kv_blocks=400, max_num_seqs=32, max_num_batched_tokens=1024)
        base.update(kw)
        return SimConfig(**base)

    return make
