"""The Triton argmax of greedy sampling (engine/layers/argmax.py), run by Triton's interpreter on CPU
tensors, equals torch's `x.float().argmax(-1)` exactly: ties (lowest index), -inf rows, NaN, -0.0,
vocabularies that are not a multiple of the block, float32 / float16 / bfloat16; and the sampler that
uses it gives torch's tokens. The GPU test does the same on CUDA (and test_engine_gpu.py through
the engine).

The interpreter runs in a subprocess (TRITON_INTERPRET must be set before triton is first imported).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import run_interpreted

from engine.envs import KernelConfig
from engine.layers import argmax
from engine.sampler import Sampler

pytest.importorskip("triton")

NAN, INF = float("nan"), float("inf")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)

WORKER = """
import sys, torch
from engine.layers import argmax
from engine.sampler import Sampler
assert type(argmax._block_argmax_kernel).__name__ == "InterpretedFunction", "not interpreted"
out = {}
for name, c in torch.load(sys.argv[1]).items():
    if c["op"] == "argmax":
        out[name] = argmax.argmax(c["x"], block=c["block"])
    else:  # the sampler with the kernels serving CPU tensors, all-greedy and mixed batches
        argmax.serves = lambda x: True
        sampler = Sampler(torch.Generator().manual_seed(5), triton_argmax=True)
        out[name] = sampler(c["x"], c["temps"], all_greedy=bool((c["temps"] == 0).all()))
