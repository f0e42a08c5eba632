"""Why a decode step that is not run ahead takes more device time than the same step run ahead.

Random-weight Qwen3-0.6B (made on the spot), block 16, prefix caching on, the engine's full KV cache.
One long sequence (the table's width) and many shorter ones fill most of the cache; once all of
them decode, blocks of steps alternate between async scheduling (run ahead) and synchronous steps.
Each step is split by CUDA events on the device's timeline:
  build     launch's start to the step's inputs being on the device (on an idle device: the host's
            build of the inputs, its copy and the table's gather; run ahead: ~0)
  copy      the copy into the decode graph's buffers
  graph     the graph's replay
  sample    the head and the sampler
and the recorder's own figures (gpu_time_s, wall_time_s, idle_before_s), and the host's clock over the
same launch: `h_inputs` (build_step_inputs), `h_pre` (launch's start to the replay, inputs included),
`h_replay` (the copy and the graph's launch), `h_launch` (all of launch). With `--profile`, a
torch.profiler trace of a few steps of each mode, summed by kernel (the kernels' own times).

    PYTHONPATH=. python3 benchmarks/diag_sync_decode.py [--out DIR] [--rounds 3] [--steps 24]
    python benchmarks/diag_sync_decode.py --preset tiny --device cpu --long 512 --short 128 --num-seqs 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from engine import model_runner
from engine.checkpoint import make_random_checkpoint
from engine.llm import LLM
from engine.sampling_params import SamplingParams

PIECES = ("build", "copy", "graph", "sample")
HOST = ("h_inputs", "h_pre", "h_replay", "h_launch")


class StepEvents:
    """Four CUDA events a decode step: launch's start, the graph's input copy, the replay, the end."""

    def __init__(self, runner) -> None:
        self.runner, self.cuda = runner, runner.device.type == "cuda"
        self.steps: list[list] = []
        self.host: list[dict[str, float]] = []
        self._launch, self._replay = runner.launch, runner._replay
        runner.launch, runner._replay = self.launch, self.replay
        self._build = model_runner.build_step_inputs
        model_runner.build_step_inputs = self.build

    def build(self, *args, **kwargs):
        t = time.perf_counter()
        out = self._build(*args, **kwargs)
        if self.host:
            self.host[-1]["h_inputs"] = (time.perf_counter() - t) * 1e3
        return out

    def _event(self):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def launch(self, batch, timer=None, input_ids=None):
        if not self.cuda or batch.kind != "decode":
            return self._launch(batch, timer, input_ids)
        self.host.append({})
        t = self._t0 = time.perf_counter()
        self.steps.append([self._event()])
        out = self._launch(batch, timer, input_ids)
        self.steps[-1].append(self._event())
        self.host[-1]["h_launch"] = (time.perf_counter() - t) * 1e3
        return out

    def replay(self, inputs, bs):
        t = time.perf_counter()
        self.host[-1]["h_pre"] = (t - self._t0) * 1e3
        self.steps[-1].append(self._event())
        self.runner._copy_graph_inputs(inputs, bs)
        self.steps[-1].append(self._event())
        self.runner.graphs[bs].replay()
        self.steps[-1].append(self._event())
        self.host[-1]["h_replay"] = (time.perf_counter() - t) * 1e3
        return self.runner.graph_outputs[bs][: inputs.attn.num_seqs]

    def pieces(self) -> list[dict[str, float]]:
        """ms of each piece per decode step, in launch order (steps that took the graph only)."""
        if not self.cuda:
            return []
        torch.cuda.synchronize()
        out = []
        for ev, host in zip(self.steps, self.host):
            if len(ev) != 5:
                out.append({})
                continue
            start, copy, graph, done, end = ev
            out.append(
                {
                    **host,
                    "build": start.elapsed_time(copy),
                    "copy": copy.elapsed_time(graph),
                    "graph": graph.elapsed_time(done),
                    "sample": done.elapsed_time(end),
                }
            )
        return out


def fill(llm: LLM, long_len: int, short_len: int, num_seqs: int, max_tokens: int, seed: int) -> None:
    """One `long_len` prompt and `num_seqs - 1` of `short_len`, distinct random tokens; steps until
    every one decodes."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for n in [long_len] + [short_len] * (num_seqs - 1):
        llm.add_request(rng.integers(1, llm.spec.vocab_size, n).tolist(), params)
    while llm.scheduler.num_waiting or any(s.num_output_tokens == 0 for s in llm.scheduler.running):
        llm.step()


def run_block(llm: LLM, asynchronous: bool, steps: int, profile: bool):
    """`steps` decode steps in one mode; (first record row, rows after, profiler or None)."""
    llm.async_scheduling = asynchronous
    first = len(llm.recorder)
    prof = None
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        prof.__enter__()
    for _ in range(steps):
        llm.step()
    if llm._inflight is not None:  # land the last step of an async block before switching
        llm._land(llm._inflight)
    if prof is not None:
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
    return first, len(llm.recorder), prof


