"""Where a one-row decode step's device time goes: the CUDA graph alone, then each piece around it.

Random-weight Qwen3-0.6B (made on the spot), block 16, async scheduling, greedy, as bench_throughput's
single stream. One request decodes to a steady state, then each stage repeats back to back and is
timed by CUDA events over the whole loop (the device's time per repeat, host issue included where
the host is slower):
  graph      the decode CUDA graph's replay alone
  +head      and the LM head and the greedy argmax (Triton unless $KVPLAN_TRITON_ARGMAX=0)
  +head (torch argmax)   the same with torch's float copy of the logits and argmax
  +copies    and the copies into the graph's input buffers (inputs built once; one Triton launch
             unless $KVPLAN_GRAPH_COPY=0)
  +copies (torch)        the same with torch's copies (five copies, and fills for padding rows)
  launch     ModelRunner.launch as a step calls it: inputs built and copied, graph, head, sampler
  step       LLM.step on the live request (its median recorded device time and wall time)

    PYTHONPATH=. python3 benchmarks/diag_single_stream.py [--repeats 300]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from engine.attention.metadata import build_step_inputs
from engine.checkpoint import make_random_checkpoint
from engine.llm import LLM
from engine.sampler import Sampler
from engine.sequence import SamplingParams


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
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_random_checkpoint(
            Path(tmp) / "qwen3-0.6b", "qwen3", "qwen3-0.6b", seed=0, device="cuda"
        )
        llm = LLM(model_dir, block_size=args.block_size, max_model_len=4096)
        llm.async_scheduling = True
        run(llm, args.repeats)
        llm.close()


def run(llm: LLM, repeats: int) -> None:
    runner = llm.runner
    batches = []
    launch = runner.launch

    def spy(batch, timer=None, input_ids=None):
        batches.append(batch)
        return launch(batch, timer, input_ids)

    runner.launch = spy
    llm.recorder.reset()
    llm.add_request(list(range(1, 129)), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    for _ in range(64):
        llm.step()
    runner.launch = launch
    batch = batches[-1]
    assert batch.kind == "decode" and batch.num_seqs == 1, batch
    inputs = build_step_inputs(batch, runner.block_size, runner.device, runner._stagings[0])
    graph, head, sampler = runner.graphs[1], runner.model.compute_logits, runner.sampler
    out = runner.graph_outputs[1]
    temps = inputs.temperatures

    def graph_head() -> None:
        graph.replay()
        sampler(head(out[:1]), temps, all_greedy=True)

    def graph_head_torch() -> None:
        graph.replay()
        torch_sampler(head(out[:1]), temps, all_greedy=True)

    def copies_graph_head() -> None:
        sampler(head(runner._replay(inputs, 1)), temps, all_greedy=True)

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
        ("+head (torch argmax)", per_repeat_us(graph_head_torch, repeats)),
        ("+copies", per_repeat_us(copies_graph_head, repeats)),
        ("+copies (torch)", copies_torch()),
        ("launch", per_repeat_us(lambda: runner.launch(batch), repeats)),
    ]
    while llm.has_unfinished():
        llm.step()
    df = llm.recorder.to_dataframe()
    decode = df.loc[(df["kind"] == "decode") & (df["step"] > 80)]
    rows.append(("step (device)", float(decode["gpu_time_s"].median() * 1e6)))
    rows.append(("step (wall)", float(decode["wall_time_s"].median() * 1e6)))
    print(f"triton argmax: {sampler.triton_argmax}, graph copy kernel: {runner.triton_graph_copy}")
    print(f"{'stage':<22}{'us':>9}")
    for name, us in rows:
        print(f"{name:<22}{us:>9.1f}")


if __name__ == "__main__":
    main()
