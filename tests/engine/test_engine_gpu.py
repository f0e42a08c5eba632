"""GPU checks (pytest -m gpu): bf16 logits against HF transformers on the same random weights,
greedy agreement under teacher forcing (decode through CUDA graphs), prefix-cache hit and miss.

Runs the fastest available backend (FA4 on Hopper). Skipped without CUDA.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SMALL = {
    "qwen3": dict(preset="qwen3-0.6b", num_hidden_layers=4, vocab_size=8192),
    "llama": dict(
        preset="tiny",
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=8192,
    ),
}


@pytest.fixture(scope="module")
def gpu_checkpoints(tmp_path_factory):
    from engine.checkpoint import make_random_checkpoint

    root = tmp_path_factory.mktemp("gpu_ckpt")
    return {
        arch: make_random_checkpoint(
            root / arch, arch, seed=3, dtype="bfloat16", init_std=0.05, device="cuda", **kw
        )
        for arch, kw in SMALL.items()
    }


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(8192) for _ in range(300)]
    lengths = [5, 37, 130, 700, 1500]
    return [[rng.randrange(8192) for _ in range(n)] for n in lengths] + [shared + [1, 2, 3], shared + [4, 5]]


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()


def _engine(path, **kw):
    from engine.llm import LLM

    opts = dict(block_size=16, max_num_seqs=16, max_num_batched_tokens=2048, max_model_len=2048,
                gpu_memory_utilization=0.3)  # fmt: skip
    opts.update(kw)
    return LLM(path, **opts)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_prefill_logits_match_hf(gpu_checkpoints, arch):
    hf = _hf_model(gpu_checkpoints[arch])
    with _engine(gpu_checkpoints[arch]) as llm:
        for prompt in _prompts():
            llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=1))
        batch = llm.scheduler.schedule()
        logits, _ = llm.runner.compute_logits(batch)
        assert llm.runner.last_graph_num_tokens == 2048  # the piecewise graphs ran it
        sampled = [seq for seq, d in zip(batch.seqs, batch.do_sample) if d]
        assert len(sampled) >= 4
        for row, seq in zip(logits.float(), sampled):
            with torch.no_grad():
                ref = hf(torch.tensor([seq.token_ids], device="cuda")).logits[0, -1].float()
            rel = ((row - ref).norm() / ref.norm()).item()
            assert rel < 3e-2, f"{arch}: prompt of {len(seq.token_ids)}: relative logit error {rel:.3g}"


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_greedy_agrees_with_hf_teacher_forced(gpu_checkpoints, arch, block_size):
    """Our greedy tokens (decode in CUDA graphs) are HF's argmax at >= 90% of positions, given the
    same prefix; the prompts sharing 300 tokens hit the prefix cache, the others miss."""
    hf = _hf_model(gpu_checkpoints[arch])
    prompts = _prompts()
    with _engine(gpu_checkpoints[arch], block_size=block_size) as llm:
        outs = llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
        )
        outs += llm.generate(
            prompts[-2:], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
        )
        assert llm.block_manager.num_prefix_hit_tokens >= 256
        assert llm.block_manager.num_prefix_queried_tokens > llm.block_manager.num_prefix_hit_tokens
        df = llm.recorder.to_dataframe()
        assert (df.loc[df["kind"] == "decode", "graph_batch_size"] > 0).all()
        assert (df.loc[df["kind"] != "decode", "graph_num_tokens"] > 0).all()
    agree = total = 0
    for prompt, out in zip(prompts + prompts[-2:], outs):
        ids = torch.tensor([prompt + out["token_ids"]], device="cuda")
        with torch.no_grad():
            pred = hf(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
        agree += sum(p == t for p, t in zip(pred, out["token_ids"]))
        total += len(pred)
    assert agree / total >= 0.9, f"{arch}: greedy agreement {agree}/{total}"


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_step_graphs_match_piecewise_and_eager(gpu_checkpoints, arch, monkeypatch):
    """The same mixed step (decodes beside a chunk over a cached prefix) through a whole-step graph,
    the piecewise graphs and eagerly: logits within bf16 rounding, the same greedy tokens."""
    prompts = _prompts(1)
    logits = {}
    for mode in ("step", "piecewise", "eager"):
        monkeypatch.setenv("KVPLAN_STEP_GRAPHS", str(int(mode == "step")))
        with _engine(
            gpu_checkpoints[arch], prefill_graphs=mode != "eager", max_num_batched_tokens=512
        ) as llm:
            assert (llm.runner.step_graphs is not None) is (mode == "step")
            for prompt in prompts:
                llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            for _ in range(50):
                batch = llm.scheduler.schedule()
                chunk_with_context = any(
                    c > 0 for c, p in zip(batch.num_computed_tokens, batch.is_prefill) if p
                )
                if batch.kind == "mixed" and batch.num_decode_seqs >= 2 and chunk_with_context:
                    break
                tokens = llm.runner.run(batch)  # token 0 everywhere: every run sees the same inputs
                llm.scheduler.postprocess(batch, [0 if t >= 0 else t for t in tokens])
            else:
                pytest.fail("no mixed step with decodes and a chunk over context")
            out, inputs = llm.runner.compute_logits(batch)
            assert (llm.runner.last_graph_num_tokens > 0) is (mode != "eager")
            if mode == "step":
                shape = llm.runner.step_graphs.shape_for(inputs)
                assert shape is not None and shape[1] > batch.num_seqs  # padded sequences too
            logits[mode] = out.float()
    ref = logits["eager"]
    for mode in ("step", "piecewise"):
        assert ((logits[mode] - ref).norm() / ref.norm()).item() < 1e-2, mode
        assert (logits[mode].argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9, mode


@pytest.mark.parametrize("block_size", [16, 256])
def test_async_scheduling_matches_the_synchronous_loop(gpu_checkpoints, block_size):
    """Decode steps through CUDA graphs, launched while the step before them runs: the same greedy
    tokens and the same steps as the synchronous loop, and most decode steps overlapped."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    runs = {}
    for overlap in (True, False):
        with _engine(gpu_checkpoints["qwen3"], block_size=block_size, async_scheduling=overlap) as llm:
            outputs = llm.generate(_prompts(2), params, use_tqdm=False)
            steps = llm.recorder.to_dataframe()
            runs[overlap] = ([o["token_ids"] for o in outputs], steps, llm.num_async_steps)
    (tokens, steps, num_async), (sync_tokens, sync_steps, _) = runs[True], runs[False]
    assert tokens == sync_tokens
    shape = ["kind", "num_seqs", "total_num_scheduled_tokens", "num_context_tokens", "graph_batch_size"]
    assert steps[shape].equals(sync_steps[shape])
    assert num_async >= 0.5 * (steps["kind"] == "decode").sum()


