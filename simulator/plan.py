"""Capacity planning over simulation results: cost, SLO objectives, and two searches.

`find_plan` finds the cheapest (GPU, TP, replicas, batch limits, block size) meeting p99 SLOs at a
rate; `find_capacity` finds the highest rate a configuration sustains. Both count a run as feasible by
`failures`: every request served, every objective met, and the offered rate kept up with (a run that
falls behind, `simulator.load`, is infeasible however its percentiles look). Both take an `evaluate`
callable (points -> rows, see sweep.PointRunner.run); prices come from gpus.json, never from code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from simulator.latency.gpus import GpuSpec, get_gpu
from simulator.load import Load, run_load
from simulator.metrics import SLO

Row = dict[str, Any]
Evaluate = Callable[[list[dict[str, Any]]], list[Row]]

# ---- cost ---------------------------------------------------------------------------------------------


def cost_per_hour(gpu: str | GpuSpec, num_gpus: int) -> float:
    """US$ per hour of `num_gpus` GPUs of this type, at the price in simulator/data/gpus.json."""
    if num_gpus < 0:
        raise ValueError(f"num_gpus: must be >= 0, got {num_gpus}")
    return get_gpu(gpu).price_per_hour_usd * num_gpus


def cost_per_million_tokens(gpu: str | GpuSpec, num_gpus: int, tokens_per_s: float) -> float:
    """US$ per million tokens produced at `tokens_per_s`: $/h x GPUs / (tok/s x 3600) x 1e6 (inf at 0)."""
    if tokens_per_s < 0 or math.isnan(tokens_per_s):
        raise ValueError(f"tokens_per_s: must be >= 0, got {tokens_per_s}")
    if tokens_per_s == 0:
        return math.inf
    return cost_per_hour(gpu, num_gpus) / (tokens_per_s * 3600.0) * 1e6


# ---- objectives -----------------------------------------------------------------------------------------

METRICS = ("ttft", "tpot", "e2e")
STATS = ("p99", "p90", "p50", "mean")


@dataclass(frozen=True)
class Objective:
    """One latency objective: `stat` of `metric` (a summary column `{metric}_{stat}_s`) <= limit_s."""

    metric: str
    stat: str
    limit_s: float

    @property
    def key(self) -> str:
        return f"{self.metric}_{self.stat}_s"

    @property
    def name(self) -> str:
        return f"{self.metric}_{self.stat}"

    def __str__(self) -> str:
        return f"{self.name}<={format_seconds(self.limit_s)}"


def parse_objectives(text: str) -> tuple[Objective, ...]:
    """`ttft_p99=2s,tpot_p99=80ms` (a bare `ttft=2s` means p99; stats p99, p90, p50, mean)."""
    out: list[Objective] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise ValueError(f"--slo: {part!r} is not NAME=VALUE (e.g. ttft_p99=2s,tpot_p99=80ms)")
        name, value = (x.strip().lower() for x in part.split("=", 1))
        metric, _, stat = name.partition("_")
        stat = stat or "p99"
        if metric not in METRICS or stat not in STATS:
            raise ValueError(
                f"--slo: unknown objective {name!r}; use {'|'.join(METRICS)} with _{'|_'.join(STATS)} (default p99)"
            )
        limit = getattr(SLO.parse(f"{metric}={value}"), f"{metric}_s")
        if not limit > 0:
            raise ValueError(f"--slo: {part!r} must be a positive time")
        out.append(Objective(metric, stat, float(limit)))
    if not out:
        raise ValueError("--slo: give at least one objective, e.g. ttft_p99=2s")
    return tuple(out)


@dataclass(frozen=True)
class Violation:
    """An objective missed (value > limit), requests not served (objective None), or the offered
    rate not kept up with (`load` set, `Load.falls_behind`; objective None, value offered / served)."""

    objective: Objective | None
    value: float
    unserved: int = 0
    num_requests: int = 0
    load: Load | None = None

    @property
    def ratio(self) -> float:
        """value / limit (offered / served for a run that falls behind; inf for unserved requests)."""
        if self.load is not None:
            return self.value
        return math.inf if self.objective is None else self.value / self.objective.limit_s

    def __str__(self) -> str:
        if self.load is not None:
            return self.load.describe()
        if self.objective is None:
            return f"{self.unserved} of {self.num_requests} requests not served (rejected or cut short)"
        o = self.objective
        excess = (self.ratio - 1.0) * 100.0
        return f"{o.name} {format_seconds(self.value)} > {format_seconds(o.limit_s)} (+{excess:.0f}%)"


def violations(summary: Mapping[str, Any], objectives: Sequence[Objective]) -> list[Violation]:
    """What a run's summary misses. A metric that is NaN (no request has it, e.g. TPOT with one-token
    outputs) is not applicable; requests that did not finish normally always count."""
    out: list[Violation] = []
    n = int(summary.get("num_requests", 0))
    # Not finished (rejected ones included), or finished early for lack of KV cache / context.
    unserved = n - int(summary.get("num_finished", 0)) + int(summary.get("num_truncated", 0))
    if unserved > 0 or n == 0:
        out.append(Violation(None, math.nan, unserved, n))
    for o in objectives:
        value = summary.get(o.key)
        if value is None:
            raise ValueError(f"objective {o.name}: the summary has no {o.key!r}")
        value = float(value)
        if not math.isnan(value) and value > o.limit_s:
            out.append(Violation(o, value))
    return out


def failures(summary: Mapping[str, Any], objectives: Sequence[Objective]) -> list[Violation]:
    """What makes a run infeasible for a plan or a capacity search: its `violations`, then falling
    behind the offered rate over its own arrivals (`simulator.load.run_load`, `Load.falls_behind`,
    the rule the dashboard applies). A run whose queue keeps growing can meet every percentile only
    because the trace ends; it is counted as missing, with what it serves of what it is offered."""
    out = violations(summary, objectives)
    load = run_load(summary)
    if load.falls_behind:
        behind = load.offered_rps / load.served_rps if load.served_rps > 0 else math.inf
        out.append(Violation(None, behind, load=load))
    return out


def describe_violations(vs: Sequence[Violation]) -> str:
    return "; ".join(str(v) for v in vs)


def severity(vs: Sequence[Violation]) -> tuple[int, float]:
    """Order points by how badly they miss: unserved requests first, then the worst ratio (value /
    limit of an objective, offered / served of a run that falls behind)."""
    unserved = sum(v.unserved for v in vs if v.objective is None)
    worst = max((v.ratio for v in vs if v.objective is not None or v.load is not None), default=0.0)
    return unserved, worst


def format_seconds(s: float) -> str:
    if math.isnan(s):
        return "n/a"
    return f"{s:.3g}s" if s >= 1 else f"{s * 1e3:.3g}ms"


def format_usd(x: float) -> str:
    return "inf" if math.isinf(x) else f"${x:,.2f}"


# ---- latency provenance ----------------------------------------------------------------------------------


def row_latency(row: Mapping[str, Any] | None) -> str:
    """The latency model behind a result row: 'fitted <profile file>' or 'roofline' ('?' unknown)."""
    from simulator.run import latency_label

    row = row or {}
    profile = row.get("profile")
    return latency_label(_latency_kind(row), profile if isinstance(profile, str) else None)


def row_trust(row: Mapping[str, Any] | None) -> str:
    """How far a fitted row extrapolates: '; 29.6% of steps outside the fit' ('' when none is, or
    the share is unknown)."""
    share = (row or {}).get("steps_outside_fit_share")
    if not isinstance(share, (int, float)) or math.isnan(share) or share <= 0:
        return ""
    return f"; {share:.1%} of steps outside the fit"


def _latency_kind(row: Mapping[str, Any] | None) -> str | None:
    """A row's `latency_model`, None where it has none (an error row; NaN once read from Parquet)."""
    kind = (row or {}).get("latency_model")
    return kind if isinstance(kind, str) and kind else None


