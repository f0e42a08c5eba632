"""Trace loaders: Azure LLM inference CSV, Mooncake JSONL, BurstGPT CSV, generic CSV / JSONL / Parquet.

`load(path)` detects the format from the file's content (or takes `format=`) and returns a Trace.
Every bad input raises one TraceError naming the file, the 1-based line (data row for Parquet) and the
field; unsorted arrivals are sorted with a warning. Also: the sample traces shipped in traces/data/.
"""

from __future__ import annotations

import bz2
import contextlib
import csv
import gzip
import io
import json
import lzma
import re
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from .schema import (
    LIST_TYPE,
    MAX_TOKENS,
    OPTIONAL_COLUMNS,
    PARQUET_META_KEY,
    LoadReport,
    RowProblem,
    Trace,
    TraceError,
    count_out_of_order,
    normalize_frame,
    parse_int_lists,
    table_to_frame,
    to_float64,
    to_int64,
    to_list_array,
)

FORMATS = ("azure", "mooncake", "burstgpt", "csv", "jsonl", "parquet")
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
CANONICAL_FIELDS = ("request_id", "arrival_s", "prompt_len", "output_len", *OPTIONAL_COLUMNS)
_LIST_FIELDS = ("prefix_block_ids", "prompt_token_ids")
MOONCAKE_BLOCK_SIZE = 512


class TraceWarning(UserWarning):
    """A loader or transform changed the data (sorted, dropped rows); the message says how much."""


@dataclass
class _Spec:
    """How one source format maps onto the canonical columns."""

    fmt: str
    fields: dict[str, tuple[str, ...]]  # canonical -> candidate source names (first present wins)
    required: tuple[str, ...] = ("arrival_s", "prompt_len", "output_len")
    time_unit: str | None = None  # None: numbers are seconds, text is a date-time; or s/ms/us/ns/datetime
    prefix_block_size: int | None = None
    zero_output: str = "error"
    extras: dict[str, str] = field(default_factory=dict)  # output column -> source column, kept as-is
    keep_other_columns: bool = False  # canonical files: keep every unmapped column
    rebase: bool = True
    lists_required: bool = False  # a missing list (e.g. Mooncake hash_ids) is an error, not []


def _azure_spec() -> _Spec:
    return _Spec(
        "azure",
        {"arrival_s": ("TIMESTAMP",), "prompt_len": ("ContextTokens",), "output_len": ("GeneratedTokens",)},
        time_unit="datetime",
    )


def _burstgpt_spec() -> _Spec:
    return _Spec(
        "burstgpt",
        {
            "arrival_s": ("Timestamp",),
            "prompt_len": ("Request tokens",),
            "output_len": ("Response tokens",),
            "session_id": ("Session ID", "SessionID"),
        },
        time_unit="s",
        zero_output="drop",
        extras={"model": "Model", "log_type": "Log Type"},
    )


def _mooncake_spec() -> _Spec:
    return _Spec(
        "mooncake",
        {
            "arrival_s": ("timestamp",),
            "prompt_len": ("input_length",),
            "output_len": ("output_length",),
            "prefix_block_ids": ("hash_ids",),
        },
        time_unit="ms",
        prefix_block_size=MOONCAKE_BLOCK_SIZE,
        lists_required=True,
    )


_DETECT = {
    "azure": {"TIMESTAMP", "ContextTokens", "GeneratedTokens"},
    "burstgpt": {"Timestamp", "Request tokens", "Response tokens"},
    "mooncake": {"timestamp", "input_length", "output_length"},
}
_HINT = (
    "known formats: azure (TIMESTAMP, ContextTokens, GeneratedTokens), burstgpt (Timestamp, Request tokens, "
    "Response tokens), mooncake JSONL (timestamp, input_length, output_length, hash_ids), kvplan "
    "(arrival_s, prompt_len, output_len); for other files pass column_map={'arrival_s': ..., "
    "'prompt_len': ..., 'output_len': ...}"
)


# --------------------------------------------------------------------------- file access


# A compressed trace may decompress to at most this many times its own size, and to at least
# DECOMPRESS_FLOOR_BYTES whatever its size (text traces compress 3-20x): beyond that it is refused
# rather than filling memory. `load(..., max_decompressed_bytes=N)` sets another cap.
DECOMPRESS_MAX_RATIO = 100
DECOMPRESS_FLOOR_BYTES = 16 << 20


