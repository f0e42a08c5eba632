"""The Triton split-KV decode kernel, run by Triton's interpreter on CPU tensors, equals the torch
reference backend on random paged caches (page sizes, GQA groups, contexts shorter than a page, of
exactly a page, of many pages, uneven across the batch; one split, and more splits than pages); and
the FA4 backend sends decode steps, and only those, to it.

The interpreter runs in one subprocess for all cases: TRITON_INTERPRET must be set before triton is
first imported (triton.language's own @jit helpers, tl.max / tl.sum / tl.cdiv, are decorated then),
and other tests import triton earlier in the session. bf16 is not checked: the interpreter's tl.dot
multiplies bf16 bit patterns as integers (Triton 3.9); fp16 stands in for the 16-bit path.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import run_interpreted

from engine.attention.metadata import AttentionMetadata, build_step_inputs
from engine.attention.torch_sdpa import TorchSDPABackend
from engine.core.scheduler import make_batch
from engine.core.sequence import Sequence
from engine.kv_cache import store_kv_cache
from engine.sampling_params import SamplingParams

pytest.importorskip("triton")

from engine.attention import triton_decode  # noqa: E402
from engine.attention.fa4 import FlashAttnCuteBackend  # noqa: E402
from engine.attention.triton_decode import choose_num_splits, split_unit  # noqa: E402

FP32 = dict(rtol=1e-4, atol=1e-5)
FP16 = dict(rtol=1e-2, atol=2e-3)

# Runs in the subprocess: every case's calls through the interpreted kernel. A case with
# "reuse": True passes one out / workspace to all its calls, as a CUDA graph replay does.
WORKER = """
import sys, torch
from engine.attention import triton_decode as td
assert type(td._split_kv_kernel).__name__ == "InterpretedFunction", "not interpreted"
results = {}
for name, case in torch.load(sys.argv[1]).items():
    outs, out, workspace = [], None, None
    for call in case["calls"]:
        args = [call[k] for k in ("q", "k_cache", "v_cache", "block_tables", "context_lens", "scale", "num_splits")]
        if case["reuse"] and out is None:
            b, h, d = call["q"].shape
            out = torch.full_like(call["q"], float("nan"))
            workspace = td.make_workspace(b, h, d, call["num_splits"], "cpu")
        got = td.paged_decode_attention(
            *args, out=out, workspace=workspace, balance=call.get("balance", 0),
            split_block=call.get("split_block", 0),
        )
        outs.append((got.clone(), got is out))
    results[name] = outs
