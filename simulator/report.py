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
    text = f"{kind} profile {s['profile']}"
    calibrated = s.get("profile_num_kv_blocks")
    if calibrated:
        text += f" (calibrated on a cache of {calibrated:,} KV blocks)"
    return text


def _extrapolation(s: dict) -> str:
    """How many steps the fitted profile priced outside the ranges of its step records."""
    outside = s.get("steps_outside_fit")
    if outside is None:
        return (
            "not checked (" + ("roofline" if s.get("latency_model") == "roofline" else "no fit ranges") + ")"
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


def format_summary(s: dict) -> str:
    cfg = s.get("config", {})
    lines = [
        f"trace {s.get('trace') or '?'}: {s['num_requests']:,} requests, {s['duration_s']:,.1f} s simulated "
        f"in {s.get('sim_wall_s', float('nan')):.2f} s wall ({s.get('sim_speedup', float('nan')):,.0f}x real time)",
        f"config: {cfg.get('model')} on {cfg.get('num_replicas')} x {cfg.get('gpu')} (tp={cfg.get('tensor_parallel_size')}), "
        f"block {cfg.get('block_size')}, {_kv_blocks(s)}, "
        f"max_num_seqs {cfg.get('max_num_seqs')}, max_num_batched_tokens {cfg.get('max_num_batched_tokens')}, "
        f"{cfg.get('policy')}, router {cfg.get('router')}"
        + (", async scheduling" if cfg.get("async_scheduling") else ""),
        f"latency: {_latency(s)}",
        "",
        f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for label, key in _LATENCY_ROWS:
        if f"{key}_mean_s" in s:
            row = [s.get(f"{key}_{stat}_s") for stat in ("mean", "p50", "p90", "p99")]
            lines.append(f"{label:<14}" + "".join(f"{_ms(v):>10}" for v in row))
    lines += [
        "",
        f"throughput       {s['throughput_rps']:,.2f} req/s, {s['output_tok_s']:,.0f} output tok/s",
        f"finished         {format_counts(s)}",
        f"preemptions      {s['num_preemptions']:,}",
        f"prefix hit rate  {s.get('prefix_hit_rate', 0.0):.1%}",
    ]
    if "kv_usage_max" in s:
        lines.append(f"KV usage         mean {s['kv_usage_mean']:.1%}, max {s['kv_usage_max']:.1%}")
        lines.append(f"queue length     max {s['queue_len_max']:,}")
    lines.append(f"extrapolation    {_extrapolation(s)}")
    if "goodput_rps" in s:
        lines.append(f"SLO attainment   {s['slo_attainment']:.1%} (goodput {s['goodput_rps']:,.2f} req/s)")
    return "\n".join(lines)
