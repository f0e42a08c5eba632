"""A designed sweep of step shapes run through the real engine, recorded for the latency fit.

Decode batches over a grid of batch sizes and contexts (prompts share a prefix so the prefill that
sets them up is cheap), prefill chunks with and without cached prefixes, and, for the chunked
policy, mixed steps. Everything goes through `LLM` exactly as serving does (CUDA graphs included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
from tqdm import tqdm

from engine.sequence import SamplingParams

DECODE_STEPS = 40


@dataclass(frozen=True)
class Workload:
    kind: str  # "decode" | "prefill" | "prefill_cached" | "mixed"
    num_seqs: int
    prompt_len: int
    max_tokens: int
    shared_prefix_len: int = 0


def design(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, kv_tokens: int, policy: str):
    """The sweep: every workload fits the KV cache and the batch limits."""
    batches = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512) if b <= max_num_seqs]
    contexts = [c for c in (128, 512, 1024, 2048, 4096, 8192) if c + DECODE_STEPS < max_model_len]
    out = [
        Workload("decode", b, c, DECODE_STEPS, shared_prefix_len=max(0, c - 16))
        for c in contexts
        for b in batches
        if b * (c + DECODE_STEPS) <= 0.8 * kv_tokens
    ]
    lengths = [
        n
        for n in (16, 64, 256, 1024, 2048, 4096, 8192, 16384)
        if n <= min(max_num_batched_tokens, max_model_len - 2)
    ]
    for n in lengths:
        for k in (1, 4, 16):
            if k * n <= max_num_batched_tokens and k <= max_num_seqs:
                out.append(Workload("prefill", k, n, 1))
                if n >= 64:
                    out.append(
                        Workload("prefill_cached", k, n, 1, shared_prefix_len=min(4096, max_model_len // 2))
                    )
    if policy == "chunked":
        out += [Workload("mixed", b, n, 24) for b in (8, 32, 128) if b <= max_num_seqs for n in (256, 2048)]
    return out


def _prompts(rng: np.random.Generator, w: Workload, vocab: int) -> list[list[int]]:
    prefix = rng.integers(0, vocab, w.shared_prefix_len).tolist()
    return [prefix + rng.integers(0, vocab, w.prompt_len).tolist() for _ in range(w.num_seqs)]


def _run(llm, w: Workload, rng: np.random.Generator, vocab: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
    prompts = _prompts(rng, w, vocab)
    if w.shared_prefix_len:  # cache the prefix first, so the measured prefills attend to it
        llm.generate([prompts[0][: w.shared_prefix_len + 1]], SamplingParams(max_tokens=1), use_tqdm=False)
    if w.kind != "mixed":
        llm.generate(prompts, params, use_tqdm=False)
        return
    # Mixed: decodes running, then one new prefill per step joins them.
    for p in prompts:
        llm.add_request(p[:64], params)
    for _ in range(4):
        llm.step()
    for p in prompts[: w.num_seqs // 2]:
        llm.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True))
        llm.step()
    while llm.has_unfinished():
        llm.step()


def run_profile(llm, seed: int = 0, time_budget_s: float = 240.0, progress: bool = True) -> pd.DataFrame:
    """Run the designed sweep on `llm` within `time_budget_s`; return its step records."""
    cfg = llm.scheduler_config
    kv_tokens = llm.cache_config.num_blocks * llm.cache_config.block_size
    work = design(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, kv_tokens, cfg.policy)
    rng = np.random.default_rng(seed)
    vocab = min(llm.spec.vocab_size, 100_000)
    t0 = time.perf_counter()
    for w in tqdm(work, desc="profiling", unit="workload", disable=not progress):
        if time.perf_counter() - t0 > time_budget_s:
            print(f"profile: time budget of {time_budget_s:.0f} s reached; {len(work)} workloads planned")
            break
        _run(llm, w, rng, vocab)
    return llm.recorder.to_dataframe()
