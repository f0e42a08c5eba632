"""Where a one-row decode step's device time goes: the CUDA graph alone, then each piece around it.

Random-weight Qwen3-0.6B (made on the spot), block 16, async scheduling, greedy, as bench_throughput's
single stream. One request decodes to a steady state, then each stage repeats back to back and is
timed by CUDA events over the whole loop (the device's time per repeat, host issue included where
the host is slower):
  graph      the decode CUDA graph's replay alone
  +head      and the LM head and the greedy argmax as the runner samples them (one fused pass,
             engine/layers/head_argmax.py, unless $KVPLAN_HEAD_ARGMAX=0)
  +head (cuBLAS, triton argmax)   the same through cuBLAS and the sampler's Triton argmax
  +head (torch argmax)   the same with torch's float copy of the logits and argmax
  +copies    and the copies into the graph's input buffers (inputs built once; one Triton launch
             unless $KVPLAN_GRAPH_COPY=0)
  +copies (torch)        the same with torch's copies (five copies, and fills for padding rows)
  launch     ModelRunner.launch as a step calls it: inputs built and copied, graph, head, sampler
  step       LLM.step on the live request (its median recorded device time and wall time)
With `--kernels`, also the critical path of "+head" under torch.profiler: each kernel is charged the
time by which it moved the latest kernel end forward (under PDL kernels overlap, so their own
durations do not add up), of which idle time before it started (nothing running).

    PYTHONPATH=. python3 benchmarks/diag_single_stream.py [--repeats 300] [--kernels]
"""

from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from engine.attention.metadata import build_step_inputs
from engine.checkpoint import make_random_checkpoint
from engine.core.scheduler import ScheduledBatch
from engine.llm import LLM
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams


def per_repeat_us(fn, repeats: int) -> float:
    """Device microseconds per call of `fn`, timed over `repeats` back-to-back calls."""
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kernels", action="store_true", help="also the kernels' critical path")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_random_checkpoint(
            Path(tmp) / "qwen3-0.6b", "qwen3", "qwen3-0.6b", seed=0, device="cuda"
        )
        llm = LLM(model_dir, block_size=args.block_size, max_model_len=4096)
        llm.async_scheduling = True
        run(llm, args.repeats, args.kernels)
        llm.close()


def steady_one_row(llm: LLM, max_tokens: int = 400) -> ScheduledBatch:
    """Add one greedy request (a 128-token prompt) and step 64 times; its last step (a one-row decode)."""
    runner, batches, launch = llm.runner, [], llm.runner.launch

    def spy(batch, timer=None, input_ids=None):
        batches.append(batch)
        return launch(batch, timer, input_ids)

    runner.launch = spy
    llm.add_request(
        list(range(1, 129)), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    )
    for _ in range(64):
        llm.step()
    runner.launch = launch
    batch = batches[-1]
    assert batch.kind == "decode" and batch.num_seqs == 1, batch
    return batch


def run(llm: LLM, repeats: int, kernels: bool = False) -> None:
    runner = llm.runner
    llm.recorder.reset()
    batch = steady_one_row(llm)
    inputs = build_step_inputs(batch, runner.block_size, runner.device, runner._staging.acquire())
    graph, head, sampler = runner.graphs[1], runner.model.compute_logits, runner.sampler
    out = runner.graph_outputs[1]
    temps = inputs.temperatures

    def graph_head() -> None:
        graph.replay()
        runner._sample(out[:1], inputs)

    def graph_head_sampler() -> None:
        graph.replay()
        sampler(head(out[:1]), temps, all_greedy=True)

    def graph_head_torch() -> None:
        graph.replay()
        torch_sampler(head(out[:1]), temps, all_greedy=True)

    def copies_graph_head() -> None:
        runner._sample(runner._replay(inputs, 1), inputs)

    def copies_torch() -> float:
        kernel, runner.triton_graph_copy = runner.triton_graph_copy, False
        try:
            return per_repeat_us(copies_graph_head, repeats)
        finally:
            runner.triton_graph_copy = kernel

    torch_sampler = Sampler(triton_argmax=False)
    rows = [
        ("graph", per_repeat_us(graph.replay, repeats)),
        ("+head", per_repeat_us(graph_head, repeats)),
        ("+head (cuBLAS, triton argmax)", per_repeat_us(graph_head_sampler, repeats)),
        ("+head (torch argmax)", per_repeat_us(graph_head_torch, repeats)),
        ("+copies", per_repeat_us(copies_graph_head, repeats)),
        ("+copies (torch)", copies_torch()),
        ("launch", per_repeat_us(lambda: runner.launch(batch), repeats)),
    ]
    if kernels:
        print_critical_path(critical_path(graph_head, repeats=50))
    while llm.has_unfinished():
        llm.step()
    df = llm.recorder.to_dataframe()
    decode = df.loc[(df["kind"] == "decode") & (df["step"] > 80)]
    rows.append(("step (device)", float(decode["gpu_time_s"].median() * 1e6)))
    rows.append(("step (wall)", float(decode["wall_time_s"].median() * 1e6)))
    print(
        f"fused head: {runner.fused_head}, triton argmax: {sampler.triton_argmax}, "
        f"graph copy kernel: {runner.triton_graph_copy}"
    )
    print(f"{'stage':<32}{'us':>9}")
    for name, us in rows:
        print(f"{name:<32}{us:>9.1f}")


def critical_path(fn, repeats: int, layers: int = 28) -> list[tuple[str, float, float, float]]:
    """[(kernel, launches, µs of the critical path, µs of it idle)] per call of `fn`, in launch
    order: a kernel is charged max(0, its end - the latest end before it), the idle part being
    max(0, its start - that latest end). Kernels of the decoder layers are named by their place in
    the layer ("L3 name": the layer's fourth launch), summed over `layers` layers."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    labels = layer_labels([e.name[:50] for e in events[: len(events) // repeats]], layers)
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    latest = events[0].time_range.start if events else 0.0
    for i, e in enumerate(events):
        start, end = e.time_range.start, e.time_range.end
        row = rows[labels[i % len(labels)]]
        row[0] += 1
        row[1] += max(0.0, end - latest)
        row[2] += max(0.0, start - latest)
        latest = max(latest, end)
    return [(name, n / repeats, t / repeats, idle / repeats) for name, (n, t, idle) in rows.items()]


def layer_labels(names: list[str], layers: int) -> list[str]:
    """Each launch's label: "L<i> name" inside the run of `layers` repeats of one period of launches
    (the decoder layers), the name alone outside it."""
    for period in range(1, 16):
        for first in range(0, 12):
            span = names[first : first + layers * period]
            if len(span) == layers * period and all(
                span[i] == span[i + period] for i in range(len(span) - period)
            ):
                return [
                    f"L{(i - first) % period} {n}" if first <= i < first + layers * period else n
                    for i, n in enumerate(names)
                ]
    return list(names)


def print_critical_path(rows: list[tuple[str, float, float, float]]) -> None:
    print(f"{'kernel':<60}{'n/call':>7}{'path us':>9}{'idle us':>9}{'us each':>9}")
    for name, n, us, idle in rows:
        print(f"{name:<60}{n:>7.1f}{us:>9.1f}{idle:>9.1f}{us / n:>9.2f}")
    print(f"{'total':<60}{sum(r[1] for r in rows):>7.1f}{sum(r[2] for r in rows):>9.1f}"
          f"{sum(r[3] for r in rows):>9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
