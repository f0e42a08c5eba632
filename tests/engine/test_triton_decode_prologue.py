"""The split-KV decode kernel with a `DecodePrologue` (q/k RMSNorm + rotary and the new token's K/V
store done inside the kernel), run by Triton's interpreter on CPU tensors, equals the unfused path it
replaces: `triton_ops.qk_norm_rotary` with `kv_store`, then `paged_decode_attention` on its output.
Bit-exact: the prologue calls the same `norm_rotate_halves` with the same float32 statistics and
roundings, and the attention then runs the same code on the same q and cache. Checked for Qwen3-style
heads (q/k norm weights) and Llama-style (none), GQA, page sizes 16 and 256, one split (direct
output), a few splits and more splits than units (empty splits), uneven contexts, and a padded row
(slot -1, as a decode graph's padding) whose cache slot must stay untouched.

The interpreter runs in a subprocess (TRITON_INTERPRET must be set before triton is first imported).
fp32 and fp16 only: the interpreter mishandles bf16 (see test_triton_decode.py).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import run_interpreted

from engine.attention.metadata import build_step_inputs
from engine.layers.rotary import RotaryEmbedding
from engine.scheduler import make_batch
from engine.sequence import SamplingParams, Sequence

pytest.importorskip("triton")

from engine.attention import triton_decode  # noqa: E402
from engine.attention.backend import DecodePrologue  # noqa: E402
from engine.attention.triton_decode import split_unit  # noqa: E402

EPS = 1e-6

# Runs in the subprocess: per case and split count, the unfused path and the fused one on copies of
# the same caches.
WORKER = """
import sys, torch
from engine.attention import triton_decode as td
from engine.attention.backend import DecodePrologue
from engine.layers import triton_ops as T
assert type(td._split_kv_kernel).__name__ == "InterpretedFunction", "not interpreted"
results = {}
for name, c in torch.load(sys.argv[1]).items():
    runs = []
    for splits in c["splits"]:
        kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
        store = (c["v"], kc, vc, c["slots"])
        q, _ = T.qk_norm_rotary(c["pos"], c["q"], c["k"], c["cos_sin"], c["qw"], c["kw"], c["eps"], kv_store=store)
        ref = td.paged_decode_attention(q, kc, vc, c["tables"], c["lens"], c["scale"], splits)
        fkc, fvc = c["k_cache"].clone(), c["v_cache"].clone()
        prologue = DecodePrologue(c["k"], c["v"], c["pos"], c["cos_sin"], c["qw"], c["kw"], c["eps"], c["slots"])
        got = td.paged_decode_attention(c["q"], fkc, fvc, c["tables"], c["lens"], c["scale"], splits, prologue=prologue)
        runs.append(dict(splits=splits, ref=ref, k_ref=kc, v_ref=vc, got=got, k_got=fkc, v_got=fvc))
    results[name] = runs
