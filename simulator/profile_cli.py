"""`kvplan profile`: run the designed sweep on the engine and fit a latency profile (argument wiring
only; registering imports no torch, running needs the `engine` extra and, to mean anything, a GPU)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from engine.launch import detected_gpu, engine_arguments, open_llm


def cmd_profile(args: argparse.Namespace) -> int:
    from simulator.calibration import fit_llm_profile, run_profile
    from simulator.latency.profile import profile_report

    detected_gpu(args)  # fail before the work, not after it

    with tempfile.TemporaryDirectory() as tmp, open_llm(args, tmp) as llm:
        records = run_profile(llm, seed=args.seed, time_budget_s=args.time_budget)
        if args.records:
            records.to_parquet(args.records, index=False)
        name = args.random or llm.spec.name
        profile = fit_llm_profile(
            records,
            llm,
            detected_gpu(args),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            tp=args.tp,
            block_size=args.block_size,
            target=args.target,
            loss=args.loss,
            extra={
                "model_name": name,
                "policy": args.policy,
                "num_steps": len(records),
                **llm.kernel_choices(),
            },
        )
    out = Path(args.out or f"{name.lower()}_{profile.gpu.lower()}_tp{args.tp}_bs{args.block_size}.json")
    profile.save(out)
    print(profile_report(profile))
    print(f"wrote {out}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="(GPU) run a designed sweep of step shapes and fit a latency profile")
    engine_arguments(p)
    p.add_argument("--out", default=None, help="profile JSON (default: MODEL_GPU_tpN_bsB.json)")
    p.add_argument("--records", default=None, help="also save the step records (Parquet)")
    p.add_argument("--time-budget", type=float, default=240.0, help="seconds of workloads at most")
    p.add_argument(
        "--target",
        default="wall_time_s",
        choices=["wall_time_s", "gpu_time_s"],
        help="the step time to fit: host wall time, or GPU time (CUDA events)",
    )
    p.add_argument(
        "--loss",
        default="median",
        choices=["median", "absolute", "relative"],
        help="least absolute seconds (default: robust to a host's slow phases), squared seconds, or squared relative error",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the designed workloads")
    p.set_defaults(func=cmd_profile)
