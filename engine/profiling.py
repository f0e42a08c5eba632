"""A designed sweep of step shapes run through the real engine, recorded for the latency fit.

Decode batches over a grid of batch sizes and contexts (distinct prompts: shared ones would read
their KV from L2 and look cheaper than serving), decode batches whose lengths spread as serving's do
(a longest sequence ~3.5x the mean), the same over a nearly full cache (serving near saturation:
large batches, the shortest sequences shorter), prefill chunks with and without cached prefixes,
mixed steps (decodes plus a prefill chunk, also over a full cache), then two short synthetic-traffic
replays so the serving loop's own shapes are in the fit. All of it goes through `LLM` exactly as
serving does.
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
    kind: str  # "decode" | "decode_spread" | "decode_serving" | "prefill" | "prefill_cached" | "mixed"
    num_seqs: int
    prompt_len: int  # spread prompts: the longest (the others spread geometrically down to `shortest`);
    # decode_serving: the prompts' total (lognormal lengths, `serving_lengths`)
    max_tokens: int
    shared_prefix_len: int = 0
    chunk_len: int = 0  # mixed: prompt length of the requests that join the running decodes
    shortest: int = 0  # > 0: prompts spread geometrically from this to prompt_len (decode_spread, mixed)
    longest: int = 0  # decode_serving: no prompt longer


@dataclass(frozen=True)
class SweepLimits:
    """What the engine under test allows: the sweep plans only workloads that fit."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_tokens: int  # KV cache size in tokens
    policy: str
    block_size: int = 16


def design(limits: SweepLimits) -> list[Workload]:
    """The sweep: every workload fits the KV cache and the batch limits."""
    max_num_seqs, max_num_batched_tokens = limits.max_num_seqs, limits.max_num_batched_tokens
    max_model_len, kv_tokens, policy = limits.max_model_len, limits.kv_tokens, limits.policy
    batches = [b for b in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512) if b <= max_num_seqs]
    contexts = [c for c in (128, 512, 1024, 2048, 4096) if c + DECODE_STEPS < max_model_len]
    out = [
        Workload("decode", b, c, DECODE_STEPS)
        for c in contexts
        for b in batches
        if b * (c + DECODE_STEPS) <= 0.8 * kv_tokens
    ]
    out += [
        Workload("decode_spread", b, c, DECODE_STEPS, shortest=128)
        for c in (2048, 4096)
        for b in (16, 32, 64, 96, 128, 192, 256)
        if c + DECODE_STEPS < max_model_len
        and b <= max_num_seqs
        and sum(spread_lengths(b, c)) + b * DECODE_STEPS <= 0.9 * kv_tokens
    ]
    out += full_cache_workloads(limits)
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
        out += [
            Workload("mixed", b, c, 32, chunk_len=n)
            for b in (4, 32, 128)
            for c in (256, 2048)
            for n in (64, 512, 4096)
            if b <= max_num_seqs and n <= max_num_batched_tokens and b * (c + 64) + 6 * n <= 0.8 * kv_tokens
        ]
    return out


def full_cache_workloads(limits: SweepLimits) -> list[Workload]:
    """Serving near saturation: decode batches (and, chunked, mixed steps) whose spread lengths fill
    the cache but for room to decode (`fill_shortest`): ~90 % less a block and the steps' tokens per
    sequence."""
    out = serving_workloads(limits)
    for longest in (2048, 4096, 8192):
        for b in (64, 96, 128, 160, 192, 256):
            if b > limits.max_num_seqs or longest + DECODE_STEPS >= limits.max_model_len:
                continue
            budget = int(0.9 * limits.kv_tokens) - b * (DECODE_STEPS + limits.block_size)
            shortest = fill_shortest(b, longest, budget)
            if shortest is None:
                continue
            out.append(Workload("decode_spread", b, longest, DECODE_STEPS, shortest=shortest))
            if limits.policy == "chunked" and longest == 4096 and b in (64, 128):
                for n in (512, 2048):
                    if n <= limits.max_num_batched_tokens:
                        out.append(Workload("mixed", b, longest, 32, chunk_len=n, shortest=shortest))
    return out