def test_chunks_queued_behind_a_busy_device_run_on_their_own_inputs(gpu_checkpoints):
    """A prompt prefilled in five chunks, four of which sample nothing, queued while the device is
    still busy (a sleep kernel ahead of them): the host builds every chunk before the first one's
    input copy runs, so reusing a staging buffer by turn alone would hand a chunk a later chunk's
    inputs. The greedy tokens equal those of the same prompt served with the device idle."""
    prompt = [random.Random(5).randrange(8192) for _ in range(1900)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for busy in (False, True):
        with _engine(gpu_checkpoints["qwen3"], max_num_batched_tokens=400) as llm:
            seq = llm.add_request(prompt, params)
            if busy:
                torch.cuda._sleep(200_000_000)  # ~0.1 s of device time ahead of the chunks
            while llm.has_unfinished():
                llm.step()
            runs.append(seq.output_token_ids)
    assert runs[1] == runs[0]


def test_triton_argmax_and_graph_copy_match_torch_and_compile_before_serving(gpu_checkpoints, monkeypatch):
    """The tokens (greedy and sampled, batches of up to 24 rows: launches with and without PDL) are the
    same with the Triton argmax and graph-input copy as with torch's, and serving compiles no kernel
    variant that warm-up and capture did not."""
    g = random.Random(4)
    prompts = [[g.randrange(8192) for _ in range(n)] for n in range(5, 125, 5)]
    params = [
        SamplingParams(temperature=0.8 if i % 3 == 0 else 0, max_tokens=16, ignore_eos=True)
        for i in range(24)
    ]
    runs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("KVPLAN_TRITON_ARGMAX", switch)
        monkeypatch.setenv("KVPLAN_GRAPH_COPY", switch)
        with _engine(gpu_checkpoints["qwen3"], max_num_seqs=32, max_num_batched_tokens=1024) as llm:
            choices = llm.kernel_choices()
            assert choices["triton_argmax"] is choices["graph_copy_kernel"] is (switch == "1")
            compiled = llm.runner.compile_count()
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert llm.runner.compile_count() == compiled, "a kernel variant compiled while serving"
            df = llm.recorder.to_dataframe()
            assert (df.loc[df["kind"] == "decode", "graph_batch_size"] == 32).any()  # 24 rows padded
            runs[switch] = [o["token_ids"] for o in outs]
    assert runs["1"] == runs["0"]
