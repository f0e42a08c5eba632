"""The fused LM head + greedy argmax (engine/layers/head_argmax.py), run by Triton's interpreter on CPU
tensors, gives the argmax of the head's logits rounded to the weight's dtype, exactly: integer-valued
weights and rows make every float32 sum exact, so ties (lowest index), NaN weights, vocabularies and
widths off the tiles are all decided as torch decides them. The GPU test runs Qwen3's head shape.

The interpreter runs in a subprocess (TRITON_INTERPRET must be set before triton is first imported).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import CPU_ENGINE, make_prompts, run_interpreted

from engine.layers import head_argmax
from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytest.importorskip("triton")

WORKER = """
import sys, torch
from engine.layers import head_argmax
assert type(head_argmax._head_argmax_kernel).__name__ == "InterpretedFunction", "not interpreted"
head_argmax.serves = lambda hidden, weight: True
out = {}
for name, c in torch.load(sys.argv[1]).items():
    out[name] = head_argmax.head_argmax(c["x"], c["w"], tiles=c["tiles"])
torch.save(out, sys.argv[2])
"""


def _expected(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.float().T).to(w.dtype).float().argmax(-1)


def _cases() -> dict[str, dict]:
    g = torch.Generator().manual_seed(0)
    cases = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        tag = str(dtype).removeprefix("torch.")
        w = torch.randint(-2, 3, (203, 40), generator=g).to(dtype)  # many ties
        x = torch.randint(-2, 3, (1, 40), generator=g).to(dtype)
        cases[f"ties_{tag}"] = dict(x=x, w=w, tiles=(8, 16, 1))
        w = torch.randint(-50, 50, (300, 64), generator=g).to(dtype)
        cases[f"wide_{tag}"] = dict(
            x=torch.randint(-9, 9, (1, 64), generator=g).to(dtype), w=w, tiles=(16, 32, 2)
        )
    w = torch.randint(-3, 3, (97, 24), generator=g).float()
    w[60, 5] = float("nan")  # row 60's logit is NaN: it wins
    w[80, 0] = float("nan")
    cases["nan"] = dict(x=torch.ones(1, 24), w=w, tiles=(8, 16, 1))
    big = torch.randint(-2, 3, (64, 16), generator=g).float()  # row 20 sums to 257, which bf16 rounds to 256
    big[10] = 0.0
    big[10, 0] = 256.0
    big[20] = 0.0
    big[20, 0], big[20, 1] = 256.0, 1.0
    cases["rounded_tie"] = dict(
        x=torch.ones(1, 16).to(torch.bfloat16), w=big.to(torch.bfloat16), tiles=(4, 8, 1)
    )
    cases["one_tile"] = dict(x=torch.ones(1, 8), w=torch.zeros(5, 8), tiles=(8, 8, 1))
    return cases


def test_head_argmax_matches_rounded_logits(tmp_path):
    cases = _cases()
    got = run_interpreted(WORKER, cases, tmp_path)
    assert sorted(got) == sorted(cases)
    for name, c in cases.items():
        expected = _expected(c["x"], c["w"])
        assert got[name].dtype == torch.int64, name
        assert torch.equal(got[name], expected), f"{name}: {got[name].tolist()} != {expected.tolist()}"
    assert got["nan"].tolist() == [60]
    assert got["one_tile"].tolist() == [0]


def test_rounded_tie_case_is_a_tie():
    """What `rounded_tie` holds the kernel to: row 20's 257 rounds to bf16's 256, tying row 10, and the
    lower row wins; in float32 row 20 would be the maximum."""
    c = _cases()["rounded_tie"]
    assert _expected(c["x"], c["w"]).tolist() == [10]
    assert (c["x"].float() @ c["w"].float().T).argmax(-1).tolist() == [20]


def test_serves_one_cuda_row_of_the_weights_dtype():
    w = torch.zeros(10, 8, dtype=torch.bfloat16)
    assert not head_argmax.serves(torch.zeros(1, 8, dtype=torch.bfloat16), w)  # CPU
    if torch.cuda.is_available():
        w = w.cuda()
        assert head_argmax.serves(torch.zeros(1, 8, dtype=torch.bfloat16, device="cuda"), w)
        assert not head_argmax.serves(torch.zeros(2, 8, dtype=torch.bfloat16, device="cuda"), w)
        assert not head_argmax.serves(torch.zeros(1, 8, device="cuda"), w)
    with pytest.raises(ValueError, match=r"head_argmax: takes one contiguous CUDA row.*hidden \(1, 8\)"):
        head_argmax.head_argmax(torch.zeros(1, 8), torch.zeros(10, 8))


def test_runner_takes_the_fused_head_for_one_row_greedy_steps(checkpoints, monkeypatch):
    """The runner's routing, on CPU with a stand-in for the kernels: steps that sample one row, all
    greedy, go to head_argmax (and give the sampler's tokens); every other step goes to the logits
    and the sampler; with the switch off, none goes."""
    prompts = make_prompts()[:3]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True)
    calls: list[int] = []

    def fake(hidden, weight):
        calls.append(hidden.shape[0])
        return F.linear(hidden, weight).float().argmax(-1)

    monkeypatch.setattr(head_argmax, "serves", lambda hidden, weight: hidden.shape[0] == 1)
    monkeypatch.setattr(head_argmax, "head_argmax", fake)
    outputs, one_row_greedy = {}, []
    for fused in (False, True):
        with LLM(checkpoints["qwen3"], **CPU_ENGINE) as llm:
            llm.runner.fused_head = fused
            sample = llm.runner._sample

            def spy(hidden, inputs, sample=sample):
                one_row_greedy.append(len(inputs.sampled_seq_indices) == 1 and inputs.all_greedy)
                return sample(hidden, inputs)

            llm.runner._sample = spy
            one = llm.generate(prompts[:1], greedy, use_tqdm=False)
            assert len(calls) == (5 if fused else 0)  # the lone request: every step
            mixed = llm.generate(prompts, [greedy, sampled, greedy], use_tqdm=False)
            outputs[fused] = [o["token_ids"] for o in one + mixed[::2]]
            if not fused:
                assert calls == []
                one_row_greedy.clear()
    assert calls == [1] * sum(one_row_greedy) and 5 < len(calls) < len(one_row_greedy)
    assert outputs[True] == outputs[False]


@pytest.mark.gpu
def test_head_argmax_on_gpu():
    """Qwen3's head shape in bf16 with the shipped tiles: integer-valued weights (exact sums, many
    ties) equal the rounded reference exactly; random weights agree with cuBLAS's token on most rows."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(4)
    w = torch.randint(-2, 3, (151936, 1024), generator=g, device="cuda").to(torch.bfloat16)
    for _ in range(5):
        x = torch.randint(-1, 2, (1, 1024), generator=g, device="cuda").to(torch.bfloat16)
        assert torch.equal(head_argmax.head_argmax(x, w), _expected(x, w))
    w = torch.randn(151936, 1024, generator=g, device="cuda").to(torch.bfloat16) * 0.02
    same = 0
    for _ in range(50):
        x = torch.randn(1, 1024, generator=g, device="cuda").to(torch.bfloat16)
        same += int(head_argmax.head_argmax(x, w)) == int(torch.nn.functional.linear(x, w).float().argmax())
    assert same >= 48
