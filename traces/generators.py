"""Synthetic workloads: arrival processes, length distributions, shared system prompts, multi-turn sessions.

Every draw comes from an explicit numpy.random.Generator built from a seed; there is no global random
state. `generate(spec)` assembles a Trace from a dict (or keyword arguments) that names the pieces;
shared prefixes are expressed as prefix_block_ids, so requests that share one share its exact tokens.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .schema import Trace, list_array_from

Rng = np.random.Generator | int
_Z90 = 1.2815515655446004  # standard normal 90th percentile
_BATCH_MIN = 64


def _rng(rng: Rng) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        return np.random.default_rng(int(rng))
    raise TypeError(f"rng must be a numpy.random.Generator or an int seed, got {type(rng).__name__}")


def _positive(name: str, value: float) -> float:
    if value is None or not (float(value) > 0 and math.isfinite(float(value))):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------- arrivals


def _times_from_gaps(gap_fn, rate: float, n: int | None, duration_s: float | None) -> np.ndarray:
    """Arrival times starting at 0, spaced by gap_fn(k) draws, until n requests and/or duration_s."""
    if n is None and duration_s is None:
        raise ValueError("give num_requests (n) and/or duration_s")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if duration_s is not None:
        _positive("duration_s", duration_s)
    if n is not None:
        if n == 0:
            return np.zeros(0)
        times = np.concatenate([[0.0], np.cumsum(gap_fn(n - 1))])
        return times if duration_s is None else times[times < duration_s]
    chunks = [np.zeros(1)]
    last = 0.0
    while last < duration_s:
        k = max(_BATCH_MIN, int(1.1 * rate * (duration_s - last)) + 16)
        t = last + np.cumsum(gap_fn(k))
        chunks.append(t)
        last = float(t[-1])
    times = np.concatenate(chunks)
    return times[times < duration_s]


def poisson_arrivals(
    rate: float, *, rng: Rng, n: int | None = None, duration_s: float | None = None
) -> np.ndarray:
    """Poisson process: exponential gaps of mean 1/rate. First arrival at 0."""
    rate, g = _positive("rate", rate), _rng(rng)
    return _times_from_gaps(lambda k: g.exponential(1.0 / rate, k), rate, n, duration_s)


def gamma_arrivals(
    rate: float, cv: float, *, rng: Rng, n: int | None = None, duration_s: float | None = None
) -> np.ndarray:
    """Renewal process with Gamma gaps of mean 1/rate and coefficient of variation cv (>1: bursty)."""
    rate, g = _positive("rate", rate), _rng(rng)
    cv = float(cv)
    if not cv >= 0:
        raise ValueError(f"cv must be >= 0, got {cv!r}")
    if cv == 0:
        return constant_arrivals(rate, n=n, duration_s=duration_s)
    shape = 1.0 / cv**2
    return _times_from_gaps(lambda k: g.gamma(shape, 1.0 / (rate * shape), k), rate, n, duration_s)


def constant_arrivals(rate: float, *, n: int | None = None, duration_s: float | None = None) -> np.ndarray:
    """Evenly spaced arrivals, 1/rate apart."""
    rate = _positive("rate", rate)
    return _times_from_gaps(lambda k: np.full(k, 1.0 / rate), rate, n, duration_s)


def onoff_arrivals(
    rate: float,
    on_s: float,
    off_s: float,
    *,
    rng: Rng,
    rate_off: float = 0.0,
    n: int | None = None,
    duration_s: float | None = None,
) -> np.ndarray:
    """Poisson at `rate` for on_s seconds, then at `rate_off` (default 0) for off_s seconds, repeating."""
    rate, on_s, g = _positive("rate", rate), _positive("on_s", on_s), _rng(rng)
    off_s = float(off_s)
    if not off_s >= 0 or not rate_off >= 0:
        raise ValueError(f"off_s and rate_off must be >= 0, got {off_s!r}, {rate_off!r}")
    period = on_s + off_s
    lam_on = rate * on_s
    lam_period = lam_on + rate_off * off_s
    mean_rate = lam_period / period

    def to_time(u: np.ndarray) -> np.ndarray:
        k = np.floor(u / lam_period)
        r = u - k * lam_period
        t_on = r / rate
        t_off = on_s + (r - lam_on) / rate_off if rate_off > 0 else np.full_like(r, on_s)
        return k * period + np.where(r < lam_on, t_on, t_off)

    if n is not None:
        u = _times_from_gaps(lambda k: g.exponential(1.0, k), 1.0, n, None)
        t = to_time(u)
        return t if duration_s is None else t[t < duration_s]
    lam_total = (duration_s // period) * lam_period + min(duration_s % period, on_s) * rate
    lam_total += max(duration_s % period - on_s, 0.0) * rate_off
    u = _times_from_gaps(lambda k: g.exponential(1.0, k), mean_rate, None, lam_total + 1e-12)
    t = to_time(u)
    return t[t < duration_s]


ARRIVALS = ("poisson", "gamma", "constant", "onoff")


def sample_arrivals(
    spec: str | dict[str, Any], *, rng: Rng, n: int | None = None, duration_s: float | None = None
) -> np.ndarray:
    """Arrival times from a spec: {"kind": "poisson"|"gamma"|"constant"|"onoff", "rate": ..., ...}."""
    spec = {"kind": spec} if isinstance(spec, str) else dict(spec)
    kind = spec.pop("kind", "poisson")
    allowed = {
        "poisson": {"rate"},
        "gamma": {"rate", "cv"},
        "constant": {"rate"},
        "onoff": {"rate", "on_s", "off_s", "rate_off"},
    }
    if kind not in allowed:
        raise ValueError(f"arrival kind must be one of {', '.join(ARRIVALS)}; got {kind!r}")
    extra = set(spec) - allowed[kind]
    if extra:
        raise ValueError(
            f"arrival '{kind}': unknown field(s) {sorted(extra)}; allowed: {sorted(allowed[kind])}"
        )
    if "rate" not in spec:
        raise ValueError(f"arrival '{kind}': missing field 'rate'")
    if kind == "poisson":
        return poisson_arrivals(spec["rate"], rng=rng, n=n, duration_s=duration_s)
    if kind == "gamma":
        if "cv" not in spec:
            raise ValueError("arrival 'gamma': missing field 'cv'")
        return gamma_arrivals(spec["rate"], spec["cv"], rng=rng, n=n, duration_s=duration_s)
    if kind == "constant":
        return constant_arrivals(spec["rate"], n=n, duration_s=duration_s)
    for f in ("on_s", "off_s"):
        if f not in spec:
            raise ValueError(f"arrival 'onoff': missing field '{f}'")
    return onoff_arrivals(
        spec["rate"],
        spec["on_s"],
        spec["off_s"],
        rng=rng,
        rate_off=spec.get("rate_off", 0.0),
        n=n,
        duration_s=duration_s,
    )


# --------------------------------------------------------------------------- lengths


def _clip_round(x: np.ndarray, lo: int, hi: int | None) -> np.ndarray:
    out = np.rint(x)
    out = np.clip(out, lo, hi if hi is not None else np.inf)
    return out.astype(np.int64)


def fixed_lengths(n: int, value: int) -> np.ndarray:
    if int(value) < 1:
        raise ValueError(f"fixed length must be >= 1, got {value!r}")
    return np.full(n, int(value), dtype=np.int64)


def uniform_lengths(n: int, low: int, high: int, *, rng: Rng) -> np.ndarray:
    """Integers uniform on [low, high], both inclusive."""
    if not 1 <= int(low) <= int(high):
        raise ValueError(f"uniform lengths need 1 <= low <= high, got low={low!r}, high={high!r}")
    return _rng(rng).integers(int(low), int(high), size=n, endpoint=True, dtype=np.int64)


def lognormal_lengths(
    n: int,
    *,
    rng: Rng,
    mean: float | None = None,
    sigma: float | None = None,
    p50: float | None = None,
    p90: float | None = None,
    min: int = 1,
    max: int | None = None,
) -> np.ndarray:
    """Lognormal lengths, given (mean, sigma of the log) or (p50, p90); rounded, clipped to [min, max]."""
    if mean is not None and sigma is not None and p50 is None and p90 is None:
        mean, sigma = _positive("mean", mean), float(sigma)
        if not sigma >= 0:
            raise ValueError(f"sigma must be >= 0, got {sigma!r}")
        mu = math.log(mean) - sigma**2 / 2
    elif p50 is not None and p90 is not None and mean is None and sigma is None:
        p50, p90 = _positive("p50", p50), _positive("p90", p90)
        if p90 < p50:
            raise ValueError(f"p90 ({p90}) must be >= p50 ({p50})")
        mu, sigma = math.log(p50), math.log(p90 / p50) / _Z90
    else:
        raise ValueError("lognormal lengths need either mean and sigma, or p50 and p90")
    if int(min) < 1 or (max is not None and int(max) < int(min)):
        raise ValueError(f"lognormal lengths need 1 <= min <= max, got min={min!r}, max={max!r}")
    return _clip_round(_rng(rng).lognormal(mu, sigma, n), int(min), max)


def empirical_lengths(n: int, values: np.ndarray, *, rng: Rng) -> np.ndarray:
    """Resample (with replacement) from observed lengths, e.g. a trace's prompt_len column."""
    v = np.asarray(values, dtype=np.int64)
    if v.size == 0 or (v < 1).any():
        raise ValueError("empirical lengths need a non-empty array of values >= 1")
    return _rng(rng).choice(v, size=n, replace=True)


