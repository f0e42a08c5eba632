"""Trace transforms: time window, rate scaling, seeded subsampling, length capping, concatenation.

Each takes a Trace and returns a new one (the input is never modified). cap_lengths also returns a
CapReport with how many rows it changed or dropped; nothing is changed silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa

from .schema import Trace, list_array_from, list_offsets_values


def time_window(
    trace: Trace, start_s: float = 0.0, end_s: float | None = None, *, rebase: bool = True
) -> Trace:
    """Rows with start_s <= arrival_s < end_s; with rebase, times shift so the window starts at 0."""
    if end_s is not None and end_s <= start_s:
        raise ValueError(f"end_s ({end_s}) must be > start_s ({start_s})")
    a = trace.df["arrival_s"].to_numpy()
    mask = a >= start_s
    if end_s is not None:
        mask &= a < end_s
    df = trace.df.loc[mask].reset_index(drop=True)
    if rebase and len(df):
        df["arrival_s"] = df["arrival_s"].to_numpy() - float(start_s)
    return trace.with_frame(df, validate=False)


def scale_rate(trace: Trace, factor: float | None = None, *, target_rate: float | None = None) -> Trace:
    """Replay `factor` times faster (arrival_s / factor), or scale to an average of target_rate req/s."""
    if (factor is None) == (target_rate is None):
        raise ValueError("give exactly one of factor or target_rate")
    if target_rate is not None:
        if not target_rate > 0:
            raise ValueError(f"target_rate must be > 0, got {target_rate!r}")
        if len(trace) < 2 or trace.duration_s <= 0:
            raise ValueError("target_rate needs a trace with at least two distinct arrival times")
        factor = target_rate / (len(trace) / trace.duration_s)
    if not (factor is not None and factor > 0 and np.isfinite(factor)):
        raise ValueError(f"factor must be a positive finite number, got {factor!r}")
    df = trace.df.copy()
    df["arrival_s"] = df["arrival_s"].to_numpy() / float(factor)
    return trace.with_frame(df, validate=False)


def subsample(trace: Trace, fraction: float | None = None, *, n: int | None = None, seed: int = 0) -> Trace:
    """A seeded random subset of rows (a fraction, or exactly n), kept in arrival order with their ids."""
    if (fraction is None) == (n is None):
        raise ValueError("give exactly one of fraction or n")
    if fraction is not None:
        if not 0 <= fraction <= 1:
            raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
        n = int(round(fraction * len(trace)))
    if not 0 <= n <= len(trace):
        raise ValueError(f"n must be in [0, {len(trace)}], got {n}")
    idx = np.sort(np.random.default_rng(seed).choice(len(trace), size=n, replace=False))
    return trace.with_frame(trace.df.take(idx).reset_index(drop=True), validate=False)


@dataclass(frozen=True)
class CapReport:
    """What cap_lengths changed: rows whose prompt / output was shortened, and rows dropped."""

    max_model_len: int
    prompts_capped: int
    outputs_capped: int
    rows_capped: int
    rows_dropped: int

    def summary(self) -> str:
        if self.rows_dropped:
            return f"dropped {self.rows_dropped} rows longer than max_model_len={self.max_model_len}"
        return (
            f"capped {self.rows_capped} rows to max_model_len={self.max_model_len} "
            f"({self.prompts_capped} prompts, {self.outputs_capped} outputs)"
        )


def cap_lengths(trace: Trace, max_model_len: int, *, policy: str = "truncate") -> tuple[Trace, CapReport]:
    """Make every prompt_len + output_len <= max_model_len.

    policy "truncate": prompts keep their first max_model_len - 1 tokens (prefix ids and token ids are
    cut to match), then outputs are cut to what is left. policy "drop": rows that do not fit are removed.
    """
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    if policy not in ("truncate", "drop"):
        raise ValueError(f"policy must be 'truncate' or 'drop', got {policy!r}")
    df = trace.df
    p = df["prompt_len"].to_numpy()
    o = df["output_len"].to_numpy()
    over = p + o > max_model_len
    if policy == "drop":
        out = trace.with_frame(df.loc[~over].reset_index(drop=True), validate=False)
        return out, CapReport(max_model_len, 0, 0, 0, int(over.sum()))
    new_p = np.minimum(p, max_model_len - 1)
    new_o = np.minimum(o, max_model_len - new_p)
    df = df.copy()
    df["prompt_len"] = new_p
    df["output_len"] = new_o
    if (new_p < p).any():
        if trace.has_prefix_ids:
            bs = trace.prefix_block_size
            df["prefix_block_ids"] = _truncate_lists(df["prefix_block_ids"], -(-new_p // bs))
        if "prompt_token_ids" in df.columns:
            df["prompt_token_ids"] = _truncate_lists(df["prompt_token_ids"], new_p, keep_nulls=True)
    report = CapReport(max_model_len, int((new_p < p).sum()), int((new_o < o).sum()), int(over.sum()), 0)
    return trace.with_frame(df, validate=False), report


def _truncate_lists(
    col: pd.Series, max_len: np.ndarray, keep_nulls: bool = False
) -> pd.arrays.ArrowExtensionArray:
    arr = pa.array(col.array)
    offsets, values, valid = list_offsets_values(arr)
    lengths = np.minimum(np.diff(offsets), max_len)
    keep = np.repeat(np.arange(len(lengths)), np.diff(offsets))
    pos = np.arange(values.size) - offsets[:-1][keep]
    new_values = values[pos < lengths[keep]]
    new_offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    out = list_array_from(new_offsets, new_values)
    if keep_nulls and not valid.all():
        out = pa.ListArray.from_arrays(
            pa.array(new_offsets.astype(np.int32)), pa.array(new_values), mask=pa.array(~valid)
        ).cast(out.type)
    return pd.arrays.ArrowExtensionArray(out)


def concat(traces: Sequence[Trace], *, gap_s: float = 0.0, name: str | None = None) -> Trace:
    """Play traces one after another: each starts gap_s after the previous one's last arrival.

    request_ids are renumbered 0..n-1; session ids and prefix block ids are offset per trace so that
    different traces never share a session or a prefix (all traces with prefix ids must agree on
    prefix_block_size).
    """
    if not traces:
        raise ValueError("concat needs at least one trace")
    if gap_s < 0:
        raise ValueError(f"gap_s must be >= 0, got {gap_s}")
    sizes = {t.prefix_block_size for t in traces if t.has_prefix_ids}
    if len(sizes) > 1:
        raise ValueError(f"cannot concatenate traces with different prefix_block_size: {sorted(sizes)}")
    bs = next(iter(sizes)) if sizes else None
    frames = []
    t_offset = 0.0
    sess_offset = 0
    id_offset = 0
    any_sessions = any(t.has_sessions for t in traces)
    for t in traces:
        df = t.df.copy()
        if len(df):
            a = df["arrival_s"].to_numpy()
            df["arrival_s"] = a - a[0] + t_offset
            t_offset = float(df["arrival_s"].iat[-1]) + gap_s
        if any_sessions:
            s = df["session_id"].to_numpy() if t.has_sessions else np.full(len(df), -1)
            df["session_id"] = np.where(s >= 0, s + sess_offset, -1)
            sess_offset += int(s.max()) + 1 if len(s) and s.max() >= 0 else 0
        if bs is not None:
            if t.has_prefix_ids:
                offsets, values, _ = list_offsets_values(pa.array(df["prefix_block_ids"].array))
                shift = id_offset - (int(values.min()) if values.size else 0)
                df["prefix_block_ids"] = pd.arrays.ArrowExtensionArray(
                    list_array_from(offsets, values + shift)
                )
                id_offset += int(values.max() - values.min()) + 1 if values.size else 0
            else:
                df["prefix_block_ids"] = pd.arrays.ArrowExtensionArray(
                    pa.array([[]] * len(df), type=pa.list_(pa.int64()))
                )
        frames.append(df)
    out = pd.concat(frames, ignore_index=True)
    out["request_id"] = np.arange(len(out), dtype=np.int64)
    return Trace(out, name=name or "+".join(t.name for t in traces), prefix_block_size=bs)
