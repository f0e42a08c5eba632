"""Async scheduling (the host schedules and launches decode step n+1 while step n runs) changes
nothing but timing: the same tokens as HF transformers and as the synchronous loop, the same steps
in the same order, the same prefix hits and preemptions, on CPU with the torch backend."""

from __future__ import annotations

import dataclasses

import pytest
from engine_helpers import CPU_ENGINE, MAX_NEW_TOKENS, make_prompts

from engine.llm import LLM
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
SHAPE_COLUMNS = [
    "kind",
    "num_seqs",
    "total_num_scheduled_tokens",
    "total_num_cached_tokens",
    "num_context_tokens",
    "num_waiting",
]


def serve(path, async_scheduling: bool, params=GREEDY, **kwargs):
    llm = LLM(path, **{**CPU_ENGINE, "async_scheduling": async_scheduling, **kwargs})
    outputs = llm.generate(make_prompts(), params, use_tqdm=False)
    return [o["token_ids"] for o in outputs], llm


def assert_same_run(a: LLM, b: LLM) -> None:
    steps_a, steps_b = (x.recorder.to_dataframe()[SHAPE_COLUMNS] for x in (a, b))
    assert steps_a.equals(steps_b)
    assert a.block_manager.num_prefix_hit_tokens == b.block_manager.num_prefix_hit_tokens
    assert a.scheduler.num_preemptions == b.scheduler.num_preemptions


@pytest.mark.parametrize(
    "opts",
    [
        dict(policy="chunked"),
        dict(policy="prefill_first"),
        dict(policy="chunked", enable_prefix_caching=False),
        dict(block_size=256, num_kv_blocks=16, max_num_batched_tokens=128),
        dict(block_size=4, num_kv_blocks=78, max_num_batched_tokens=128),  # forced preemption
        dict(block_size=4, num_kv_blocks=78, max_num_batched_tokens=128, policy="prefill_first"),
    ],
    ids=["chunked", "prefill_first", "no_caching", "block256", "preempt", "preempt_prefill_first"],
)
def test_async_matches_hf_and_the_synchronous_loop(checkpoints, hf_greedy, opts):
    tokens, llm = serve(checkpoints["qwen3"], True, **opts)
    sync_tokens, sync = serve(checkpoints["qwen3"], False, **opts)
    with llm, sync:
        assert tokens == hf_greedy["qwen3"] == sync_tokens
        assert llm.num_async_steps > 0 and sync.num_async_steps == 0
        assert_same_run(llm, sync)
        # a step scheduled while the one before it ran is recorded as overlapped: decodes only, never
        # the first step after a prefill or mixed step (nothing ran while that one's successor was built)
        steps = llm.recorder.to_dataframe()
        overlapped = steps["overlapped"].to_numpy()
        assert overlapped.sum() == llm.num_async_steps
        assert (steps.loc[overlapped, "kind"] == "decode").all()
        assert not (overlapped[1:] & (steps["kind"].to_numpy()[:-1] != "decode")).any()
        assert not sync.recorder.to_dataframe()["overlapped"].any()
        assert (steps.loc[overlapped, "num_waiting"] == 0).all()  # never ahead of a waiting request
        if opts.get("block_size") == 4:  # the small cache keeps requests waiting
            assert steps["num_waiting"].max() > 0
        if opts.get("block_size") == 4:
            assert llm.scheduler.num_preemptions > 0


def test_async_sampling_draws_the_same_tokens(checkpoints):
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    tokens, llm = serve(checkpoints["llama"], True, params, seed=7)
    sync_tokens, sync = serve(checkpoints["llama"], False, params, seed=7)
    with llm, sync:
        assert tokens == sync_tokens
        assert llm.num_async_steps > 0


def test_requests_that_stop_at_eos_are_never_deferred(checkpoints, hf_greedy):
    eos = hf_greedy["qwen3"][0][3]  # the tiny checkpoint has no EOS: make one of its 4th tokens EOS
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)  # EOS honoured: values matter
    runs = []
    for async_scheduling in (True, False):
        llm = LLM(checkpoints["qwen3"], **CPU_ENGINE, async_scheduling=async_scheduling)
        llm.spec = dataclasses.replace(llm.spec, eos_token_id=eos)
        runs.append(([o["token_ids"] for o in llm.generate(make_prompts(), params, use_tqdm=False)], llm))
    (tokens, llm), (sync_tokens, sync) = runs
    with llm, sync:
        assert tokens == sync_tokens
        assert tokens[0] == hf_greedy["qwen3"][0][:4]  # stopped at its EOS
        assert llm.num_async_steps == 0


def test_deferred_steps_carry_the_time_their_tokens_arrived(checkpoints):
    llm = LLM(checkpoints["qwen3"], **CPU_ENGINE, async_scheduling=True)
    with llm:
        seqs = [llm.add_request(p, GREEDY) for p in make_prompts()]
        finished = []
        while llm.has_unfinished():
            finished += llm.step()
        assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs)
        assert llm.num_async_steps > 0
        for seq in seqs:
            assert len(seq.output_token_ids) == MAX_NEW_TOKENS
            assert seq.arrival_time <= seq.first_scheduled_time <= seq.first_token_time
            assert seq.first_token_time < seq.last_token_time == seq.finish_time
        steps = llm.recorder.to_dataframe()
        assert (steps["wall_time_s"] > 0).all()
        assert (steps["idle_before_s"].iloc[1:] >= 0).all()  # a step starts when the one before ended


def test_replay_command_serves_with_async_scheduling(tmp_path, capsys):
    """`kvplan replay --async-scheduling` on a CPU: a replay folder whose run.json says so, with every
    request's timings in order."""
    import json

    import pandas as pd

    from simulator.cli import main

    out = tmp_path / "replay"
    argv = ["replay", "--random", "tiny", "--trace", "azure_conv_2023", "--limit", "6", "--rate-scale", "50",
            "--backend", "torch", "--max-model-len", "4096", "--gpu", "H200", "--async-scheduling", "--quiet",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    meta = json.loads((out / "run.json").read_text())
    assert meta["async_scheduling"] is True
    req = pd.read_parquet(out / "requests.parquet")
    assert len(req) == 6 and (req["finish_reason"] == "length").all()
    assert (req["arrival_s"] <= req["first_scheduled_s"]).all()
    assert (req["first_scheduled_s"] < req["first_token_s"]).all()
    assert (req["first_token_s"] <= req["finish_s"]).all()


def test_reset_prefix_cache_forgets_what_a_run_cached(checkpoints):
    llm = LLM(checkpoints["qwen3"], **CPU_ENGINE)
    with llm:
        prompt = make_prompts()[3]  # 70 tokens: 4 full blocks
        first = llm.generate([prompt], GREEDY, use_tqdm=False)
        assert llm.generate([prompt], GREEDY, use_tqdm=False) == first
        assert llm.block_manager.num_prefix_hit_tokens == 64
        llm.reset_prefix_cache()
        assert llm.generate([prompt], GREEDY, use_tqdm=False) == first
        assert llm.block_manager.num_prefix_hit_tokens == 0
        llm.add_request(prompt, GREEDY)
        with pytest.raises(RuntimeError, match="unfinished"):
            llm.reset_prefix_cache()
