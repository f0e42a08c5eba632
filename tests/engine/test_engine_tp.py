"""Tensor parallelism on a CPU (gloo, torch attention, float32): TP=2 and TP=4 reproduce TP=1's greedy
tokens with prefix caching and forced preemption (KV heads split, and replicated when TP exceeds
them); heads that do not divide fail before any process starts; a worker that dies mid-run is a
RuntimeError on rank 0, not a hang; step records carry tp and, when profiled, all-reduce times."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from engine_helpers import CPU_ENGINE, MAX_NEW_TOKENS, make_prompts

from engine.distributed import TEST_EXIT_CODE, TEST_EXIT_ENV, StepMessage, check_tp_shapes, resolve_port
from engine.llm import LLM
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
# 78 blocks of 4 tokens: every request fits alone but not all at once (preemption); the prompts
# share 40- and 272-token prefixes (prefix-cache hits)
OPTS = {
    **CPU_ENGINE,
    "block_size": 4,
    "max_num_batched_tokens": 128,
    "num_kv_blocks": 78,
    "dist_timeout_s": 60.0,
}


@pytest.fixture(scope="module")
def tp_checkpoints(checkpoints, tmp_path_factory) -> dict:
    """The tiny checkpoints (4 heads, 2 KV heads) plus a Qwen3 variant with 4 KV heads."""
    from engine.checkpoint import make_random_checkpoint

    kv4 = make_random_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "kv4", "qwen3", "tiny", seed=2, dtype="float32", init_std=0.2,
        num_key_value_heads=4,
    )  # fmt: skip
    return {**checkpoints, "qwen3-kv4": kv4}


def generate(path, **kwargs) -> tuple[list[list[int]], dict]:
    with LLM(path, **{**OPTS, **kwargs}) as llm:
        outputs = llm.generate(make_prompts(), GREEDY, use_tqdm=False)
        stats = {
            "preemptions": llm.scheduler.num_preemptions,
            "hits": llm.block_manager.num_prefix_hit_tokens,
            "steps": llm.recorder.to_dataframe(),
            "async": llm.async_scheduling,
        }
    return [o["token_ids"] for o in outputs], stats


@pytest.mark.parametrize(
    "model, tp, policy",
    [
        ("qwen3", 2, "chunked"),
        ("llama", 2, "prefill_first"),
        ("qwen3", 4, "chunked"),  # 2 KV heads over 4 ranks: each KV head on two ranks
        ("qwen3-kv4", 4, "chunked"),
    ],
)
def test_tp_matches_tp1(tp_checkpoints, model, tp, policy):
    path = tp_checkpoints[model]
    reference, _ = generate(path, policy=policy)
    profile = tp == 2
    tokens, stats = generate(
        path, policy=policy, tensor_parallel_size=tp, profile_allreduce=profile, async_scheduling=True
    )
    assert tokens == reference
    assert stats["async"] is False  # asked for, but every rank replays each batch: off under TP
    assert stats["preemptions"] > 0 and stats["hits"] > 0
    df = stats["steps"]
    assert (df["tp"] == tp).all()
    if profile:
        assert (df["allreduce_time_s"] > 0).all()
        assert (df["allreduce_time_s"] <= df["gpu_time_s"]).all()
    else:
        assert df["allreduce_time_s"].isna().all()
    assert not multiprocessing.active_children()  # close() joined every worker


def test_allreduce_time_is_nan_without_tp(checkpoints):
    _, stats = generate(checkpoints["qwen3"], profile_allreduce=True)
    assert stats["steps"]["allreduce_time_s"].isna().all()


def test_heads_not_dividing_fail_before_spawning(checkpoints):
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide num_heads 4"):
        LLM(checkpoints["qwen3"], **OPTS, tensor_parallel_size=3)
    assert not multiprocessing.active_children()


def test_vocab_or_mlp_not_dividing_fail_early(checkpoints):
    import dataclasses

    from engine.model_spec import ModelSpec

    spec = ModelSpec.from_hf_config(checkpoints["qwen3"])
    check_tp_shapes(spec, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 does not divide vocab_size 510"):
        check_tp_shapes(dataclasses.replace(spec, vocab_size=510), 4)
    with pytest.raises(ValueError, match="does not divide intermediate_size 130"):
        check_tp_shapes(dataclasses.replace(spec, intermediate_size=130), 4)


def test_dead_worker_is_runtime_error(checkpoints, monkeypatch):
    monkeypatch.setenv(TEST_EXIT_ENV, "1:3")  # rank 1 exits when it receives step 3
    t0 = time.monotonic()
    llm = LLM(checkpoints["qwen3"], **OPTS, tensor_parallel_size=2)
    with (
        llm,
        pytest.raises(RuntimeError, match=rf"rank 1 \(pid \d+\) exited with code {TEST_EXIT_CODE}.*step 3"),
    ):
        llm.generate(make_prompts(), GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    assert llm.runner is None and llm.executor is None  # closed on the failure
    assert not multiprocessing.active_children()


def test_step_message_rebuilds_the_runner_inputs():
    """A worker's batch (built from the pickled message) gives the model the same inputs as
    rank 0's ScheduledBatch: a prefill chunk that does not sample, a prefix hit, decodes."""
    import pickle

    from engine.attention.metadata import build_step_inputs
    from engine.core.scheduler import make_batch
    from engine.core.sequence import Sequence

    seqs = [Sequence(i, list(range(10 * i, 10 * i + n)), GREEDY) for i, n in enumerate([9, 7, 12, 5])]
    for i, s in enumerate(seqs):
        s.block_table = [4 * i + j for j in range(4)]
    batch = make_batch(seqs, [4, 3, 1, 1], [0, 4, 11, 4], [0, 4, 0, 0], [], 16)
    worker = pickle.loads(pickle.dumps(StepMessage.from_batch(batch))).to_batch()
    assert (worker.kind, worker.num_seqs, worker.do_sample) == (batch.kind, batch.num_seqs, batch.do_sample)
    cpu = torch.device("cpu")
    a, b = build_step_inputs(batch, 4, cpu), build_step_inputs(worker, 4, cpu)
    for name in ("input_ids", "positions", "logits_indices"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    for name in ("slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "context_lens", "block_tables"):
        assert getattr(a.attn, name).tolist() == getattr(b.attn, name).tolist(), name
    assert a.sampled_seq_indices == b.sampled_seq_indices


def test_table_deltas_rebuild_every_table_on_the_worker():
    """Rank 0 sends each sequence the blocks it added since the last step (its whole table when its
    list is new); the worker's tables equal rank 0's after every step, keep their list while rank 0's
    does (so its BlockTableRows keeps the row) and are forgotten once rank 0 forgets them."""
    import pickle

    from engine.core.scheduler import make_batch
    from engine.core.sequence import Sequence
    from engine.distributed import TableDeltas, WorkerTables

    seqs = [Sequence(i, [1, 2, 3], GREEDY) for i in range(3)]
    for i, s in enumerate(seqs):
        s.block_table = [10 * i]
    deltas, tables, kept = TableDeltas(keep=3), WorkerTables(), {}

    def step(batch_seqs):
        n = len(batch_seqs)
        batch = make_batch(batch_seqs, [1] * n, [2] * n, [0] * n, [], 0, n)
        message = pickle.loads(pickle.dumps(StepMessage.from_batch(batch, deltas)))
        worker = message.to_batch(tables)
        assert [w.block_table for w in worker.seqs] == [s.block_table for s in batch_seqs]
        return message, {s.seq_id: w.block_table for s, w in zip(batch_seqs, worker.seqs)}

    message, kept = step(seqs)
    assert (message.block_tables, message.table_whole) == ([[0], [10], [20]], (True, True, True))
    seqs[0].block_table.append(1)  # a decode opened a block
    seqs[2].block_table = [7, 8]  # freed and given blocks again: a new list
    message, now = step(seqs)
    assert (message.block_tables, message.table_whole) == ([[1], [], [7, 8]], (False, False, True))
    assert now[0] is kept[0] and now[1] is kept[1] and now[2] is not kept[2]
    new = Sequence(3, [1, 2, 3], GREEDY)
    new.block_table = [30]
    message, _ = step([seqs[0], new])  # four held, keep 3: the two absent from the step go
    assert (message.seq_ids, message.forget) == ((0, 3), (1, 2))
    assert sorted(tables._tables) == [0, 3]
    with pytest.raises(ValueError, match="needs the worker's WorkerTables"):
        message.to_batch()


def test_rendezvous_port(monkeypatch):
    monkeypatch.delenv("KVPLAN_TP_PORT", raising=False)
    assert resolve_port(None) == 0  # a free one, bound by the store
    monkeypatch.setenv("KVPLAN_TP_PORT", "29517")
    assert resolve_port(None) == 29517
    assert resolve_port(40000) == 40000
    with pytest.raises(ValueError, match="dist_port"):
        resolve_port(70000)
