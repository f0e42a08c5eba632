"""A designed sweep of step shapes run through the real engine, recorded for the latency fit.

Phases, in the order they run (docs/CALIBRATION.md says what each covers and why):
- `short`: the sweep of a 131k-token box: decode batches over a grid of batch sizes and contexts to
  4k (distinct prompts: shared ones would read their KV from L2 and look cheaper than serving),
  decode batches whose lengths spread as serving's do, the same over a (131k-token) full box,
  prefill chunks with and without cached prefixes, mixed steps at short context;
- `long`: decode batches over a corpus of distinct documents sized from the engine's real KV cache
  (`corpus_lengths`: one per sequence slot, the longest at max_model_len, spread geometrically to
  fill most of the cache), every batch size from 1 to max_num_seqs and uniform batches at 8k to
  max_model_len; each document is prefilled once and reused by prefix hits;
- `mixed_long`: long prefills (half and all of max_model_len) chunked beside long decodes;
- `mixed_serving`: serving's common mixed step, one short prompt (128-2,048 tokens after one cached
  block) joining a running batch (2 to 160 sequences) of document prefixes spread from 512 to 4,096
  tokens;
- `full`: the largest batch over nearly all of the cache;
- with async scheduling, a `sync` twin of every `long` and `full` workload whose requests stop at
  EOS: the engine cannot run their steps ahead, so the fit's sync terms see every block-table width;
- then two short synthetic-traffic replays so the serving loop's own shapes are in the fit.
All of it goes through `LLM` exactly as serving does (`run_sweep`). `plan_steps` replays the same
driver on the control plane alone (no torch): the step shapes the sweep will run, for the envelope it
covers (`envelope`) and the device-time estimate (simulator/calibration.py prices them on a profile).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from engine.core.config import cdiv
from engine.records import STEP_RECORD_COLUMNS
from engine.sampling_params import SamplingParams

DECODE_STEPS = 40
SHORT_KV_TOKENS = 131072  # the `short` phase's box: the cache the shipped profiles were measured in
CORPUS_SHARE = 0.8  # of the KV cache: the `long` phase's documents together
FULL_SHARE = 0.97  # of the KV cache: the `full` workload's prompts and decode room together
LONG_CONTEXTS = (8192, 16384, 24576)  # uniform long-context decode batches (where the documents are as long)
LONG_BATCHES = (1, 4, 16, 64)
MIXED_LONG_SHARES = (16, 4, 2)  # mixed_long: decode batches of 1/16, 1/4 and 1/2 of the documents
MIXED_SERVING_BATCHES = (160, 128, 96, 64, 32, 16, 8, 2)  # mixed_serving: running batches, largest first
MIXED_SERVING_JOINS = (128, 256, 512, 1024, 2048) * 3  # its prompts, each one mixed step beside them
PHASES = ("short", "long", "mixed_long", "mixed_serving", "full", "serving")
SERVING_S = 28.0  # the two synthetic-traffic replays: 20 s + 8 s of traffic, served in real time


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
    phase: str = "short"
    lengths: tuple[int, ...] = ()  # > (): sequence i's prompt is corpus document i's first lengths[i] tokens
    joins: tuple[int, ...] = ()  # mixed over documents: fresh prompts that join one after another
    sync: bool = False  # its requests stop at EOS: an async engine cannot run their steps ahead
    join_prefix: int = 0  # joins start with corpus document 0's first that many tokens (cached)


@dataclass(frozen=True)
class SweepLimits:
    """What the engine under test allows: the sweep plans only workloads that fit."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_tokens: int  # KV cache size in tokens
    policy: str
    block_size: int = 16
    async_scheduling: bool = False

    @classmethod
    def of_llm(cls, llm) -> SweepLimits:
        """The limits of an engine: its scheduler's and its real KV cache's (blocks x block size)."""
        cfg, cache = llm.scheduler_config, llm.cache_config
        return cls(
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            cfg.max_model_len,
            cache.num_blocks * cache.block_size,
            cfg.policy,
            cache.block_size,
            bool(getattr(llm, "async_scheduling", False)),
        )


