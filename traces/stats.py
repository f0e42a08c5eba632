"""Summary statistics of a Trace: size, rate, burstiness, length percentiles and prefix reuse.

Pure functions over a Trace; percentiles use numpy's default linear interpolation. Prefix reuse assumes
an infinite cache and leading-prefix matching over `prefix_block_ids` (n/a for traces without them).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from .schema import Trace, list_offsets_values, splitmix64


@dataclass(frozen=True)
class LengthStats:
    """Distribution of one length column (tokens)."""

    mean: float
    p50: float
    p90: float
    p99: float
    min: int
    max: int


@dataclass(frozen=True)
class PrefixReuse:
    """Blocks / tokens already seen by an earlier request, with an infinite cache and prefix matching.

    A block is reused when an earlier request had the same chain of ids up to it; its reused tokens are
    at most as many as an earlier request had in that block (a prompt's last block may be partial).
    """

    prefix_block_size: int
    total_blocks: int
    distinct_block_ids: int
    reused_blocks: int
    total_tokens: int
    reused_tokens: int

    @property
    def block_reuse(self) -> float:
        return self.reused_blocks / self.total_blocks if self.total_blocks else 0.0

    @property
    def token_reuse(self) -> float:
        return self.reused_tokens / self.total_tokens if self.total_tokens else 0.0


@dataclass(frozen=True)
class TraceStats:
    """What `traces stats` prints. rate_rps is rows / duration; the CV is std / mean of the gaps."""

    name: str
    rows: int
    duration_s: float
    rate_rps: float | None
    interarrival_cv: float | None
    interarrival_p50_s: float | None
    interarrival_p99_s: float | None
    interarrival_max_s: float | None
    prompt: LengthStats
    output: LengthStats
    sessions: int | None
    prefix: PrefixReuse | None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.prefix is not None:
            d["prefix"]["block_reuse"] = self.prefix.block_reuse
            d["prefix"]["token_reuse"] = self.prefix.token_reuse
        return d

    def format(self) -> str:
        def num(x: float | None, spec: str) -> str:
            return "n/a" if x is None else format(x, spec)

        lines = [
            f"trace            {self.name}",
            f"rows             {self.rows:,}",
            f"duration         {self.duration_s:,.1f} s",
            f"arrival rate     {num(self.rate_rps, '.3f')} req/s",
            f"inter-arrival    CV {num(self.interarrival_cv, '.3f')}, p50 {num(self.interarrival_p50_s, '.3f')} s, "
            f"p99 {num(self.interarrival_p99_s, '.3f')} s, max {num(self.interarrival_max_s, '.3f')} s",
        ]
        for label, s in (("prompt tokens", self.prompt), ("output tokens", self.output)):
            lines.append(
                f"{label:<16} mean {s.mean:,.1f}, p50 {s.p50:,.0f}, p90 {s.p90:,.0f}, p99 {s.p99:,.0f}, "
                f"min {s.min:,}, max {s.max:,}"
            )
        if self.sessions is not None:
            lines.append(f"sessions         {self.sessions:,}")
        if self.prefix is None:
            lines.append("prefix reuse     n/a (no prefix_block_ids)")
        else:
            p = self.prefix
            lines.append(
                f"prefix reuse     {100 * p.block_reuse:.1f}% of blocks, {100 * p.token_reuse:.1f}% of tokens "
                f"({p.reused_blocks:,} of {p.total_blocks:,} blocks of {p.prefix_block_size}; "
                f"{p.distinct_block_ids:,} distinct ids)"
            )
        return "\n".join(lines)


def length_stats(values: np.ndarray) -> LengthStats:
    v = np.asarray(values)
    if v.size == 0:
        return LengthStats(float("nan"), float("nan"), float("nan"), float("nan"), 0, 0)
    p50, p90, p99 = np.percentile(v, [50, 90, 99])
    return LengthStats(float(v.mean()), float(p50), float(p90), float(p99), int(v.min()), int(v.max()))


def _chain_hashes(offsets: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per block, a 64-bit hash of the row's ids up to and including it (its prefix chain)."""
    lengths = np.diff(offsets)
    chain = np.empty(values.size, dtype=np.uint64)
    if values.size == 0:
        return chain
    ids = splitmix64(values.view(np.uint64))
    order = np.argsort(-lengths, kind="stable")
    sorted_len = lengths[order]
    starts = offsets[:-1][order]
    for d in range(int(sorted_len[0])):
        k = int(np.searchsorted(-sorted_len, -d, side="left"))  # rows with length > d
        pos = starts[:k] + d
        parent = chain[pos - 1] if d else np.uint64(0x243F6A8885A308D3)
        chain[pos] = splitmix64(parent ^ ids[pos])
    return chain


def prefix_reuse(trace: Trace) -> PrefixReuse | None:
    """Fraction of prefix blocks (and their tokens) that an earlier request already had, in arrival order."""
    if not trace.has_prefix_ids or trace.prefix_block_size is None:
        return None
    bs = trace.prefix_block_size
    offsets, values, _ = list_offsets_values(pa.array(trace.df["prefix_block_ids"].array))
    prompt = trace.df["prompt_len"].to_numpy()
    lengths = np.diff(offsets)
    chain = _chain_hashes(offsets, values)
    codes, uniques = pd.factorize(chain)
    seen_max = np.maximum.accumulate(codes)
    is_new = np.ones(codes.size, dtype=bool)
    is_new[1:] = codes[1:] > seen_max[:-1]
    # Tokens per block: bs, except a row's last block, which may be partial.
    block_tokens = np.full(values.size, bs, dtype=np.int64)
    has = lengths > 0
    last = offsets[1:][has] - 1
    block_tokens[last] = np.clip(prompt[has] - (lengths[has] - 1) * bs, 0, bs)
    reused_tokens = np.where(is_new, 0, block_tokens)
    # A hit block reuses at most the tokens an earlier request had in it: only chains that were ever
    # partial need the exact (grouped running maximum) computation.
    partial = block_tokens < bs
    if partial.any():
        flag = np.zeros(len(uniques), dtype=bool)
        flag[codes[partial]] = True
        sel = np.flatnonzero(flag[codes])
        bt = pd.Series(block_tokens[sel])
        sub = codes[sel]
        earlier = bt.groupby(sub).cummax().groupby(sub).shift(1).fillna(0).to_numpy(dtype=np.int64)
        reused_tokens[sel] = np.minimum(block_tokens[sel], earlier)
    return PrefixReuse(
        prefix_block_size=bs,
        total_blocks=int(values.size),
        distinct_block_ids=int(pd.unique(values).size),
        reused_blocks=int((~is_new).sum()),
        total_tokens=int(prompt.sum()),
        reused_tokens=int(reused_tokens.sum()),
    )


def trace_stats(trace: Trace) -> TraceStats:
    """Rows, duration, rate, inter-arrival CV and percentiles, length percentiles, sessions, prefix reuse."""
    df = trace.df
    a = df["arrival_s"].to_numpy()
    gaps = np.diff(a)
    duration = trace.duration_s
    cv = p50 = p99 = gmax = None
    if gaps.size:
        mean = gaps.mean()
        cv = float(gaps.std() / mean) if mean > 0 else None
        g50, g99 = np.percentile(gaps, [50, 99])
        p50, p99, gmax = float(g50), float(g99), float(gaps.max())
    return TraceStats(
        name=trace.name,
        rows=len(trace),
        duration_s=duration,
        rate_rps=len(trace) / duration if duration > 0 else None,
        interarrival_cv=cv,
        interarrival_p50_s=p50,
        interarrival_p99_s=p99,
        interarrival_max_s=gmax,
        prompt=length_stats(df["prompt_len"].to_numpy()),
        output=length_stats(df["output_len"].to_numpy()),
        sessions=int(df["session_id"][df["session_id"] >= 0].nunique()) if trace.has_sessions else None,
        prefix=prefix_reuse(trace),
    )