def describe_latency(rows: Sequence[Mapping[str, Any] | None]) -> str:
    """The latency models behind `rows`, most used first: 'fitted a.json (3 rows), roofline (2 rows)'."""
    counts: dict[str, int] = {}
    for row in rows:
        if _latency_kind(row):
            label = row_latency(row)
            counts[label] = counts.get(label, 0) + 1
    if not counts:
        return "none simulated"
    if len(counts) == 1:
        return next(iter(counts))
    order = sorted(counts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{label} ({n} rows)" for label, n in order)


def mixed_latency_warning(rows: Sequence[Mapping[str, Any] | None]) -> str | None:
    """A warning when `rows` come from different kinds of latency model (fitted and roofline), whose
    differences then come partly from the models; None when they share one kind."""
    kinds = {_latency_kind(row) for row in rows} - {None}
    if len(kinds) <= 1:
        return None
    return (
        f"warning: these results come from different latency models ({describe_latency(rows)}); "
        "part of their differences comes from the models, not the configurations"
    )


def option_latency(
    options: Sequence[Option], profile: str, model: str, async_scheduling: bool = False
) -> dict[Option, str]:
    """The latency model each option would be simulated with, before any run: 'fitted <file>' where
    `profile` ('auto', 'roofline' or a file) gives a fitted profile for its GPU, TP and block size,
    'transferred <file>' where it gives the transferred model's coefficients, else 'roofline'."""
    from simulator.latency.transfer import is_transfer_file
    from simulator.run import latency_label
    from simulator.sweep import profile_for

    out: dict[Option, str] = {}
    for opt in options:
        path = profile_for(profile, model, opt.gpu, opt.block_size, opt.tp, async_scheduling)
        if path is None:
            out[opt] = "roofline"
        else:
            out[opt] = latency_label("transferred" if is_transfer_file(path) else "fitted", path.name)
    return out


def like_with_like(
    options: Sequence[Option],
    profile: str,
    model: str,
    async_scheduling: bool = False,
    mix: bool = False,
) -> tuple[str, str | None]:
    """The profile choice a plan over `options` runs with, and a line to show (None: nothing to say).

    When some options would be fitted and others not, the plan compares like with like: every
    option on the model that covers them all (the transferred model where the others would take it,
    `simulator.defaults.TRANSFER_MODEL`; else the roofline), and the line says which options lost
    their fitted profile. With `mix`, each option keeps its own model and the line warns of the mix.
    """
    from simulator.defaults import TRANSFER_MODEL

    labels = option_latency(options, profile, model, async_scheduling)
    fitted = [opt for opt, label in labels.items() if label.startswith("fitted")]
    if not fitted or len(fitted) == len(labels):
        return profile, None
    common = "roofline" if "roofline" in labels.values() else "transferred"
    common_name = "the roofline" if common == "roofline" else "the transferred model"
    names = "; ".join(f"{opt} ({labels[opt]})" for opt in fitted[:4])
    names += f"; and {len(fitted) - 4} more" if len(fitted) > 4 else ""
    if mix:
        return profile, (
            f"warning: {len(fitted)} of {len(labels)} options are simulated on fitted profiles and the "
            f"others on {common_name} ({names}); part of their differences comes from the models"
        )
    return ("roofline" if common == "roofline" else str(TRANSFER_MODEL)), (
        f"note: only {len(fitted)} of {len(labels)} options have a fitted profile ({names}); every "
        f"option is simulated on {common_name} to compare like with like (--mix-latency-models keeps "
        "the fitted profiles where there are any)"
    )


# ---- plan: cheapest configuration meeting the SLOs at a rate -------------------------------------------------


@dataclass(frozen=True)
class Option:
    """A family of configurations that differ only in the number of replicas."""

    gpu: str
    tp: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def unit_cost(self) -> float:
        """$/h of one replica."""
        return cost_per_hour(self.gpu, self.tp)

    def point(self, replicas: int, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return {
            **(base or {}),
            "gpu": self.gpu,
            "tp": self.tp,
            "block_size": self.block_size,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "replicas": replicas,
        }

    def __str__(self) -> str:
        return (
            f"{get_gpu(self.gpu).name} tp={self.tp} block={self.block_size} "
            f"seqs={self.max_num_seqs} batched_tokens={self.max_num_batched_tokens}"
        )


@dataclass
class Candidate:
    """The outcome of one option's replica search.

    status: "best", "feasible" (meets the SLOs and keeps up with the rate, costs more), "infeasible"
    (fails, see `failures`, at the most replicas the GPU budget allows), "pruned" (cannot be cheaper
    than the best: it fails at every replica count that would be), "invalid" (the configuration
    cannot run). `row` holds the metrics at `replicas`.
    """

    option: Option
    status: str = "invalid"
    replicas: int | None = None
    row: Row | None = None
    failed: list[Violation] = field(default_factory=list)
    reason: str = ""
    fails_at: int = 0  # most replicas known to fail (0: none); below replicas - 1 the count is an upper bound

    @property
    def num_gpus(self) -> int | None:
        return None if self.replicas is None else self.replicas * self.option.tp

    @property
    def cost_per_hour(self) -> float | None:
        return None if self.replicas is None else self.option.unit_cost * self.replicas


class _ReplicaSearch:
    """Fewest replicas meeting the SLOs, assuming more replicas never hurt: gallop 1, 2, 4, ... to a
    feasible count, then bisect between the largest failing and the smallest passing count."""

    def __init__(self, option: Option, cap: int) -> None:
        self.option = option
        self.cap = cap  # most replicas the GPU budget allows
        self.lo = 0  # largest count known to fail
        self.hi: int | None = None  # smallest count known to pass
        self.rows: dict[int, tuple[Row, list[Violation]]] = {}
        self.error: str | None = None

    def next(self, limit: int) -> int | None:
        """The next count to try, below `limit` (what could still beat the best), or None when done."""
        if self.error is not None:
            return None
        if self.hi is not None and self.hi - self.lo <= 1:
            return None
        if self.lo >= limit:
            return None
        if self.hi is None:
            return min(max(1, 2 * self.lo), limit)
        return min((self.lo + self.hi) // 2, limit)

    def update(self, replicas: int, row: Row, failed: list[Violation]) -> None:
        self.rows[replicas] = (row, failed)
        if failed:
            self.lo = max(self.lo, replicas)
        else:
            self.hi = replicas if self.hi is None else min(self.hi, replicas)


@dataclass
class PlanResult:
    rate: float
    objectives: tuple[Objective, ...]
    max_gpus: int
    candidates: list[Candidate]  # best first, then feasible by cost, then the others
    num_simulations: int
    closest: Candidate | None = None  # when nothing is feasible: the point that missed least

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates and self.candidates[0].status == "best" else None


def plan_options(
    gpus: Sequence[str],
    tps: Sequence[int],
    block_sizes: Sequence[int],
    max_num_seqs: Sequence[int],
    max_num_batched_tokens: Sequence[int],
) -> list[Option]:
    return [
        Option(get_gpu(g).name, tp, bs, mns, mnbt)
        for g in gpus
        for tp in tps
        for bs in block_sizes
        for mns in max_num_seqs
        for mnbt in max_num_batched_tokens
    ]


def find_plan(
    evaluate: Evaluate,
    options: Sequence[Option],
    objectives: Sequence[Objective],
    max_gpus: int,
    rate: float = math.nan,
    base_point: Mapping[str, Any] | None = None,
    wave_size: int | None = None,
    prune: bool = True,
) -> PlanResult:
    """The cheapest option x replicas meeting `objectives` and keeping up with the offered rate
    (`failures`), with the others ranked and explained.

    Searches all options together in waves: each live option proposes its next replica count, and
    the `wave_size` cheapest proposals (all when None) go to `evaluate` at once, to run in parallel.
    With `prune`, the cheapest feasible cost found so far caps every option's replica count, so
    options that cannot beat it stop early (small waves prune most); without, every option's fewest
    replicas is found exactly.
    """
    if wave_size is not None and wave_size <= 0:
        raise ValueError(f"wave_size: must be a positive integer, got {wave_size}")
    if max_gpus <= 0:
        raise ValueError(f"max_gpus: must be a positive integer, got {max_gpus}")
    objectives = tuple(objectives)
    searches: list[_ReplicaSearch] = []
    cands: dict[Option, Candidate] = {}
    for opt in dict.fromkeys(options):
        cands[opt] = Candidate(opt)
        if opt.tp > max_gpus:
            cands[opt].reason = f"tp={opt.tp} needs more GPUs than max_gpus={max_gpus}"
            continue
        searches.append(_ReplicaSearch(opt, max_gpus // opt.tp))
    best_cost = math.inf
    num_sims = 0
    while True:
        proposals: list[tuple[float, int, _ReplicaSearch, int]] = []
        for i, s in enumerate(searches):
            limit = s.cap
            if prune and math.isfinite(best_cost) and s.option.unit_cost > 0:
                limit = min(limit, math.floor(best_cost / s.option.unit_cost + 1e-9))
            r = s.next(limit)
            if r is not None:
                proposals.append((s.option.unit_cost * r, i, s, r))
        if not proposals:
            break
        proposals.sort(key=lambda p: p[:2])
        wave = [(s, r) for _, _, s, r in proposals[:wave_size]]
        rows = evaluate([s.option.point(r, base_point) for s, r in wave])
        num_sims += len(wave)
        for (s, r), row in zip(wave, rows):
            if row.get("error") is not None:
                s.error = str(row["error"])
                continue
            failed = failures(row, objectives)
            s.update(r, row, failed)
            if not failed:
                best_cost = min(best_cost, s.option.unit_cost * r)
    for s in searches:
        _conclude(s, cands[s.option])
    return _rank(list(cands.values()), objectives, max_gpus, rate, num_sims, searches)


def _conclude(s: _ReplicaSearch, c: Candidate) -> None:
    if s.error is not None:
        c.status, c.reason = "invalid", s.error
        return
    if s.hi is not None:
        c.status, c.replicas = "feasible", s.hi
        c.row, c.failed = s.rows[s.hi]
        c.fails_at = s.lo
        return
    if s.lo == 0:  # never tried: even one replica costs more than the best
        c.status = "pruned"
        c.reason = f"one replica costs {format_usd(s.option.unit_cost)}/h, more than the best"
        return
    c.replicas = s.lo
    c.row, c.failed = s.rows[s.lo]
    c.status = "infeasible" if s.lo >= s.cap else "pruned"


def _rank(
    cands: list[Candidate],
    objectives: tuple[Objective, ...],
    max_gpus: int,
    rate: float,
    num_sims: int,
    searches: list[_ReplicaSearch],
) -> PlanResult:
    def headroom(c: Candidate) -> float:
        return max(
            (float(c.row[o.key]) / o.limit_s for o in objectives if c.row and not _nan(c.row[o.key])),
            default=0,
        )

    feasible = sorted(
        (c for c in cands if c.status == "feasible"), key=lambda c: (c.cost_per_hour, c.num_gpus, headroom(c))
    )
    others = [c for c in cands if c.status != "feasible"]
    order = {"infeasible": 0, "pruned": 1, "invalid": 2}
    others.sort(key=lambda c: (order[c.status], severity(c.failed) if c.failed else (0, 0.0)))
    closest = None
    if feasible:
        best = feasible[0]
        best.status, best.reason = "best", "cheapest configuration meeting every objective and keeping up"
        for c in feasible[1:]:
            extra = c.cost_per_hour - best.cost_per_hour
            if extra > 1e-9:
                c.reason = f"costs {format_usd(extra)}/h more (+{extra / best.cost_per_hour * 100:.0f}%)"
                if c.replicas - c.fails_at > 1:  # the search stopped once no count in between could win
                    c.reason += (
                        f"; fails with {_n_replicas(c.fails_at)}, fewer than {c.replicas} not resolved"
                    )
            else:
                c.reason = "same cost as the best, with less latency headroom or more GPUs"
    else:
        tried = [
            (severity(failed), s.option, r, row, failed)
            for s in searches
            for r, (row, failed) in s.rows.items()
        ]
        if tried:
            _, opt, r, row, failed = min(tried, key=lambda t: (t[0], -t[2]))
            closest = Candidate(opt, "infeasible", r, row, failed)
    for c in others:
        if c.status == "infeasible":
            c.reason = (
                f"fails with {_n_replicas(c.replicas)}, the most max_gpus={max_gpus} allows: "
                + describe_violations(c.failed)
            )
        elif c.status == "pruned" and c.replicas is not None:
            more = c.option.unit_cost * (c.replicas + 1)
            c.reason = (
                f"fails with {_n_replicas(c.replicas)} ({describe_violations(c.failed)}); "
                f"{c.replicas + 1} would cost {format_usd(more)}/h, not cheaper than the best"
            )
    return PlanResult(rate, objectives, max_gpus, feasible + others, num_sims, closest)


def _n_replicas(n: int) -> str:
    return f"{n} replica" if n == 1 else f"{n} replicas"


def _nan(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def format_plan(
    result: PlanResult, trace_label: str = "", model: str = "", max_alternatives: int | None = None
) -> str:
    """The plan as text: the best configuration, then each alternative and why it lost."""
    objs = ", ".join(str(o) for o in result.objectives)
    what = " ".join(x for x in (model, "serving", trace_label) if x)
    lines = [f"Plan: {what} at {result.rate:.3g} req/s; SLO {objs}; at most {result.max_gpus} GPUs"]
    lines.append(f"Latency: {describe_latency([c.row for c in result.candidates if c.row])}")
    best = result.best
    if best is not None:
        lines.append(
            f"Best: {best.replicas} x ({best.option}) = {best.num_gpus} GPUs, {format_usd(best.cost_per_hour)}/h"
            f" [{row_latency(best.row)}{row_trust(best.row)}]"
        )
        lines.append("  " + _metrics_line(best, result.objectives))
    else:
        lines.append(
            f"Infeasible: no configuration meets the SLOs and keeps up with the rate within {result.max_gpus} GPUs."
        )
        if result.closest is not None:
            c = result.closest
            lines.append(
                f"  closest: {c.replicas} x ({c.option}), {format_usd(c.cost_per_hour)}/h "
                f"[{row_latency(c.row)}{row_trust(c.row)}]: {describe_violations(c.failed)}"
            )
    rest = [c for c in result.candidates if c is not best]
    shown = rest if max_alternatives is None else rest[:max_alternatives]
    if rest:
        lines.append("Alternatives:")
        for c in shown:
            size = f"{c.replicas} x " if c.replicas else ""
            cost = f" {format_usd(c.cost_per_hour)}/h" if c.cost_per_hour is not None else ""
            latency = f" [{row_latency(c.row)}{row_trust(c.row)}]" if c.row else ""
            lines.append(f"  [{c.status}] {size}({c.option}){cost}{latency}: {c.reason}")
        if len(shown) < len(rest):
            lines.append(f"  ... and {len(rest) - len(shown)} more")
    lines.append(f"({result.num_simulations} simulations)")
    return "\n".join(lines)


def _metrics_line(c: Candidate, objectives: Sequence[Objective]) -> str:
    row = c.row or {}
    parts = [
        f"{o.name} {format_seconds(float(row.get(o.key, math.nan)))} (<= {format_seconds(o.limit_s)})"
        for o in objectives
    ]
    tok_s = float(row.get("output_tok_s", 0.0))
    if tok_s > 0:
        parts.append(
            f"{format_usd(cost_per_million_tokens(c.option.gpu, c.num_gpus or 0, tok_s))} per M output tokens"
        )
    parts.extend(_load_part(row))
    return ", ".join(parts)


def _load_part(row: Mapping[str, Any]) -> list[str]:
    """['keeps up: serves 10.1 of 10.1 req/s offered'] of a run's row ([] with too few requests)."""
    load = run_load(row)
    return [load.describe()] if load.keeps_up or load.falls_behind else []


# ---- capacity: the highest rate a configuration sustains --------------------------------------------------


@dataclass
class ScaleSearch:
    """A bracket [lo, hi] of the rate scale: lo passes, hi fails (None where never found)."""

    lo: float | None
    hi: float | None
    evaluations: list[tuple[float, bool]]

    @property
    def converged(self) -> bool:
        return self.lo is not None and self.hi is not None


def search_max_scale(
    feasible: Callable[[list[float]], list[bool]],
    start: float = 1.0,
    tolerance: float = 0.05,
    parallel: int = 1,
    min_scale: float = 1.0 / 1024,
    max_scale: float = 1024.0,
    growth: float = 2.0,
) -> ScaleSearch:
    """Largest scale x with feasible(x), assuming feasibility only falls as x grows.

    Gallops from `start` by `growth` (up while passing, down while failing) to a bracket, then splits
    it geometrically until hi / lo <= 1 + tolerance. Each round asks `feasible` for `parallel` scales at
    once (k-ary search: a round of p probes shrinks the bracket p + 1 times).
    """
    if not tolerance > 0:
        raise ValueError(f"tolerance: must be > 0, got {tolerance}")
    if not 0 < min_scale <= start <= max_scale:
        raise ValueError(f"start: must be within [{min_scale}, {max_scale}], got {start}")
    p = max(1, int(parallel))
    lo: float | None = None
    hi: float | None = None
    evals: list[tuple[float, bool]] = []

    def probe(xs: list[float]) -> None:
        nonlocal lo, hi
        oks = feasible(xs)
        evals.extend(zip(xs, oks))
        for x, ok in zip(xs, oks):
            if ok:
                lo = x if lo is None else max(lo, x)
            else:
                hi = x if hi is None else min(hi, x)
        if lo is not None and hi is not None and lo >= hi:  # not monotone: stay below the lowest failure
            passing = [x for x, ok in evals if ok and x < hi]
            lo = max(passing) if passing else None

    probe(sorted({min(start * growth**i, max_scale) for i in range(p)}))
    while lo is None or hi is None:
        if lo is None:  # everything failed: go down
            base = min(x for x, _ in evals)
            if base <= min_scale:
                break
            probe(sorted({max(base / growth ** (i + 1), min_scale) for i in range(p)}))
        else:  # everything passed: go up
            base = max(x for x, _ in evals)
            if base >= max_scale:
                break
            probe(sorted({min(base * growth ** (i + 1), max_scale) for i in range(p)}))
    while lo is not None and hi is not None and hi / lo > 1 + tolerance:
        ratio = hi / lo
        probe([lo * ratio ** ((i + 1) / (p + 1)) for i in range(p)])
    return ScaleSearch(lo, hi, evals)


@dataclass
class CapacityResult:
    base_rate: float  # the trace's own average rate (req/s)
    objectives: tuple[Objective, ...]
    search: ScaleSearch
    row: Row | None  # metrics at the highest passing scale
    fail_row: Row | None  # metrics at the lowest failing scale
    gpu: str
    num_gpus: int

    @property
    def max_scale(self) -> float | None:
        return self.search.lo

    @property
    def max_rate(self) -> float | None:
        return None if self.search.lo is None else self.base_rate * self.search.lo

    @property
    def cost_per_hour(self) -> float:
        return cost_per_hour(self.gpu, self.num_gpus)

    @property
    def cost_per_million_output_tokens(self) -> float | None:
        if self.row is None:
            return None
        return cost_per_million_tokens(self.gpu, self.num_gpus, float(self.row["output_tok_s"]))


def find_capacity(
    evaluate: Evaluate,
    point: Mapping[str, Any],
    objectives: Sequence[Objective],
    base_rate: float,
    tolerance: float = 0.05,
    parallel: int = 1,
    min_scale: float = 1.0 / 1024,
    max_scale: float = 1024.0,
) -> CapacityResult:
    """The highest rate scale at which `point` meets `objectives` and keeps up with the rate
    (`failures`; see `search_max_scale`)."""
    objectives = tuple(objectives)
    rows: dict[float, Row] = {}

    def feasible(xs: list[float]) -> list[bool]:
        got = evaluate([{**point, "rate_scale": x} for x in xs])
        out = []
        for x, row in zip(xs, got):
            if row.get("error") is not None:
                raise ValueError(f"the configuration cannot run: {row['error']}")
            rows[x] = row
            out.append(not failures(row, objectives))
        return out

    search = search_max_scale(feasible, 1.0, tolerance, parallel, min_scale, max_scale)
    gpu = str(point.get("gpu", "H200"))
    num_gpus = int(point.get("tp", 1)) * int(point.get("replicas", 1))
    return CapacityResult(
        base_rate,
        objectives,
        search,
        rows.get(search.lo) if search.lo is not None else None,
        rows.get(search.hi) if search.hi is not None else None,
        get_gpu(gpu).name,
        num_gpus,
    )


def format_capacity(result: CapacityResult, what: str = "") -> str:
    objs = ", ".join(str(o) for o in result.objectives)
    s = result.search
    lines = [f"Capacity{' of ' + what if what else ''} under {objs}"]
    lines.append(
        f"  latency: {describe_latency([r for r in (result.row, result.fail_row) if r])}{row_trust(result.row)}"
    )
    lines.append(f"  trace native rate {result.base_rate:.3g} req/s; {len(s.evaluations)} simulations")
    if s.lo is None:
        fail = failures(result.fail_row or {}, result.objectives) if result.fail_row else []
        lines.append(f"  fails even at {s.hi:.4g}x the trace rate: {describe_violations(fail)}")
        return "\n".join(lines)
    if s.hi is None:
        lines.append(
            f"  meets the SLOs and keeps up at every rate tried, up to {s.lo:.4g}x ({result.max_rate:.4g} req/s)"
        )
    else:
        lines.append(
            f"  max sustainable rate: {result.max_rate:.4g} req/s ({s.lo:.4g}x the trace; fails at {s.hi:.4g}x "
            f"= {result.base_rate * s.hi:.4g} req/s)"
        )
    row = result.row or {}
    parts = [f"{o.name} {format_seconds(float(row.get(o.key, math.nan)))}" for o in result.objectives]
    parts.extend(_load_part(row))
    lines.append(f"  at that rate: {', '.join(parts)}; output {float(row.get('output_tok_s', 0)):.4g} tok/s")
    if result.fail_row is not None:
        lines.append(f"  above it: {describe_violations(failures(result.fail_row, result.objectives))}")
    lines.append(
        f"  cost: {result.num_gpus} x {result.gpu} = {format_usd(result.cost_per_hour)}/h, "
        f"{format_usd(result.cost_per_million_output_tokens or math.inf)} per million output tokens"
    )
    return "\n".join(lines)


# ---- the band: each answer again under the latency model's own error ------------------------------------
# A band's runs take every step time x (1 - e) (optimistic, "low") and x (1 + e) (pessimistic, "high"),
# e the fitted profile's held-back p90 relative error (simulator/band.py). What is affordable: a plan
# runs the best configuration at both ends and, optimistic, the cheaper configurations its search saw
# fail (up to `max_checks`, the costliest first: those nearest the best); a capacity search repeats
# its rate search at each end, starting from the point's answer.


@dataclass
class PlanBand:
    """The best configuration at both ends of the band, and the cheaper configurations that fail on
    the point run but meet every objective on the optimistic one (the choice is inside the band)."""

    low: Row | None = None  # the best (or, with none, the closest) on the optimistic run
    high: Row | None = None  # the best on the pessimistic run
    high_failed: list[Violation] = field(default_factory=list)
    checked: list[tuple[Option, int]] = field(default_factory=list)  # cheaper failures run optimistic
    inside: list[tuple[Option, int, Row]] = field(default_factory=list)  # those that then pass
    closest_passes: bool = False  # with no best: the closest meets every objective optimistic
    note: str = ""  # why there is no band, or what part of it could not run


def cheaper_failures(result: PlanResult, max_checks: int = 8) -> list[tuple[Option, int]]:
    """(option, replicas) that the plan's search saw fail at a cost below the best's, the costliest
    first, at most `max_checks`: each option's largest failing count (the best's own included)."""
    best = result.best
    if best is None or best.cost_per_hour is None:
        return []
    out: list[tuple[Option, int]] = []
    for c in result.candidates:
        if c.status in ("best", "feasible"):
            k = c.fails_at
        elif c.status in ("infeasible", "pruned") and c.failed and c.replicas:
            k = c.replicas
        else:
            k = 0
        if k and c.option.unit_cost * k < best.cost_per_hour - 1e-9:
            out.append((c.option, k))
    out.sort(key=lambda p: (-p[0].unit_cost * p[1], str(p[0])))
    return out[:max_checks]


def plan_band(
    result: PlanResult,
    evaluate_low: Evaluate,
    evaluate_high: Evaluate,
    base_point: Mapping[str, Any] | None = None,
    max_checks: int = 8,
) -> PlanBand:
    """The band of a plan (see the section's comment): the best at both ends, cheaper failures (or,
    with no best, the closest configuration) on the optimistic run."""
    band = PlanBand()
    best, objectives = result.best, result.objectives
    head = best if best is not None else result.closest
    if head is None or head.replicas is None:
        band.note = "nothing to bracket: no configuration ran"
        return band
    band.checked = cheaper_failures(result, max_checks) if best is not None else []
    points = [head.option.point(head.replicas, base_point)] + [
        opt.point(k, base_point) for opt, k in band.checked
    ]
    low_rows = evaluate_low(points)
    errors = [str(r["error"]) for r in low_rows if r.get("error") is not None]
    if low_rows[0].get("error") is None:
        band.low = low_rows[0]
    if best is None:
        band.closest_passes = band.low is not None and not failures(band.low, objectives)
    else:
        high_row = evaluate_high(points[:1])[0]
        if high_row.get("error") is None:
            band.high, band.high_failed = high_row, failures(high_row, objectives)
        else:
            errors.append(str(high_row["error"]))
        for (opt, k), row in zip(band.checked, low_rows[1:]):
            if row.get("error") is None and not failures(row, objectives):
                band.inside.append((opt, k, row))
    if errors:
        band.note = "; ".join(dict.fromkeys(errors))
    return band


def _scale_text(row: Mapping[str, Any] | None) -> str:
    """'steps x0.897 decode, x0.820 prefill' of a band run's row ('' without factors)."""
    row = row or {}
    d, p = row.get("step_time_scale_decode"), row.get("step_time_scale_prefill")
    if not isinstance(d, (int, float)) or not isinstance(p, (int, float)):
        return ""
    return f"steps x{d:.3f} decode, x{p:.3f} prefill"


def format_plan_band(band: PlanBand, result: PlanResult) -> str:
    """The plan's band as text lines under the plan."""
    objectives = result.objectives
    best = result.best
    lines = [
        "Band (every step time x (1 -/+ e), e the held-back p90 relative errors of the option's fitted "
        "profile or the leave-one-out p90 of the transferred model, decode and prefill apart):"
    ]
    if band.low is None and band.high is None:
        lines.append(f"  none: {band.note or 'not run'}")
        return "\n".join(lines)

    def values(row: Row) -> str:
        return ", ".join(f"{o.name} {format_seconds(float(row.get(o.key, math.nan)))}" for o in objectives)

    if best is None:
        if band.low is not None:
            c = result.closest
            verdict = "meets every objective" if band.closest_passes else "still misses"
            lines.append(
                f"  the closest, {c.replicas} x ({c.option}), on the optimistic run ({_scale_text(band.low)}): "
                f"{values(band.low)}; {verdict}"
            )
    else:
        if band.low is not None:
            lines.append(f"  best, optimistic ({_scale_text(band.low)}): {values(band.low)}")
        if band.high is not None:
            verdict = (
                "misses " + describe_violations(band.high_failed)
                if band.high_failed
                else "meets every objective"
            )
            lines.append(f"  best, pessimistic ({_scale_text(band.high)}): {values(band.high)}; {verdict}")
        for opt, k, row in band.inside:
            cost = opt.unit_cost * k
            lines.append(
                f"  note: {k} x ({opt}) at {format_usd(cost)}/h, cheaper than the best, fails on the point "
                f"run but meets every objective on the optimistic one ({values(row)}): the choice between "
                "them is inside the latency model's error band"
            )
        if band.checked and not band.inside:
            lines.append(
                f"  the {len(band.checked)} cheaper configuration(s) that failed still fail on the optimistic run"
            )
    if band.note:
        lines.append(f"  ({band.note})")
    return "\n".join(lines)


@dataclass
class CapacityBand:
    """A capacity search repeated at each end of the band: `high` with every step (1 + e) times as
    long (the pessimistic rate), `low` with (1 - e) (the optimistic rate); None where not run."""

    low: ScaleSearch | None = None
    high: ScaleSearch | None = None
    num_simulations: int = 0
    factors: dict[str, str] = field(default_factory=dict)  # side -> 'steps x.. decode, x.. prefill'
    note: str = ""

    def rate_range(self, result: CapacityResult) -> tuple[float | None, float | None]:
        """(lowest, highest) max sustainable rate over the point and both ends: the hull, as the
        band of a simulation (None: that end fails at every rate tried)."""
        scales = [s.lo for s in (self.high, self.low) if s is not None] + [result.search.lo]
        known = [x for x in scales if x is not None]
        low = None if any(x is None for x in scales) or not known else min(known)
        high = max(known) if known else None
        return (
            None if low is None else result.base_rate * low,
            None if high is None else result.base_rate * high,
        )


def capacity_band(
    result: CapacityResult,
    evaluate_low: Evaluate,
    evaluate_high: Evaluate,
    point: Mapping[str, Any],
    tolerance: float = 0.05,
    parallel: int = 1,
    min_scale: float = 1.0 / 1024,
    max_scale: float = 1024.0,
    growth: float = 1.25,
) -> CapacityBand:
    """The band of a capacity search: the same search at each end, from the point's answer (its
    highest passing scale, else its lowest failing one) by steps of `growth`."""
    band = CapacityBand()
    start = result.search.lo if result.search.lo is not None else result.search.hi
    if start is None:
        band.note = "nothing to bracket: the search ran no simulation"
        return band
    start = min(max(start, min_scale), max_scale)
    objectives = result.objectives
    for side, evaluate in (("high", evaluate_high), ("low", evaluate_low)):

        def feasible(xs: list[float], evaluate: Evaluate = evaluate, side: str = side) -> list[bool]:
            rows = evaluate([{**point, "rate_scale": x} for x in xs])
            band.num_simulations += len(xs)
            for row in rows:
                if row.get("error") is not None:
                    raise ValueError(str(row["error"]))
                band.factors.setdefault(side, _scale_text(row))
            return [not failures(row, objectives) for row in rows]

        try:
            search = search_max_scale(feasible, start, tolerance, parallel, min_scale, max_scale, growth)
        except ValueError as e:
            band.note = str(e)
            return band
        setattr(band, side, search)
    return band


def format_capacity_band(band: CapacityBand, result: CapacityResult) -> str:
    """The capacity's band: its rate range, and the rate at each end."""
    if band.low is None or band.high is None:
        return f"  band: none ({band.note or 'not run'})"
    lo, hi = band.rate_range(result)
    if lo is None:  # the pessimistic end fails at every rate tried
        bottom = f"below {result.base_rate * (band.high.hi or 0.0):.4g}"
    else:
        bottom = f"{lo:.4g}"
    top = "?" if hi is None else f"{hi:.4g}"
    ends = []
    for side, what in (("high", "pessimistic"), ("low", "optimistic")):
        search = getattr(band, side)
        rate = (
            "fails at every rate tried" if search.lo is None else f"{result.base_rate * search.lo:.4g} req/s"
        )
        if search.lo is not None and search.hi is None:
            rate = f"meets the SLOs up to {result.base_rate * search.lo:.4g} req/s, the most tried"
        ends.append(f"{what} ({band.factors.get(side, '')}) {rate}")
    return (
        f"  band: max sustainable rate {bottom} to {top} req/s (every step time x (1 -/+ e), e the "
        f"held-back p90 relative errors of a fitted profile, the leave-one-out p90 of the transferred "
        f"model): {'; '.join(ends)}; {band.num_simulations} more simulations"
    )
