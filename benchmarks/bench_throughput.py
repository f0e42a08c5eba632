"""Engine throughput on nano-vllm's benchmark recipe (BENCHMARKS.md), plus single-stream decode.

Random-weight Qwen3-0.6B (made on the spot unless --model-dir is given); 256 requests from
random.seed(0): prompts of randint(100, 1024) tokens each randint(0, 10000), then max_tokens
randint(100, 1024), EOS ignored, max_model_len 4096; one warm-up request first. Throughput is
sum(max_tokens) over the wall time of the generate call. Each timed run starts from an empty prefix
cache. Writes the step records as Parquet. Beside the throughput it prints the run's per-step floor
(bench_long_context.py's: each recorded step's FLOPs at --peak-tflops or bytes at --peak-tbps,
whichever is longer) and the output tok/s that floor would allow.

    PYTHONPATH=. python3 benchmarks/bench_throughput.py --block-size 256 --records out/steps.parquet
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from random import randint, seed

from bench_long_context import H200_TBPS, H200_TFLOPS, ModelCosts, run_floor

from engine.llm import LLM
from engine.sampling_params import SamplingParams


def nano_vllm_workload(
    num_seqs: int = 256, max_input: int = 1024, max_output: int = 1024, shared_prefix: int = 0
):
    """The recipe's prompts and sampling parameters; with `shared_prefix`, every prompt starts with the
    same that many tokens (a system prompt: every request's first blocks are prefix hits)."""
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, max_input))] for _ in range(num_seqs)]
    if shared_prefix:
        system = [10001 + i % 5000 for i in range(shared_prefix)]
        prompts = [system + p for p in prompts]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, max_output))
        for _ in range(num_seqs)
    ]
    return prompts, params


def single_stream(llm: LLM, prompt_len: int = 128, max_tokens: int = 256) -> tuple[float, float, float]:
    """One request alone: (median wall time of its decode steps, its time per output token after
    the first, median device time of its decode steps: CUDA events around each step's work), in ms.
    Device time close to wall time means the step waits on the GPU, not on the host."""
    llm.recorder.reset()
    seq = llm.add_request(list(range(1, prompt_len + 1)), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))  # fmt: skip
    while llm.has_unfinished():
        llm.step()
    df = llm.recorder.to_dataframe()
    decode = df.loc[df["kind"] == "decode"]
    step_ms, gpu_ms = (float(decode[col].median() * 1e3) for col in ("wall_time_s", "gpu_time_s"))
    return step_ms, (seq.finish_time - seq.first_token_time) / (max_tokens - 1) * 1e3, gpu_ms


def timed_run(llm: LLM, prompts, params, records: str | None, peaks: tuple[float, float]) -> dict:
    """The recipe's generate call and one single stream, on `llm` as it is set, each from an empty
    prefix cache (a rerun of the same prompts would hit what the run before cached)."""
    llm.reset_prefix_cache()
    llm.recorder.reset()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    total = sum(p.max_tokens for p in params)
    df = llm.recorder.to_dataframe()
    if records:
        llm.recorder.save(records)
    async_steps = llm.num_async_steps
    floor = run_floor(df, ModelCosts.of(llm.spec), wall, total, *peaks)
    llm.reset_prefix_cache()
    step_ms, tpot_ms, gpu_ms = single_stream(llm)
    kinds = df.groupby("kind").agg(
        steps=("step", "size"),
        seqs_mean=("num_seqs", "mean"),
        wall_ms_median=("wall_time_s", lambda x: 1e3 * x.median()),
        gpu_ms_median=("gpu_time_s", lambda x: 1e3 * x.median()),
        wall_s_total=("wall_time_s", "sum"),
    )
    print(f"async_scheduling={llm.async_scheduling}")
    print(kinds.round(2).to_string())
    return {
        "async_scheduling": llm.async_scheduling,
        "output_tokens": total,
        "wall_s": round(wall, 3),
        "tok_per_s": round(total / wall, 1),
        "steps": len(df),
        "async_steps": async_steps,
        "compiled_steps": int(df["compiled"].sum()),
        "gpu_busy_frac": round(float(df["gpu_time_s"].sum() / df["wall_time_s"].sum()), 3),
        "decode_step_ms_median": round(
            float(df.loc[df["kind"] == "decode", "wall_time_s"].median() * 1e3), 2
        ),
        "single_stream_ms_per_token": round(step_ms, 3),
        "single_stream_tpot_ms": round(tpot_ms, 3),
        "single_stream_gpu_ms": round(gpu_ms, 3),
        "floor_s": round(floor["per_step_floor_s"], 3),
        "floor_compute_s": round(floor["compute_floor_s"], 3),
        "floor_bandwidth_s": round(floor["bandwidth_floor_s"], 3),
        "floor_tok_per_s": round(total / floor["per_step_floor_s"], 1),
        "fraction_of_floor": round(floor["fraction_of_floor"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="HF checkpoint folder (default: random Qwen3-0.6B in a temp dir)")
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--policy", default="chunked", choices=["chunked", "prefill_first"])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument(
        "--async-scheduling",
        default="off",
        choices=["off", "on", "both"],
        help="overlap decode steps' host work with the device (both: off, on, off, on on one engine)",
    )
    ap.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        help="prepend the same this many tokens to every prompt (prefix-sharing variant; 0: the recipe)",
    )
    ap.add_argument("--records", help="write the timed run's step records here (.parquet or .csv)")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--peak-tflops", type=float, default=H200_TFLOPS, help="matrix ceiling, TFLOP/s")
    ap.add_argument("--peak-tbps", type=float, default=H200_TBPS, help="memory ceiling, TB/s")
    args = ap.parse_args()

    model_dir = args.model_dir
    if model_dir is None:
        from engine.checkpoint import make_random_checkpoint

        model_dir = make_random_checkpoint(
            Path(tempfile.mkdtemp()) / "qwen3-0.6b", "qwen3", "qwen3-0.6b", seed=0, device="cuda"
        )
    t0 = time.perf_counter()
    llm = LLM(
        model_dir,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=4096,
        policy=args.policy,
        attention_backend=args.backend,
        enforce_eager=args.enforce_eager,
    )
    start_s = time.perf_counter() - t0
    prompts, params = nano_vllm_workload(args.num_seqs, shared_prefix=args.shared_prefix)
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up request
    modes = {"off": [False], "on": [True], "both": [False, True, False, True]}[args.async_scheduling]
    runs = []
    for i, mode in enumerate(modes):
        llm.async_scheduling = mode
        llm.num_async_steps = 0
        records = args.records if i == len(modes) - 1 else None
        runs.append(timed_run(llm, prompts, params, records, (args.peak_tflops, args.peak_tbps)))
    head = {
        "backend": llm.attention_backend,
        "block_size": args.block_size,
        "policy": args.policy,
        "shared_prefix": args.shared_prefix,
        "num_kv_blocks": llm.runner.num_kv_blocks,
        "start_s": round(start_s, 1),
    }
    llm.close()
    if args.json:
        Path(args.json).write_text(json.dumps({**head, "runs": runs}, indent=2))
    print("\n".join(f"{k:>28}  {v}" for k, v in head.items()))
    table = [(k, *(r[k] for r in runs)) for k in runs[0]]
    for row in table:
        print(f"{row[0]:>28}  " + "  ".join(f"{v!s:>10}" for v in row[1:]))


if __name__ == "__main__":
    main()