torch.save(results, sys.argv[2])
"""


def _decode_step(contexts, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """A decode step (one new token per sequence) over random pages drawn from a shuffled pool, with
    random KV in the cache (the new tokens' K/V stored): (q, k_cache, v_cache, k, v, metadata)."""
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
    md = build_step_inputs(batch, block_size, torch.device("cpu")).attn
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(len(contexts), num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(len(contexts), num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(contexts), num_kv_heads, head_dim, generator=gen).to(dtype)
    store_kv_cache(k, v, k_cache, v_cache, md.slot_mapping)
    return q, k_cache, v_cache, k, v, md


def _reference(q, k_cache, v_cache, k, v, md: AttentionMetadata) -> torch.Tensor:
    """The torch backend in fp32 on the same (rounded) inputs."""
    up = [t.float() for t in (q, k, v, k_cache, v_cache)]
    return TorchSDPABackend().forward(*up, md, q.shape[-1] ** -0.5)


def _contexts(block_size: int) -> list[int]:
    """Shorter than a page, exactly a page, many pages (ragged end), one token: uneven across the batch."""
    return [max(1, block_size // 2 - 3), block_size, 3 * block_size + 7, 1]


def _case(step, splits, balance=0, split_block=0):
    """(what the worker runs, the expected outputs) for one decode step at each split count."""
    q, k_cache, v_cache, k, v, md = step
    call = dict(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=md.block_tables,
        context_lens=md.context_lens, scale=q.shape[-1] ** -0.5,
    )  # fmt: skip
    ref = _reference(q, k_cache, v_cache, k, v, md)
    calls = [{**call, "num_splits": s, "balance": balance, "split_block": split_block} for s in splits]
    return calls, [ref] * len(splits)


def _build_cases() -> dict[str, tuple[dict, list[torch.Tensor]]]:
    cases = {}
    for block_size, groups in ((16, (1, 2, 4)), (64, (1, 2, 4)), (256, (1, 4))):
        for group in groups:
            step = _decode_step(_contexts(block_size), block_size, 2 * group, 2, 64, torch.float32)
            units = -(-step[-1].max_seqlen_k // split_unit(block_size))
            # one split (direct output), a few, more splits than units (empty splits)
            calls, refs = _case(step, [1, 3, units + 2])
            cases[f"page{block_size}-group{group}"] = ({"calls": calls, "reuse": False}, refs)
    for name, head_dim, dtype in (
        ("d128", 128, torch.float32),
        ("d80", 80, torch.float32),
        ("fp16", 128, torch.float16),
    ):
        calls, refs = _case(_decode_step([40, 300, 17], 32, 8, 2, head_dim, dtype, seed=3), [1, 4])
        cases[name] = ({"calls": calls, "reuse": False}, refs)
    calls, refs = [], []  # one set of buffers, contexts changing between calls
    for contexts, seed in (([200, 9], 0), ([3, 130], 1), ([64, 64], 2)):
        c, r = _case(_decode_step(contexts, 16, 4, 2, 64, torch.float32, seed), [6])
        calls += c
        refs += r
    cases["fixed-buffers"] = ({"calls": calls, "reuse": True}, refs)
    # balanced: one long sequence among short ones uses several splits, the short ones one each
    # (written without the merge); balance 1 leaves every sequence one split, a large one all four
    skewed = _decode_step([900, 20, 64, 3, 130, 65], 16, 4, 2, 64, torch.float32, seed=5)
    for balance in (1, 24, 10_000):
        calls, refs = _case(skewed, [4, 7], balance)
        cases[f"balanced-{balance}"] = ({"calls": calls, "reuse": False}, refs)
    calls, refs = [], []  # balanced over fixed buffers: which rows merge changes between calls
    for contexts, seed in (([700, 9, 5], 0), ([3, 5, 1300], 1), ([64, 64, 64], 2)):
        c, r = _case(_decode_step(contexts, 16, 4, 2, 64, torch.float32, seed), [4], balance=16)
        calls += c
        refs += r
    cases["balanced-fixed-buffers"] = ({"calls": calls, "reuse": True}, refs)
    # fine splits: 64-token units inside pages of 128 and 256 (splits start mid-page), plain and
    # balanced, more splits than units included
    for block_size in (128, 256):
        step = _decode_step([700, 20, 256, 3, 130], block_size, 4, 2, 64, torch.float32, seed=7)
        calls, refs = _case(step, [2, 5, 13], split_block=64)
        balanced, balanced_refs = _case(step, [4], balance=12, split_block=64)
        cases[f"fine-page{block_size}"] = ({"calls": calls + balanced, "reuse": False}, refs + balanced_refs)
    step = _decode_step([20, 5], 16, 4, 2, 64, torch.float32)  # a row without keys: zeros
    empty = {**_case(step, [1])[0][0], "context_lens": torch.tensor([0, 5], dtype=torch.int32)}
    calls = [empty, {**empty, "num_splits": 4}, {**empty, "num_splits": 4, "balance": 8}]
    cases["no-keys"] = ({"calls": calls, "reuse": False}, None)
    return cases


CASES = _build_cases()


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, list[tuple[torch.Tensor, bool]]]:
    """Every case run through the interpreted kernel, in one subprocess."""
    cases = {name: spec for name, (spec, _) in CASES.items()}
    return run_interpreted(WORKER, cases, tmp_path_factory.mktemp("triton_decode"))


@pytest.mark.parametrize("name", [n for n in CASES if n != "no-keys"])
def test_matches_torch_reference(interpreted, name):
    spec, refs = CASES[name]
    tol = FP16 if spec["calls"][0]["q"].dtype == torch.float16 else FP32
    for call, (out, is_out), ref in zip(spec["calls"], interpreted[name], refs):
        assert out.dtype == call["q"].dtype and is_out == spec["reuse"]
        torch.testing.assert_close(
            out.float(), ref, **tol, msg=lambda m, s=call["num_splits"]: f"{s} splits: {m}"
        )


def test_no_keys_gives_zeros(interpreted):
    """A row with context 0 (never scheduled, but possible in a padded batch): zeros, not NaN."""
    for out, _ in interpreted["no-keys"]:
        assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isfinite(out[1]).all()


def test_rejects_bad_shapes():
    q, k_cache, v_cache, *_ = _decode_step([20], 16, 4, 2, 64, torch.float32)
    tables, lens = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    decode = triton_decode.paged_decode_attention
    with pytest.raises(ValueError, match="num_splits"):
        decode(q, k_cache, v_cache, tables, lens, 0.1, 0)
    with pytest.raises(ValueError, match="does not fit"):
        decode(q[:, :3], k_cache, v_cache, tables, lens, 0.1, 1)
    with pytest.raises(ValueError, match="workspace"):
        decode(
            q, k_cache, v_cache, tables, lens, 0.1, 2, None, triton_decode.make_workspace(1, 4, 64, 3, "cpu")
        )


class _Recorder:
    """Stands in for a kernel: records its calls, returns zeros (FA4's varlen returns (out, lse))."""

    def __init__(self, pair: bool) -> None:
        self.calls, self.pair = [], pair

    def __call__(self, q, *args, **kwargs):
        self.calls.append(args)
        self.kwargs = kwargs
        return (torch.zeros_like(q), None) if self.pair else torch.zeros_like(q)


def test_fa4_backend_routes_decode_to_triton(monkeypatch):
    monkeypatch.delenv("KVPLAN_DECODE_BALANCE", raising=False)
    varlen, decode = _Recorder(pair=True), _Recorder(pair=False)
    backend = FlashAttnCuteBackend(varlen_fn=varlen, decode_kernel="triton", decode_fn=decode)
    assert backend.decode_kernel == "triton" and backend.name == "flash_attn_cute"
    q, k_cache, v_cache, k, v, md = _decode_step([5, 70, 33], 16, 4, 2, 64, torch.float32)
    backend.forward(q, k, v, k_cache, v_cache, md, 0.125)
    assert not varlen.calls and len(decode.calls) == 1
    k_arg, v_arg, tables, lens, scale, splits = decode.calls[0]
    assert k_arg is k_cache and v_arg is v_cache and tables is md.block_tables and lens is md.context_lens
    assert scale == 0.125 and splits == choose_num_splits(3, 2, 70, 16) == 2
    assert decode.kwargs == {"balance": 0}  # 3 rows: a grid of 32 splits, which all sequences use
    prefill = AttentionMetadata(**{**md.__dict__, "max_seqlen_q": 2})  # not a decode step: FA4
    backend.forward(q, k, v, k_cache, v_cache, prefill, 0.125)
    assert len(varlen.calls) == 1 and len(decode.calls) == 1


def test_fa4_backend_splits_large_pages_inside(monkeypatch):
    """Block 256: the grid counts 64-token units and the kernel is told so (split_block 64); with
    KVPLAN_DECODE_FINE_SPLITS=0, whole pages as before; block 16 passes no split_block."""
    monkeypatch.delenv("KVPLAN_DECODE_BALANCE", raising=False)
    for block_size, value, splits, kwargs in (
        (256, "1", 11, {"balance": 0, "split_block": 64}),  # 700 keys: 11 units of 64
        (256, "0", 3, {"balance": 0}),
        (16, "1", 11, {"balance": 0}),
    ):
        monkeypatch.setenv("KVPLAN_DECODE_FINE_SPLITS", value)
        decode = _Recorder(pair=False)
        backend = FlashAttnCuteBackend(
            varlen_fn=_Recorder(pair=True), decode_kernel="triton", decode_fn=decode
        )
        q, k_cache, v_cache, k, v, md = _decode_step([700, 9], block_size, 4, 2, 64, torch.float32)
        backend.forward(q, k, v, k_cache, v_cache, md, 0.125)
        assert (decode.calls[0][5], decode.kwargs) == (splits, kwargs), (block_size, value)


def test_decode_split_kv_records_fine_splits(monkeypatch):
    """What profiles record of the split rule (`LLM.decode_split_kv`): split_tokens 64 where pages
    over 64 tokens are split inside; nothing new at block 16 or with KVPLAN_DECODE_FINE_SPLITS=0."""
    from types import SimpleNamespace

    from engine.llm import LLM

    monkeypatch.delenv("KVPLAN_DECODE_BALANCE", raising=False)
    base = {"num_kv_heads": 4, "num_sms": 132, "balanced": True}
    for block_size, value, expected in (
        (256, "1", {**base, "block_size": 256, "split_tokens": 64}),
        (256, "0", {**base, "block_size": 256}),
        (16, "1", {**base, "block_size": 16}),
    ):
        monkeypatch.setenv("KVPLAN_DECODE_FINE_SPLITS", value)
        backend = FlashAttnCuteBackend(
            varlen_fn=_Recorder(pair=True), decode_kernel="triton", decode_fn=_Recorder(False)
        )
        backend._num_sms = 132
        llm = SimpleNamespace(
            runner=SimpleNamespace(backend=backend),
            spec=SimpleNamespace(num_kv_heads=8),
            parallel_config=SimpleNamespace(tensor_parallel_size=2),
            cache_config=SimpleNamespace(block_size=block_size),
        )
        assert LLM.decode_split_kv(llm) == expected


def test_fa4_backend_decode_kernel_choice(monkeypatch):
    monkeypatch.delenv("KVPLAN_DECODE_KERNEL", raising=False)
    varlen = _Recorder(pair=True)
    default = FlashAttnCuteBackend(varlen_fn=varlen).decode_kernel
    assert default == ("triton" if torch.cuda.is_available() else "fa4")
    backend = FlashAttnCuteBackend(varlen_fn=varlen, decode_kernel="fa4")
    q, k_cache, v_cache, k, v, md = _decode_step([5, 70], 16, 4, 2, 64, torch.float32)
    backend.forward(q, k, v, k_cache, v_cache, md, 0.125)
    assert backend.decode_kernel == "fa4" and len(varlen.calls) == 1
    monkeypatch.setenv("KVPLAN_DECODE_KERNEL", "fa4")
    assert FlashAttnCuteBackend(varlen_fn=varlen, decode_fn=_Recorder(False)).decode_kernel == "fa4"
    with pytest.raises(ValueError, match="not one of"):
        FlashAttnCuteBackend(varlen_fn=varlen, decode_kernel="cuda")


def test_fa4_backend_decode_balance_switch(monkeypatch):
    """KVPLAN_DECODE_BALANCE=0: the grid of the batch-size policy alone and no balancing; 64
    sequences of 8 kv heads take 1 split then, 4 balanced (decode_splits.MIN_GRID_SPLITS)."""
    q, k_cache, v_cache, k, v, md = _decode_step([700] * 64, 16, 8, 8, 64, torch.float32)
    for value, splits, balance in (("0", 1, 0), ("1", 4, 8 * 132)):
        monkeypatch.setenv("KVPLAN_DECODE_BALANCE", value)
        decode = _Recorder(pair=False)
        backend = FlashAttnCuteBackend(
            varlen_fn=_Recorder(pair=True), decode_kernel="triton", decode_fn=decode
        )
        backend.forward(q, k, v, k_cache, v_cache, md, 0.125)
        assert decode.calls[0][5] == splits and decode.kwargs == {"balance": balance}
    monkeypatch.setenv("KVPLAN_DECODE_BALANCE", "yes")
    with pytest.raises(ValueError, match="KVPLAN_DECODE_BALANCE: 'yes' is not 0 or 1"):
        FlashAttnCuteBackend(
            varlen_fn=_Recorder(pair=True), decode_kernel="triton", decode_fn=_Recorder(False)
        )


@pytest.mark.gpu
def test_balanced_decode_on_gpu_bf16_in_a_graph():
    """On the GPU in bf16, replayed from one CUDA graph over fixed buffers as a decode step runs: a
    skewed batch of 96 (one sequence 40x the others' median), then new contexts in the same
    buffers, balanced as the engine launches it, equals the fp32 torch reference within bf16."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    lengths = [[160 + 7 * i for i in range(95)] + [6400], [3000] + [40 + i for i in range(95)]]
    steps = [_decode_step(c, 16, 16, 8, 128, bf16, seed=i) for i, c in enumerate(lengths)]
    num_blocks = max(s[1].shape[0] for s in steps)
    k_cache = torch.zeros(num_blocks, 16, 8, 128, dtype=bf16, device=dev)
    v_cache = torch.zeros_like(k_cache)
    q = torch.zeros(96, 16, 128, dtype=bf16, device=dev)
    tables = torch.zeros(96, max(s[-1].block_tables.shape[1] for s in steps), dtype=torch.int32, device=dev)
    lens = torch.zeros(96, dtype=torch.int32, device=dev)
    splits = choose_num_splits(96, 8, 16384, 16, balanced=True)
    balance = triton_decode.balance_programs(132)
    out = torch.empty_like(q)
    workspace = triton_decode.make_workspace(96, 16, 128, splits, dev)

    def run():
        triton_decode.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, 128**-0.5, splits, out, workspace, balance=balance
        )

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for step in steps:
        sq, sk, sv, k, v, md = step
        k_cache.zero_()
        v_cache.zero_()
        k_cache[: sk.shape[0]].copy_(sk)
        v_cache[: sv.shape[0]].copy_(sv)
        q.copy_(sq)
        tables.zero_()
        tables[:, : md.block_tables.shape[1]].copy_(md.block_tables)
        lens.copy_(md.context_lens)
        out.fill_(float("nan"))
        graph.replay()
        ref = _reference(sq, sk, sv, k, v, md)
        torch.testing.assert_close(out.float().cpu(), ref, rtol=2e-2, atol=2e-2)