def kernel_sums(prof, num_steps: int) -> dict[str, float]:
    """ms a step by kernel name (device time of each kernel, summed)."""
    sums: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            sums[evt.key[:60]] += evt.device_time_total / 1e3 / num_steps
    return dict(sums)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--long", type=int, default=32000, help="the long prompt (the table's width)")
    ap.add_argument("--short", type=int, default=6400, help="every other prompt")
    ap.add_argument("--num-seqs", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24, help="decode steps a block")
    ap.add_argument("--profile", action="store_true", help="a torch.profiler block of each mode too")
    ap.add_argument("--out", type=Path, default=None, help="write the step rows here (csv)")
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_default_dtype(torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        arch = "qwen3" if args.preset.startswith("qwen3") or args.preset == "tiny" else "llama"
        model_dir = make_random_checkpoint(
            Path(tmp) / args.preset, arch, args.preset, seed=0, device=args.device
        )
        llm = LLM(
            model_dir,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            device=args.device,
            max_num_seqs=max(256, args.num_seqs),
        )
        try:
            report(llm, args)
        finally:
            llm.close()


def report(llm: LLM, args: argparse.Namespace) -> None:
    steps = args.steps * 2 * args.rounds + 2 * args.steps + 8
    fill(llm, args.long, args.short, args.num_seqs, steps, seed=0)
    events = StepEvents(llm.runner)
    blocks = []
    for _ in range(args.rounds):
        for asynchronous in (True, False):
            blocks.append((asynchronous, *run_block(llm, asynchronous, args.steps, False)[:2]))
    profiles = {}
    if args.profile:
        for asynchronous in (True, False):
            prof = run_block(llm, asynchronous, 8, True)[2]
            profiles[asynchronous] = kernel_sums(prof, 8)
    df = llm.recorder.to_dataframe()
    decode = df.loc[df["kind"] == "decode"].copy()
    pieces = events.pieces()
    # the events' steps are the decode launches in order; so are the decode rows from the first block on
    rows = df.loc[blocks[0][1] :]
    rows = rows.loc[rows["kind"] == "decode"]
    n = min(len(rows), len(pieces)) if pieces else len(rows)
    rows = rows.iloc[:n].copy()
    for p in PIECES + HOST:
        rows[p] = [pieces[i].get(p, float("nan")) if pieces else float("nan") for i in range(n)]
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        rows.to_csv(args.out / "sync_decode_steps.csv", index=False)
    print(
        f"{args.num_seqs} sequences: 1 x {args.long} + {args.num_seqs - 1} x {args.short} tokens, "
        f"block {args.block_size}; median batch {int(decode['num_seqs'].median())}, "
        f"context {int(rows['num_context_tokens'].median()):,}, width {int(rows['max_seq_len'].median()):,}"
    )
    print(
        f"{'mode':>14} {'steps':>5} {'gpu_time':>8} {'wall':>7} {'idle':>6} "
        + " ".join(f"{p:>8}" for p in PIECES + HOST)
    )
    for label, sel in (
        ("run ahead", rows["overlapped"].astype(bool)),
        ("not run ahead", ~rows["overlapped"].astype(bool)),
    ):
        part = rows.loc[sel]
        if part.empty:
            continue
        med = {c: float(part[c].median()) for c in ("gpu_time_s", "wall_time_s", "idle_before_s")}
        print(
            f"{label:>14} {len(part):>5} {med['gpu_time_s'] * 1e3:>8.2f} {med['wall_time_s'] * 1e3:>7.2f} "
            f"{med['idle_before_s'] * 1e3:>6.2f} "
            + " ".join(f"{part[p].median():>8.2f}" for p in PIECES + HOST)
        )
    for asynchronous, sums in profiles.items():
        total = sum(sums.values())
        print(f"kernels a step, {'async' if asynchronous else 'sync'}: {total:.2f} ms")
        other = profiles.get(not asynchronous, {})
        for name, ms in sorted(sums.items(), key=lambda kv: -kv[1])[:8]:
            print(f"  {ms:7.3f} ms (other mode {other.get(name, 0.0):7.3f})  {name}")
    by_block = []
    for asynchronous, lo, hi in blocks:
        part = rows.loc[(rows.index >= lo) & (rows.index < hi)]
        by_block.append(f"{'A' if asynchronous else 'S'} {statistics.median(part['gpu_time_s']) * 1e3:.2f}")
    print("median gpu_time_s by block, in order (A run ahead, S synchronous):", ", ".join(by_block))


if __name__ == "__main__":
    main()