LENGTHS = ("fixed", "uniform", "lognormal", "empirical")


def _empirical_values(source: Any, column: str) -> np.ndarray:
    if isinstance(source, Trace):
        return source.df[column].to_numpy()
    if isinstance(source, (str, Path)):
        from .loaders import load, load_shipped, shipped_names

        if str(source) in shipped_names():
            return load_shipped(str(source)).df[column].to_numpy()
        return load(source).df[column].to_numpy()
    return np.asarray(source)


def sample_lengths(
    spec: int | str | dict[str, Any], n: int, *, rng: Rng, column: str = "prompt_len"
) -> np.ndarray:
    """Lengths from a spec: an int (fixed), a string (see parse_length_spec) or a dict with "kind".

    {"kind": "fixed", "value": 512}; {"kind": "uniform", "low": 100, "high": 2000};
    {"kind": "lognormal", "mean": 1000, "sigma": 0.8} or {"kind": "lognormal", "p50": 800, "p90": 3000}
    (optional "min", "max"); {"kind": "empirical", "trace": Trace | path | shipped name, "column": ...}
    or {"kind": "empirical", "values": [...]}. `column` is the default column for empirical traces.
    """
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        return fixed_lengths(n, int(spec))
    if isinstance(spec, str):
        spec = parse_length_spec(spec)
    spec = dict(spec)
    kind = spec.pop("kind", None)
    allowed = {
        "fixed": {"value"},
        "uniform": {"low", "high"},
        "lognormal": {"mean", "sigma", "p50", "p90", "min", "max"},
        "empirical": {"trace", "values", "column"},
    }
    if kind not in allowed:
        raise ValueError(f"length kind must be one of {', '.join(LENGTHS)}; got {kind!r}")
    extra = set(spec) - allowed[kind]
    if extra:
        raise ValueError(
            f"length '{kind}': unknown field(s) {sorted(extra)}; allowed: {sorted(allowed[kind])}"
        )
    try:
        if kind == "fixed":
            return fixed_lengths(n, spec["value"])
        if kind == "uniform":
            return uniform_lengths(n, spec["low"], spec["high"], rng=rng)
        if kind == "lognormal":
            return lognormal_lengths(n, rng=rng, **spec)
    except KeyError as e:
        raise ValueError(f"length '{kind}': missing field {e}") from None
    if ("trace" in spec) == ("values" in spec):
        raise ValueError("length 'empirical': give exactly one of 'trace' or 'values'")
    values = _empirical_values(spec.get("trace", spec.get("values")), spec.get("column", column))
    return empirical_lengths(n, values, rng=rng)


