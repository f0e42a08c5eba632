"""Why eager (prefill/mixed) steps run slower inside a busy replay than in the profile sweep.

One process, random-weight Qwen3-0.6B served as calibrate.py serves it (8,192 KV blocks of 16,
chunked). Times a probe (a 1,000-token prefill beside 4 decodes) before and after each replay of the
heavy window of azure_conv_2023 (600–840 s at 8x), and in every replay the host time of each step's
launch phase (`compute_logits` returns before the GPU finishes) beside its wall time. Replays: plain,
with gc frozen, and with cProfile over the mixed steps. Prints medians per step kind and phase.

    PYTHONPATH=. python3 benchmarks/diag_replay_steps.py [--out DIR] [--replays plain,frozen,cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import random
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from profile_prefill import fresh_prompt

from engine.checkpoint import make_random_checkpoint
from engine.llm import LLM
from engine.replay import replay_trace
from engine.sampling_params import SamplingParams
from traces.cli import load_trace_arg

ONE = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)


class LaunchTimer:
    """Wraps the runner's compute_logits: host seconds of each step's launch phase, and optionally a
    cProfile of the mixed steps only."""

    def __init__(self, runner) -> None:
        self.runner, self.inner = runner, runner.compute_logits
        self.launch_s: list[float] = []
        self.kinds: list[str] = []
        self.cprofile: cProfile.Profile | None = None
        runner.compute_logits = self

    def __call__(self, batch):
        prof = self.cprofile if batch.kind != "decode" else None
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        out = self.inner(batch)
        self.launch_s.append(time.perf_counter() - t0)
        if prof is not None:
            prof.disable()
        self.kinds.append(batch.kind)
        return out

    def reset(self) -> None:
        self.launch_s, self.kinds = [], []


def probe(llm: LLM, rng: random.Random, steps: int = 20) -> float:
    """Median wall ms of a step holding 4 decodes and a fresh 1,000-token prefill."""
    for _ in range(4):
        llm.add_request(
            fresh_prompt(rng, 200), SamplingParams(temperature=0, ignore_eos=True, max_tokens=3 * steps)
        )
    llm.step()
    walls = []
    for _ in range(steps):
        llm.add_request(fresh_prompt(rng, 1000), ONE)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.step()
        walls.append(time.perf_counter() - t0)
    while llm.has_unfinished():
        llm.step()
    return sorted(walls)[len(walls) // 2] * 1e3


def replay(llm: LLM, trace, timer: LaunchTimer) -> pd.DataFrame:
    llm.recorder.reset()
    llm.block_manager.reset_prefix_cache()
    timer.reset()
    before = [s["collections"] for s in gc.get_stats()]
    replay_trace(llm, trace, progress=False, max_wall_s=200)
    cols = [s["collections"] - b for s, b in zip(gc.get_stats(), before)]
    steps = llm.recorder.to_dataframe()
    assert len(steps) == len(timer.launch_s), (len(steps), len(timer.launch_s))
    steps["launch_s"] = timer.launch_s
    steps.attrs["gc"] = cols
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--replays", default="plain,frozen,cprofile")
    ap.add_argument("--window", default="600:840")
    ap.add_argument("--rate-scale", type=float, default=8.0)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    ckpt = make_random_checkpoint(
        Path(tempfile.mkdtemp()) / "m", "qwen3", "qwen3-0.6b", seed=0, device="cuda"
    )
    llm = LLM(ckpt, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=16384,
              num_kv_blocks=8192)  # fmt: skip
    timer = LaunchTimer(llm.runner)
    rng = random.Random(0)
    trace = load_trace_arg("azure_conv_2023", args.rate_scale, None, args.window)
    rows = [("start", "probe ms", f"{probe(llm, rng):.2f}")]
    print(f"tracked objects after start-up: {len(gc.get_objects()):,}", flush=True)
    for name in args.replays.split(","):
        if name == "frozen":
            gc.freeze()
        timer.cprofile = cProfile.Profile() if name == "cprofile" else None
        t0 = time.perf_counter()
        steps = replay(llm, trace, timer)
        steps.to_parquet(out / f"steps_{name}.parquet", index=False)
        wall = time.perf_counter() - t0
        for kind, g in steps.groupby("kind"):
            rows.append((name, f"{kind} n={len(g)} wall/launch/gpu ms",
                         f"{g.wall_time_s.median() * 1e3:.2f} / {g.launch_s.median() * 1e3:.2f} / "
                         f"{g.gpu_time_s.median() * 1e3:.2f}"))  # fmt: skip
        rows.append((name, "replay s, gc collections", f"{wall:.0f} s, {steps.attrs['gc']}"))
        rows.append((name, "probe ms after", f"{probe(llm, rng):.2f}"))
        if timer.cprofile is not None:
            s = io.StringIO()
            pstats.Stats(timer.cprofile, stream=s).sort_stats("tottime").print_stats(30)
            (out / "cprofile_mixed.txt").write_text(s.getvalue())
            print(s.getvalue()[:6000], flush=True)
        print(rows[-4:], flush=True)
    # the probe shape under cProfile, for comparison with the replay's mixed steps
    timer.cprofile = cProfile.Profile()
    probe(llm, rng)
    s = io.StringIO()
    pstats.Stats(timer.cprofile, stream=s).sort_stats("tottime").print_stats(30)
    (out / "cprofile_probe.txt").write_text(s.getvalue())
    llm.close()
    print(f"\n{'run':<10} {'what':<40} value")
    for r in rows:
        print(f"{r[0]:<10} {r[1]:<40} {r[2]}")


if __name__ == "__main__":
    main()
