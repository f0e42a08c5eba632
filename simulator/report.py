"""Plain-text tables of simulation summaries for the terminal.

Formatting only: numbers come from `simulator.metrics.summarize`.
"""

from __future__ import annotations

import math

_LATENCY_ROWS = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e"), ("queue", "queue"))


def _ms(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value * 1000:,.1f}"


def _kv_blocks(s: dict) -> str:
    """'72,146 KV blocks/replica (GPU memory)': the count and where it came from."""
    blocks = s.get("num_kv_blocks_per_replica")
    text = f"{blocks:,} KV blocks/replica" if isinstance(blocks, int) else "? KV blocks/replica"
    source = {"gpu_memory": "GPU memory", "config": "--num-kv-blocks"}.get(s.get("kv_blocks_source") or "")
    return f"{text} ({source})" if source else text


def _latency(s: dict) -> str:
    """The latency model and profile behind the numbers, and the profile's own calibration cache."""
    kind = s.get("latency_model") or "?"
    if not s.get("profile"):
        return kind
    text = f"{kind} {'model' if kind == 'transferred' else 'profile'} {s['profile']}"
    calibrated, graphs = s.get("profile_num_kv_blocks"), s.get("profile_step_graphs")
    notes = [f"calibrated on a cache of {calibrated:,} KV blocks"] if calibrated else []
    if graphs is not None:  # the engine's default since whole-step graphs: say when a profile predates them
        notes.append(
            "whole-step graphs" if graphs else "piecewise graphs: the engine's default is whole-step graphs"
        )
    return f"{text} ({', '.join(notes)})" if notes else text


def _extrapolation(s: dict) -> str:
    """How many steps the fitted profile priced outside the ranges of its step records."""
    outside = s.get("steps_outside_fit")
    if outside is None:
        return (
            "not checked ("
            + {"roofline": "roofline", "transferred": "transferred model"}.get(
                s.get("latency_model"), "no fit ranges"
            )
            + ")"
        )
    text = f"{outside:,} of {s['sim_steps']:,} steps ({s.get('steps_outside_fit_share') or 0.0:.1%}) outside the fit's ranges"
    if outside:
        text += (
            f" (decode {s['decode_steps_outside_fit']:,}, prefill/mixed {s['prefill_steps_outside_fit']:,})"
        )
    return text + f"; {s['fit_ranges']}"


def format_counts(s: dict) -> str:
    """Finished requests (truncated ones among them) and, apart, those rejected at arrival, by reason."""
    text = f"{s['num_finished']:,} of {s['num_requests']:,} ({s['num_truncated']:,} of them truncated)"
    text += f"; rejected {s['num_rejected']:,}"
    reasons = [
        (s.get("num_rejected_prompt_too_long", 0), "prompts longer than max_model_len"),
        (s.get("num_rejected_kv_capacity", 0), "prompts larger than the whole KV cache"),
    ]
    parts = [f"{n:,} {what if n > 1 else what.replace('prompts', 'prompt', 1)}" for n, what in reasons if n]
    if parts:
        text += f" ({', '.join(parts)})"
    return text


def _band_line(s: dict) -> str | None:
    """What the summary's band is: the runs behind it and the error that scaled them (None: the
    summary has no band entry)."""
    if "band" not in s:
        return None
    band = s["band"]
    if band is None:
        return f"band: {s.get('band_note') or 'none'}"
    e = band["errors"]
    return (
        f"band: [low, high] of each figure over this run and two with every step time x (1 -/+ e), "
        f"e = decode {e['decode']:.1%}, prefill/mixed {e['prefill']:.1%} ({e['source']}); "
        f"the two ran {band.get('sim_wall_s', 0.0):.2f} s of simulation (in processes beside this one where "
        "the machine has two cores or more)"
    )


def _load_line(s: dict) -> list[str]:
    """Offered against served request rate and the verdict (`simulator.load`), where it applies."""
    from simulator.load import NO_LOAD, load_verdict

    load = load_verdict(s, float(s.get("arrival_span_s", 0.0)))
    if load.verdict == NO_LOAD:
        return []
    return [
        f"load             offered {load.offered_rps:,.2f} req/s, served {load.served_rps:,.2f} req/s ({load.verdict})"
    ]


def _range(s: dict, key: str, fmt) -> str:
    """' [low, high]' of a summary entry's band, '' without one."""
    band = s.get("band")
    pair = (band or {}).get("ranges", {}).get(key)
    if pair is None:
        return ""
    return f" [{fmt(pair[0])}, {fmt(pair[1])}]"


def format_summary(s: dict) -> str:
    cfg = s.get("config", {})
    band = s.get("band") or None
    width = 20 if band else 10
    lines = [
        f"trace {s.get('trace') or '?'}: {s['num_requests']:,} requests, {s['duration_s']:,.1f} s simulated "
        f"in {s.get('sim_wall_s', float('nan')):.2f} s wall ({s.get('sim_speedup', float('nan')):,.0f}x real time)",
        f"config: {cfg.get('model')} on {cfg.get('num_replicas')} x {cfg.get('gpu')} (tp={cfg.get('tensor_parallel_size')}), "
        f"block {cfg.get('block_size')}, {_kv_blocks(s)}, "
        f"max_num_seqs {cfg.get('max_num_seqs')}, max_num_batched_tokens {cfg.get('max_num_batched_tokens')}, "
        f"{cfg.get('policy')}, router {cfg.get('router')}"
        + (", async scheduling" if cfg.get("async_scheduling") else ""),
        f"latency: {_latency(s)}",
    ]
    if _band_line(s) is not None:
        lines.append(_band_line(s))
    lines += ["", f"{'latency (ms)':<14}" + "".join(f"{c:>{width}}" for c in ("mean", "p50", "p90", "p99"))]
    stats = ("mean", "p50", "p90", "p99")
    for label, key in _LATENCY_ROWS:
        if f"{key}_mean_s" in s:
            row = [s.get(f"{key}_{stat}_s") for stat in stats]
            lines.append(f"{label:<14}" + "".join(f"{_ms(v):>{width}}" for v in row))
            if band:
                cells = [_range(s, f"{key}_{stat}_s", _ms).strip() or "-" for stat in stats]
                lines.append(f"{'  [low, high]':<14}" + "".join(f"{c:>{width}}" for c in cells))
    rps, tok = (
        _range(s, "throughput_rps", lambda v: f"{v:,.2f}"),
        _range(s, "output_tok_s", lambda v: f"{v:,.0f}"),
    )
    lines += [
        "",
        f"throughput       {s['throughput_rps']:,.2f} req/s{rps}, {s['output_tok_s']:,.0f} output tok/s{tok}",
        f"finished         {format_counts(s)}",
        *_load_line(s),
        f"preemptions      {s['num_preemptions']:,}{_range(s, 'num_preemptions', lambda v: f'{v:,.0f}')}",
        f"prefix hit rate  {s.get('prefix_hit_rate', 0.0):.1%}",
    ]
    if "kv_usage_max" in s:
        lines.append(f"KV usage         mean {s['kv_usage_mean']:.1%}, max {s['kv_usage_max']:.1%}")
        lines.append(f"queue length     max {s['queue_len_max']:,}")
    lines.append(f"extrapolation    {_extrapolation(s)}")
    if "goodput_rps" in s:
        lines.append(
            f"SLO attainment   {s['slo_attainment']:.1%}{_range(s, 'slo_attainment', lambda v: f'{v:.1%}')} "
            f"(goodput {s['goodput_rps']:,.2f} req/s{_range(s, 'goodput_rps', lambda v: f'{v:,.2f}')})"
        )
    return "\n".join(lines)
