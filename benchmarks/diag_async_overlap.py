"""Async scheduling, simulated against real: steps, batches, preemptions, decode steps scheduled ahead by
predecessor and reason, the mixed-step error by (decodes x chunk tokens), and metrics with mixed steps scaled."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd

from simulator import sim as simmod
from simulator.latency.base import StepShape
from simulator.latency.profile import load_latency_model
from simulator.latency.scaled import ScaledModel
from simulator.metrics import summarize
from simulator.run import kv_blocks_for, run_simulation
from simulator.validate import compare, read_run, sim_config_for, step_residuals, validate_profile

METRICS = ("tpot_mean_s", "e2e_mean_s", "e2e_p50_s", "e2e_p99_s", "ttft_p50_s", "ttft_p99_s")
DECODE_CELLS = [0, 16, 48, 96, 160, 256]
TOKEN_CELLS = [0, 2048, 8191, 8192]


def simulated_steps(trace, config, latency) -> pd.DataFrame:
    """Every step of a stepped simulation: shape, requests left waiting, preemptions, overlapped."""
    log: list[dict] = []
    note = simmod.Replica._note_capacity

    def noting(replica, batch) -> None:
        note(replica, batch)
        log.append(
            {
                **{f: getattr(batch, f) for f in ("kind", "num_seqs", "num_prefill_seqs")},
                **{f: getattr(batch, f) for f in ("total_num_scheduled_tokens", "num_prefill_tokens")},
                **{f: getattr(batch, f) for f in ("num_context_tokens", "max_seq_len", "prefill_attn_work")},
                "total_num_cached_tokens": batch.total_num_cached_tokens,
                "num_preempted": len(batch.preempted_seq_ids),
                "num_waiting": replica.scheduler.num_waiting,
            }
        )

    simmod.Replica._note_capacity = noting
    try:
        stepped = dataclasses.replace(config, fast_forward=False)
        run = simmod.simulate(trace, stepped, latency, kv_blocks_for(stepped), record_batches=True)
    finally:
        simmod.Replica._note_capacity = note
    steps = pd.DataFrame(log)
    steps = steps[steps["kind"] != "empty"].reset_index(drop=True)
    steps["overlapped"] = run.replicas[0].overlap_log
    ahead = latency.overlapped_model()
    steps["predicted_s"] = [
        (ahead if o else latency).predict(StepShape.of(r)).total
        for r, o in zip(steps.itertuples(index=False), steps["overlapped"])
    ]
    return steps


def with_reasons(steps: pd.DataFrame) -> pd.DataFrame:
    """`steps` with the kind of the step before each and why a decode step was (not) overlapped."""
    prev_kind = steps["kind"].shift(1).fillna("start")
    prev_seqs = steps["num_seqs"].shift(1).fillna(0)
    reason = np.where(prev_kind != "decode", "after " + prev_kind, "after decode")
    after_decode = prev_kind == "decode"
    reason = np.where(after_decode & (steps["num_waiting"] > 0), "after decode, waiting", reason)
    reason = np.where(
        after_decode & (steps["num_waiting"] == 0) & (steps["num_seqs"] < prev_seqs),
        "after decode, finish",
        reason,
    )
    return steps.assign(prev_kind=prev_kind, reason=reason)


def decode_table(real: pd.DataFrame, sim: pd.DataFrame) -> pd.DataFrame:
    rows = {}
    for side, df in (("real", real), ("sim", sim)):
        d = df[df["kind"] == "decode"]
        g = d.groupby("reason")["overlapped"]
        rows[(side, "steps")], rows[(side, "overlapped")] = g.size(), g.sum()
    table = pd.DataFrame(rows).fillna(0).astype(int)
    table.loc["all decode steps"] = table.sum()
    return table


def mixed_cells(real: pd.DataFrame, sim: pd.DataFrame) -> pd.DataFrame:
    """Mixed steps by decodes x chunk tokens: real steps, their summed error on the profile, sim steps."""

    def cells(df):
        dec = df["num_seqs"] - df["num_prefill_seqs"]
        return [pd.cut(dec, DECODE_CELLS), pd.cut(df["total_num_scheduled_tokens"], TOKEN_CELLS)]

    r, s = real[real["kind"] == "mixed"], sim[sim["kind"] == "mixed"]
    g = r.groupby(cells(r), observed=True)
    out = pd.DataFrame({"real steps": g.size(), "real s": g["measured_s"].sum()})
    out["summed error"] = g["predicted_s"].sum() / out["real s"] - 1
    gs = s.groupby(cells(s), observed=True)
    out["sim steps"], out["sim s"] = gs.size(), gs["predicted_s"].sum()
    out.index.names = ["decodes", "chunk tokens"]
    return out.fillna(0)


def kinds_table(real: pd.DataFrame, sim: pd.DataFrame, real_preemptions: int) -> tuple[pd.DataFrame, dict]:
    rows = []
    for side, df, time in (("real", real, "measured_s"), ("sim", sim, "predicted_s")):
        for kind, d in df.groupby("kind"):
            dec = d["num_seqs"] - d["num_prefill_seqs"]
            rows.append(
                {
                    "side": side,
                    "kind": kind,
                    "steps": len(d),
                    "decodes mean": dec.mean(),
                    "context mean": d["num_context_tokens"].mean(),
                    "time s": d[time].sum(),
                    "decode token-s": (d[time] * dec).sum(),
                }
            )
    table = pd.DataFrame(rows).set_index(["side", "kind"])
    preempted = {"real": real_preemptions, "sim": int(sim["num_preempted"].sum())}
    return table, preempted


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog="The simulation runs stepped (fast_forward off), noting each step it schedules. A decode "
        "step after a decode step is 'finish' when it holds fewer requests than that step (one finished), "
        "'waiting' when requests were left waiting. --scale-mixed F prices prefill and mixed steps F times "
        "the profile (ScaledModel). Example: python benchmarks/diag_async_overlap.py --real "
        "simulator/data/validation/h200_qwen3-8b_bs16_async_azure-conv_x3 --scale-mixed 0.96,1.04",
    )
    parser.add_argument("--real", nargs="+", required=True, help="replay folders (with steps.parquet)")
    parser.add_argument("--profile", default="auto", help="a profile file, or auto (the replay's own)")
    parser.add_argument("--scale-mixed", default="", help="comma-separated factors on prefill/mixed steps")
    args = parser.parse_args()
    pd.set_option("display.width", 200)
    for run in args.real:
        meta, trace, requests, steps = read_run(run)
        if steps is None or "overlapped" not in steps:
            raise SystemExit(f"--real {run}: no steps.parquet with an overlapped column")
        config = sim_config_for(meta)
        profile = validate_profile(args.profile, run)
        latency = load_latency_model(
            profile, config.model, config.gpu, config.tensor_parallel_size, config.block_size
        )
        real = step_residuals(
            steps.assign(overlapped=steps["overlapped"].fillna(False).astype(bool)), latency
        )
        real = with_reasons(real)
        sim = with_reasons(simulated_steps(trace, config, latency))
        summary = run_simulation(trace, config, latency=latency).summary
        print(f"\n===== {Path(run).name} on {Path(str(profile)).name}")
        kinds, preempted = kinds_table(real, sim, int(requests["num_preemptions"].sum()))
        print(kinds.round(2).to_string())
        print(f"preemptions: real {preempted['real']}, sim {preempted['sim']}")
        print(
            f"overlapped decode steps: real {int(real['overlapped'].sum()):,}, sim stepped "
            f"{int(sim['overlapped'].sum()):,} (fast-forwarded run: {summary.get('sim_overlapped_steps', 0):,})"
        )
        print(decode_table(real, sim).to_string())
        print("mixed steps by decodes x chunk tokens (summed error: the profile on the real steps):")
        print(mixed_cells(real, sim).round(3).to_string())
        table = compare(summarize(requests), summary).set_index("metric")["rel_error"]
        scales = [1.0] + [float(f) for f in args.scale_mixed.split(",") if f]
        print(f"{'prefill/mixed x':>16}" + "".join(f"{m[:-2]:>11}" for m in METRICS) + f"{'overlapped':>12}")
        for f in scales:
            if f != 1.0:
                s = run_simulation(trace, config, latency=ScaledModel(latency, 1.0, f)).summary
                table = compare(summarize(requests), s).set_index("metric")["rel_error"]
            else:
                s = summary
            print(
                f"{f:>16.3f}"
                + "".join(f"{table[m]:>+11.1%}" for m in METRICS)
                + f"{s.get('sim_overlapped_steps', 0):>12,}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
