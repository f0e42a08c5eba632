"""The engine (torch backend, float32, CPU) reproduces HF transformers' greedy tokens exactly, under
both scheduling policies, with prefix caching on and off, under forced preemption, at block sizes
16 and 256, with small token budgets that force chunked prefills and mixed steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import CPU_ENGINE, MAX_NEW_TOKENS, make_prompts

from engine.core.scheduler import make_batch
from engine.llm import LLM
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)


def run_engine(path, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, **{**CPU_ENGINE, **kwargs})
    outputs = llm.generate(make_prompts(), GREEDY, use_tqdm=False)
    return [o["token_ids"] for o in outputs], llm


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("policy", ["chunked", "prefill_first"])
@pytest.mark.parametrize("caching", [True, False])
def test_matches_hf_greedy(checkpoints, hf_greedy, arch, policy, caching):
    tokens, llm = run_engine(checkpoints[arch], policy=policy, enable_prefix_caching=caching)
    with llm:
        assert tokens == hf_greedy[arch]
        hits = llm.block_manager.num_prefix_hit_tokens
        assert (hits > 0) == caching
        kinds = set(llm.recorder.to_dataframe()["kind"])
        assert {"prefill", "decode"} <= kinds
        if policy == "chunked":
            assert "mixed" in kinds


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_block_size_256(checkpoints, hf_greedy, arch):
    tokens, llm = run_engine(checkpoints[arch], block_size=256, num_kv_blocks=16, max_num_batched_tokens=128)
    with llm:
        assert tokens == hf_greedy[arch]
        assert llm.block_manager.num_prefix_hit_tokens >= 256


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("policy", ["chunked", "prefill_first"])
def test_forced_preemption(checkpoints, hf_greedy, arch, policy):
    # 78 blocks of 4 tokens: every request fits alone, but not all running ones at once
    tokens, llm = run_engine(
        checkpoints[arch], policy=policy, block_size=4, num_kv_blocks=78, max_num_batched_tokens=128
    )
    with llm:
        assert llm.scheduler.num_preemptions > 0
        assert tokens == hf_greedy[arch]


def test_eager_and_graph_flags_on_cpu(checkpoints):
    """On a CPU nothing is captured: every step is eager (graph_batch_size 0), with the torch
    attention backend and the torch layer functions (what profiles and replays record)."""
    _, llm = run_engine(checkpoints["qwen3"])
    with llm:
        assert llm.kernel_choices() == {
            "decode_kernel": None,
            "decode_balanced": None,
            "decode_fine_splits": None,
            "layer_kernels": "torch",
            "prefill_graphs": "eager",
            "step_graphs": False,
            "async_scheduling": False,
            "pdl": False,
            "gemv_prefetch": False,
            "triton_argmax": False,
            "graph_copy_kernel": False,
            "gemv_tuned_tiles": False,
            "fused_head_argmax": False,
            "table_rows": True,  # the host's tables: on a CPU too
            "device_tables": True,  # their copy on the model's device (here the CPU)
        }
        df = llm.recorder.to_dataframe()
        assert (df["graph_batch_size"] == 0).all()
        assert df["gpu_time_s"].notna().all()
        idle = df["idle_before_s"].to_numpy()
        assert np.isnan(idle[0]) and (idle[1:] >= 0).all() and (idle[1:] < 0.5).all()


def test_recorder_idle_before_s():
    from engine.step_recorder import StepRecorder

    rec = StepRecorder()
    batch = make_batch([], [], [], [], [], 0)
    for start, wall in ((10.0, 0.5), (10.75, 0.25), (12.0, 0.5)):
        rec.record(batch, rec.timer(), wall, start_s=start)
    idle = rec.to_dataframe()["idle_before_s"].tolist()
    assert np.isnan(idle[0]) and idle[1:] == [0.25, 1.0]
    rec.reset()
    rec.record(batch, rec.timer(), 0.5, start_s=20.0)
    assert np.isnan(rec.to_dataframe()["idle_before_s"][0])


def test_decode_graph_buffers_on_cpu(checkpoints, hf_greedy, monkeypatch):
    """The CUDA-graph decode path (static buffers, padding to the graph size, FA4-style metadata)
    run on a CPU: 'graphs' replay the model eagerly on the static buffers, attention is the FA4
    backend over a plain-torch fake of flash_attn.cute's varlen call."""
    from test_engine_attention_backends import fake_fa4_varlen

    from engine.attention.fa4 import FlashAttnCuteBackend
    from engine.attention.metadata import set_forward_context
    from engine.model_runner import ModelRunner

    class EagerGraph:
        def __init__(self, runner, bs, buf):
            self.run = lambda: runner.model(buf.input_ids[:bs], buf.positions[:bs])
            self.metadata = buf.metadata(bs, runner.max_model_len)
            with set_forward_context(self.metadata):
                self.out = self.run()

        def replay(self):
            with set_forward_context(self.metadata):
                self.out.copy_(self.run())

    def eager_capture(self, bs, buf, pool):
        graph = EagerGraph(self, bs, buf)
        return graph, graph.out, pool

    monkeypatch.setattr(ModelRunner, "_capture", eager_capture)
    llm = LLM(checkpoints["llama"], block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512,
              num_kv_blocks=128, attention_backend="torch", device="cpu")  # fmt: skip
    with llm:
        runner = llm.runner
        runner.backend = FlashAttnCuteBackend(varlen_fn=fake_fa4_varlen)
        runner.kv_cache.bind(runner.model.attention_layers(), runner.backend)
        runner.capture_cudagraphs()
        assert runner.graph_sizes == [1, 2, 4]
        outputs = llm.generate(make_prompts(), GREEDY, use_tqdm=False)
        assert [o["token_ids"] for o in outputs] == hf_greedy["llama"]
        df = llm.recorder.to_dataframe()
        used = set(df.loc[df["kind"] == "decode", "graph_batch_size"])
        assert {1, 2, 4} <= used | {1, 2}  # graphs of several sizes, padded batches included
        assert (
            df.loc[df["kind"] == "decode", "graph_batch_size"] >= df.loc[df["kind"] == "decode", "num_seqs"]
        ).all()


