"""Fitted latency model: linear in roofline-shaped features, fit by non-negative least squares.

`fit_step_records` trains a `FittedModel` on the engine's step records (CONTRACT.md columns), one
fit for decode steps and one for prefill/mixed steps, then a host floor per step kind (the least
time a step takes, whatever its GPU work: `fit_floor`), and reports its error on held-back steps.
Numpy only (no scipy). Saving and loading fits is `profile.py`'s job, not this module's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from engine.decode_splits import (
    balance_programs,
    grid_splits,
    num_splits_for_batch,
    split_unit,
)
from engine.decode_splits import (
    longest_split_divisor as balanced_divisor,
)
from engine.records import STEP_RECORD_COLUMNS
from simulator.latency.base import _SCALAR_STEPS, BatchShape, LatencyModelBase, StepTime, arange_int64

DECODE_FEATURES = (
    "const",
    "batch_size",
    "num_context_tokens",
    "max_seq_len",
    "batch_x_max_seq_len",
    "longest_split",
    "multi_row",
)
# Profiles fitted before batch_x_max_seq_len, longest_split or multi_row existed load with their
# coefficients 0.
LEGACY_DECODE_FEATURES = (DECODE_FEATURES[:4], DECODE_FEATURES[:5], DECODE_FEATURES[:6])
# Fits of records served with async scheduling, where some decode steps were scheduled while the one
# before them ran (the step records' `overlapped`), add the host's time a step that was not pays:
# `sync` (1 for such a step) and `sync_x_batch_size` (its padded batch size). Fits without them are
# fits of synchronous engines: every step paid it, and the other coefficients hold it.
SYNC_FEATURES = ("sync", "sync_x_batch_size")
# And the host's time that grows with the block table the step's inputs carry: `sync_x_table_entries`
# (for a step not scheduled ahead, its table's entries: num_seqs x blocks of the longest sequence,
# `table_entries`). Fits of async records without it (ASYNC_DECODE_FEATURES) predict with it 0.
TABLE_FEATURES = ("sync_x_table_entries",)
ASYNC_DECODE_FEATURES = DECODE_FEATURES + SYNC_FEATURES
TABLE_DECODE_FEATURES = ASYNC_DECODE_FEATURES + TABLE_FEATURES
PREFILL_FEATURES = (
    "const",
    "total_num_scheduled_tokens",
    "prefill_attn_work",
    "num_context_tokens",
    "num_seqs",
    "num_decode_seqs",
)
# The host's time of a prefill or mixed step that grows with its prefix-cache hits (the engine matches
# a hit prompt's blocks by hash on the host): c x total_num_cached_tokens, fitted where asked.
PREFIX_FEATURES = ("total_num_cached_tokens",)
PREFIX_PREFILL_FEATURES = PREFILL_FEATURES + PREFIX_FEATURES
# The attention span of a prefill or mixed step whose work is too small to fill the GPU: varlen
# prefill kernels run one program per (query tile, kv head) through all of a sequence's keys, so a
# few short queries over a long cached prefix take as long as the longest sequence's keys, however
# little work the step has (`attn_span`, fitted where the profile knows its `AttnSpan`).
SPAN_FEATURES = ("attn_span",)
_PREFILL_FEATURE_SETS = (
    PREFILL_FEATURES,
    PREFIX_PREFILL_FEATURES,
    PREFILL_FEATURES + SPAN_FEATURES,
    PREFIX_PREFILL_FEATURES + SPAN_FEATURES,
)

RECORD_COLUMNS = STEP_RECORD_COLUMNS
_REQUIRED = (
    "kind",
    "num_seqs",
    "num_decode_seqs",
    "total_num_scheduled_tokens",
    "num_context_tokens",
    "max_seq_len",
    "prefill_attn_work",
)
TARGETS = ("auto", "gpu_time_s", "wall_time_s")
# A prefill/mixed step the host queued without waiting for: its GPU time passed its wall time by more
# than this share of the wall time and this many seconds (a chunk that samples nothing).
_QUEUED_SHARE, _QUEUED_MIN_S = 0.5, 1e-3
# A numpy pass of a balanced model's decode run fills its longest-split coefficients stretch by
# stretch (the steps over which the split count holds) up to this many stretches, else per step.
_MAX_STRETCHES = 32


# ---- CUDA-graph padding ---------------------------------------------------------------------------
def decode_graph_batch_sizes(max_num_seqs: int, max_capture: int | None = None) -> tuple[int, ...]:
    """Batch sizes the engine captures decode CUDA graphs at, as nano-vllm does: 1, 2, 4, 8, then
    multiples of 16, up to m = max_num_seqs (or min(max_num_seqs, max_capture); nano-vllm itself
    caps at 512, kvplan's engine does not). Sizes above m are left out. The engine's model runner
    keeps an identical list (`engine.model_runner.graph_batch_sizes`)."""
    if max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs: must be a positive integer, got {max_num_seqs}")
    m = max_num_seqs if max_capture is None else min(max_num_seqs, max_capture)
    return (*(b for b in (1, 2, 4, 8) if b <= m), *range(16, m + 1, 16))


def max_graph_batch_size(max_num_seqs: int, max_capture: int | None = None) -> int:
    """Largest captured decode graph batch size (the last of `decode_graph_batch_sizes`)."""
    return decode_graph_batch_sizes(max_num_seqs, max_capture)[-1]


def graph_padded_batch_size(num_seqs: int, max_graph_batch_size: int) -> int:
    """Batch size a decode step of `num_seqs` runs at: the smallest captured graph size that holds
    it, or `num_seqs` itself (eager) above the largest graph or when graphs are off (max = 0).

    With max_graph_batch_size = decode_graph_batch_sizes(...)[-1], this equals the smallest size of
    that list >= num_seqs where there is one.
    """
    if num_seqs > max_graph_batch_size or num_seqs <= 0:
        return num_seqs
    if num_seqs <= 8:
        return 1 if num_seqs <= 1 else 2 if num_seqs <= 2 else 4 if num_seqs <= 4 else 8
    return (num_seqs + 15) // 16 * 16


# ---- non-negative least squares (Lawson-Hanson) -------------------------------------------------
def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin ||a x - b||_2 subject to x >= 0, by the Lawson-Hanson active-set method."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    m, n = a.shape
    max_iter = max_iter or 30 * max(n, 1)
    tol = 10 * np.finfo(np.float64).eps * max(m, n) * max(np.abs(a).sum(axis=0).max(initial=0.0), 1.0)
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    it = 0
    while not passive.all() and (w[~passive] > tol).any() and it < max_iter:
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while it < max_iter:
            it += 1
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                break
            neg = passive & (z <= 0)
            step = x[neg] - z[neg]
            alpha = float(np.min(np.where(step > 0, x[neg] / np.where(step > 0, step, 1.0), 0.0)))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                z = x
                break
        x = z
        w = a.T @ (b - a @ x)
    return x


# ---- fit results --------------------------------------------------------------------------------
@dataclass(frozen=True)
class FitError:
    """Relative error |predicted - measured| / measured of a fit on its held-back records
    (on its training records when n_test is 0)."""

    n_train: int
    n_test: int
    median_rel_error: float
    p90_rel_error: float
    max_rel_error: float


@dataclass(frozen=True)
class LinearFit:
    """time_s = sum(coefficients[i] * feature[i]) for one kind of step."""

    features: tuple[str, ...]
    coefficients: tuple[float, ...]
    error: FitError | None = None

    def __post_init__(self) -> None:
        if len(self.features) != len(self.coefficients):
            raise ValueError(
                f"LinearFit: {len(self.features)} features but {len(self.coefficients)} coefficients"
            )

    def as_dict(self) -> dict[str, float]:
        return dict(zip(self.features, self.coefficients))


@dataclass(frozen=True)
class SplitKV:
    """A decode kernel that splits each sequence's KV over programs as the engine's Triton split-KV
    kernel does (`engine.decode_splits`): its longest program reads about max_seq_len / splits
    tokens. Per TP rank: kv heads of one rank, SMs of one GPU. Not `balanced` (engines before
    balanced splits): every sequence takes the batch size's splits. `balanced`: the longest sequence
    takes as many as keep its splits near an even share of the step's keys, in units of whole pages of
    `block_size` (at least 64 tokens), or of `split_tokens` where the engine split larger pages
    inside (0: whole pages, as profiles recorded before the engine split inside pages)."""

    num_kv_heads: int
    num_sms: int
    block_size: int = 0
    balanced: bool = False
    split_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "num_sms"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"split_kv.{name}: must be a positive integer, got {value!r}")
        if not isinstance(self.balanced, bool):
            raise ValueError(f"split_kv.balanced: must be true or false, got {self.balanced!r}")
        size = self.block_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or (self.balanced and not size):
            raise ValueError(f"split_kv.block_size: must be a positive integer when balanced, got {size!r}")
        tokens = self.split_tokens
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ValueError(f"split_kv.split_tokens: must be a non-negative integer, got {tokens!r}")

    @property
    def split_block_size(self) -> int:
        """The page size `engine.decode_splits`' rules count in: `split_tokens` where set, else the
        pages' (the rules make units of max(that, 64) tokens)."""
        return self.split_tokens or self.block_size

    def num_splits(self, padded_batch_size: int) -> int:
        return num_splits_for_batch(padded_batch_size, self.num_kv_heads, self.num_sms)

    def divisor(self, padded_batch_size: int, num_context_tokens: int, max_seq_len: int) -> int:
        """Splits of the longest sequence of a decode step (balanced or not)."""
        if not self.balanced:
            return self.num_splits(padded_batch_size)
        return balanced_divisor(
            padded_batch_size,
            num_context_tokens,
            max_seq_len,
            self.num_kv_heads,
            self.num_sms,
            self.split_block_size,
        )

    def divisors(
        self, padded_batch_size: int, num_context_tokens: np.ndarray, max_seq_len: np.ndarray
    ) -> np.ndarray:
        """`divisor` over int64 arrays of steps at one padded batch size, in the same integer arithmetic."""
        if not self.balanced:
            return np.full(len(max_seq_len), self.num_splits(padded_batch_size), dtype=np.int64)
        unit, heads = split_unit(self.split_block_size), self.num_kv_heads
        units = np.maximum(-(-max_seq_len // unit), 1)
        grid_size = grid_splits(padded_batch_size, heads, self.num_sms)
        grid = np.minimum(grid_size, units)  # choose_num_splits
        balance = balance_programs(self.num_sms, True, grid_size)
        if balance:
            per_program = -(-(num_context_tokens + padded_batch_size) * heads // balance)
            target = np.maximum(-(-per_program // unit), 1)
        else:  # target_split_units: 1
            target = np.ones_like(units)
        wanted = np.minimum(grid, -(-units // target))
        per_split = -(-units // wanted)
        return -(-units // per_split)

    def as_dict(self) -> dict[str, Any]:
        """The profile's field: {num_kv_heads, num_sms}, and block_size and balanced when balanced,
        and split_tokens where set."""
        out: dict[str, Any] = {"num_kv_heads": self.num_kv_heads, "num_sms": self.num_sms}
        if self.balanced:
            out |= {"block_size": self.block_size, "balanced": True}
        if self.split_tokens:
            out["split_tokens"] = self.split_tokens
        return out


@dataclass(frozen=True)
class AttnSpan:
    """The geometry of a varlen prefill kernel that gives each (query tile of `tile_rows` rows, kv
    head) one program over all of its sequence's keys, query heads of a kv head packed in the tile's
    rows: per TP rank, `num_kv_heads` kv heads with `num_q_per_kv` query heads each, `num_sms` SMs."""

    num_kv_heads: int
    num_q_per_kv: int
    num_sms: int
    tile_rows: int = 128

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "num_q_per_kv", "num_sms", "tile_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"attn_span.{name}: must be a positive integer, got {value!r}")

    def as_dict(self) -> dict[str, int]:
        return {
            "num_kv_heads": self.num_kv_heads,
            "num_q_per_kv": self.num_q_per_kv,
            "num_sms": self.num_sms,
            "tile_rows": self.tile_rows,
        }


def attn_span(span: AttnSpan, num_prefill_seqs, num_prefill_tokens, prefill_attn_work,
              num_context_tokens, num_decode_seqs, max_seq_len) -> float:  # fmt: skip
    """Keys of the longest sequence beyond the step's keys per SM: max(0, max_seq_len - K / SMs),
    K = kv heads x (query tiles x keys of each prefill + keys of each decode), from the step's totals
    as if its prefills had equal chunks: their cached tokens then follow from prefill_attn_work, and
    the decodes' (a mixed step's) are the rest of num_context_tokens. Plain float arithmetic: the
    simulator prices every prefill and mixed step with it (`attn_spans` for record columns)."""
    chunk = num_prefill_tokens / (num_prefill_seqs or 1)
    cached = (prefill_attn_work - num_prefill_tokens * (chunk + 1) / 2) / (chunk if chunk > 1 else 1)
    cached = 0.0 if cached < 0 else (num_context_tokens if cached > num_context_tokens else cached)
    tiles = -(-chunk * span.num_q_per_kv // span.tile_rows) or 1.0
    keys = span.num_kv_heads * (
        tiles * (cached + num_prefill_tokens) + (num_context_tokens - cached) + num_decode_seqs
    )
    excess = max_seq_len - keys / span.num_sms
    return excess if excess > 0 else 0.0


SPAN_COLUMNS = ("num_prefill_seqs", "num_prefill_tokens", "prefill_attn_work", "num_context_tokens",
                "num_decode_seqs", "max_seq_len")  # fmt: skip


def attn_spans(span: AttnSpan, frame: pd.DataFrame) -> np.ndarray:
    """`attn_span` of each step of step records (SPAN_COLUMNS), the same floats."""
    columns = (frame[c].to_numpy(dtype=np.float64).tolist() for c in SPAN_COLUMNS)
    return np.array([attn_span(span, *row) for row in zip(*columns)], dtype=np.float64)


def split_run_consts(split_kv: SplitKV, b: int) -> tuple[int, int, int, int]:
    """(grid splits, balance programs, unit tokens, kv heads) of a balanced `split_kv` at padded
    batch size `b`: what `split_run` reads."""
    grid = grid_splits(b, split_kv.num_kv_heads, split_kv.num_sms)
    return (
        grid,
        balance_programs(split_kv.num_sms, True, grid),
        split_unit(split_kv.split_block_size),
        split_kv.num_kv_heads,
    )


def split_run(
    consts: tuple[int, int, int, int], b: int, num_context_tokens: int, max_seq_len: int, num_seqs: int
) -> tuple[int, int]:
    """(`SplitKV.divisor` of this decode step in plain integer arithmetic, steps that keep it) at
    padded batch size `b` (`consts`: `split_run_consts` of b): a run whose context grows by
    `num_seqs` tokens and its longest sequence by one a step keeps its split count until the
    longest sequence passes a unit boundary or the step's keys per balanced program pass one."""
    grid, balance, unit, heads = consts
    units = (max_seq_len + unit - 1) // unit or 1
    hold = units * unit + 1 - max_seq_len  # max_seq_len in ((units - 1) * unit, units * unit]
    if units < grid:
        grid = units
    wanted = grid
    if balance:
        keys = (num_context_tokens + b) * heads
        target = ((keys + balance - 1) // balance + unit - 1) // unit or 1
        wanted = (units + target - 1) // target
        if wanted > grid:
            wanted = grid
        if num_seqs:  # keys in ((target - 1) * balance * unit, target * balance * unit]
            same_target = (target * balance * unit - keys) // (num_seqs * heads) + 1
            if same_target < hold:
                hold = same_target
    per_split = (units + wanted - 1) // wanted
    return (units + per_split - 1) // per_split, hold


def longest_split_divisor(split_kv: SplitKV | None, padded_batch_size: int) -> int:
    """What max_seq_len is divided by for the longest_split feature when splits depend on the batch
    size only: the kernel's splits, else 1."""
    return split_kv.num_splits(padded_batch_size) if split_kv is not None else 1


def table_entries(num_seqs: Any, max_seq_len: Any, block_size: int) -> Any:
    """Entries of a step's block table: num_seqs rows x the blocks of its longest sequence
    (ceil(max_seq_len / block_size)), as the engine builds it for every step (`prepare_inputs`) and
    `engine.profiling.envelope` reports it (`table_width`). Integers, or int64 arrays."""
    return num_seqs * ((max_seq_len + block_size - 1) // block_size)


STEP_FLOOR_KINDS = ("decode", "prefill", "mixed")


@dataclass(frozen=True)
class StepFloors:
    """Host floors, seconds: a step of each kind takes at least this long, whatever its GPU work
    (the host launching a step's kernels and graphs, scheduling and sampling). A step's time is
    max(floor of its kind, the linear fit's prediction); 0 = no floor."""

    decode: float = 0.0
    prefill: float = 0.0
    mixed: float = 0.0

    def __post_init__(self) -> None:
        for kind in STEP_FLOOR_KINDS:
            value = getattr(self, kind)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < np.inf:
                raise ValueError(f"floors.{kind}: must be a finite time >= 0 s, got {value!r}")


@dataclass(frozen=True)
class FitSummary:
    """What a fit was trained on."""

    target: str  # the measured column fitted: "gpu_time_s" or "wall_time_s"
    num_records: int  # rows given
    num_used: int  # rows fitted or held back (not compiled, not empty)
    num_compiled_dropped: int
    num_empty_dropped: int
    tp: int | None  # the records' single tp value, when the column exists
    block_size: int | None
    seed: int
    holdout_fraction: float


class FittedModel(LatencyModelBase):
    """Linear step-time model fitted on step records: decode and prefill/mixed fits.

    decode:  c0 + c1 * padded batch size + c2 * num_context_tokens + c3 * max_seq_len
             + c4 * padded batch size * max_seq_len (KV read as if every sequence were the longest:
               decode kernels that give each sequence its own programs wait for the longest one)
             + c5 * max_seq_len / splits (the longest program of a split-KV kernel, `split_kv`;
               splits = 1 without one, and the fit leaves c5 at 0)
             + c6 * [padded batch size > 1] (one-row steps take the engine's fused GEMV path:
               engine/layers/gemv.py; larger ones cuBLAS and unfused norms, a step up in time)
             + c7 + c8 * padded batch size (fits of async-scheduling records only, SYNC_FEATURES:
               the host's time a step not scheduled ahead pays; `overlapped_model()` leaves it out)
             + c9 * num_seqs * ceil(max_seq_len / block_size) (TABLE_FEATURES: the part of that time
               that grows with the block table's entries, `table_entries`; also left out by
               `overlapped_model()`; `block_size` is the profile's)
    prefill/mixed: c0 + c1 * new tokens + c2 * prefill_attn_work + c3 * num_context_tokens
                   + c4 * num_seqs + c5 * num_decode_seqs
                   [+ c6 * total_num_cached_tokens (PREFIX_FEATURES)]
                   [+ c * attn_span (SPAN_FEATURES: the longest sequence's keys that the step's work
                     per SM does not cover, `attn_span` with the profile's `AttnSpan`)]
    The padded batch size is the CUDA-graph size a decode step runs at (`graph_padded_batch_size`
    with `max_graph_batch_size`; 0 = graphs off, padded size = num_seqs). A step's time is the
    larger of that and its kind's host floor (`floors`; None = no floors, the linear fits alone).
    """

    def __init__(
        self,
        decode: LinearFit,
        prefill: LinearFit,
        max_graph_batch_size: int = 0,
        summary: FitSummary | None = None,
        profile: Any = None,
        split_kv: SplitKV | None = None,
        floors: StepFloors | None = None,
        overlapped: bool = False,
        block_size: int | None = None,
        attn_span: AttnSpan | None = None,
    ) -> None:
        if tuple(decode.features) in LEGACY_DECODE_FEATURES:
            padding = (0.0,) * (len(DECODE_FEATURES) - len(decode.features))
            decode = LinearFit(DECODE_FEATURES, (*decode.coefficients, *padding), decode.error)
        if tuple(decode.features) not in (DECODE_FEATURES, ASYNC_DECODE_FEATURES, TABLE_DECODE_FEATURES):
            raise ValueError(
                f"decode fit features {list(decode.features)} != expected {list(DECODE_FEATURES)}"
                f" (or those and {list(SYNC_FEATURES)}, or those and {list(TABLE_FEATURES)})"
            )
        if tuple(prefill.features) not in _PREFILL_FEATURE_SETS:
            raise ValueError(
                f"prefill fit features {list(prefill.features)} != expected {list(PREFILL_FEATURES)}"
                f" (or those and {list(PREFIX_FEATURES)}, then {list(SPAN_FEATURES)})"
            )
        if SPAN_FEATURES[0] in prefill.features and attn_span is None:
            raise ValueError(f"attn_span: a prefill fit with {SPAN_FEATURES[0]} needs the kernel's AttnSpan")
        if max_graph_batch_size < 0:
            raise ValueError(f"max_graph_batch_size: must be >= 0, got {max_graph_batch_size}")
        self.decode = decode
        self.prefill = prefill
        self.max_graph_batch_size = max_graph_batch_size
        self.summary = summary
        self.profile = profile  # the LatencyProfile this model was loaded from, if any
        self.split_kv = split_kv
        self.floors = floors
        self._decode_floor, self._prefill_floor, self._mixed_floor = (
            (floors.decode, floors.prefill, floors.mixed) if floors is not None else (0.0, 0.0, 0.0)
        )
        self._gmax = max_graph_batch_size
        coefs = [float(c) for c in decode.coefficients]
        self._d0, self._d1, self._d2, self._d3, self._d4, self._d5, self._d6 = coefs[:7]
        self.sync_coefficients = (coefs[7], coefs[8]) if len(coefs) > 7 else (0.0, 0.0)
        self.table_coefficient = coefs[9] if len(coefs) > 9 else 0.0
        if self.table_coefficient != 0.0 and not (
            isinstance(block_size, int) and not isinstance(block_size, bool) and block_size > 0
        ):
            raise ValueError(
                f"block_size: a decode fit with {TABLE_FEATURES[0]} needs the KV block size, got {block_size!r}"
            )
        self.block_size = block_size
        # `overlapped`: decode steps scheduled while the step before them ran (async scheduling), so
        # the host's work for them is hidden. Otherwise (the default) they pay it, as every step of a
        # synchronous engine does: the sync terms join the intercept and the batch-size term (adding
        # 0.0 is exact: fits without them predict bit for bit as before).
        self.overlapped = overlapped
        if not overlapped:
            self._d0 += self.sync_coefficients[0]
            self._d1 += self.sync_coefficients[1]
        # the table term a step pays (0.0: none, and the paths below skip it: predictions of fits
        # without it are bit for bit those of before it)
        self._table = 0.0 if overlapped else self.table_coefficient
        self._bs = block_size or 1
        self._overlapped_model: FittedModel | None = None
        self._p = tuple(float(c) for c in prefill.coefficients)
        names = tuple(prefill.features)
        # a second a cached token, a second a key of span (0.0: not fitted)
        self._prefix = self._p[names.index(PREFIX_FEATURES[0])] if PREFIX_FEATURES[0] in names else 0.0
        self._span = self._p[names.index(SPAN_FEATURES[0])] if SPAN_FEATURES[0] in names else 0.0
        self.attn_span = attn_span
        # padded batch -> (c0 + c6 [b > 1] + c1 * b, c3 + c4 * b + c5 / splits)
        self._decode_coefs: dict[int, tuple[float, float]] = {}
        # balanced split-KV: the longest sequence's splits depend on the step's keys, not just b
        self._balanced = split_kv is not None and split_kv.balanced
        self._length_coefs: dict[tuple[int, int], float] = {}  # (b, splits) -> c3 + c4 * b + c5 / splits
        self._split_consts: dict[int, tuple[int, int, int, int]] = {}  # b -> (grid, balance, unit, heads)
        # a balanced run's constants by its batch: num_seqs -> (b, the decode time of no tokens, split consts)
        self._balanced_runs: dict[int, tuple[int, float, tuple[int, int, int, int]]] = {}
        if self._balanced and not self._table:  # short runs straight to their loop (the usual case)
            self.decode_step_times = self._balanced_decode_step_times

    def _balanced_decode_step_times(
        self,
        num_seqs: int,
        num_context_tokens: int,
        max_seq_len: int,
        max_steps: int,
        start: float,
        deadline: float,
    ) -> list[float]:
        """`decode_step_times` of a balanced model without a table term: a run that it would price
        step by step goes to `_balanced_decode_times` at once."""
        if max_steps <= _SCALAR_STEPS or start >= deadline:
            run = (num_seqs, num_context_tokens, max_seq_len)
            return _balanced_decode_times(self, run, max_steps, start, deadline)
        return LatencyModelBase.decode_step_times(
            self, num_seqs, num_context_tokens, max_seq_len, max_steps, start, deadline
        )

    def _coefs(self, b: int) -> tuple[float, float]:
        """(the decode time of no tokens, the time per token of max_seq_len) at padded batch size `b`,
        memoised."""
        coefs = self._decode_coefs.get(b)
        if coefs is None:
            length = self._d3 + self._d4 * b + self._d5 / longest_split_divisor(self.split_kv, b)
            coefs = self._decode_coefs[b] = (self._intercept(b) + self._d1 * b, length)
        return coefs

    def _length_coef(self, b: int, num_context_tokens: int, max_seq_len: int) -> float:
        """The time per token of max_seq_len at padded batch size `b`: memoised per (b, splits)."""
        if not self._balanced:
            return self._coefs(b)[1]
        return self._split_length_coef(b, self._splits(b, num_context_tokens, max_seq_len))

    def _split_length_coef(self, b: int, splits: int) -> float:
        """c3 + c4 * b + c5 / splits of a balanced model, memoised per (b, splits)."""
        coef = self._length_coefs.get((b, splits))
        if coef is None:
            coef = self._length_coefs[(b, splits)] = self._d3 + self._d4 * b + self._d5 / splits
        return coef

    def _splits(self, b: int, num_context_tokens: int, max_seq_len: int) -> int:
        """`split_kv.divisor(b, ...)` of a balanced model in plain integer arithmetic, with the
        padded batch's constants memoised (the tests compare them)."""
        return self._split_run(b, num_context_tokens, max_seq_len, 0)[0]

    def _split_run(self, b: int, num_context_tokens: int, max_seq_len: int, num_seqs: int) -> tuple[int, int]:
        """`split_run` at padded batch size `b`, with its constants memoised."""
        return split_run(self._split_consts_of(b), b, num_context_tokens, max_seq_len, num_seqs)

    def _split_consts_of(self, b: int) -> tuple[int, int, int, int]:
        """`split_run_consts` at padded batch size `b`, memoised."""
        consts = self._split_consts.get(b)
        if consts is None:
            consts = self._split_consts[b] = split_run_consts(self.split_kv, b)
        return consts

    def _intercept(self, b: int) -> float:
        return self._d0 + self._d6 if b > 1 else self._d0

    @property
    def has_sync_terms(self) -> bool:
        """Whether the fit tells steps scheduled ahead from the others (records of async scheduling)."""
        return self.sync_coefficients != (0.0, 0.0) or self.table_coefficient != 0.0

    def overlapped_model(self) -> FittedModel:
        """This model for decode steps scheduled while the step before them ran: without the sync
        terms (the model itself when it has none, or is that model already)."""
        if self.overlapped or not self.has_sync_terms:
            return self
        if self._overlapped_model is None:
            self._overlapped_model = FittedModel(
                self.decode,
                self.prefill,
                self.max_graph_batch_size,
                self.summary,
                self.profile,
                self.split_kv,
                self.floors,
                overlapped=True,
                block_size=self.block_size,
                attn_span=self.attn_span,
            )
        return self._overlapped_model

    def __repr__(self) -> str:
        return f"FittedModel(decode={self.decode.as_dict()}, prefill={self.prefill.as_dict()}, floors={self.floors})"

    def decode_step_time(self, num_seqs: int, num_context_tokens: int, max_seq_len: int) -> float:
        b = num_seqs
        if 0 < b <= self._gmax:  # inline graph_padded_batch_size: this is the fast-forward hot path
            if b <= 8:
                b = 1 if b <= 1 else 2 if b <= 2 else 4 if b <= 4 else 8
            else:
                b = (b + 15) // 16 * 16
        base, length_coef = self._coefs(b)
        if self._balanced:
            length_coef = self._length_coef(b, num_context_tokens, max_seq_len)
        t = base + self._d2 * num_context_tokens + length_coef * max_seq_len
        if self._table:
            t = t + self._table * (num_seqs * ((max_seq_len + self._bs - 1) // self._bs))
        return t if t > self._decode_floor else self._decode_floor

    def _leading_decode_times(
        self,
        num_seqs: int,
        num_context_tokens: int,
        max_seq_len: int,
        max_steps: int,
        start: float,
        deadline: float,
    ) -> list[float]:
        """The reference loop with `decode_step_time` inlined: the same float operations in the same
        order ((c0(b) + d1*b) + d2*ctx) + length_coef(b)*len, without a call a step. The host floor is
        left out where it cannot bind: the first step is above it and later ones only grow. Balanced
        split-KV models (the longest split changes within a run) recompute it every step."""
        if self._table:
            run = (num_seqs, num_context_tokens, max_seq_len)
            return _table_decode_times(self, run, max_steps, start, deadline)
        if self._balanced:
            run = (num_seqs, num_context_tokens, max_seq_len)
            return _balanced_decode_times(self, run, max_steps, start, deadline)
        b = graph_padded_batch_size(num_seqs, self._gmax)
        base, d3 = self._coefs(b)
        d2 = self._d2
        # counts as floats: integers, exact, and float * float is the interpreter's fast path
        ctx, length, step = float(num_context_tokens), float(max_seq_len), float(num_seqs)
        floor = self._decode_floor
        if floor > 0.0 and not (d2 >= 0.0 and d3 >= 0.0 and base + d2 * ctx + d3 * length >= floor):
            return _floored_decode_times(base, d2, d3, floor, ctx, length, step, max_steps, start, deadline)
        times = [start]
        append = times.append
        t = start
        for _ in range(max_steps):
            if t >= deadline:
                break
            t = t + (base + d2 * ctx + d3 * length)
            append(t)
            ctx += step
            length += 1.0
        return times

    def _decode_step_array(
        self, num_seqs: int, num_context_tokens: int, max_seq_len: int, num_steps: int
    ) -> np.ndarray:
        b = graph_padded_batch_size(num_seqs, self._gmax)
        base, length_coef = self._coefs(b)
        if self._balanced:
            length_coef = self._length_coef_array(b, num_seqs, num_context_tokens, max_seq_len, num_steps)
        steps = arange_int64(num_context_tokens, num_steps, num_seqs) * self._d2
        # in place, in decode_step_time's order (a sum's two terms commute exactly)
        steps += base
        lengths = arange_int64(max_seq_len, num_steps, 1)
        steps += lengths * length_coef
        if self._table:
            steps += table_entries(num_seqs, lengths, self._bs) * self._table
        if self._decode_floor > 0.0:
            np.maximum(steps, self._decode_floor, out=steps)
        return steps

    def _length_coef_array(
        self, b: int, num_seqs: int, num_context_tokens: int, max_seq_len: int, num_steps: int
    ) -> np.ndarray:
        """c3 + c4 * b + c5 / splits of each step of a balanced model's decode run (as
        `_split_length_coef` adds them): filled stretch by stretch (`_split_run`) where the run has
        few, else from `SplitKV.divisors` over its steps."""
        _, balance, unit, heads = self._split_consts_of(b)
        stretches = num_steps // unit + (num_steps * num_seqs * heads // (balance * unit) if balance else 0)
        if stretches > _MAX_STRETCHES:
            context = arange_int64(num_context_tokens, num_steps, num_seqs)
            splits = self.split_kv.divisors(b, context, arange_int64(max_seq_len, num_steps, 1))
            return (self._d3 + self._d4 * b) + self._d5 / splits
        coefs = np.empty(num_steps)
        j = 0
        while j < num_steps:
            splits, hold = self._split_run(b, num_context_tokens + j * num_seqs, max_seq_len + j, num_seqs)
            coefs[j : j + hold] = self._split_length_coef(b, splits)
            j += hold
        return coefs

    def _decode_parts(
        self, num_seqs: int, num_context_tokens: int, max_seq_len: int
    ) -> tuple[float, float, float, float]:
        b = graph_padded_batch_size(num_seqs, self._gmax)
        attention = (
            self._d2 * num_context_tokens
            + self._length_coef(b, num_context_tokens, max_seq_len) * max_seq_len
        )
        linear, overhead = self._d1 * b, self._intercept(b)
        if self._table:
            overhead += self._table * table_entries(num_seqs, max_seq_len, self._bs)
        below_floor = self._decode_floor - (overhead + linear + attention)
        return (linear, attention, 0.0, overhead + below_floor if below_floor > 0.0 else overhead)

    def _predict_prefill(self, batch: BatchShape) -> StepTime:
        p = self._p
        linear = p[1] * batch.total_num_scheduled_tokens
        attention = p[2] * batch.prefill_attn_work + p[3] * batch.num_context_tokens
        overhead = p[0] + p[4] * batch.num_seqs + p[5] * batch.num_decode_seqs
        if self._prefix:
            overhead += self._prefix * batch.total_num_cached_tokens
        if self._span:
            attention += self._span * attn_span(
                self.attn_span, batch.num_prefill_seqs, batch.num_prefill_tokens, batch.prefill_attn_work,
                batch.num_context_tokens, batch.num_decode_seqs, batch.max_seq_len,
            )  # fmt: skip
        total = linear + attention + overhead
        floor = self._mixed_floor if batch.kind == "mixed" else self._prefill_floor
        if total < floor:  # host-bound: the time below the floor is host overhead
            return StepTime(linear, attention, 0.0, overhead + (floor - total), floor)
        return StepTime(linear, attention, 0.0, overhead, total)


def _table_decode_times(
    model: FittedModel, run: tuple[int, int, int], max_steps: int, start: float, deadline: float
) -> list[float]:
    """`FittedModel._leading_decode_times` of a model with a table term, `run` = (num_seqs,
    num_context_tokens, max_seq_len): decode_step_time's operations a step, in its order (the
    longest split recomputed a step where balanced; the table's entries change once a block)."""
    num_seqs, ctx, length = run
    b = graph_padded_batch_size(num_seqs, model._gmax)
    base, length_coef = model._coefs(b)
    d2, table, bs, floor = model._d2, model._table, model._bs, model._decode_floor
    balanced = model._balanced
    times = [start]
    append = times.append
    t = start
    for _ in range(max_steps):
        if t >= deadline:
            break
        if balanced:
            length_coef = model._length_coef(b, ctx, length)
        s = base + d2 * ctx + length_coef * length
        s = s + table * (num_seqs * ((length + bs - 1) // bs))
        t = t + (s if s > floor else floor)
        append(t)
        ctx += num_seqs
        length += 1
    return times


def _balanced_decode_times(
    model: FittedModel, run: tuple[int, int, int], max_steps: int, start: float, deadline: float
) -> list[float]:
    """`FittedModel._leading_decode_times` of a balanced model, `run` = (num_seqs, num_context_tokens,
    max_seq_len): decode_step_time's operations a step, the floor applied as it applies it. The
    longest split holds over stretches of steps (`_split_run`): its coefficient is looked up once a
    stretch, not once a step."""
    num_seqs, ctx, length = run
    memo = model._balanced_runs.get(num_seqs)
    if memo is None:
        b = graph_padded_batch_size(num_seqs, model._gmax)
        memo = model._balanced_runs[num_seqs] = (b, model._coefs(b)[0], model._split_consts_of(b))
    b, base, consts = memo
    d2, floor, step = model._d2, model._decode_floor, float(num_seqs)
    times = [start]
    append = times.append
    t, left = start, max_steps
    coefs = model._length_coefs
    while left > 0 and t < deadline:
        splits, hold = split_run(consts, b, ctx, length, num_seqs)  # `_split_run`, inlined
        coef = coefs.get((b, splits))
        if coef is None:
            coef = model._split_length_coef(b, splits)
        n = hold if hold < left else left
        # counts as floats: integers, exact (as in the int * float of decode_step_time)
        c, m = float(ctx), float(length)
        if d2 >= 0.0 and coef >= 0.0 and base + d2 * c + coef * m > floor:
            for _ in range(n):  # above the floor from the first step on: steps only grow
                if t >= deadline:
                    break
                t = t + (base + d2 * c + coef * m)
                append(t)
                c += step
                m += 1.0
        else:
            for _ in range(n):
                if t >= deadline:
                    break
                s = base + d2 * c + coef * m
                t = t + (s if s > floor else floor)
                append(t)
                c += step
                m += 1.0
        left -= n
        ctx += n * num_seqs
        length += n
    return times


def _floored_decode_times(
    base: float,
    d2: float,
    d3: float,
    floor: float,
    ctx: float,
    length: float,
    step: float,
    max_steps: int,
    start: float,
    deadline: float,
) -> list[float]:
    """`FittedModel._leading_decode_times`' loop with each step raised to the host floor, as
    `decode_step_time` raises it."""
    times = [start]
    append = times.append
    t = start
    for _ in range(max_steps):
        if t >= deadline:
            break
        s = base + d2 * ctx + d3 * length
        t = t + (s if s > floor else floor)
        append(t)
        ctx += step
        length += 1.0
    return times


# ---- fitting ------------------------------------------------------------------------------------
def _row_names(frame: pd.DataFrame, mask: np.ndarray, limit: int = 5) -> str:
    labels = frame["step"][mask] if "step" in frame.columns else frame.index[mask]
    shown = [str(v) for v in list(labels)[:limit]]
    more = int(mask.sum()) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more > 0 else "")


def _single_value(frame: pd.DataFrame, column: str) -> int | None:
    if column not in frame.columns:
        return None
    values = pd.unique(frame[column].dropna())
    if len(values) > 1:
        raise ValueError(
            f"step records: column {column!r} has several values {sorted(values)}; fit one config at a time"
        )
    return int(values[0]) if len(values) else None


def attributed_times(frame: pd.DataFrame) -> np.ndarray:
    """Each step's wall time, with the GPU work the host queued without waiting counted where it was
    queued: a prefill or mixed step whose GPU time passed its wall time (a chunk that samples
    nothing, `_QUEUED_SHARE`) is charged its GPU time, and the steps after it that waited for that
    work (their wall time beyond their own GPU time) that much less. The total is the wall time's.
    `frame`: step records in step order (its `step` column, where it has one, increasing)."""
    for column in ("wall_time_s", "gpu_time_s"):
        if column not in frame.columns:
            raise ValueError(f"step records: attributed times need {column}")
    if "step" in frame.columns and not (np.diff(frame["step"].to_numpy()) > 0).all():
        raise ValueError("step records: attributed times need the records in step order (`step` increasing)")
    wall = frame["wall_time_s"].to_numpy(dtype=np.float64)
    gpu = frame["gpu_time_s"].to_numpy(dtype=np.float64)
    queued = (frame["kind"].to_numpy() != "decode") & (
        gpu - wall > np.maximum(_QUEUED_MIN_S, _QUEUED_SHARE * wall)
    )
    out, debt = wall.copy(), 0.0
    for i in range(len(wall)):
        if queued[i]:
            out[i] = gpu[i]
            debt += gpu[i] - wall[i]
        elif debt > 0.0:
            paid = min(debt, max(wall[i] - gpu[i], 0.0))
            out[i] = wall[i] - paid
            debt -= paid
    return out


def _choose_target(frame: pd.DataFrame, target: str) -> str:
    if target not in TARGETS:
        raise ValueError(f"target: {target!r} is not one of {list(TARGETS)}")
    candidates = ("gpu_time_s", "wall_time_s") if target == "auto" else (target,)
    for column in candidates:
        if column in frame.columns:
            y = pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype=np.float64)
            bad = ~(np.isfinite(y) & (y > 0))
            if not bad.any():
                return column
            if target != "auto" or column == candidates[-1]:
                raise ValueError(
                    f"step records: {column} must be a positive finite time; bad at step(s) {_row_names(frame, bad)}"
                )
    raise ValueError(f"step records: no target column; need one of {list(candidates)}")


def decode_features(
    frame: pd.DataFrame, max_graph_batch_size: int, split_kv: SplitKV | None = None
) -> np.ndarray:
    """Design matrix of decode records (columns as DECODE_FEATURES)."""
    n = frame["num_seqs"].to_numpy(dtype=np.int64)
    padded_sizes = [graph_padded_batch_size(int(v), max_graph_batch_size) for v in n]
    padded = np.array(padded_sizes, dtype=np.float64)
    if split_kv is not None and split_kv.balanced:
        ctx, lengths = (frame[c].to_numpy(dtype=np.int64) for c in ("num_context_tokens", "max_seq_len"))
        splits = np.array(
            [split_kv.divisor(b, int(c), int(m)) for b, c, m in zip(padded_sizes, ctx, lengths)],
            dtype=np.float64,
        )
    else:
        splits = np.array([longest_split_divisor(split_kv, b) for b in padded_sizes], dtype=np.float64)
    max_seq_len = frame["max_seq_len"].to_numpy(dtype=np.float64)
    return np.column_stack(
        [
            np.ones(len(frame)),
            padded,
            frame["num_context_tokens"].to_numpy(dtype=np.float64),
            max_seq_len,
            padded * max_seq_len,
            max_seq_len / splits,
            (padded > 1).astype(np.float64),
        ]
    )


def sync_features(frame: pd.DataFrame, padded: np.ndarray) -> np.ndarray | None:
    """The SYNC_FEATURES columns of decode records (1 and the padded batch size where a step was not
    `overlapped`, else 0), or None when the records cannot tell them apart: no `overlapped` column
    (older records), or every step on one side (a synchronous engine)."""
    if "overlapped" not in frame.columns:
        return None
    sync = (~frame["overlapped"].fillna(False).astype(bool)).to_numpy(dtype=np.float64)
    if sync.all() or not sync.any():
        return None
    return np.column_stack([sync, sync * padded])


def infer_overlapped(frame: pd.DataFrame) -> np.ndarray:
    """Which steps of an async-scheduling engine's records were scheduled while the step before them
    ran, for records from before the `overlapped` column: a decode step right after a decode step of
    as many requests (none finished, none admitted). Steps whose engine had requests waiting (a full
    cache) were not, and this cannot see that: use it on profiling sweeps, whose batches run with
    nothing waiting (on the shipped block-16 `_async` sweep it agrees with the recorded column on
    99.88 % of the steps), not on replays near saturation."""
    kind = frame["kind"].astype(str).to_numpy()
    num_seqs = frame["num_seqs"].to_numpy()
    out = np.zeros(len(frame), dtype=bool)
    out[1:] = (kind[1:] == "decode") & (kind[:-1] == "decode") & (num_seqs[1:] == num_seqs[:-1])
    return out


def prefill_features(
    frame: pd.DataFrame, features: tuple[str, ...] = PREFILL_FEATURES, span: AttnSpan | None = None
) -> np.ndarray:
    """Design matrix of prefill/mixed records (columns as `features`: PREFILL_FEATURES, then
    optionally PREFIX_FEATURES and SPAN_FEATURES, the last computed with `span`)."""
    if SPAN_FEATURES[0] in features:
        if span is None:
            raise ValueError(f"{SPAN_FEATURES[0]}: needs the kernel's AttnSpan")
        rest = prefill_features(frame, tuple(f for f in features if f not in SPAN_FEATURES))
        return np.column_stack([rest, attn_spans(span, frame)])
    return np.column_stack(
        [np.ones(len(frame))] + [frame[c].to_numpy(dtype=np.float64) for c in features[1:]]
    )


def _infer_max_graph(decode: pd.DataFrame, max_num_seqs: int | None, given: int | None) -> int:
    if given is not None:
        return given
    if "graph_batch_size" in decode.columns:
        recorded = decode["graph_batch_size"].fillna(0).to_numpy(dtype=np.int64)
        if not (recorded > 0).any():
            return 0  # the engine ran decode eagerly
        return max_graph_batch_size(max_num_seqs) if max_num_seqs is not None else int(recorded.max())
    return max_graph_batch_size(max_num_seqs) if max_num_seqs is not None else 0


def _check_graph_sizes(decode: pd.DataFrame, gmax: int) -> None:
    if "graph_batch_size" not in decode.columns:
        return
    recorded = decode["graph_batch_size"].fillna(0).to_numpy(dtype=np.int64)
    n = decode["num_seqs"].to_numpy(dtype=np.int64)
    recorded = np.where(recorded > 0, recorded, n)
    expected = np.array([graph_padded_batch_size(int(v), gmax) for v in n], dtype=np.int64)
    bad = recorded != expected
    if bad.any():
        raise ValueError(
            f"step records: graph_batch_size disagrees with decode_graph_batch_sizes (largest graph {gmax}) "
            f"at step(s) {_row_names(decode, bad)}; pass max_graph_batch_size/max_num_seqs of the engine run"
        )


LOSSES = ("absolute", "relative", "median")
MEDIAN_ITERATIONS = 30  # reweighting rounds of the "median" loss


def _varies_apart(a: np.ndarray, b: np.ndarray, min_spread: float = 0.05) -> bool:
    """Whether `a` is more than a multiple of `b` over the records: the spread (coefficient of
    variation) of a / b is at least `min_spread`. Used on num_seqs * max_seq_len against the context
    sum: when every sequence of every decode step has about the same context they are one feature,
    a fit could split the weight of b * max_seq_len and the context sum arbitrarily, then extrapolate
    badly to batches of mixed lengths."""
    ok = b > 0
    if ok.sum() < 2:
        return False
    ratio = a[ok] / b[ok]
    return float(np.std(ratio) / np.mean(ratio)) >= min_spread


def _holdout_split(n: int, seed: int, holdout_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(held-back, training) row indices: the first round(n * holdout_fraction) of a seeded permutation."""
    n_test = int(round(n * holdout_fraction))
    order = np.random.default_rng(seed).permutation(n)
    return order[:n_test], order[n_test:]


def _fit_kind(
    x: np.ndarray,
    y: np.ndarray,
    features: tuple[str, ...],
    seed: int,
    holdout_fraction: float,
    kind: str,
    loss: str = "absolute",
) -> LinearFit:
    n, k = x.shape
    test, train = _holdout_split(n, seed, holdout_fraction)
    if len(train) < k:
        raise ValueError(
            f"step records: {n} usable {kind} steps; need at least {k} to fit plus the held-back "
            f"{holdout_fraction:.0%} (got {len(train)} for training)"
        )
    if loss == "median":
        coef = _least_absolute_nnls(x[train], y[train])
    else:
        # "absolute" minimises squared seconds, so long steps (which dominate a simulated run's
        # clock) weigh most; "relative" weights each row by 1 / measured time.
        coef = _weighted_nnls(x[train], y[train], 1.0 / y[train] if loss == "relative" else None)
    check = test if len(test) else train
    error = _fit_error(x[check] @ coef, y[check], len(train), len(test))
    return LinearFit(features, tuple(float(c) for c in coef), error)


def _fit_error(predicted: np.ndarray, measured: np.ndarray, n_train: int, n_test: int) -> FitError:
    rel = np.abs(predicted - measured) / measured
    return FitError(
        n_train=n_train,
        n_test=n_test,
        median_rel_error=float(np.median(rel)),
        p90_rel_error=float(np.quantile(rel, 0.9)),
        max_rel_error=float(rel.max()),
    )


# ---- host floors --------------------------------------------------------------------------------
FLOOR_MIN_GAIN = 1e-12  # a floor must lower the loss by more than this fraction of sum(loss of 0 s)


def fit_floor(predicted: np.ndarray, measured: np.ndarray, loss: str = "absolute") -> float:
    """The floor f that minimises `loss` of max(f, predicted) against `measured` (the linear fit's
    predictions held fixed), exactly: "median" the sum of absolute deviations, "absolute" of squared
    seconds, "relative" of squared relative errors. 0.0 when no floor lowers the loss by more than
    rounding (FLOOR_MIN_GAIN of the loss of predicting 0 s): steps that the linear fit predicts to
    within rounding or from above are not host-bound. Ties go to the lowest floor."""
    if loss not in LOSSES:
        raise ValueError(f"loss: {loss!r} is not one of {list(LOSSES)}")
    p = np.asarray(predicted, dtype=np.float64)
    y = np.asarray(measured, dtype=np.float64)
    if p.shape != y.shape or p.ndim != 1:
        raise ValueError(f"fit_floor: predicted {p.shape} and measured {y.shape} must be equal 1-d shapes")
    if len(p) == 0:
        return 0.0
    w = 1.0 / (y * y) if loss == "relative" else np.ones_like(y)
    floor = _absolute_floor(p, y) if loss == "median" else _squared_floor(p, y, w)
    gain = _floor_loss(0.0, p, y, w, loss) - _floor_loss(floor, p, y, w, loss)
    rounding = FLOOR_MIN_GAIN * _floor_loss(0.0, np.zeros_like(p), y, w, loss)
    return floor if gain > rounding else 0.0


def _floor_loss(floor: float, p: np.ndarray, y: np.ndarray, w: np.ndarray, loss: str) -> float:
    r = np.maximum(p, floor) - y
    return float(np.abs(r).sum() if loss == "median" else (w * r * r).sum())


def _absolute_floor(p: np.ndarray, y: np.ndarray) -> float:
    """argmin_f sum |max(f, p) - y|: piecewise linear in f with kinks at the p and y, so its minimum is
    one of them. Swept in order: from f = p_i, record i adds slope -1 (its y is above, until f = y_i,
    from where +1) or +1 (its y is at or below)."""
    above = y > p
    kinks = np.concatenate([p, y[above]])
    change = np.concatenate([np.where(above, -1.0, 1.0), np.full(int(above.sum()), 2.0)])
    order = np.argsort(kinks, kind="stable")
    kinks, change = kinks[order], change[order]
    slope = np.concatenate([[0.0], np.cumsum(change)[:-1]])  # on the segment that ends at kinks[j]
    loss = np.cumsum(slope * np.diff(kinks, prepend=kinks[0]))  # relative to the loss of no floor
    return float(kinks[int(np.argmin(loss))])


def _squared_floor(p: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """argmin_f sum w (max(f, p) - y)^2: with the k lowest predictions floored (f between the k-th and
    the next), the weighted mean of their y, clipped to that interval; the best over k."""
    order = np.argsort(p, kind="stable")
    p, y, w = p[order], y[order], w[order]
    sw, swy, swyy = np.cumsum(w), np.cumsum(w * y), np.cumsum(w * y * y)
    kept = np.concatenate([np.cumsum((w * (p - y) ** 2)[::-1])[::-1][1:], [0.0]])  # unfloored rest
    upper = np.concatenate([p[1:], [np.inf]])
    f = np.clip(swy / sw, p, upper)
    loss = sw * f * f - 2.0 * f * swy + swyy + kept
    return float(f[int(np.argmin(loss))])


def _fit_floors(
    predicted: np.ndarray, measured: np.ndarray, kinds: np.ndarray, train: np.ndarray, loss: str
) -> dict[str, float]:
    """One floor per step kind present, fitted on the kind's training rows."""
    floors = {}
    for kind in np.unique(kinds):
        rows = train[kinds[train] == kind]
        floors[str(kind)] = fit_floor(predicted[rows], measured[rows], loss)
    return floors


def _floored_fit(
    fit: LinearFit,
    x: np.ndarray,
    y: np.ndarray,
    kinds: np.ndarray,
    seed: int,
    holdout_fraction: float,
    loss: str,
) -> tuple[LinearFit, dict[str, float]]:
    """A kind's floors (fitted on the rows `fit` was trained on) and `fit` with its held-back error
    recomputed for max(floor, prediction)."""
    test, train = _holdout_split(len(y), seed, holdout_fraction)
    predicted = x @ np.asarray(fit.coefficients)
    floors = _fit_floors(predicted, y, kinds, train, loss)
    floor_of_row = np.array([floors[str(k)] for k in kinds])
    check = test if len(test) else train
    floored = np.maximum(predicted[check], floor_of_row[check])
    return LinearFit(
        fit.features, fit.coefficients, _fit_error(floored, y[check], len(train), len(test))
    ), floors


def _weighted_nnls(x: np.ndarray, y: np.ndarray, w: np.ndarray | None) -> np.ndarray:
    """argmin ||w * (x c - y)||_2 over c >= 0 (w = None: all ones), columns scaled to unit norm."""
    a = x if w is None else x * w[:, None]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    return nnls(a / scale, y if w is None else y * w) / scale


def _least_absolute_nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin sum |x c - y| over c >= 0, by iteratively reweighted least squares (weights
    1 / sqrt(|residual|), residuals floored at 1e-4 of the median time): a fit through the typical
    step, which the slow phases of a busy host (heavy-tailed step times) do not drag up."""
    floor = 1e-4 * float(np.median(y))
    coef = _weighted_nnls(x, y, None)
    for _ in range(MEDIAN_ITERATIONS):
        w = 1.0 / np.sqrt(np.maximum(np.abs(x @ coef - y), floor))
        coef = _weighted_nnls(x, y, w)
    return coef


def fit_step_records(
    records: pd.DataFrame,
    *,
    max_num_seqs: int | None = None,
    max_graph_batch_size: int | None = None,
    target: str = "auto",
    holdout_fraction: float = 0.25,
    seed: int = 0,
    loss: str = "absolute",
    split_kv: SplitKV | None = None,
    floors: bool = True,
    host_table: bool = True,
    prefix_hits: bool = False,
    attn_span: AttnSpan | None = None,
) -> FittedModel:
    """Fit a `FittedModel` on step records (a DataFrame with CONTRACT.md's step-record columns).

    Drops `compiled` and `empty` steps; fits `target` ("auto": gpu_time_s, else wall_time_s) by
    non-negative least squares on `loss` ("absolute" seconds, "relative" error, or "median": least
    absolute deviations in seconds); holds back `holdout_fraction` of each kind's
    steps (a permutation seeded by `seed`) to measure the error. Decode batch sizes are padded to
    CUDA-graph sizes up to `max_graph_batch_size` (default: from `max_num_seqs`, else the records'
    largest `graph_batch_size`; 0 when the records show no graphs). `split_kv`: how the engine's
    decode kernel split each sequence's KV (None: it did not, and longest_split stays out of the fit).
    Records of async scheduling (an `overlapped` column with steps on both sides) add SYNC_FEATURES
    and, where the records give the block size and `host_table` is set, TABLE_FEATURES to the
    decode fit (`host_table` False: the fit of before TABLE_FEATURES, e.g. to refit a profile made
    then).
    `prefix_hits`: add PREFIX_FEATURES to the prefill/mixed fit (the host's time of prefix-cache hits).
    `attn_span`: add SPAN_FEATURES to it, with this kernel geometry (None: leave it out).
    `floors`: then fit a host floor per step kind (`fit_floor`, same loss, same training steps, the
    linear coefficients held as fitted); the held-back error is that of max(floor, linear).
    """
    if not isinstance(records, pd.DataFrame):
        raise TypeError(f"records: expected a pandas DataFrame, got {type(records).__name__}")
    missing = [c for c in _REQUIRED if c not in records.columns]
    if missing:
        raise ValueError(
            f"step records: missing column(s) {missing}; expected CONTRACT.md's {list(RECORD_COLUMNS)}"
        )
    if not 0 <= holdout_fraction < 1:
        raise ValueError(f"holdout_fraction: must be in [0, 1), got {holdout_fraction}")
    if loss not in LOSSES:
        raise ValueError(f"loss: {loss!r} is not one of {list(LOSSES)}")
    frame = records.reset_index(drop=True)
    kinds = frame["kind"].astype(str)
    unknown = ~kinds.isin(["prefill", "decode", "mixed", "empty"]).to_numpy()
    if unknown.any():
        raise ValueError(f"step records: unknown kind at step(s) {_row_names(frame, unknown)}")
    compiled = (
        frame["compiled"].fillna(False).astype(bool).to_numpy()
        if "compiled" in frame
        else np.zeros(len(frame), bool)
    )
    empty = (kinds == "empty").to_numpy()
    keep = ~compiled & ~empty
    used = frame[keep].reset_index(drop=True)
    numeric = [c for c in _REQUIRED if c != "kind"]
    bad = ~np.isfinite(used[numeric].apply(pd.to_numeric, errors="coerce").to_numpy(dtype=np.float64)).all(
        axis=1
    )
    if bad.any():
        raise ValueError(f"step records: missing or non-numeric values at step(s) {_row_names(used, bad)}")
    target_column = _choose_target(used, target)
    tp = _single_value(used, "tp")
    block_size = _single_value(used, "block_size")

    is_decode = (used["kind"] == "decode").to_numpy()
    dec, pre = used[is_decode], used[~is_decode]
    if len(dec) == 0 or len(pre) == 0:
        raise ValueError(
            f"step records: need both decode and prefill/mixed steps to fit; got {len(dec)} decode and "
            f"{len(pre)} prefill/mixed usable steps (of {len(frame)}, {int(compiled.sum())} compiled)"
        )
    gmax = _infer_max_graph(dec, max_num_seqs, max_graph_batch_size)
    _check_graph_sizes(dec, gmax)
    y = used[target_column].to_numpy(dtype=np.float64)
    x_dec = decode_features(dec, gmax, split_kv)
    n_times_max = dec["num_seqs"].to_numpy(dtype=np.float64) * x_dec[:, 3]
    if not _varies_apart(n_times_max, x_dec[:, 2]):
        x_dec[:, 4] = 0.0  # records cannot tell b * max_seq_len from the context sum: leave it out
    if split_kv is None:
        x_dec[:, 5] = 0.0  # max_seq_len / 1 is max_seq_len: nothing to add
    features = DECODE_FEATURES
    sync = sync_features(dec, x_dec[:, 1])
    if sync is not None:
        x_dec, features = np.column_stack([x_dec, sync]), ASYNC_DECODE_FEATURES
        if host_table and block_size is not None:  # the table term needs the block size (the records' column)
            entries = table_entries(
                *(dec[c].to_numpy(dtype=np.int64) for c in ("num_seqs", "max_seq_len")), block_size
            )
            x_dec, features = np.column_stack([x_dec, sync[:, 0] * entries]), TABLE_DECODE_FEATURES
    decode_fit = _fit_kind(x_dec, y[is_decode], features, seed, holdout_fraction, "decode", loss)
    prefill_names = PREFIX_PREFILL_FEATURES if prefix_hits else PREFILL_FEATURES
    if prefix_hits and PREFIX_FEATURES[0] not in pre.columns:
        raise ValueError(f"step records: the prefix-hit term needs the {PREFIX_FEATURES[0]} column")
    if attn_span is not None:
        missing = [c for c in ("num_prefill_seqs", "num_prefill_tokens") if c not in pre.columns]
        if missing:
            raise ValueError(f"step records: the span term needs the column(s) {missing}")
        prefill_names = prefill_names + SPAN_FEATURES
    x_pre = prefill_features(pre, prefill_names, attn_span)
    prefill_fit = _fit_kind(
        x_pre, y[~is_decode], prefill_names, seed, holdout_fraction, "prefill/mixed", loss
    )
    step_floors = None
    if floors:
        split = (seed, holdout_fraction, loss)
        decode_fit, decode_floor = _floored_fit(
            decode_fit, x_dec, y[is_decode], dec["kind"].to_numpy(), *split
        )
        prefill_fit, prefill_floors = _floored_fit(
            prefill_fit, x_pre, y[~is_decode], pre["kind"].to_numpy(), *split
        )
        step_floors = StepFloors(**decode_floor, **prefill_floors)
    summary = FitSummary(
        target=target_column,
        num_records=len(frame),
        num_used=len(used),
        num_compiled_dropped=int(compiled.sum()),
        num_empty_dropped=int((empty & ~compiled).sum()),
        tp=tp,
        block_size=block_size,
        seed=seed,
        holdout_fraction=holdout_fraction,
    )
    return FittedModel(
        decode_fit,
        prefill_fit,
        gmax,
        summary,
        split_kv=split_kv,
        floors=step_floors,
        block_size=block_size,
        attn_span=attn_span,
    )
