"""Profile-sweep workloads run through a real (tiny, CPU) engine: spread prompts over a full cache,
with and without a joining prefill chunk, give the step shapes the sweep means them to (the whole
sweep against its plan: tests/engine/test_calibration.py)."""

from __future__ import annotations

import numpy as np

from engine.llm import LLM
from engine.profiling import Workload, _run, spread_lengths


def test_spread_workloads_fill_the_cache_and_mix_in_a_chunk(checkpoints):
    with LLM(checkpoints["qwen3"], num_kv_blocks=96, block_size=16, max_model_len=512, device="cpu") as llm:
        vocab, rng = llm.spec.vocab_size, np.random.default_rng(0)
        lengths = spread_lengths(8, 160, shortest=20)
        _run(llm, Workload("decode_spread", 8, 160, 4, shortest=20), rng, vocab)
        steps = llm.recorder.to_dataframe()
        decode = steps[steps.kind == "decode"]
        # the prefill samples the first of 4 tokens; 3 decode steps of all 8 follow
        assert decode.num_seqs.tolist() == [8, 8, 8]
        assert decode.max_seq_len.tolist() == [161, 162, 163]  # the longest prompt, 1..3 tokens on
        assert decode.num_context_tokens.tolist() == [sum(lengths) + 8 * i for i in range(3)]
        llm.recorder.reset()
        _run(llm, Workload("mixed", 8, 160, 8, chunk_len=40, shortest=20), rng, vocab)
        steps = llm.recorder.to_dataframe()
        mixed = steps[(steps.kind == "mixed") & (steps.num_prefill_tokens == 40)]
        assert len(mixed) == 6 and (mixed.num_decode_seqs == 8).all()  # six joins, each in one step
