"""StepRecorder overhead: the same workload on one engine with step recording on and off,
alternated (on, off, then off, on, ...), reporting the relative slowdown of the medians (target <= 2%).

    PYTHONPATH=. python3 benchmarks/bench_recorder_overhead.py [--model-dir DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from random import randint, seed

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.step_recorder import StepRecorder


def workload(num_seqs: int, max_output: int):
    seed(1)
    prompts = [[randint(0, 10000) for _ in range(randint(50, 300))] for _ in range(num_seqs)]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(32, max_output)) for _ in prompts
    ]
    return prompts, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir")
    ap.add_argument("--num-seqs", type=int, default=128)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--device")
    args = ap.parse_args()
    model_dir = args.model_dir
    if model_dir is None:
        from engine.checkpoint import make_random_checkpoint

        model_dir = make_random_checkpoint(
            Path(tempfile.mkdtemp()) / "qwen3-0.6b", "qwen3", "qwen3-0.6b", device="cuda"
        )
    llm = LLM(model_dir, block_size=args.block_size, max_model_len=4096, device=args.device)
    recorder = llm.recorder
    prompts, params = workload(args.num_seqs, args.max_output)
    llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm-up
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.repeats):
        for on in (True, False) if r % 2 == 0 else (False, True):  # alternate the order too
            llm.recorder = StepRecorder(recorder.tp, recorder.block_size, recorder.cuda) if on else None
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            if on:
                llm.recorder.to_dataframe()  # resolving the events is part of the cost
            times[on].append(time.perf_counter() - t)
    llm.close()
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"recording on  (median of {args.repeats}): {on:.3f} s   {times[True]}")
    print(f"recording off (median of {args.repeats}): {off:.3f} s   {times[False]}")
    print(f"recorder overhead: {100 * (on - off) / off:+.2f}%  (target <= 2%)")


if __name__ == "__main__":
    main()