def test_kv_sizing_from_measured_memory(checkpoints, monkeypatch):
    """The CUDA sizing path, run on a CPU with torch.cuda's memory queries faked: a scratch-cache
    forward of max_num_batched_tokens, then the control plane's num_kv_blocks on what is left."""
    from engine.memory import kv_block_bytes
    from engine.model_spec import ModelSpec

    gib = 1 << 30
    fake = {
        "synchronize": lambda *a: None,
        "reset_peak_memory_stats": lambda *a: None,
        "empty_cache": lambda: None,
        "memory_allocated": lambda *a: 2 * gib,
        "max_memory_allocated": lambda *a: 3 * gib,  # 1 GiB of activations
        "memory_reserved": lambda *a: 4 * gib,
        "mem_get_info": lambda *a: (10 * gib, 16 * gib),  # 6 GiB used: 2 GiB outside torch
    }
    _, llm = run_engine(checkpoints["qwen3"])
    with llm:
        for name, fn in fake.items():
            monkeypatch.setattr(torch.cuda, name, fn)
        blocks = llm.runner.profile_num_blocks(0.5, enforce_eager=False)
        spec = ModelSpec.from_hf_config(checkpoints["qwen3"])
        budget = 8 * gib - 2 * gib - 2 * gib - 1 * gib - (512 << 20)
        assert blocks == budget // kv_block_bytes(spec, 16)
        assert all(a.k_cache is None for a in llm.runner.model.attention_layers())  # scratch released


@pytest.mark.parametrize("check_s,flagged", [(0.0, 1), (1e9, 0)])
def test_a_compile_flags_its_step_when_the_step_is_slow_enough_to_ask(
    checkpoints, monkeypatch, check_s, flagged
):
    """Steps of at least COMPILE_CHECK_S ask the runner whether a kernel variant was compiled; a
    compile (here faked: the count grows once, at the third step) flags that step only."""
    import engine.llm as engine_llm

    monkeypatch.setattr(engine_llm, "COMPILE_CHECK_S", check_s)
    _, llm = run_engine(checkpoints["qwen3"])
    with llm:
        llm.recorder.reset()
        calls = iter(range(10_000))
        base = llm._compiles
        monkeypatch.setattr(llm.runner, "compile_count", lambda: base + (next(calls) >= 2))
        llm.generate(make_prompts(), GREEDY, use_tqdm=False)
        df = llm.recorder.to_dataframe()
        assert int(df["compiled"].sum()) == flagged
        assert df["compiled"].tolist()[2] == bool(flagged)


def test_freeze_gc_freezes_after_start_and_unfreezes_on_close(checkpoints, monkeypatch):
    import gc

    from engine.llm import LLM

    small = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    monkeypatch.delenv("KVPLAN_FREEZE_GC", raising=False)
    assert gc.get_freeze_count() == 0
    llm = LLM(checkpoints["qwen3"], **small)  # on by default
    assert llm.freeze_gc is True and gc.get_freeze_count() > 0
    llm.close()
    assert gc.get_freeze_count() == 0
    with LLM(checkpoints["qwen3"], freeze_gc=False, **small) as llm:
        assert llm.freeze_gc is False and gc.get_freeze_count() == 0
    monkeypatch.setenv("KVPLAN_FREEZE_GC", "0")
    with LLM(checkpoints["qwen3"], **small) as llm:
        assert llm.freeze_gc is False and gc.get_freeze_count() == 0
    with LLM(checkpoints["qwen3"], freeze_gc=True, **small):  # the argument wins
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
