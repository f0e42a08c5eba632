"""Token lists of bytes (`array("B")`, the simulator's generated prompts) give exactly what lists of
Python ints give: the same steps, block ids, hits, evictions, preemptions, timestamps and ITL, with
fast-forward (plain and fused) and without it, eager and lazy registration alike."""

from __future__ import annotations

import random
from array import array
from dataclasses import replace

import pytest
from cp_helpers import Run, Workload, block_manager_state, drive, itl_counts, new_hit_workload, request_fields

from simulator.fast_forward import FastForwardScheduler


def byte_workload(policy: str, seed: int = 7) -> Workload:
    """Shared system prompts and requests of their own, every token a byte, a cache too small for the
    peak (preemptions) and prefix caching on (hits and evictions)."""
    rng = random.Random(seed)
    system_prompts = [[rng.randrange(256) for _ in range(rng.choice([48, 64, 96]))] for _ in range(4)]
    arrivals, t = [], 0.0
    for i in range(600):
        t += rng.expovariate(150.0)
        prompt = [rng.randrange(256) for _ in range(rng.randrange(1, 200))] + list(i.to_bytes(2, "big"))
        if rng.random() < 0.6:
            prompt = rng.choice(system_prompts) + prompt
        arrivals.append((t, prompt, rng.choice([1, 2, 8, 32, 64, 128, 256])))
    longest = max(len(p) for _, p, _ in arrivals)
    return Workload(
        arrivals=arrivals,
        block_size=16,
        num_blocks=220,
        policy=policy,
        max_num_seqs=48,
        max_num_batched_tokens=256 if policy == "chunked" else longest + 400,
    )


def assert_identical(a: Run, b: Run) -> None:
    """Two runs of one workload by the same driver: every request, block, gap, step and count."""
    assert [request_fields(s) for s in b.seqs] == [request_fields(s) for s in a.seqs]
    assert block_manager_state(b.bm) == block_manager_state(a.bm)
    assert itl_counts(b.sched) == itl_counts(a.sched)
    for name in ("num_preemptions", "num_finished", "num_rejected"):
        assert getattr(b.sched, name) == getattr(a.sched, name)
    assert (b.end_time, b.finished, b.steps) == (a.end_time, a.finished, a.steps)
    assert (b.num_ff_calls, b.num_ff_steps, b.num_fused) == (a.num_ff_calls, a.num_ff_steps, a.num_fused)


@pytest.fixture
def byte_prompts(monkeypatch):
    """Make `FastForwardScheduler.add_request` take each prompt as a fresh `array("B")` of its
    values, as the simulator hands over its generated prompts (no copy)."""
    add = FastForwardScheduler.add_request

    def add_bytes(self, prompt, params, arrival_time=0.0, *args, **kwargs):
        kwargs.pop("copy_prompt", None)
        return add(self, array("B", prompt), params, arrival_time, *args, copy_prompt=False, **kwargs)

    monkeypatch.setattr(FastForwardScheduler, "add_request", add_bytes)


@pytest.mark.parametrize("policy", ["chunked", "prefill_first"])
@pytest.mark.parametrize("mode", ["stepped", "forwarded", "fused", "lazy"])
def test_byte_token_lists_run_exactly_as_int_lists(policy, mode, byte_prompts, monkeypatch):
    w = byte_workload(policy)
    kw = {"stepped": {"use_fast_forward": False}, "fused": {"use_fast_forward": True, "fuse_steps": True}}
    options = kw.get(mode, {"use_fast_forward": True})
    if mode == "lazy":
        w = replace(w, lazy_registration=True)
    elif mode != "stepped":
        w = replace(w, lazy_registration=False)
    with_bytes = drive(w, **options)
    assert all(type(s.token_ids) is array for s in with_bytes.seqs)  # the path under test
    monkeypatch.undo()
    with_ints = drive(w, **options)
    assert all(type(s.token_ids) is list for s in with_ints.seqs)
    assert_identical(with_ints, with_bytes)
    # the run meets what byte tokens could change: hits, evictions, preemptions, long runs
    assert with_ints.bm.num_prefix_hit_tokens > 1000
    assert with_ints.bm.num_evictions > 0
    assert with_ints.sched.num_preemptions > 10
    if mode != "stepped":
        assert with_ints.num_ff_steps > 1000


@pytest.mark.parametrize("num_output", [6, 9])
def test_a_run_stops_before_a_new_hit_of_byte_tokens(num_output, byte_prompts, monkeypatch):
    # test_fast_forward's known gap with byte prompts: A decodes zeros that fill B's third block, so
    # the run reads A's tokens of that block to see it (`_stop_before_new_hit`)
    w = new_hit_workload(num_output)
    with_bytes = drive(w, use_fast_forward=True)
    assert all(type(s.token_ids) is array for s in with_bytes.seqs)
    monkeypatch.undo()
    with_ints = drive(w, use_fast_forward=True)
    assert_identical(with_ints, with_bytes)
    a, b = with_bytes.seqs
    assert b.first_scheduled_time == a.finish_time and b.num_cached_tokens == 12
    assert list(a.token_ids) == [1, 2, 3, 4, 5, 6, 7] + [0] * num_output