def sweep(limits: SweepLimits) -> list[Workload]:
    """Every phase's workloads in the order they run: `design` within the short box, then
    `long_workloads`, with their `sync` twins under async scheduling."""
    box = SweepLimits(
        limits.max_num_seqs,
        limits.max_num_batched_tokens,
        limits.max_model_len,
        min(limits.kv_tokens, SHORT_KV_TOKENS),
        limits.policy,
        limits.block_size,
    )
    return design(box) + long_workloads(limits)


def corpus_lengths(limits: SweepLimits) -> list[int]:
    """The `long` phase's documents, longest first: as many as the cache holds up to one per
    sequence slot (max_num_seqs), the longest `longest_document` tokens, spread geometrically
    (`fill_shortest`, from 16 tokens up) so that together they fill CORPUS_SHARE of the cache."""
    longest, budget = longest_document(limits), int(CORPUS_SHARE * limits.kv_tokens)
    if longest < 16:
        return []
    n = limits.max_num_seqs
    if n * longest <= budget:
        return [longest] * n
    lo, hi = 0, n + 1  # sum(spread(lo)) <= budget < sum(spread(hi)), from the floor of 16
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if sum(spread_lengths(mid, longest, 16)) <= budget:
            lo = mid
        else:
            hi = mid
    if lo == 0:
        return []
    shortest = fill_shortest(lo, longest, budget)
    return [longest] * lo if shortest is None else spread_lengths(lo, longest, shortest)[::-1]


def longest_document(limits: SweepLimits) -> int:
    """The longest prompt of the long phases: max_model_len less room for two runs of decode steps."""
    return limits.max_model_len - 2 * DECODE_STEPS