def _compression(path: Path) -> str | None:
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic.startswith(b"\x1f\x8b"):
        return "gzip"
    if magic.startswith(b"BZh"):
        return "bz2"
    if magic.startswith(b"\xfd7zXZ"):
        return "xz"
    return None


def default_decompressed_cap(path: str | Path) -> int:
    """The most bytes `load` decompresses `path` to by default."""
    return max(DECOMPRESS_FLOOR_BYTES, DECOMPRESS_MAX_RATIO * Path(path).stat().st_size)


class _Decompressed(io.RawIOBase):
    """A decompressing reader that stops at `cap` bytes and turns a truncated or corrupt stream
    into a TraceError naming the file."""

    def __init__(self, path: Path, inner, kind: str, cap: int) -> None:
        self.path, self.inner, self.kind, self.cap, self.total = path, inner, kind, cap, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        try:
            data = self.inner.read(len(buf))
        except (EOFError, OSError, zlib.error, lzma.LZMAError) as e:
            raise TraceError(self.path, f"truncated or corrupt {self.kind} file: {e}") from None
        self.total += len(data)
        if self.total > self.cap:
            raise TraceError(
                self.path,
                f"decompresses to more than {self.cap / (1 << 20):,.1f} MiB (the cap: {DECOMPRESS_MAX_RATIO} "
                f"times the file's size, at least {DECOMPRESS_FLOOR_BYTES >> 20} MiB); decompress it "
                "yourself to load it, or pass max_decompressed_bytes= to traces.load",
            )
        buf[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.inner.close()
        super().close()


def _open_binary(path: Path, cap: int | None = None):
    """The file's bytes, decompressed (gzip, bz2, xz: from its content, not its name) up to `cap`
    bytes (default: default_decompressed_cap)."""
    kind = _compression(path)
    if kind is None:
        return open(path, "rb")
    inner = {"gzip": gzip.open, "bz2": bz2.open, "xz": lzma.open}[kind](path, "rb")
    cap = default_decompressed_cap(path) if cap is None else cap
    return io.BufferedReader(_Decompressed(path, inner, kind, cap), buffer_size=1 << 20)


def _open_text(path: Path, cap: int | None = None):
    return io.TextIOWrapper(_open_binary(path, cap), encoding="utf-8-sig", newline="")


def _iter_nonblank_lines(path: Path, cap: int | None = None) -> Iterator[tuple[int, str]]:
    with _open_text(path, cap) as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield lineno, line


def detect_format(path: str | Path) -> str:
    """Guess the format from the content: parquet, mooncake, jsonl, azure, burstgpt or csv."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(4) == b"PAR1":
            return "parquet"
    try:
        with _open_binary(path) as f:
            head = f.read(1 << 16)
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise TraceError(path, f"cannot read the file: {e}") from None
    if not head.strip():
        raise TraceError(path, "empty file")
    if b"\x00" in head:
        raise TraceError(path, "binary content that is not Parquet; " + _HINT, line=1)
    try:
        lineno, first = next(_iter_nonblank_lines(path))
    except UnicodeDecodeError:
        raise TraceError(path, "not UTF-8 text and not Parquet; " + _HINT, line=1) from None
    first = first.strip()
    if first.startswith("["):
        raise TraceError(
            path, "a JSON array is not supported; write JSON Lines (one object per line)", line=lineno
        )
    if first.startswith("{"):
        try:
            obj = json.loads(first)
        except json.JSONDecodeError as e:
            raise TraceError(path, f"not valid JSON: {e.msg} (column {e.colno})", line=lineno) from None
        if not isinstance(obj, dict):
            raise TraceError(path, "expected a JSON object per line", line=lineno)
        return "mooncake" if _DETECT["mooncake"] <= set(obj) else "jsonl"
    header = {c.strip() for c in next(csv.reader([first]))}
    for fmt in ("azure", "burstgpt"):
        if _DETECT[fmt] <= header:
            return fmt
    return "csv"


# --------------------------------------------------------------------------- error plumbing


def _csv_line_of(path: Path, data_row: int) -> int | None:
    """1-based line of a 0-based CSV data row, skipping blank lines as pandas does."""
    with _open_text(path) as f:
        reader = csv.reader(f)
        header_seen = False
        i = -1
        for row in reader:
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if not header_seen:
                header_seen = True
                continue
            i += 1
            if i == data_row:
                return reader.line_num
    return None


def _jsonl_line_of(path: Path, data_row: int) -> int | None:
    for i, (lineno, _) in enumerate(_iter_nonblank_lines(path)):
        if i == data_row:
            return lineno
    return None


def _raise(
    path: Path, p: RowProblem, sources: dict[str, str], line_of: Callable[[int], int | None], label: str
):
    msg = p.message + (f" ({p.count} rows have this problem; the first is shown)" if p.count > 1 else "")
    line = line_of(p.row) if p.row is not None else None
    raise TraceError(path, msg, line=line, field=sources.get(p.field, p.field), row_label=label) from None


# --------------------------------------------------------------------------- column conversion


@dataclass
class _Acc:
    """Converted columns, chunk by chunk."""

    parts: dict[str, list] = field(default_factory=dict)
    time_kind: str | None = None  # "ns" (date-times) or "s" (numbers)
    block_sizes: set = field(default_factory=set)
    rows: int = 0

    def add(self, key: str, value: Any) -> None:
        self.parts.setdefault(key, []).append(value)


def _looks_numeric(ser: pd.Series) -> bool:
    first = ser.dropna()
    if first.empty:
        return True
    return not pd.isna(pd.to_numeric(pd.Series([first.iloc[0]]), errors="coerce").iloc[0])


def _parse_time(raw: Any, unit: str | None, acc: _Acc) -> np.ndarray:
    """A time column -> int64 ns since the epoch (date-times) or float64 seconds (numbers)."""
    ser = raw.to_pandas() if isinstance(raw, (pa.Array, pa.ChunkedArray)) else pd.Series(raw, copy=False)
    numeric_dtype = pd.api.types.is_numeric_dtype(ser.dtype) and not pd.api.types.is_bool_dtype(ser.dtype)
    as_datetime = unit == "datetime" and not numeric_dtype
    if unit is None and not numeric_dtype:
        as_datetime = not _looks_numeric(ser)
    kind = "ns" if as_datetime else "s"
    if acc.time_kind not in (None, kind):
        raise RowProblem("arrival_s", 0, "mixes date-time text and numbers")
    acc.time_kind = kind
    if not as_datetime:
        return to_float64(ser, "arrival_s") * TIME_UNITS.get(unit or "s", 1.0)
    if pd.api.types.is_datetime64_any_dtype(ser.dtype):
        ts = ser
    else:
        ts = pd.to_datetime(ser, format="ISO8601", errors="coerce")
    bad = ts.isna().to_numpy()
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        rawv = ser.iloc[row]
        missing = rawv is None or (isinstance(rawv, float) and np.isnan(rawv)) or rawv is pd.NA
        msg = (
            "missing time"
            if missing
            else f"unparseable time {rawv!r} (expected e.g. 2023-11-16 18:17:03.9799600)"
        )
        raise RowProblem("arrival_s", row, msg, int(bad.sum()))
    if isinstance(ts.dtype, pd.DatetimeTZDtype):
        ts = ts.dt.tz_convert("UTC").dt.tz_localize(None)
    return ts.dt.as_unit("ns").to_numpy().view(np.int64)


def _convert_chunk(raw: dict[str, Any], extras: dict[str, Any], spec: _Spec, acc: _Acc) -> None:
    """Convert one chunk (canonical name -> source column) and append it to acc; rows are chunk-relative."""
    acc.add("arrival", _parse_time(raw["arrival_s"], spec.time_unit, acc))
    acc.add("prompt_len", to_int64(raw["prompt_len"], "prompt_len", min_value=1, max_value=MAX_TOKENS))
    acc.add("output_len", to_int64(raw["output_len"], "output_len", min_value=0, max_value=MAX_TOKENS))
    if "request_id" in raw:
        acc.add("request_id", to_int64(raw["request_id"], "request_id"))
    if "session_id" in raw:
        s = raw["session_id"]
        acc.add("session_id", s.to_pandas() if isinstance(s, (pa.Array, pa.ChunkedArray)) else pd.Series(s))
    for col in _LIST_FIELDS:
        if col in raw:
            arr = _list_column(raw[col], col)
            if spec.lists_required and arr.null_count:
                row = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
                raise RowProblem(col, row, "missing value (expected a list of block ids)", arr.null_count)
            acc.add(col, arr)
    if "prefix_block_size" in raw:
        bs = to_int64(raw["prefix_block_size"], "prefix_block_size", min_value=1)
        acc.block_sizes.update(np.unique(bs).tolist())
    for name, col in extras.items():
        acc.add("extra:" + name, col.to_pandas() if isinstance(col, (pa.Array, pa.ChunkedArray)) else col)


def _list_column(v: Any, col: str) -> pa.Array | pa.ChunkedArray:
    """A list column from Arrow (lists or text), or pandas (lists, or '[1,2,3]' text from CSV)."""
    if isinstance(v, (pa.Array, pa.ChunkedArray)):
        if not (pa.types.is_string(v.type) or pa.types.is_large_string(v.type) or pa.types.is_null(v.type)):
            return to_list_array(v, col)
        v = v.to_pandas()
    ser = pd.Series(v, copy=False)
    nonnull = ser.dropna()
    if len(nonnull) and not isinstance(nonnull.iloc[0], str):
        return to_list_array(ser, col)
    return parse_int_lists(ser, col)


def _chunked(fn: Callable[[], None], start: int) -> None:
    try:
        fn()
    except RowProblem as p:
        raise RowProblem(p.field, None if p.row is None else p.row + start, p.message, p.count) from None


def _take(v: Any, keep: np.ndarray) -> Any:
    """Rows of one column where keep is True."""
    if isinstance(v, (pa.Array, pa.ChunkedArray)):
        return v.filter(pa.array(keep))
    if isinstance(v, pd.Series):
        return v[keep].reset_index(drop=True)
    return v[keep]


def _finish(
    path: Path,
    spec: _Spec,
    acc: _Acc,
    sources: dict[str, str],
    line_of: Callable[[int], int | None],
    label: str,
    name: str | None,
    meta_block_size: int | None = None,
) -> Trace:
    """Concatenate chunks, drop / check / sort / rebase, and build the Trace with its LoadReport."""
    n_read = acc.rows
    if n_read == 0:
        raise TraceError(path, "no data rows (the file has a header or schema but no requests)")
    parts = acc.parts
    cat = {k: (np.concatenate(v) if isinstance(v[0], np.ndarray) else v) for k, v in parts.items()}
    rows = np.arange(n_read)
    keep = np.ones(n_read, dtype=bool)
    dropped: dict[str, int] = {}
    zero = cat["output_len"] == 0
    if zero.any():
        if spec.zero_output == "drop":
            what = sources.get("output_len", "output_len")
            dropped[f"{what} == 0 (failed requests)"] = int(zero.sum())
            keep &= ~zero
        else:
            row = int(np.flatnonzero(zero)[0])
            p = RowProblem(
                "output_len",
                row,
                "value 0 (must be >= 1; pass zero_output='drop' to drop such rows)",
                int(zero.sum()),
            )
            _raise(path, p, sources, line_of, label)
    if not keep.any():
        raise TraceError(path, f"no rows left after dropping {n_read} rows ({', '.join(dropped)})")
    t = cat["arrival"]
    if acc.time_kind == "ns":
        t0 = t[keep].min()
        arrival = (t - t0).astype(np.float64) / 1e9
    else:
        arrival = t.astype(np.float64, copy=False)
    cols: dict[str, Any] = {
        "request_id": cat.get("request_id", rows),
        "arrival_s": arrival,
        "prompt_len": cat["prompt_len"],
        "output_len": cat["output_len"],
    }
    if "session_id" in parts:
        s = pd.concat(parts["session_id"], ignore_index=True)
        if pd.api.types.is_numeric_dtype(s.dtype) and not pd.api.types.is_bool_dtype(s.dtype):
            cols["session_id"] = s.fillna(-1)
        else:
            cols["session_id"] = pd.factorize(s, use_na_sentinel=True)[0].astype(np.int64)
    for col in _LIST_FIELDS:
        if col in parts:  # chunks stay chunks: no copy of the (possibly large) list data
            chunks = [c for p in parts[col] for c in (p.chunks if isinstance(p, pa.ChunkedArray) else [p])]
            cols[col] = pa.chunked_array(chunks, type=LIST_TYPE)
    for key in parts:
        if key.startswith("extra:"):
            cols[key[6:]] = pd.concat(parts[key], ignore_index=True).array
    if not keep.all():
        cols = {k: _take(v, keep) for k, v in cols.items()}
        rows = rows[keep]
    block_size = spec.prefix_block_size
    if acc.block_sizes:
        if len(acc.block_sizes) > 1:
            raise TraceError(
                path,
                f"prefix_block_size is not constant: {sorted(acc.block_sizes)}",
                field="prefix_block_size",
            )
        block_size = block_size or int(next(iter(acc.block_sizes)))
    block_size = block_size or meta_block_size
    try:
        frame = normalize_frame(cols, block_size)
    except RowProblem as p:
        if p.row is not None:
            p = RowProblem(p.field, int(rows[p.row]), p.message, p.count)
        _raise(path, p, sources, line_of, label)
    a = frame["arrival_s"].to_numpy()
    out_of_order = count_out_of_order(a)
    if out_of_order:
        order = np.argsort(a, kind="stable")
        frame = frame.take(order).reset_index(drop=True)
        warnings.warn(
            f"{path}: {out_of_order} of {len(frame)} rows arrive earlier than a row before them; "
            "sorted by arrival time (stable)",
            TraceWarning,
            stacklevel=4,
        )
    if spec.rebase and len(frame):
        first = frame["arrival_s"].iat[0]
        if first != 0.0:
            frame["arrival_s"] = frame["arrival_s"].to_numpy() - first
    for reason, k in dropped.items():
        warnings.warn(f"{path}: dropped {k} of {n_read} rows: {reason}", TraceWarning, stacklevel=4)
    report = LoadReport(str(path), spec.fmt, n_read, len(frame), dropped, out_of_order)
    return Trace._trusted(frame, name=name or _stem(path), prefix_block_size=block_size, load_report=report)


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".bz2", ".xz"):
        name = name.removesuffix(suffix)
    return Path(name).stem


# --------------------------------------------------------------------------- column mapping


def _generic_spec(
    fmt: str, column_map: dict[str, str] | None, columns: list[str], time_unit: str | None
) -> _Spec | None:
    if column_map is not None:
        unknown = set(column_map) - set(CANONICAL_FIELDS)
        if unknown:
            raise ValueError(
                f"column_map: unknown canonical column(s) {sorted(unknown)}; known: {', '.join(CANONICAL_FIELDS)}"
            )
        fields = {c: (c,) for c in CANONICAL_FIELDS}
        fields.update({k: (v,) for k, v in column_map.items()})
        required = tuple(dict.fromkeys(["arrival_s", "prompt_len", "output_len", *column_map]))
        return _Spec(fmt, fields, required=required, time_unit=time_unit)
    if {"arrival_s", "prompt_len", "output_len"} <= set(columns):
        fields = {c: (c,) for c in CANONICAL_FIELDS}
        fields["prefix_block_size"] = ("prefix_block_size",)
        return _Spec(fmt, fields, time_unit=time_unit or "s", keep_other_columns=True, rebase=False)
    return None


def _resolve(
    path: Path, spec: _Spec, columns: list[str], label_line: int | None
) -> tuple[dict[str, str], dict[str, str]]:
    """(canonical -> source column present in the file, output extra name -> source column)."""
    present = set(columns)
    stripped = {c.strip(): c for c in columns if isinstance(c, str)}
    mapping: dict[str, str] = {}
    for canon, cands in spec.fields.items():
        for c in cands:
            if c in present:
                mapping[canon] = c
                break
            if c in stripped:
                mapping[canon] = stripped[c]
                break
    for canon in spec.required:
        if canon not in mapping:
            want = spec.fields[canon][0]
            raise TraceError(
                path,
                f"missing column (found: {', '.join(map(str, columns))}) for format '{spec.fmt}'. {_HINT}",
                line=label_line,
                field=want,
            )
    used = set(mapping.values())
    extras = {k: v for k, v in spec.extras.items() if v in present}
    if spec.keep_other_columns:
        extras.update({c: c for c in columns if c not in used})
    return mapping, extras


def _no_format(path: Path, fmt: str, columns: list[str], line: int | None) -> TraceError:
    """No format's columns are all there: name the missing ones of the format the file comes
    closest to (the kvplan schema, or a known format that shares at least two columns)."""
    present = {str(c).strip() for c in columns}
    candidates = {"kvplan": ("arrival_s", "prompt_len", "output_len")}
    candidates.update({k: tuple(sorted(v)) for k, v in _DETECT.items()})
    near, missing = None, ()
    for name, cols in candidates.items():
        lacking = tuple(c for c in cols if c not in present)
        if len(cols) - len(lacking) >= (0 if name == "kvplan" else 2) and (
            near is None or len(lacking) < len(missing)
        ):
            near, missing = name, lacking
    what = f"cannot tell the trace format from columns [{', '.join(map(str, columns))}] ({fmt})"
    if near is not None:
        what += f"; read as {near}, it lacks {', '.join(missing)}"
    return TraceError(path, f"{what}. {_HINT}", line=line, field=missing[0] if near else None)


# --------------------------------------------------------------------------- CSV


def _csv_source(path: Path, opts: dict):
    """What pandas reads: the path, or a capped decompressing reader of a compressed file."""
    if _compression(path) is None:
        return contextlib.nullcontext(path)
    return _open_binary(path, opts["max_decompressed_bytes"])


def _load_csv(path: Path, spec: _Spec | None, column_map, opts: dict) -> Trace:
    try:
        with _csv_source(path, opts) as src:
            header = list(pd.read_csv(src, nrows=0).columns)
    except pd.errors.EmptyDataError:
        raise TraceError(path, "empty file") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as e:
        raise TraceError(path, f"not a readable CSV: {e}", line=1) from None
    if spec is None:
        spec = _generic_spec("csv", column_map, header, opts["time_unit"])
        if spec is None:
            raise _no_format(path, "csv", header, 1)
    _apply_opts(spec, opts)
    mapping, extras = _resolve(path, spec, header, 1)
    sources = {**mapping}
    acc = _Acc()
    line_of = lambda k: _csv_line_of(path, k)  # noqa: E731
    try:
        # All columns are read (no usecols) so that a row with too many fields is an error, not ignored.
        with (
            _csv_source(path, opts) as src,
            pd.read_csv(src, chunksize=opts["chunksize"], engine="c") as reader,
        ):
            for chunk in reader:
                raw = {canon: chunk[src] for canon, src in mapping.items()}
                ex = {name: chunk[src].reset_index(drop=True) for name, src in extras.items()}
                start = acc.rows
                _chunked(lambda: _convert_chunk(raw, ex, spec, acc), start)  # noqa: B023
                acc.rows += len(chunk)
    except RowProblem as p:
        _raise(path, p, sources, line_of, "line")
    except pd.errors.ParserError as e:
        m = re.search(r"line (\d+)", str(e))
        raise TraceError(path, f"malformed CSV: {e}", line=int(m.group(1)) if m else None) from None
    except UnicodeDecodeError as e:
        raise TraceError(path, f"not UTF-8 text: {e}") from None
    return _finish(path, spec, acc, sources, line_of, "line", opts["name"])


def _apply_opts(spec: _Spec, opts: dict) -> None:
    if opts["time_unit"] is not None and spec.fmt in ("csv", "jsonl", "parquet"):
        spec.time_unit = opts["time_unit"]
    if opts["prefix_block_size"] is not None:
        spec.prefix_block_size = opts["prefix_block_size"]
    if opts["zero_output"] is not None:
        spec.zero_output = opts["zero_output"]
    if opts["rebase"] is not None:
        spec.rebase = opts["rebase"]


# --------------------------------------------------------------------------- JSON Lines


def _read_json_fast(path: Path, spec: _Spec | None, cap: int | None) -> pa.Table | None:
    import pyarrow.json as pj

    parse = pj.ParseOptions(newlines_in_values=False)
    if spec is not None and spec.fmt == "mooncake":
        schema = pa.schema(
            [
                ("timestamp", pa.float64()),
                ("input_length", pa.int64()),
                ("output_length", pa.int64()),
                ("hash_ids", LIST_TYPE),
            ]
        )
        parse = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    try:
        plain = _compression(path) is None
        with pa.input_stream(str(path), compression=None) if plain else _open_binary(path, cap) as stream:
            return pj.read_json(stream, read_options=pj.ReadOptions(block_size=16 << 20), parse_options=parse)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None


def _read_json_slow(path: Path, cap: int | None) -> tuple[list[dict], list[int]]:
    """Parse line by line with the standard library; TraceError on the first malformed line."""
    objs: list[dict] = []
    lines: list[int] = []
    try:
        for lineno, line in _iter_nonblank_lines(path, cap):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(path, f"not valid JSON: {e.msg} (column {e.colno})", line=lineno) from None
            if not isinstance(obj, dict):
                raise TraceError(path, f"expected a JSON object, got {type(obj).__name__}", line=lineno)
            objs.append(obj)
            lines.append(lineno)
    except UnicodeDecodeError as e:
        raise TraceError(path, f"not UTF-8 text: {e}") from None
    return objs, lines


def _load_jsonl(path: Path, spec: _Spec | None, column_map, opts: dict) -> Trace:
    table = _read_json_fast(path, spec, opts["max_decompressed_bytes"])
    lines: list[int] | None = None
    if table is not None:
        columns = table.column_names
        if table.num_rows == 0:
            raise TraceError(path, "empty file")
        get = table.column
    else:
        objs, lines = _read_json_slow(path, opts["max_decompressed_bytes"])
        if not objs:
            raise TraceError(path, "empty file")
        columns = list(dict.fromkeys(k for o in objs for k in o))
        get = None
    if spec is None:
        spec = _generic_spec("jsonl", column_map, columns, opts["time_unit"])
        if spec is None:
            raise _no_format(path, "jsonl", columns, lines[0] if lines else 1)
    _apply_opts(spec, opts)
    first_line = lines[0] if lines else _jsonl_line_of(path, 0)
    mapping, extras = _resolve(path, spec, columns, first_line)
    if get is None:

        def get(src: str) -> pd.Series:
            return pd.Series([o.get(src) for o in objs], dtype=object)

    if lines is not None:
        line_of = lines.__getitem__
    else:
        line_of = lambda k: _jsonl_line_of(path, k)  # noqa: E731
    acc = _Acc()
    raw = {canon: get(src) for canon, src in mapping.items()}
    ex = {name: get(src) for name, src in extras.items()}
    try:
        _convert_chunk(raw, ex, spec, acc)
    except RowProblem as p:
        _raise(path, p, mapping, line_of, "line")
    acc.rows = len(raw["arrival_s"])
    return _finish(path, spec, acc, mapping, line_of, "line", opts["name"])


# --------------------------------------------------------------------------- Parquet


def _load_parquet(path: Path, spec: _Spec | None, column_map, opts: dict) -> Trace:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(path))
    except (pa.ArrowInvalid, OSError) as e:
        raise TraceError(path, f"not a readable Parquet file: {e}") from None
    columns = pf.schema_arrow.names
    raw_meta = (pf.schema_arrow.metadata or {}).get(PARQUET_META_KEY)
    meta = json.loads(raw_meta) if raw_meta else {}
    if spec is None:
        spec = _generic_spec("parquet", column_map, columns, opts["time_unit"])
        if spec is None:
            raise _no_format(path, "parquet", columns, None)
    _apply_opts(spec, opts)
    mapping, extras = _resolve(path, spec, columns, None)
    usecols = sorted(set(mapping.values()) | set(extras.values()))
    acc = _Acc()
    line_of = lambda k: k + 1  # noqa: E731
    try:
        for batch in pf.iter_batches(batch_size=opts["chunksize"], columns=usecols):
            raw = {canon: batch.column(src) for canon, src in mapping.items()}
            ex = {name: batch.column(src) for name, src in extras.items()}
            if spec.keep_other_columns:
                ex = {name: table_to_frame(pa.table({name: col}))[name] for name, col in ex.items()}
            start = acc.rows
            _chunked(lambda: _convert_chunk(raw, ex, spec, acc), start)  # noqa: B023
            acc.rows += batch.num_rows
    except RowProblem as p:
        _raise(path, p, mapping, line_of, "row")
    return _finish(
        path,
        spec,
        acc,
        mapping,
        line_of,
        "row",
        opts["name"] or meta.get("name"),
        meta.get("prefix_block_size"),
    )


# --------------------------------------------------------------------------- entry points


def load(
    path: str | Path,
    format: str | None = None,
    column_map: dict[str, str] | None = None,
    *,
    time_unit: str | None = None,
    prefix_block_size: int | None = None,
    name: str | None = None,
    zero_output: str | None = None,
    rebase: bool | None = None,
    chunksize: int = 500_000,
    max_decompressed_bytes: int | None = None,
) -> Trace:
    """Load a trace file into a Trace (sorted by arrival, times in seconds from the first request).

    format: None (detect from content) or one of FORMATS. column_map: canonical -> source column, for
    generic csv / jsonl / parquet files, e.g. {"arrival_s": "t", "prompt_len": "in", "output_len": "out"}.
    time_unit: unit of a numeric time column (s, ms, us, ns) or "datetime" for date-time text.
    zero_output: "drop" or "error" for rows whose output length is 0 (default: drop for BurstGPT, where
    they are failed requests, error elsewhere). rebase: shift times so the first request is at 0
    (default: yes, except for files already in the kvplan schema). The LoadReport is trace.load_report.
    max_decompressed_bytes: the most bytes a gzip / bz2 / xz file may decompress to (default: 100 times
    its size, at least 16 MiB); a file beyond it raises TraceError instead of filling memory.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such trace file")
    if format is not None and format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}; got {format!r}")
    if time_unit is not None and time_unit not in (*TIME_UNITS, "datetime"):
        raise ValueError(f"time_unit must be one of {', '.join(TIME_UNITS)}, datetime; got {time_unit!r}")
    if zero_output not in (None, "drop", "error"):
        raise ValueError(f"zero_output must be 'drop' or 'error'; got {zero_output!r}")
    if chunksize < 1:
        raise ValueError(f"chunksize must be >= 1; got {chunksize}")
    if max_decompressed_bytes is not None and max_decompressed_bytes < 1:
        raise ValueError(f"max_decompressed_bytes must be >= 1; got {max_decompressed_bytes}")
    fmt = format or detect_format(path)
    if path.stat().st_size == 0:
        raise TraceError(path, "empty file")
    opts = dict(
        time_unit=time_unit,
        prefix_block_size=prefix_block_size,
        name=name,
        zero_output=zero_output,
        rebase=rebase,
        chunksize=chunksize,
        max_decompressed_bytes=max_decompressed_bytes,
    )
    if column_map is not None and fmt in ("azure", "burstgpt"):
        fmt = "csv"
    if column_map is not None and fmt == "mooncake":
        fmt = "jsonl"
    if fmt == "azure":
        return _load_csv(path, _azure_spec(), None, opts)
    if fmt == "burstgpt":
        return _load_csv(path, _burstgpt_spec(), None, opts)
    if fmt == "mooncake":
        return _load_jsonl(path, _mooncake_spec(), None, opts)
    if fmt == "csv":
        return _load_csv(path, None, column_map, opts)
    if fmt == "jsonl":
        return _load_jsonl(path, None, column_map, opts)
    return _load_parquet(path, None, column_map, opts)