torch.save(results, sys.argv[2])
"""


def _step(contexts, block_size, num_heads, num_kv_heads, head_dim, dtype, norm, seed=0):
    """A decode step over random pages plus one padded row (context 1, slot -1, block table of
    zeros, as a decode graph pads): the case the worker runs, with raw q/k/v as strided views into
    one projected qkv row per sequence, as the model passes them."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in contexts]
    num_blocks = sum(pages) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for i, n in enumerate(contexts):
        seq = Sequence(i, torch.randint(0, 100, (n,), generator=gen).tolist(), SamplingParams(temperature=0))
        seq.block_table = [free.pop() for _ in range(pages[i])]
        seqs.append(seq)
    batch = make_batch(seqs, [1] * len(seqs), [n - 1 for n in contexts], [0] * len(seqs), [], 0)
    inputs = build_step_inputs(batch, block_size, torch.device("cpu"))
    md = inputs.attn
    rows = len(contexts) + 1
    tables = torch.zeros(rows, md.block_tables.shape[1], dtype=torch.int32)
    tables[:-1] = md.block_tables
    pad = torch.tensor([1], dtype=torch.int32)
    lens = torch.cat([md.context_lens, pad])
    pos = torch.cat([inputs.positions, torch.zeros(1, dtype=torch.int32)])
    slots = torch.cat([md.slot_mapping, torch.full((1,), -1, dtype=torch.int32)])
    h, hkv, d = num_heads, num_kv_heads, head_dim
    qkv = torch.randn(rows, (h + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    shape = (num_blocks, block_size, hkv, d)
    rope = RotaryEmbedding(d, 4096, {"rope_theta": 1e6, "rope_type": "default"})
    weights = [(1 + 0.2 * torch.randn(d, generator=gen)).to(dtype) for _ in range(2)] if norm else [None] * 2
    return dict(
        q=q.view(rows, h, d), k=k.view(rows, hkv, d), v=v.view(rows, hkv, d),
        k_cache=torch.randn(shape, generator=gen).to(dtype), v_cache=torch.randn(shape, generator=gen).to(dtype),
        tables=tables, lens=lens, pos=pos, slots=slots, cos_sin=rope.cos_sin_cache,
        qw=weights[0], kw=weights[1], eps=EPS if norm else 0.0, scale=d**-0.5,
    )  # fmt: skip


def _build_cases() -> dict[str, dict]:
    cases = {}
    for block_size in (16, 256):
        contexts = [max(1, block_size // 2 - 3), block_size, 3 * block_size + 7, 1]
        units = -(-max(contexts) // split_unit(block_size))
        for norm, style in ((True, "qwen3"), (False, "llama")):
            case = _step(contexts, block_size, 4, 2, 64, torch.float32, norm, seed=block_size)
            case["splits"] = [1, 3, units + 2]  # direct; a few; more than units (empty splits)
            cases[f"{style}-page{block_size}"] = case
    for norm, style in ((True, "qwen3"), (False, "llama")):
        case = _step([40, 300, 17], 32, 8, 2, 128, torch.float16, norm, seed=5)  # group 4, fp16
        case["splits"] = [1, 4]
        cases[f"{style}-fp16-d128"] = case
    return cases


CASES = _build_cases()


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, list[dict]]:
    """Every case through the interpreted kernels, in one subprocess."""
    return run_interpreted(WORKER, CASES, tmp_path_factory.mktemp("decode_prologue"))


@pytest.mark.parametrize("name", list(CASES))
def test_prologue_equals_unfused_path(interpreted, name):
    """Bit-exact attention output and K/V caches against qk_norm_rotary(kv_store) + the kernel."""
    for run in interpreted[name]:
        tag = f"{name}, {run['splits']} splits"
        assert torch.equal(run["got"], run["ref"]), f"{tag}: attention output differs"
        assert torch.equal(run["k_got"], run["k_ref"]), f"{tag}: key cache differs"
        assert torch.equal(run["v_got"], run["v_ref"]), f"{tag}: value cache differs"


@pytest.mark.parametrize("name", list(CASES))
def test_prologue_writes_only_the_new_slots(interpreted, name):
    """The caches change at the real rows' slots only (the padded row's slot -1 writes nothing), and
    there they hold a normed, rotated key (not the raw one) and the raw value."""
    case = CASES[name]
    real = case["slots"][:-1].long()
    for run in interpreted[name]:
        for got, before in ((run["k_got"], case["k_cache"]), (run["v_got"], case["v_cache"])):
            flat, flat_before = got.flatten(0, 1), before.flatten(0, 1)
            untouched = torch.ones(flat.shape[0], dtype=torch.bool)
            untouched[real] = False
            assert torch.equal(flat[untouched], flat_before[untouched]), f"{name}: a slot changed"
        new_k = run["k_got"].flatten(0, 1)[real]
        assert torch.equal(run["v_got"].flatten(0, 1)[real], case["v"][:-1])
        assert not torch.equal(new_k, case["k"][:-1])


def test_rejects_bad_prologue():
    case = CASES["qwen3-page16"]
    q, tables, lens = case["q"], case["tables"], case["lens"]
    good = DecodePrologue(
        case["k"], case["v"], case["pos"], case["cos_sin"], case["qw"], case["kw"], EPS, case["slots"]
    )

    def decode(prologue, query=q):
        triton_decode.paged_decode_attention(
            query, case["k_cache"], case["v_cache"], tables, lens, 0.1, 1, prologue=prologue
        )

    with pytest.raises(ValueError, match="do not fit"):
        decode(good._replace(k=case["k"][:-1], v=case["v"][:-1]))
    with pytest.raises(ValueError, match="both q/k norm weights"):
        decode(good._replace(k_weight=None))
    with pytest.raises(ValueError, match="float32"):
        decode(good._replace(cos_sin=case["cos_sin"].half()))
    with pytest.raises(ValueError, match="fewer rows"):
        decode(good._replace(slot_mapping=case["slots"][:2]))
    with pytest.raises(ValueError, match="power-of-two"):
        odd = torch.zeros(q.shape[0], q.shape[1], 48)
        k_cache = torch.zeros(4, 16, 2, 48)
        triton_decode.paged_decode_attention(
            odd, k_cache, k_cache, tables, lens, 0.1, 1,
            prologue=good._replace(k=torch.zeros(q.shape[0], 2, 48), v=torch.zeros(q.shape[0], 2, 48), cos_sin=torch.zeros(8, 48)),
        )  # fmt: skip
