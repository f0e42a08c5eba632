"""The profile sweep's design (engine/profiling.py): which step shapes it plans, exactly."""

from __future__ import annotations

from engine.profiling import design, spread_lengths


def test_spread_lengths_are_geometric():
    assert spread_lengths(5, 2048) == [128, 256, 512, 1024, 2048]
    assert spread_lengths(1, 300) == [300]
    lengths = spread_lengths(128, 4096)
    assert max(lengths) * len(lengths) / sum(lengths) > 3  # serving-like: longest >> mean


def test_design_plans_spread_decodes_that_fit():
    spread = [(w.num_seqs, w.prompt_len) for w in design(256, 8192, 16384, 131072, "chunked")
              if w.kind == "decode_spread"]  # fmt: skip
    assert spread == [(16, 2048), (32, 2048), (64, 2048), (96, 2048), (128, 2048),
                      (16, 4096), (32, 4096), (64, 4096), (96, 4096)]  # fmt: skip
    # batch limit and context limit cut the list
    small = [(w.num_seqs, w.prompt_len) for w in design(64, 8192, 4096, 131072, "chunked")
             if w.kind == "decode_spread"]  # fmt: skip
    assert small == [(16, 2048), (32, 2048), (64, 2048)]