def parse_length_spec(text: str) -> int | dict[str, Any]:
    """Parse a CLI length spec: '512', 'uniform:100:2000', 'lognormal:mean=1000,sigma=0.8',
    'lognormal:p50=800,p90=3000', 'empirical:azure_conv_2023' (a shipped name or a trace file path)."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    kind, _, rest = text.partition(":")
    kind = kind.strip().lower()
    if kind == "fixed":
        return {"kind": "fixed", "value": int(rest)}
    if kind == "empirical":
        if not rest:
            raise ValueError(
                "empirical length spec needs a source: 'empirical:azure_conv_2023' or a file path"
            )
        src, _, col = rest.partition("#")
        out: dict[str, Any] = {"kind": "empirical", "trace": src}
        if col:
            out["column"] = col
        return out
    if kind not in ("uniform", "lognormal"):
        raise ValueError(f"cannot parse length spec {text!r}; kinds: {', '.join(LENGTHS)}")
    fields: dict[str, Any] = {"kind": kind}
    parts = [p for p in rest.replace(":", ",").split(",") if p.strip()]
    positional = ["low", "high"] if kind == "uniform" else ["mean", "sigma"]
    for i, p in enumerate(parts):
        key, eq, val = p.partition("=")
        if not eq:
            if i >= len(positional):
                raise ValueError(f"cannot parse length spec {text!r}: too many values")
            key, val = positional[i], key
        key = key.strip()
        num = float(val)
        fields[key] = int(num) if key in ("low", "high", "min", "max") else num
    return fields


# --------------------------------------------------------------------------- workloads


def _concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + l) for each (s, l)."""
    lengths = lengths.astype(np.int64)
    total = int(lengths.sum())
    seg = np.repeat(np.arange(len(starts)), lengths)
    offs = np.cumsum(lengths) - lengths
    return starts.astype(np.int64)[seg] + (np.arange(total, dtype=np.int64) - offs[seg])


