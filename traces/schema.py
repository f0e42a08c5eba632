"""The canonical request trace: a pandas DataFrame with a fixed, validated schema, wrapped in `Trace`.

Loaders and generators produce a Trace; the engine replay and the simulator consume one. This module
also turns prefix identity (Mooncake-style block hash ids) into deterministic synthetic token ids.
It does no I/O except in the explicit `to_*` / `from_parquet` calls, and imports no torch.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

# Columns, in the order a Trace keeps them. Extra columns (e.g. BurstGPT's `model`) follow these.
REQUIRED_COLUMNS = ("request_id", "arrival_s", "prompt_len", "output_len")
OPTIONAL_COLUMNS = ("session_id", "prefix_block_ids", "prompt_token_ids")
SCHEMA_DOC = {
    "request_id": "int64, unique per trace (loaders: the 0-based data row in the source file)",
    "arrival_s": "float64 seconds since the trace start, finite, >= 0, non-decreasing",
    "prompt_len": "int64, 1 to 10,000,000 (MAX_TOKENS), prompt (input) tokens",
    "output_len": "int64, 1 to 10,000,000 (MAX_TOKENS), output (generated) tokens",
    "session_id": "optional int64; rows of one multi-turn conversation share it (-1: no session)",
    "prefix_block_ids": "optional list<int64> per row: ids of the prompt's blocks of "
    "`prefix_block_size` tokens, in order; equal leading ids mean an equal leading prefix",
    "prompt_token_ids": "optional list<int64> per row (null: use synthetic tokens), len == prompt_len",
}
# The most tokens one request's prompt or output may have: beyond every model's context, and small
# enough that simulating such a row cannot take minutes and gigabytes.
MAX_TOKENS = 10_000_000
LIST_TYPE = pa.list_(pa.int64())
PARQUET_META_KEY = b"kvplan.trace"

# Hash domains keep prefix-block tokens and per-request tokens from ever sharing a hash input.
_PREFIX_DOMAIN = 0x5052454649584B56  # "PREFIXKV"
_UNIQUE_DOMAIN = 0x554E495155454B56  # "UNIQUEKV"


class TraceError(ValueError):
    """Bad trace input. Names the file, the 1-based line (or data row) and the field at fault."""

    def __init__(
        self,
        path: str | Path | None,
        message: str,
        *,
        line: int | None = None,
        field: str | None = None,
        row_label: str = "line",
    ):
        self.path = None if path is None else str(path)
        self.line = line
        self.field = field
        self.problem = message
        where = [self.path or "<trace>"]
        if line is not None:
            where.append(f"{row_label} {line}")
        if field is not None:
            where.append(f"field '{field}'")
        super().__init__(": ".join([", ".join(where), message]))


class RowProblem(ValueError):
    """A problem at one data row (0-based, in the order given) of one canonical column; internal."""

    def __init__(self, field: str, row: int | None, message: str, count: int = 1):
        self.field, self.row, self.message, self.count = field, row, message, count
        more = f" ({count} rows have this problem; the first is shown)" if count > 1 else ""
        super().__init__(
            f"column '{field}'" + (f", row {row}" if row is not None else "") + f": {message}{more}"
        )


# --------------------------------------------------------------------------- synthetic token ids


_MASK64 = 0xFFFFFFFFFFFFFFFF
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise on a uint64 array (wrapping arithmetic)."""
    z = np.asarray(x, dtype=np.uint64) + np.uint64(_GOLDEN)
    z ^= z >> np.uint64(30)
    z *= np.uint64(_MIX1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    return z


def splitmix64_int(x: int) -> int:
    """splitmix64 of one Python int (taken mod 2**64); equal to splitmix64(np.uint64(x))."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _domain_key(domain: int, salt: int) -> int:
    return splitmix64_int((int(salt) & _MASK64) ^ domain)


SMALL_TOKEN_VOCAB = 256  # Python keeps one object per int below 257: such tokens cost no memory


def synthetic_vocab_size(vocab_size: int, block_size: int) -> int:
    """How many distinct values synthetic prompt tokens take for a model of `vocab_size` served with
    KV blocks of `block_size` tokens (the simulator and the engine replay both ask this).

    256 at block sizes of 8 and more: every such int is one shared Python object, which makes a
    million prompts several times cheaper to build, copy, hash and free, while a block still holds
    at least 64 random bits, so unrelated requests never share a block by accident. Smaller blocks
    keep the model's whole vocabulary.
    """
    return min(vocab_size, SMALL_TOKEN_VOCAB) if block_size >= 8 else vocab_size


def synthetic_token_ids(
    prompt_len: int,
    prefix_block_ids: np.ndarray | list[int] | None = None,
    prefix_block_size: int | None = None,
    request_id: int = 0,
    vocab_size: int = 32000,
    salt: int = 0,
) -> np.ndarray:
    """Deterministic token ids (int64 array of length prompt_len) for one request.

    Position p inside prefix block j is drawn from hash(salt, prefix_block_ids[j], p mod block size);
    positions past the last prefix block from hash(salt, request_id, p) in a separate domain. Two
    requests whose first k ids agree therefore share exactly their first k*prefix_block_size tokens,
    at any engine block size, and tokens of distinct blocks / requests come from distinct hash inputs.
    With vocab_size <= 256 each 64-bit hash gives eight tokens (one byte each), p // 8 its input.
    """
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    ids = np.asarray([] if prefix_block_ids is None else prefix_block_ids, dtype=np.int64)
    parts = []
    covered = 0
    if len(ids):
        if not prefix_block_size or prefix_block_size < 1:
            raise ValueError("prefix_block_size must be >= 1 when prefix_block_ids are given")
        covered = min(prompt_len, len(ids) * prefix_block_size)
        nblocks = -(-covered // prefix_block_size)
        base = splitmix64(ids[:nblocks].view(np.uint64) ^ np.uint64(_domain_key(_PREFIX_DOMAIN, salt)))
        parts.append(_draw_rows(base, prefix_block_size, vocab_size).ravel()[:covered])
    if covered < prompt_len:
        base = splitmix64_int(_domain_key(_UNIQUE_DOMAIN, salt) ^ (int(request_id) & _MASK64))
        row = _draw_rows(np.array([base], dtype=np.uint64), prompt_len, vocab_size)[0]
        parts.append(row[covered:])
    toks = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return toks.astype(np.int64)


def _draw_rows(base: np.ndarray, length: int, vocab_size: int) -> np.ndarray:
    """Tokens at positions 0..length-1 of each row seeded by `base` (uint64), shape (rows, length):
    bytes of splitmix64(base ^ (p // 8)) when vocab_size <= 256, else splitmix64(base ^ p)."""
    if vocab_size <= SMALL_TOKEN_VOCAB:
        words = splitmix64(base[:, None] ^ np.arange(-(-length // 8), dtype=np.uint64)[None, :])
        return _bytes_mod(words.view(np.uint8)[:, :length], vocab_size)
    toks = splitmix64(base[:, None] ^ np.arange(length, dtype=np.uint64)[None, :])
    return np.remainder(toks, np.uint64(vocab_size), out=toks)


def _bytes_mod(b: np.ndarray, vocab_size: int) -> np.ndarray:
    return b if vocab_size == 256 else np.remainder(b, np.uint8(vocab_size))


# --------------------------------------------------------------------------- column normalisation


def _first(mask: np.ndarray) -> tuple[int, int]:
    idx = np.flatnonzero(mask)
    return int(idx[0]), len(idx)


def _numeric_view(values: Any) -> tuple[np.ndarray | None, pd.Series]:
    """(numpy array if the column is plainly numeric with no missing values, else None; as a Series)."""
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        values = values.to_pandas()
    ser = values if isinstance(values, pd.Series) else pd.Series(values, copy=False)
    dt = ser.dtype
    if isinstance(dt, np.dtype) and dt.kind in "iuf":
        return ser.to_numpy(), ser
    if isinstance(dt, np.dtype) and dt.kind == "b":
        return None, ser
    if pd.api.types.is_numeric_dtype(dt) and not pd.api.types.is_bool_dtype(dt) and not ser.hasnans:
        return ser.to_numpy(dtype=np.float64 if pd.api.types.is_float_dtype(dt) else np.int64), ser
    return None, ser


def _is_missing(raw: Any) -> bool:
    return raw is None or raw is pd.NA or raw is pd.NaT or (isinstance(raw, float) and math.isnan(raw))


def _coerce(ser: pd.Series, field: str) -> np.ndarray:
    """Slow path: any column -> float64, RowProblem on the first missing / non-numeric / infinite value."""
    if pd.api.types.is_bool_dtype(ser.dtype):
        raise RowProblem(field, 0 if len(ser) else None, "expected numbers, got booleans")
    num = pd.to_numeric(ser, errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(num)
    if bad.any():
        row, count = _first(bad)
        raw = ser.iloc[row]
        msg = "missing value" if _is_missing(raw) else f"not a number: {raw!r}"
        raise RowProblem(field, row, msg, count)
    return num


def to_int64(
    values: Any, field: str, *, min_value: int | None = None, max_value: int | None = None
) -> np.ndarray:
    """Column -> int64 array, or RowProblem naming the first bad row (missing, non-numeric, fractional,
    outside [min_value, max_value])."""
    arr, ser = _numeric_view(values)
    if arr is not None and arr.dtype.kind in "iu":
        out = arr.astype(np.int64, copy=False)
    else:
        num = arr if arr is not None else _coerce(ser, field)
        _check_finite(num, ser, field)
        frac = num != np.floor(num)
        if frac.any():
            row, count = _first(frac)
            raise RowProblem(field, row, f"not an integer: {ser.iloc[row]!r}", count)
        big = np.abs(num) > 2.0**62
        if big.any():
            row, count = _first(big)
            raise RowProblem(field, row, f"out of range: {ser.iloc[row]!r}", count)
        out = num.astype(np.int64)
    if min_value is not None:
        bad = out < min_value
        if bad.any():
            row, count = _first(bad)
            kind = "negative value" if out[row] < 0 else "value"
            raise RowProblem(field, row, f"{kind} {int(out[row])} (must be >= {min_value})", count)
    if max_value is not None:
        bad = out > max_value
        if bad.any():
            row, count = _first(bad)
            raise RowProblem(field, row, f"value {int(out[row]):,} (must be <= {max_value:,})", count)
    return out


def to_float64(values: Any, field: str) -> np.ndarray:
    """Column -> finite float64 array, or RowProblem naming the first missing / non-numeric row."""
    arr, ser = _numeric_view(values)
    out = arr.astype(np.float64, copy=False) if arr is not None else _coerce(ser, field)
    _check_finite(out, ser, field)
    return out


def _check_finite(num: np.ndarray, ser: pd.Series, field: str) -> None:
    bad = ~np.isfinite(num)
    if bad.any():
        row, count = _first(bad)
        msg = "missing value" if np.isnan(num[row]) else f"not a finite number: {ser.iloc[row]!r}"
        raise RowProblem(field, row, msg, count)


def _row_scan_list(values: list, field: str) -> RowProblem:
    """Slow path: find the first row of a list column that is not a list of integers."""
    for i, v in enumerate(values):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
            return RowProblem(field, i, f"expected a list of integers, got {v!r}")
        for x in v:
            ok = isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
            if not ok and isinstance(x, (float, np.floating)) and float(x).is_integer():
                ok = True
            if not ok:
                return RowProblem(field, i, f"expected integers in the list, got {x!r}")
    return RowProblem(field, None, "expected a list of integers per row")


def to_list_array(values: Any, field: str) -> pa.Array | pa.ChunkedArray:
    """Column of per-row integer lists (ArrowDtype list, object of lists/arrays, or Arrow) -> list<int64>.

    Arrow input keeps its chunks (no copy when it is already list<int64>).
    """
    if isinstance(values, pd.Series):
        values = values.array
    if isinstance(values, pd.arrays.ArrowExtensionArray):
        values = pa.array(values)  # via __arrow_array__: the (chunked) Arrow data, no copy
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        arr = values
    else:
        obj = list(values)
        try:
            arr = pa.array(obj, from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError):
            raise _row_scan_list(obj, field) from None
        if pa.types.is_null(arr.type):
            arr = pa.nulls(len(arr), LIST_TYPE)
    if arr.type == LIST_TYPE:
        return arr
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        raise RowProblem(
            field, 0 if len(arr) else None, f"expected a list of integers per row, got {arr.type}"
        )
    vt = arr.type.value_type
    if not (pa.types.is_integer(vt) or pa.types.is_floating(vt) or pa.types.is_null(vt)):
        raise _row_scan_list(arr.to_pylist(), field)
    try:
        return arr.cast(LIST_TYPE, safe=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        raise _row_scan_list(arr.to_pylist(), field) from None


def list_lengths(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Per-row list lengths as int64 (0 for null rows)."""
    return pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def list_offsets_values(arr: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets int64 [n+1], flat values int64, valid bool [n]) of a list<int64> array; nulls are empty."""
    lengths = list_lengths(arr)
    offsets = np.zeros(len(arr) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = pc.list_flatten(arr).to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    valid = ~arr.is_null().to_numpy(zero_copy_only=False)
    return offsets, values, valid


def list_array_from(offsets: np.ndarray, values: np.ndarray) -> pa.Array:
    """list<int64> array from CSR offsets (n+1) and flat values."""
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32 if offsets[-1] < 2**31 else np.int64)),
        pa.array(values.astype(np.int64, copy=False)),
    ).cast(LIST_TYPE)


def arrow_column(arr: pa.Array | pa.ChunkedArray) -> pd.arrays.ArrowExtensionArray:
    return pd.arrays.ArrowExtensionArray(arr)


def normalize_frame(df: pd.DataFrame | dict[str, Any], prefix_block_size: int | None) -> pd.DataFrame:
    """Validate and convert a frame (or a dict of equal-length columns) to the canonical schema.

    Keeps the row order. Raises RowProblem (a ValueError) naming the column and 0-based row of the first
    problem. Does not check that arrivals are sorted (callers sort or reject).
    """
    cols = df if isinstance(df, dict) else {c: df[c] for c in df.columns}
    for col in REQUIRED_COLUMNS:
        if col not in cols:
            raise RowProblem(col, None, f"missing column (have: {', '.join(map(str, cols))})")
    n = len(cols["request_id"])
    out: dict[str, Any] = {
        "request_id": to_int64(cols["request_id"], "request_id"),
        "arrival_s": to_float64(cols["arrival_s"], "arrival_s"),
        "prompt_len": to_int64(cols["prompt_len"], "prompt_len", min_value=1, max_value=MAX_TOKENS),
        "output_len": to_int64(cols["output_len"], "output_len", min_value=1, max_value=MAX_TOKENS),
    }
    neg = out["arrival_s"] < 0
    if neg.any():
        row, count = _first(neg)
        raise RowProblem("arrival_s", row, f"negative time {out['arrival_s'][row]!r}", count)
    rid = out["request_id"]
    if n > 1 and not (np.diff(rid) > 0).all():
        dup = pd.Series(rid).duplicated().to_numpy()
        if dup.any():
            row, count = _first(dup)
            raise RowProblem("request_id", row, f"duplicate request_id {int(rid[row])}", count)
    if "session_id" in cols:
        out["session_id"] = to_int64(cols["session_id"], "session_id")
    if "prefix_block_ids" in cols:
        if prefix_block_size is None or int(prefix_block_size) < 1:
            raise RowProblem(
                "prefix_block_ids", None, f"needs prefix_block_size >= 1 (got {prefix_block_size!r})"
            )
        arr = to_list_array(cols["prefix_block_ids"], "prefix_block_ids")
        lengths = list_lengths(arr)
        max_blocks = -(-out["prompt_len"] // int(prefix_block_size))
        bad = lengths > max_blocks
        if bad.any():
            row, count = _first(bad)
            raise RowProblem(
                "prefix_block_ids",
                row,
                f"{int(lengths[row])} blocks of {prefix_block_size} tokens for a prompt of "
                f"{int(out['prompt_len'][row])} tokens (at most {int(max_blocks[row])})",
                count,
            )
        if arr.null_count:  # a missing list means no prefix ids: store it as []
            arr = list_array_from(*list_offsets_values(arr)[:2])
        out["prefix_block_ids"] = arrow_column(arr)
    if "prompt_token_ids" in cols:
        arr = to_list_array(cols["prompt_token_ids"], "prompt_token_ids")
        lengths = list_lengths(arr)
        valid = ~arr.is_null().to_numpy(zero_copy_only=False)
        bad = valid & (lengths != out["prompt_len"])
        if bad.any():
            row, count = _first(bad)
            raise RowProblem(
                "prompt_token_ids",
                row,
                f"{int(lengths[row])} tokens but prompt_len is {int(out['prompt_len'][row])}",
                count,
            )
        low = pc.min(pc.list_flatten(arr)).as_py()
        if low is not None and low < 0:
            offsets, values, _ = list_offsets_values(arr)
            k = int(np.flatnonzero(values < 0)[0])
            row = int(np.searchsorted(offsets, k, side="right") - 1)
            raise RowProblem("prompt_token_ids", row, f"negative token id {int(values[k])}")
        out["prompt_token_ids"] = arrow_column(arr)
    frame = pd.DataFrame(out, index=pd.RangeIndex(n))
    for c in cols:
        if c not in out:
            v = cols[c]
            frame[c] = v.array if isinstance(v, pd.Series) else v
    return frame


def count_out_of_order(arrival_s: np.ndarray) -> int:
    """Rows that arrive earlier than some row before them (0 for a sorted column)."""
    if len(arrival_s) < 2:
        return 0
    return int((arrival_s[1:] < np.maximum.accumulate(arrival_s)[:-1]).sum())


# --------------------------------------------------------------------------- Trace


@dataclass
class LoadReport:
    """What a loader read, kept and dropped; attached to the Trace it returns as `trace.load_report`."""

    path: str
    format: str
    rows_read: int
    rows_loaded: int
    dropped: dict[str, int] = field(default_factory=dict)
    out_of_order: int = 0

    def summary(self) -> str:
        s = f"{self.path} ({self.format}): {self.rows_loaded} of {self.rows_read} rows loaded"
        for reason, k in self.dropped.items():
            s += f"; dropped {k} ({reason})"
        if self.out_of_order:
            s += f"; sorted {self.out_of_order} out-of-order arrivals"
        return s


class Trace:
    """A request trace: `df` holds one row per request, sorted by `arrival_s` (see SCHEMA_DOC).

    Treat `df` as read-only: transforms return new Traces. `prefix_block_size` is the number of tokens
    per entry of `prefix_block_ids` (512 for Mooncake), None when the trace has no prefix identity.
    """

    def __init__(
        self,
        df: pd.DataFrame,
        *,
        name: str = "trace",
        prefix_block_size: int | None = None,
        load_report: LoadReport | None = None,
    ):
        try:
            frame = normalize_frame(df, prefix_block_size)
        except RowProblem as p:
            raise ValueError(f"Trace '{name}': {p}") from None
        unsorted = count_out_of_order(frame["arrival_s"].to_numpy())
        if unsorted:
            a = frame["arrival_s"].to_numpy()
            row = int(np.flatnonzero(a[1:] < a[:-1])[0]) + 1
            raise ValueError(
                f"Trace '{name}': column 'arrival_s', row {row}: arrivals must be sorted "
                f"({unsorted} rows out of order; loaders sort, or use df.sort_values('arrival_s', kind='stable'))"
            )
        self._init(frame, name, prefix_block_size, load_report)

    def _init(self, frame: pd.DataFrame, name: str, prefix_block_size: int | None, load_report) -> None:
        self._df = frame
        self.name = str(name)
        has_prefix = "prefix_block_ids" in frame.columns
        self.prefix_block_size = int(prefix_block_size) if (has_prefix and prefix_block_size) else None
        self.load_report = load_report
        self._cache: dict[str, Any] = {}

    @classmethod
    def _trusted(
        cls, frame: pd.DataFrame, *, name: str, prefix_block_size: int | None, load_report=None
    ) -> Trace:
        """Wrap a frame already produced by normalize_frame and sorted (internal fast path)."""
        t = cls.__new__(cls)
        t._init(frame, name, prefix_block_size, load_report)
        return t

    # -- basic properties
    @property
    def df(self) -> pd.DataFrame:
        return self._df

    def __len__(self) -> int:
        return len(self._df)

    @property
    def duration_s(self) -> float:
        a = self._df["arrival_s"]
        return float(a.iloc[-1] - a.iloc[0]) if len(a) else 0.0

    @property
    def has_prefix_ids(self) -> bool:
        return "prefix_block_ids" in self._df.columns

    @property
    def has_sessions(self) -> bool:
        return "session_id" in self._df.columns

    def __repr__(self) -> str:
        extra = f", prefix_block_size={self.prefix_block_size}" if self.prefix_block_size else ""
        return f"Trace(name={self.name!r}, rows={len(self)}, duration_s={self.duration_s:.3f}{extra})"

    def with_frame(self, df: pd.DataFrame, *, name: str | None = None, validate: bool = True) -> Trace:
        """A new Trace with this one's metadata and another frame (validated unless told otherwise)."""
        bs = self.prefix_block_size if "prefix_block_ids" in df.columns else None
        if validate:
            return Trace(df, name=name or self.name, prefix_block_size=bs)
        return Trace._trusted(df.reset_index(drop=True), name=name or self.name, prefix_block_size=bs)

    # -- token ids
    def _arrays(self) -> dict[str, Any]:
        c = self._cache
        if not c:
            c["prompt_len"] = self._df["prompt_len"].to_numpy()
            c["request_id"] = self._df["request_id"].to_numpy()
            if self.has_prefix_ids:
                c["prefix"] = list_offsets_values(pa.array(self._df["prefix_block_ids"].array))[:2]
            if "prompt_token_ids" in self._df.columns:
                c["tokens"] = list_offsets_values(pa.array(self._df["prompt_token_ids"].array))
        return c

    def prefix_ids(self, i: int) -> np.ndarray:
        """Prefix block ids of row i as an int64 array (empty when the trace has none)."""
        c = self._arrays()
        if "prefix" not in c:
            return np.zeros(0, dtype=np.int64)
        off, vals = c["prefix"]
        return vals[off[i] : off[i + 1]]

    def token_ids(self, i: int, vocab_size: int = 32000, salt: int = 0) -> list[int]:
        """Prompt token ids of row i: `prompt_token_ids` when present, else synthetic_token_ids()."""
        n = len(self._df)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for a trace of {n} rows")
        i = i % n
        c = self._arrays()
        if "tokens" in c:
            off, vals, valid = c["tokens"]
            if valid[i]:
                return vals[off[i] : off[i + 1]].tolist()
        ids = None
        if "prefix" in c:
            off, vals = c["prefix"]
            ids = vals[off[i] : off[i + 1]]
        return synthetic_token_ids(
            int(c["prompt_len"][i]), ids, self.prefix_block_size, int(c["request_id"][i]), vocab_size, salt
        ).tolist()

    def prompt_num_tokens(self, i: int) -> int:
        """How many tokens `token_ids(i)` gives: its `prompt_token_ids` when present, else prompt_len."""
        c = self._arrays()
        if "tokens" in c:
            off, _, valid = c["tokens"]
            if valid[i]:
                return int(off[i + 1] - off[i])
        return int(c["prompt_len"][i])

    def token_ids_many(
        self,
        start: int,
        stop: int,
        vocab_size: int = 32000,
        salt: int = 0,
        skip: Callable[[int], bool] | None = None,
        compact: bool = False,
    ) -> list[list[int] | array | None]:
        """`token_ids(i)` for rows start..stop-1, rows of unique tokens generated in one numpy pass
        (the simulator calls this per chunk of arrivals; the values equal the per-row function's).
        With `skip`, a row whose prompt length (`prompt_num_tokens`) it holds true for is None,
        generated not at all (the simulator skips the prompts its scheduler would reject).
        With `compact`, rows of unique tokens of a vocabulary of at most `SMALL_TOKEN_VOCAB` are
        `array("B")`s of the same values (a byte a token, no Python int built); other rows are lists."""
        c = self._arrays()
        rows = range(start, min(stop, len(self._df)))
        skipped = [skip(self.prompt_num_tokens(i)) for i in rows] if skip is not None else None
        fancy = ("tokens" in c) or ("prefix" in c)
        if fancy or not len(rows):
            if skipped is None:
                return [self.token_ids(i, vocab_size, salt) for i in rows]
            return [None if out else self.token_ids(i, vocab_size, salt) for i, out in zip(rows, skipped)]
        lens = np.asarray(c["prompt_len"][rows.start : rows.stop], dtype=np.int64)
        ids = c["request_id"][rows.start : rows.stop]
        if skipped is not None and any(skipped):
            lens = np.where(skipped, 0, lens)
            out = self._unique_token_rows(lens, ids, vocab_size, salt, compact)
            return [None if k else row for row, k in zip(out, skipped)]
        return self._unique_token_rows(lens, ids, vocab_size, salt, compact)

    @staticmethod
    def _unique_token_rows(
        lens: np.ndarray, request_ids: Any, vocab_size: int, salt: int, compact: bool = False
    ) -> list[list[int]] | list[array]:
        """The synthetic unique-token prompts of `lens` tokens of the rows of `request_ids` (as
        `array("B")`s with `compact` where the tokens are bytes)."""
        ids = np.asarray(request_ids, dtype=np.int64).view(np.uint64)
        base = splitmix64(ids ^ np.uint64(_domain_key(_UNIQUE_DOMAIN, salt)))
        per = 8 if vocab_size <= SMALL_TOKEN_VOCAB else 1  # tokens one hash gives (as _draw_rows)
        nwords = -(-lens // per)
        offsets = np.concatenate(([0], np.cumsum(nwords)))
        pos = np.arange(offsets[-1], dtype=np.uint64) - np.repeat(offsets[:-1].astype(np.uint64), nwords)
        words = splitmix64(pos ^ np.repeat(base, nwords))
        if per == 8:
            flat = _bytes_mod(words.view(np.uint8), vocab_size)
        else:
            flat = np.remainder(words, np.uint64(vocab_size), out=words).view(np.int64)
        starts = (offsets[:-1] * per).tolist()
        if compact and per == 8:  # byte tokens: each row copied from the buffer, no int objects
            data = flat.astype(np.uint8, copy=False).tobytes()
            return [array("B", data[a : a + n]) for a, n in zip(starts, lens.tolist())]
        return [flat[a : a + n].tolist() for a, n in zip(starts, lens.tolist())]

    # -- persistence
    def _meta(self) -> dict[str, Any]:
        return {"schema_version": 1, "name": self.name, "prefix_block_size": self.prefix_block_size}

    def to_parquet(self, path: str | Path) -> Path:
        """Write the frame and the trace metadata (name, prefix_block_size) to one Parquet file."""
        import pyarrow.parquet as pq

        table = pa.Table.from_pandas(self._df, preserve_index=False)
        meta = dict(table.schema.metadata or {})
        meta[PARQUET_META_KEY] = json.dumps(self._meta()).encode()
        pq.write_table(table.replace_schema_metadata(meta), str(path))
        return Path(path)

    @classmethod
    def from_parquet(cls, path: str | Path) -> Trace:
        """Read a Parquet file written by to_parquet (or any Parquet file in the canonical schema)."""
        import pyarrow.parquet as pq

        table = pq.read_table(str(path))
        raw = (table.schema.metadata or {}).get(PARQUET_META_KEY)
        meta = json.loads(raw) if raw else {}
        df = table_to_frame(table)
        return cls(
            df, name=meta.get("name", Path(path).stem), prefix_block_size=meta.get("prefix_block_size")
        )

    @classmethod
    def from_csv(cls, path: str | Path) -> Trace:
        """Read a CSV written by to_csv (same as traces.load(path, format="csv"))."""
        from .loaders import load

        return load(path, format="csv")

    @classmethod
    def from_jsonl(cls, path: str | Path) -> Trace:
        """Read JSON Lines written by to_jsonl (same as traces.load(path, format="jsonl"))."""
        from .loaders import load

        return load(path, format="jsonl")

    def _text_frame(self) -> pd.DataFrame:
        """Frame for CSV/JSONL: lists become '[1,2,3]' text, and prefix_block_size a constant column."""
        df = self._df.copy()
        for col in ("prefix_block_ids", "prompt_token_ids"):
            if col in df.columns:
                df[col] = format_int_lists(pa.array(df[col].array))
        if self.prefix_block_size:
            df["prefix_block_size"] = self.prefix_block_size
        return df

    def to_csv(self, path: str | Path) -> Path:
        """Write a CSV that traces.load() reads back into an equal Trace (lists as '[1,2,3]' cells)."""
        self._text_frame().to_csv(path, index=False)
        return Path(path)

    def to_jsonl(self, path: str | Path) -> Path:
        """Write JSON Lines, one object per request; traces.load() reads it back into an equal Trace."""
        df = self._df
        cols: dict[str, list] = {}
        for c in df.columns:
            if c in ("prefix_block_ids", "prompt_token_ids"):
                cols[c] = pa.array(df[c].array).to_pylist()
            else:
                cols[c] = df[c].tolist()
        if self.prefix_block_size:
            cols["prefix_block_size"] = [self.prefix_block_size] * len(df)
        keys = list(cols)
        with open(path, "w", encoding="utf-8") as f:
            for row in zip(*cols.values()):
                f.write(json.dumps(dict(zip(keys, row)), separators=(", ", ": ")))
                f.write("\n")
        return Path(path)


def table_to_frame(table: pa.Table) -> pd.DataFrame:
    """Arrow table -> pandas, keeping list columns as Arrow-backed (compact) columns."""

    def mapper(t: pa.DataType):
        return pd.ArrowDtype(t) if (pa.types.is_list(t) or pa.types.is_large_list(t)) else None

    return table.to_pandas(types_mapper=mapper)


def format_int_lists(arr: pa.Array) -> np.ndarray:
    """list<int64> -> object array of '[1,2,3]' strings (None for null rows)."""
    out = np.empty(len(arr), dtype=object)
    for i, v in enumerate(arr.to_pylist()):
        out[i] = None if v is None else "[" + ",".join(map(str, v)) + "]"
    return out


def parse_int_lists(strings: pd.Series | np.ndarray, field: str) -> pa.Array:
    """'[1,2,3]' / '1 2 3' / '' text cells -> list<int64> (empty or missing cells -> null)."""
    s = pa.array(
        pd.Series(strings, copy=False).astype(object).where(lambda x: x.notna(), None), type=pa.string()
    )
    trimmed = pc.utf8_trim(s, "[] \t")
    empty = pc.fill_null(pc.equal(trimmed, ""), False)
    parts = pc.split_pattern_regex(pc.if_else(empty, pa.scalar(None, pa.string()), trimmed), r"[,\s]+")
    try:
        lists = parts.cast(LIST_TYPE)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        lists = None
    if lists is None:
        for i, cell in enumerate(pd.Series(strings, copy=False).tolist()):
            if cell is None or (isinstance(cell, float) and math.isnan(cell)):
                continue
            body = str(cell).strip().strip("[]").strip()
            for tok in body.replace(",", " ").split():
                try:
                    int(tok)
                except ValueError:
                    raise RowProblem(field, i, f"not a list of integers: {cell!r}") from None
        raise RowProblem(field, None, "not a list of integers")
    empty_list = pa.array([[]] * len(lists), type=LIST_TYPE)
    return pc.if_else(empty, empty_list, lists)