def long_workloads(limits: SweepLimits) -> list[Workload]:
    """The `long`, `mixed_long`, `mixed_serving` and `full` phases (and, with async scheduling, the `sync` twins of
    the decode ones) over the corpus documents (`corpus_lengths`)."""
    docs = corpus_lengths(limits)
    if not docs:
        return []
    n_docs, bs = len(docs), limits.block_size
    batches = sorted({b for b in (1 << k for k in range(12)) if b <= n_docs} | {n_docs}, reverse=True)
    # the documents' prefill first (chunks at long context), so that every batch over them is
    # admitted by prefix hits and decodes together
    out = [Workload("prefill", n_docs, docs[0], 1, phase="long", lengths=tuple(docs))]
    out += [
        Workload("decode", b, docs[0], DECODE_STEPS, phase="long", lengths=tuple(docs[:b])) for b in batches
    ]
    for c in LONG_CONTEXTS:
        for b in LONG_BATCHES:
            if b <= n_docs and c <= docs[b - 1] and c < limits.max_model_len:
                out.append(Workload("decode", b, c, DECODE_STEPS, phase="long", lengths=(c,) * b))
    if limits.policy == "chunked":
        longest = docs[0]
        joins = tuple(n for n in (512, 2048, longest // 4, longest // 2, longest) if 16 <= n <= longest)
        for b in dict.fromkeys(max(1, n_docs // k) for k in MIXED_LONG_SHARES):
            chunk = limits.max_num_batched_tokens - b
            if b > n_docs or chunk <= 0:
                continue
            steps = sum(cdiv(n, chunk) for n in joins) + DECODE_STEPS // 4
            if _joins_fit(limits, docs[:b], joins, steps) and docs[b - 1] + steps < limits.max_model_len:
                out.append(
                    Workload(
                        "mixed", b, docs[0], steps, phase="mixed_long", lengths=tuple(docs[:b]), joins=joins
                    )
                )
    out += mixed_serving_workloads(limits, docs)
    b = n_docs
    budget = int(FULL_SHARE * limits.kv_tokens) - b * (DECODE_STEPS + bs)
    scale = budget / sum(docs)
    if scale > 1:
        full = tuple(min(docs[0], int(n * scale)) for n in docs)
        out.append(Workload("prefill", b, docs[0], 1, phase="full", lengths=full))
        out.append(Workload("decode", b, docs[0], DECODE_STEPS, phase="full", lengths=full))
    if limits.async_scheduling:
        twins = []
        for w in out:
            twins.append(w)
            if w.kind == "decode":
                twins.append(replace(w, sync=True))
        out = twins
    return out


def mixed_serving_workloads(limits: SweepLimits, docs: list[int]) -> list[Workload]:
    """The `mixed_serving` phase (chunked policy): running batches of MIXED_SERVING_BATCHES over the
    longest documents' prefixes (lengths spread from 512 to 4,096 tokens, longest on the longest
    document; prefix hits on what the `long` phase cached), joined one at a time by prompts of
    MIXED_SERVING_JOINS tokens, each prefilled in one step beside the running decodes. Each join
    starts with one block that is cached (document 0's first), as serving's shared system prompts
    make most prefills prefix hits."""
    if limits.policy != "chunked":
        return []
    longest, out = min(4096, limits.max_model_len // 2), []
    # a join needs a slot beside the running batch: b < max_num_seqs
    for b in (b for b in MIXED_SERVING_BATCHES if b <= len(docs) and b < limits.max_num_seqs):
        spread = sorted(spread_lengths(b, longest, min(512, longest)), reverse=True)
        lengths = tuple(max(1, min(n, d)) for n, d in zip(spread, docs))
        joins = tuple(n for n in MIXED_SERVING_JOINS if n + b <= limits.max_num_batched_tokens)
        prefix = limits.block_size if docs[0] >= limits.block_size else 0
        steps = len(joins) + DECODE_STEPS // 4
        if joins and _joins_fit(limits, lengths, joins, steps) and lengths[0] + steps < limits.max_model_len:
            shape = dict(lengths=lengths, joins=joins, join_prefix=prefix)
            out.append(Workload("mixed", b, lengths[0], steps, phase="mixed_serving", **shape))
    return out


def _joins_fit(limits: SweepLimits, lengths: Seq[int], joins: Seq[int], steps: int) -> bool:
    """Whether the cache holds a running batch of `lengths` decoding `steps` tokens (a block of room
    each) beside the `joins` prompts and two blocks more."""
    bs = limits.block_size
    return sum(lengths) + len(lengths) * (steps + bs) + sum(joins) + 2 * bs <= limits.kv_tokens


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


class Corpus:
    """The long phases' documents: document i is a fixed random token sequence (seeded by `seed` and
    i) of the longest document's length; a prompt takes its first n tokens, so a later prompt of the
    same document hits what an earlier one left cached."""

    def __init__(self, vocab: int, length: int, seed: int = 0) -> None:
        self.vocab, self.length, self.seed = vocab, length, seed
        self._docs: dict[int, np.ndarray] = {}

    def prompt(self, i: int, n: int) -> list[int]:
        if n > self.length:
            raise ValueError(f"Corpus.prompt: {n} tokens asked of documents of {self.length}")
        if i not in self._docs:
            self._docs[i] = np.random.default_rng([self.seed, 1, i]).integers(0, self.vocab, self.length)
        return self._docs[i][:n].tolist()


def _prompts(
    rng: np.random.Generator, w: Workload, vocab: int, corpus: Corpus | None = None
) -> list[list[int]]:
    if w.lengths:
        return [corpus.prompt(i, n) for i, n in enumerate(w.lengths)]
    prefix = rng.integers(0, vocab, w.shared_prefix_len).tolist()
    if w.kind == "decode_serving":
        lengths = serving_lengths(w.num_seqs, w.prompt_len, w.longest, rng)
    elif w.shortest:
        lengths = spread_lengths(w.num_seqs, w.prompt_len, w.shortest)
    else:
        lengths = [w.prompt_len] * w.num_seqs
    return [prefix + rng.integers(0, vocab, n).tolist() for n in lengths]


def _serve(engine, prompts: list[list[int]], params: SamplingParams) -> None:
    """`generate` on the step API: add every prompt, step until all are done."""
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()


def _run(engine, w: Workload, rng: np.random.Generator, vocab: int, corpus: Corpus | None = None) -> None:
    """Drive one workload through `engine` (an `LLM`, or a `PlanEngine` for its step shapes)."""
    params = SamplingParams(temperature=0.0, max_tokens=w.max_tokens, ignore_eos=not w.sync)
    prompts = _prompts(rng, w, vocab, corpus)
    if w.shared_prefix_len:  # cache the prefix first, so the measured prefills attend to it
        _serve(engine, [prompts[0][: w.shared_prefix_len + 1]], SamplingParams(max_tokens=1))
    if w.kind != "mixed":
        _serve(engine, prompts, params)
        return
    # Mixed: decodes running, then new requests join, each prompt chunked into the steps.
    for p in prompts:
        engine.add_request(p, params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    join = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    if w.joins:  # prompts one after another, each stepped until its prefill is done
        prefix = corpus.prompt(0, w.join_prefix) if w.join_prefix else []
        for n in w.joins:
            seq = engine.add_request(prefix + rng.integers(0, vocab, n).tolist(), join)
            while seq.num_computed_tokens < seq.num_prompt_tokens and not seq.is_finished:
                engine.step()
    else:
        for _ in range(6):
            engine.add_request(rng.integers(0, vocab, w.chunk_len).tolist(), join)
            engine.step()
    while engine.has_unfinished():
        engine.step()


# a planned step: its phase and workload, the batch totals of its step record, and whether it runs ahead
_SHAPE = slice(STEP_RECORD_COLUMNS.index("kind"), STEP_RECORD_COLUMNS.index("num_kv_blocks_used") + 1)
PLAN_COLUMNS = ("phase", "workload", *STEP_RECORD_COLUMNS[_SHAPE], "overlapped")


class PlanEngine:
    """The engine's loop on the control plane alone: the same Scheduler and BlockManager, a token
    that is never EOS for every sample, and the async loop's rule for which decode steps are
    scheduled while the step before them runs (`LLM.step`). Records each step's shape (PLAN_COLUMNS)."""

    def __init__(self, limits: SweepLimits, eos_token_id: int | None, vocab: int) -> None:
        from engine.core.block_manager import BlockManager
        from engine.core.config import SchedulerConfig
        from engine.core.scheduler import Scheduler

        cfg = SchedulerConfig(
            limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_model_len, limits.policy
        )
        self.block_manager = BlockManager(limits.kv_tokens // limits.block_size, limits.block_size, True)
        self.scheduler = Scheduler(cfg, self.block_manager, clock=lambda: 0.0, record_itl=False)
        self.async_scheduling = limits.async_scheduling
        self.eos_token_id = eos_token_id
        self.token = next(t for t in range(vocab) if t != eos_token_id)
        self._ahead = None  # the last step, when it could run ahead (the engine would leave it running)
        self.rows: list[tuple] = []
        self.phase, self.workload = "", -1

    def add_request(self, prompt: list[int], params: SamplingParams):
        return self.scheduler.add_request(prompt, params, None, self.eos_token_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list:
        from engine.core.scheduler import can_run_ahead, schedules_ahead

        sched, ahead = self.scheduler, self._ahead
        reads_none = ahead is not None and sched.schedule_reads_no_token_values()
        batch = sched.schedule()
        if batch.is_empty:
            self._ahead = None
            return sched.postprocess(batch, [])
        overlapped = reads_none and schedules_ahead(ahead.seqs, batch)
        self._ahead = batch if self.async_scheduling and can_run_ahead(batch) else None
        self.rows.append(
            (self.phase, self.workload, batch.kind, batch.num_seqs, batch.num_prefill_seqs,
             batch.num_decode_seqs, batch.total_num_scheduled_tokens, batch.num_prefill_tokens,
             batch.total_num_cached_tokens, batch.num_context_tokens, batch.max_seq_len,
             batch.prefill_attn_work, batch.num_kv_blocks_used, overlapped)
        )  # fmt: skip
        return sched.postprocess(batch, [self.token] * batch.num_seqs)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=list(PLAN_COLUMNS))


def plan_steps(
    work: list[Workload], limits: SweepLimits, vocab: int, eos_token_id: int | None = None, seed: int = 0
) -> pd.DataFrame:
    """The steps `run_sweep` runs for `work` on an engine of `limits` (PLAN_COLUMNS, one row a
    step), from the same driver on the control plane alone; equal to the engine's step records'
    shapes while no request samples its EOS early (only `sync` requests stop at it)."""
    engine = PlanEngine(limits, eos_token_id, vocab)
    rng, corpus = np.random.default_rng(seed), Corpus(vocab, max(longest_document(limits), 1), seed)
    for i, w in enumerate(work):
        engine.phase, engine.workload = w.phase, i
        _run(engine, w, rng, vocab, corpus)
    return engine.frame()


def envelope(steps: pd.DataFrame, block_size: int) -> dict[str, Any]:
    """What the steps cover (planned steps or step records: the same columns), per group (decode;
    decode steps not scheduled ahead, `decode_sync`; prefill and mixed): the number of steps and
    [min, max] of batch, longest sequence, sum of context, step tokens, KV blocks in use and
    block-table width (batch x blocks of the longest sequence)."""
    frame = steps[steps["kind"] != "empty"]
    if "compiled" in frame.columns:
        frame = frame[~frame["compiled"].astype(bool)]
    decode = frame[frame["kind"] == "decode"]
    overlapped = decode["overlapped"].fillna(False).astype(bool) if "overlapped" in decode else False
    groups = {
        "decode": decode,
        "decode_sync": decode[~overlapped],
        "prefill": frame[frame["kind"] != "decode"],
    }
    out: dict[str, Any] = {"block_size": int(block_size)}
    for name, rows in groups.items():
        width = rows["num_seqs"] * ((rows["max_seq_len"] + block_size - 1) // block_size)
        figures = {
            "batch": rows["num_seqs"],
            "longest": rows["max_seq_len"],
            "context": rows["num_context_tokens"],
            "step_tokens": rows["total_num_scheduled_tokens"],
            "kv_blocks": rows["num_kv_blocks_used"],
            "table_width": width,
        }
        out[name] = {"steps": int(len(rows))} | {
            k: [int(v.min()), int(v.max())] if len(rows) else [0, 0] for k, v in figures.items()
        }
    return out


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


def run_sweep(
    llm,
    work: list[Workload],
    limits: SweepLimits,
    seed: int = 0,
    time_budget_s: float = 300.0,
    progress: bool = True,
    serving: bool = True,
) -> pd.DataFrame:
    """Run `work` (the sweep of an engine of `limits`: `sweep`) on `llm`, then, with `serving`, two
    short synthetic-traffic replays (`serving_traces`); return its step records. Stops (saying what
    was left) past twice `time_budget_s`, should the estimate it was held to be far off. The
    workloads' prompts come from `seed`, as `plan_steps`'s do."""
    rng = np.random.default_rng(seed)
    vocab = min(llm.spec.vocab_size, 100_000)
    corpus = Corpus(vocab, max(longest_document(limits), 1), seed)
    t0 = time.perf_counter()
    for i, w in enumerate(tqdm(work, desc="profiling", unit="workload", disable=not progress)):
        if time.perf_counter() - t0 > 2 * time_budget_s:
            print(
                f"profile: twice the budget of {time_budget_s:.0f} s reached; ran {i} of {len(work)} workloads"
            )
            break
        _run(llm, w, rng, vocab, corpus)
    if serving:
        from engine.replay import replay_trace

        for trace in serving_traces(limits.max_model_len):
            replay_trace(llm, trace, progress=False, max_wall_s=120)
    return llm.recorder.to_dataframe()
