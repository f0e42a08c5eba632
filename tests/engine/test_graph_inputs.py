"""The one-launch copy of a decode step's inputs into the CUDA graph's buffers
(engine/layers/graph_inputs.py), run by Triton's interpreter on CPU tensors, writes exactly what the
torch copies write: the step's rows, the block tables' first `width` columns only, slot -1 and
context 1 in the padding rows, nothing else. The GPU test does the same on CUDA.

The interpreter runs in a subprocess (TRITON_INTERPRET must be set before triton is first imported).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import run_interpreted

from engine.layers import graph_inputs

pytest.importorskip("triton")

WORKER = """
import sys, torch
from engine.layers import graph_inputs
assert type(graph_inputs._copy_decode_inputs_kernel).__name__ == "InterpretedFunction", "not interpreted"
out = {}
for name, c in torch.load(sys.argv[1]).items():
    graph_inputs.MAX_BLOCK_COLUMNS = c["max_block"]
    graph_inputs.copy_triton(c["src"], c["dst"], c["bs"])
    out[name] = c["dst"]
torch.save(out, sys.argv[2])
"""


def _step(n: int, width: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A decode step's inputs as build_step_inputs makes them: views of one packed int32 buffer."""
    lengths = [n, n, n, n + 1, n, n, n * width]
    packed = torch.randint(0, 1000, (sum(lengths),), generator=g, dtype=torch.int32)
    ids, pos, slots, _, _, ctx, tables = torch.split(packed, lengths)
    return ids, pos, slots, ctx, tables.view(n, width)


def _graph_buffers(rows: int, max_width: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Graph buffers full of stale values (which rows and columns a copy leaves must stay)."""
    stale = [torch.randint(-50, -2, (rows,), generator=g, dtype=torch.int32) for _ in range(4)]
    return (*stale, torch.randint(-50, -2, (rows, max_width), generator=g, dtype=torch.int32))


def _cases() -> dict[str, dict]:
    """(n, bs, width, graph rows, graph width, columns a program copies at a time)."""
    g = torch.Generator().manual_seed(0)
    shapes = {
        "one_row": (1, 1, 3, 8, 16, 1024),
        "padded": (3, 4, 2, 8, 16, 1024),
        "padded_to_all_rows": (5, 8, 16, 8, 16, 1024),
        "column_chunks": (2, 8, 11, 8, 16, 4),  # 3 chunks, the last partial
        "no_padding_wide": (6, 6, 37, 16, 40, 1024),
    }
    cases = {}
    for name, (n, bs, width, rows, max_width, max_block) in shapes.items():
        src, dst = _step(n, width, g), _graph_buffers(rows, max_width, g)
        cases[name] = dict(src=src, dst=dst, bs=bs, max_block=max_block)
    return cases


def test_graph_copy_kernel_matches_torch(tmp_path):
    cases = _cases()
    got = run_interpreted(WORKER, cases, tmp_path)
    assert sorted(got) == sorted(cases)
    for name, c in cases.items():
        expected = tuple(t.clone() for t in c["dst"])
        graph_inputs.copy_torch(c["src"], expected, c["bs"])
        assert not all(torch.equal(a, b) for a, b in zip(expected, c["dst"])), name  # it copied
        for i, (a, b) in enumerate(zip(got[name], expected)):
            assert torch.equal(a, b), f"{name}: buffer {i}\n{a}\n{b}"


def test_torch_copy_pads_and_keeps_the_rest():
    src = tuple(torch.arange(2, dtype=torch.int32) + 10 * i for i in range(4))
    src += (torch.tensor([[7, 8], [9, 6]], dtype=torch.int32),)
    dst = tuple(torch.zeros(4, dtype=torch.int32) for _ in range(4)) + (torch.zeros(4, 3, dtype=torch.int32),)
    graph_inputs.copy_torch(src, dst, 3)
    assert [t.tolist() for t in dst[:4]] == [[0, 1, 0, 0], [10, 11, 0, 0], [20, 21, -1, 0], [30, 31, 1, 0]]
    assert dst[4].tolist() == [[7, 8, 0], [9, 6, 0], [0, 0, 0], [0, 0, 0]]


def test_sizes_are_checked():
    g = torch.Generator().manual_seed(1)
    with pytest.raises(ValueError, match="2 rows x 5 blocks do not fit 2 of 4 x 4"):
        graph_inputs.copy_triton(_step(2, 5, g), _graph_buffers(4, 4, g), 2)
    with pytest.raises(ValueError, match="3 rows x 2 blocks do not fit 2 of 4 x 4"):
        graph_inputs.copy_triton(_step(3, 2, g), _graph_buffers(4, 4, g), 2)


def test_block_columns():
    assert graph_inputs.block_columns(1) == 16
    assert graph_inputs.block_columns(256) == 256
    assert graph_inputs.block_columns(300) == 512
    assert graph_inputs.block_columns(8192) == 1024


@pytest.mark.gpu
def test_graph_copy_on_gpu():
    """On CUDA (launches over at most 16 rows use PDL, larger ones not): the torch copies' result."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(2)
    for n, bs, width in ((1, 1, 3), (3, 4, 7), (13, 16, 256), (17, 32, 100), (40, 48, 256)):
        src = tuple(t.cuda() for t in _step(n, width, g))
        dst = tuple(t.cuda() for t in _graph_buffers(64, 256, g))
        expected = tuple(t.clone() for t in dst)
        graph_inputs.copy_torch(src, expected, bs)
        graph_inputs.copy_triton(src, dst, bs)
        for i, (a, b) in enumerate(zip(dst, expected)):
            assert torch.equal(a, b), (n, bs, width, i)