torch.save(out, sys.argv[2])
"""


def _special_rows(vocab: int) -> torch.Tensor:
    """Rows torch orders by its rules: all -inf, one NaN, NaNs after +inf, +inf twice, -0.0 before
    0.0 as the maximum, NaN at the last column, a row of one value."""
    rows = torch.full((7, vocab), -INF)
    rows[1, vocab // 3] = NAN
    rows[2, 1], rows[2, vocab - 2], rows[2, vocab // 2] = INF, NAN, NAN
    rows[3] = torch.linspace(-5, 5, vocab)
    rows[3, 2], rows[3, vocab - 1] = INF, INF
    rows[4] = -1.0
    rows[4, vocab // 2], rows[4, vocab - 1] = -0.0, 0.0
    rows[5] = torch.linspace(-5, 5, vocab)
    rows[5, vocab - 1] = NAN
    rows[6] = 0.25
    return rows


def _cases() -> dict[str, dict]:
    """Random logits (few ties), small integers (many ties), special values; vocab below, at, over
    and not a multiple of the block; rows taken from a wider tensor (strided)."""
    g = torch.Generator().manual_seed(0)
    cases = {}
    for dtype in DTYPES:
        tag = str(dtype).removeprefix("torch.")
        cases[f"random_{tag}"] = dict(x=torch.randn(3, 1000, generator=g).to(dtype), block=128)
        cases[f"ties_{tag}"] = dict(x=torch.randint(-2, 3, (4, 777), generator=g).to(dtype), block=128)
        cases[f"special_{tag}"] = dict(x=_special_rows(300).to(dtype), block=64)
        cases[f"one_block_{tag}"] = dict(x=torch.randint(0, 2, (2, 50), generator=g).to(dtype), block=64)
    cases["exact_blocks"] = dict(x=torch.randint(-1, 2, (2, 512), generator=g).float(), block=128)
    cases["one_column"] = dict(x=torch.randn(3, 1, generator=g), block=64)
    wide = torch.randint(-3, 1, (3, 600), generator=g).to(torch.bfloat16)
    cases["strided_rows"] = dict(x=wide[:, :333], block=64)
    for case in cases.values():
        case["op"] = "argmax"
    return cases


def _sampler_cases() -> dict[str, dict]:
    g = torch.Generator().manual_seed(1)
    logits = torch.randint(-4, 4, (4, 200), generator=g).to(torch.bfloat16)
    return {
        "sampler_greedy": dict(op="sampler", x=logits, temps=torch.zeros(4)),
        "sampler_mixed": dict(op="sampler", x=logits, temps=torch.tensor([0.0, 1.0, 0.0, 0.7])),
    }


def test_argmax_kernels_match_torch(tmp_path):
    cases = {**_cases(), **_sampler_cases()}
    got = run_interpreted(WORKER, cases, tmp_path)
    assert sorted(got) == sorted(cases)
    for name, c in cases.items():
        if c["op"] == "argmax":
            expected = c["x"].float().argmax(-1)
        else:
            torch_sampler = Sampler(torch.Generator().manual_seed(5), triton_argmax=False)
            expected = torch_sampler(c["x"], c["temps"], all_greedy=bool((c["temps"] == 0).all()))
        assert got[name].dtype == torch.int64, name
        assert torch.equal(got[name], expected), f"{name}: {got[name].tolist()} != {expected.tolist()}"


def test_special_rows_follow_torch_rules():
    """What the kernels are held to (torch on a CPU): NaN wins, the first NaN; ties go to the lowest
    index; -0.0 ties 0.0; a row of -inf gives 0."""
    assert _special_rows(300).argmax(-1).tolist() == [0, 100, 150, 2, 150, 299, 0]


def test_serves_only_cuda_float_rows():
    assert not argmax.serves(torch.zeros(2, 8))  # CPU: torch's argmax
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert argmax.serves(torch.zeros(2, 8, device=cuda, dtype=torch.bfloat16))
        assert not argmax.serves(torch.zeros(2, 8, device=cuda, dtype=torch.float64))
        assert not argmax.serves(torch.zeros(8, 2, device=cuda).t())
        assert not argmax.serves(torch.zeros(0, 8, device=cuda))


def test_cpu_sampler_keeps_torch(monkeypatch):
    logits = torch.randint(-2, 2, (3, 40), generator=torch.Generator().manual_seed(2)).float()
    sampler = Sampler(triton_argmax=True)
    monkeypatch.setattr(argmax, "argmax", lambda x: pytest.fail("a CPU tensor went to the kernels"))
    assert torch.equal(sampler(logits, torch.zeros(3), all_greedy=True), logits.argmax(-1))


def test_env_switch(monkeypatch):
    """A Sampler built outside an engine follows $KVPLAN_TRITON_ARGMAX; inside one (the model runner
    passes its own), the active kernel config's `triton_argmax`."""
    monkeypatch.setenv("KVPLAN_TRITON_ARGMAX", "0")
    assert not Sampler().triton_argmax
    with KernelConfig(triton_argmax=True).activate():
        assert Sampler().triton_argmax
    monkeypatch.setenv("KVPLAN_TRITON_ARGMAX", "1")
    assert Sampler().triton_argmax and not Sampler(triton_argmax=False).triton_argmax
    monkeypatch.setenv("KVPLAN_TRITON_ARGMAX", "yes")
    with pytest.raises(ValueError, match="KVPLAN_TRITON_ARGMAX: 'yes' is not 0 or 1"):
        Sampler()


@pytest.mark.gpu
def test_argmax_on_gpu():
    """On CUDA, Qwen3's vocabulary and odd ones, with and without PDL-sized row counts: torch's
    argmax on the same device, index for index."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        for rows, vocab in ((1, 151936), (3, 151936), (20, 32000), (2, 1000), (5, 2049)):
            for x in (
                torch.randn(rows, vocab, generator=g),
                torch.randint(-3, 3, (rows, vocab), generator=g).float(),
            ):
                x = x.to("cuda", dtype)
                assert torch.equal(argmax.argmax(x), x.float().argmax(-1)), (dtype, rows, vocab)
        special = _special_rows(151936).to("cuda", dtype)
        assert torch.equal(argmax.argmax(special), special.float().argmax(-1)), dtype
        assert argmax.argmax(special).tolist() == _special_rows(151936).argmax(-1).tolist()