def save(trace: Trace, path: str | Path) -> Path:
    """Write a trace in the format its suffix names: .parquet, .csv or .jsonl."""
    suffix = Path(path).suffix.lower()
    if suffix == ".parquet":
        return trace.to_parquet(path)
    if suffix == ".csv":
        return trace.to_csv(path)
    if suffix in (".jsonl", ".json"):
        return trace.to_jsonl(path)
    raise ValueError(f"{path}: unknown output suffix {suffix!r}; use .parquet, .csv or .jsonl")


# --------------------------------------------------------------------------- shipped samples

_SHIPPED = {
    "azure_code_2023": "azure_code_2023.csv",
    "azure_conv_2023": "azure_conv_2023.csv",
    "mooncake_synthetic": "mooncake_synthetic.jsonl",
}


def shipped_names() -> list[str]:
    """Names of the sample traces shipped in traces/data/ (see traces/data/README.md)."""
    return list(_SHIPPED)


def shipped(name: str) -> Path:
    """Path of a shipped sample trace, e.g. shipped("azure_conv_2023")."""
    key = name.removesuffix(".csv").removesuffix(".jsonl")
    if key not in _SHIPPED:
        raise ValueError(f"unknown shipped trace {name!r}; shipped: {', '.join(_SHIPPED)}")
    return Path(__file__).resolve().parent / "data" / _SHIPPED[key]


def load_shipped(name: str, **kwargs: Any) -> Trace:
    """Load a shipped sample trace by name (keyword arguments as for load())."""
    kwargs.setdefault("name", name.removesuffix(".csv").removesuffix(".jsonl"))
    return load(shipped(name), **kwargs)