def zipf_probabilities(k: int, s: float) -> np.ndarray:
    """Popularity of K items, p_i proportional to 1 / (i + 1)**s (s = 0: uniform)."""
    if k < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {k}")
    if not s >= 0:
        raise ValueError(f"zipf exponent must be >= 0, got {s!r}")
    w = 1.0 / np.arange(1, k + 1, dtype=np.float64) ** float(s)
    return w / w.sum()


_SPEC_KEYS = {
    "name",
    "seed",
    "num_requests",
    "duration_s",
    "arrival",
    "rate",
    "cv",
    "on_s",
    "off_s",
    "rate_off",
    "prompt",
    "output",
    "shared_prefix",
    "sessions",
    "prefix_block_size",
}
_PREFIX_KEYS = {"num_prefixes", "prefix_len", "zipf", "fraction"}
_SESSION_KEYS = {"turns", "think_time_s"}


def generate(spec: dict[str, Any] | None = None, **kwargs: Any) -> Trace:
    """Build a synthetic Trace from a spec dict and/or keyword arguments (keywords win).

    Keys: name ("synthetic"), seed (0), num_requests and/or duration_s; arrival ("poisson" | "gamma" |
    "constant" | "onoff" or a dict with "kind"), rate (1.0 req/s; sessions/s with sessions), cv (gamma),
    on_s / off_s / rate_off (onoff); prompt (512) and output (128): length specs (see sample_lengths);
    shared_prefix: {"num_prefixes": K, "prefix_len": int or length spec, "zipf": s (1.0),
    "fraction": share of requests with a system prompt (1.0)} - `prompt` is then the user part;
    sessions: {"turns": int or length spec, "think_time_s": mean exponential gap between turns (10)} -
    turn n's prompt is turn n-1's prompt + output + `prompt` new tokens, and its prefix_block_ids
    extend turn n-1's; prefix_block_size (tokens per prefix id; default: with a fixed system prompt
    length, the largest power of two <= 512 dividing it, which it must be a multiple of; with a sampled
    one, 64, and sampled lengths are rounded to a multiple; with sessions only, 512).
    Every block of a generated prompt gets an id when prefix ids are used (Mooncake style).
    """
    s = {**(spec or {}), **kwargs}
    unknown = set(s) - _SPEC_KEYS
    if unknown:
        raise ValueError(f"generate: unknown key(s) {sorted(unknown)}; allowed: {sorted(_SPEC_KEYS)}")
    n, duration = s.get("num_requests"), s.get("duration_s")
    if n is None and duration is None:
        raise ValueError("generate: give num_requests and/or duration_s")
    seeds = np.random.SeedSequence(int(s.get("seed", 0))).spawn(6)
    g_arr, g_prompt, g_out, g_prefix, g_turns, g_think = (np.random.default_rng(x) for x in seeds)

    arrival = s.get("arrival", "poisson")
    arrival = {"kind": arrival} if isinstance(arrival, str) else dict(arrival)
    for key in ("rate", "cv", "on_s", "off_s", "rate_off"):
        if key in s:
            arrival[key] = s[key]
    arrival.setdefault("rate", 1.0)

    sp = s.get("shared_prefix")
    sess = s.get("sessions")
    if sp is not None and set(sp) - _PREFIX_KEYS:
        raise ValueError(
            f"shared_prefix: unknown key(s) {sorted(set(sp) - _PREFIX_KEYS)}; allowed: {sorted(_PREFIX_KEYS)}"
        )
    if sess is not None and set(sess) - _SESSION_KEYS:
        raise ValueError(
            f"sessions: unknown key(s) {sorted(set(sess) - _SESSION_KEYS)}; allowed: {sorted(_SESSION_KEYS)}"
        )

    # Units: one per request, or one per session.
    starts = sample_arrivals(arrival, rng=g_arr, n=n, duration_s=duration)
    units = len(starts)

    # System prompts.
    bs = s.get("prefix_block_size")
    sys_len = np.zeros(units, dtype=np.int64)
    sys_start = np.zeros(units, dtype=np.int64)
    next_id = 0
    if sp is not None:
        k = int(sp.get("num_prefixes", 1))
        probs = zipf_probabilities(k, float(sp.get("zipf", 1.0)))
        plen_spec = sp.get("prefix_len", 1024)
        fixed = isinstance(plen_spec, (int, np.integer))
        plen = sample_lengths(plen_spec, k, rng=g_prefix)
        if bs is None:
            bs = math.gcd(512, *map(int, plen)) if fixed else 64
        bs = int(bs)
        if bs < 1:
            raise ValueError(f"prefix_block_size must be >= 1, got {bs}")
        if fixed and (plen % bs).any():
            raise ValueError(
                f"shared_prefix.prefix_len {int(plen[0])} is not a multiple of prefix_block_size {bs}"
            )
        plen = np.maximum(bs, (plen + bs // 2) // bs * bs)  # sampled lengths: nearest multiple of bs
        pblocks = plen // bs
        pbase = np.cumsum(pblocks) - pblocks
        next_id = int(pblocks.sum())
        choice = g_prefix.choice(k, size=units, p=probs)
        fraction = float(sp.get("fraction", 1.0))
        if not 0 <= fraction <= 1:
            raise ValueError(f"shared_prefix.fraction must be in [0, 1], got {fraction}")
        has = g_prefix.random(units) < fraction
        sys_len = np.where(has, plen[choice], 0)
        sys_start = np.where(has, pbase[choice], 0)
    elif sess is not None:
        bs = int(bs or 512)

    # Rows: one per request, or one per session turn.
    if sess is not None:
        turns = sample_lengths(sess.get("turns", 3), units, rng=g_turns, column="output_len")
        think = _positive("sessions.think_time_s", sess.get("think_time_s", 10.0))
        rows = int(turns.sum())
        unit = np.repeat(np.arange(units), turns)
        first = np.cumsum(turns) - turns
        turn = np.arange(rows) - first[unit]
        gaps = np.where(turn > 0, g_think.exponential(think, rows), 0.0)
        arrival_s = starts[unit] + _grouped_cumsum(gaps, first, turns)
    else:
        rows, unit, turn = units, np.arange(units), np.zeros(units, dtype=np.int64)
        arrival_s = starts
    user = sample_lengths(s.get("prompt", 512), rows, rng=g_prompt, column="prompt_len")
    out = sample_lengths(s.get("output", 128), rows, rng=g_out, column="output_len")
    if sess is not None:
        first = np.cumsum(turns) - turns
        hist = _grouped_cumsum(user, first, turns) + _grouped_cumsum(out, first, turns) - out
        prompt = sys_len[unit] + hist
    else:
        prompt = sys_len[unit] + user

    cols: dict[str, Any] = {"arrival_s": arrival_s, "prompt_len": prompt, "output_len": out}
    if sess is not None:
        cols["session_id"] = unit
    if bs is not None:
        sys_blocks = sys_len[unit] // bs
        own = -(-(prompt - sys_len[unit]) // bs)  # blocks after the system prompt
        if sess is not None:
            need = np.zeros(units, dtype=np.int64)
            np.maximum.at(need, unit, own)
            unit_base = next_id + np.cumsum(need) - need
        else:
            unit_base = next_id + np.cumsum(own) - own
        own_start = unit_base[unit] if sess is not None else unit_base
        starts2 = np.stack([sys_start[unit], own_start], axis=1).ravel()
        lens2 = np.stack([sys_blocks, own], axis=1).ravel()
        values = _concat_ranges(starts2, lens2)
        offsets = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(sys_blocks + own, out=offsets[1:])
        cols["prefix_block_ids"] = pd.arrays.ArrowExtensionArray(list_array_from(offsets, values))
    df = pd.DataFrame(cols)
    df["_turn"] = turn
    df = df.sort_values(["arrival_s", "_turn"], kind="stable").drop(columns="_turn")
    if duration is not None:
        df = df[df["arrival_s"].to_numpy() < duration]
    if n is not None:
        df = df.iloc[: int(n)]
    df = df.reset_index(drop=True)
    df.insert(0, "request_id", np.arange(len(df), dtype=np.int64))
    return Trace(df, name=str(s.get("name", "synthetic")), prefix_block_size=bs)


def _grouped_cumsum(x: np.ndarray, first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Cumulative sum of x restarted at each group (groups are contiguous: first index, size)."""
    c = np.cumsum(x)
    before = np.where(first > 0, c[np.maximum(first - 1, 0)], 0)
    return c - np.repeat(before, counts)