def serving_workloads(limits: SweepLimits) -> list[Workload]:
    """Decode batches as serving near saturation runs them: lengths drawn as conversations' are
    (`serving_lengths`), filling ~96 % of the cache's blocks with room to decode: the steps' tokens
    and, on average, half a block per sequence (its last block's unused part). Their steps cost more
    per token than the geometric spreads' at the same totals (docs/PERF.md, "Kernels and step pieces")."""
    out = []
    for b in (64, 96, 128, 160, 192):
        budget = int(0.96 * limits.kv_tokens) - b * (DECODE_STEPS + limits.block_size // 2)
        longest = min(8192, limits.max_model_len - DECODE_STEPS - 1)
        if b <= limits.max_num_seqs and b * 64 <= budget <= b * longest:
            out.append(Workload("decode_serving", b, budget, DECODE_STEPS, longest=longest))
    return out


def serving_lengths(num_seqs: int, total: int, longest: int, rng: np.random.Generator) -> list[int]:
    """`num_seqs` lognormal lengths (median 900 tokens, sigma 0.9: the shipped conversation traces'
    shape) scaled to sum to about `total`, each in [16, longest]."""
    x = np.clip(rng.lognormal(np.log(900), 0.9, num_seqs), 16, None)
    x = np.clip(x * total / x.sum(), 16, longest)
    return [int(v) for v in np.clip(np.round(x * total / x.sum()), 16, longest)]


def fill_shortest(num_seqs: int, longest: int, budget: int, floor: int = 16) -> int | None:
    """The largest shortest length s in [floor, longest] whose geometric spread s..longest over
    `num_seqs` prompts sums to at most `budget`; None when even `floor` goes over or when the
    uniform batch (s = longest) stays under it (that batch cannot fill the cache)."""
    if sum(spread_lengths(num_seqs, longest, floor)) > budget or num_seqs * longest <= budget:
        return None
    lo, hi = floor, longest  # sum(lo) <= budget < sum(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if sum(spread_lengths(num_seqs, longest, mid)) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def spread_lengths(num_seqs: int, longest: int, shortest: int = 128) -> list[int]:
    """Prompt lengths spread geometrically from `shortest` to `longest` (serving-like skew)."""
    if num_seqs == 1:
        return [longest]
    return [round(x) for x in np.geomspace(shortest, longest, num_seqs)]


def _prompts(rng: np.random.Generator, w: Workload, vocab: int) -> list[list[int]]:
    prefix = rng.integers(0, vocab, w.shared_prefix_len).tolist()
    if w.kind == "decode_serving":
        lengths = serving_lengths(w.num_seqs, w.prompt_len, w.longest, rng)
    elif w.shortest:
        lengths = spread_lengths(w.num_seqs, w.prompt_len, w.shortest)
    else:
        lengths = [w.prompt_len] * w.num_seqs
    return [prefix + rng.integers(0, vocab, n).tolist() for n in lengths]


def _run(llm, w: Workload, rng: np.random.Generator, vocab: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=True)
    prompts = _prompts(rng, w, vocab)
    if w.shared_prefix_len:  # cache the prefix first, so the measured prefills attend to it
        llm.generate([prompts[0][: w.shared_prefix_len + 1]], SamplingParams(max_tokens=1), use_tqdm=False)
    if w.kind != "mixed":
        llm.generate(prompts, params, use_tqdm=False)
        return
    # Mixed: decodes running, then a new request joins each step, its prompt chunked into them.
    for p in prompts:
        llm.add_request(p, params)
    sched = llm.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        llm.step()
    join = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for _ in range(6):
        llm.add_request(rng.integers(0, vocab, w.chunk_len).tolist(), join)
        llm.step()
    while llm.has_unfinished():
        llm.step()


def serving_traces(max_model_len: int) -> list:
    """Synthetic traffic shaped like conversation traces, light then heavy (never a validation trace)."""
    import traces

    lengths = dict(
        prompt={"kind": "lognormal", "p50": 1000, "p90": 2700, "min": 16, "max": max_model_len // 2},
        output={"kind": "lognormal", "p50": 130, "p90": 420, "min": 4, "max": max_model_len // 4},
    )
    return [
        traces.generate(name="calib-light", duration_s=20, rate=5.0, seed=101, **lengths),
        traces.generate(name="calib-heavy", duration_s=8, rate=40.0, seed=102, **lengths),
    ]


def run_profile(
    llm, seed: int = 0, time_budget_s: float = 240.0, progress: bool = True, serving: bool = True
) -> pd.DataFrame:
    """Run the designed sweep on `llm` within `time_budget_s` (then, with `serving`, two short
    synthetic-traffic replays); return its step records."""
    cfg, cache = llm.scheduler_config, llm.cache_config
    limits = SweepLimits(
        cfg.max_num_seqs,
        cfg.max_num_batched_tokens,
        cfg.max_model_len,
        cache.num_blocks * cache.block_size,
        cfg.policy,
        cache.block_size,
    )
    work = design(limits)
    rng = np.random.default_rng(seed)
    vocab = min(llm.spec.vocab_size, 100_000)
    t0 = time.perf_counter()
    for w in tqdm(work, desc="profiling", unit="workload", disable=not progress):
        if time.perf_counter() - t0 > time_budget_s:
            print(f"profile: time budget of {time_budget_s:.0f} s reached; {len(work)} workloads planned")
            break
        _run(llm, w, rng, vocab)
    if serving:
        from engine.replay import replay_trace

        for trace in serving_traces(cfg.max_model_len):
            replay_trace(llm, trace, progress=False, max_wall_s=120)
    return llm.recorder.to_dataframe()
