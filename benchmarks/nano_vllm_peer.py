"""One workload on nano-vllm (the peer in /work/shared/peers, not part of the project), driven through
its public API in a process of its own for side_by_side.py; writes a JSON summary. Needs CUDA.

    PYTHONPATH=<peers>/nano-vllm:<peers>/fa2_shim:. python3 benchmarks/nano_vllm_peer.py \
        --workload long_context --model-dir MODEL_WITH_TOKENIZER --json out/nano_long.json
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import bench_long_context as lc

from engine.model_spec import ModelSpec

TEMPERATURE = 0.6  # nano-vllm has no greedy sampling; its bench uses 0.6
NANO_BLOCK_SIZE = 256


def nano_recipe(num_seqs: int = 256, max_input: int = 1024, max_output: int = 1024) -> tuple[list, list]:
    """BENCHMARKS.md's workload as plain lists (prompts, max_tokens), equal to
    bench_throughput.nano_vllm_workload's: random.seed(0), prompts first, then the lengths."""
    random.seed(0)
    rand = random.randint
    prompts = [[rand(0, 10000) for _ in range(rand(100, max_input))] for _ in range(num_seqs)]
    return prompts, [rand(100, max_output) for _ in range(num_seqs)]


def require_nano_vllm():
    """nano-vllm's LLM and SamplingParams, or SystemExit saying what is missing."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("nano-vllm needs a CUDA GPU (torch.cuda.is_available() is False); on a CPU run "
                         "side_by_side.py with --systems ours")  # fmt: skip
    try:
        from nanovllm import LLM, SamplingParams
    except ImportError as e:
        raise SystemExit(f"cannot import nanovllm ({e}): give side_by_side.py --peers, the folder "
                         "holding nano-vllm/ and fa2_shim/ (see /work/shared/peers/README.md)") from None  # fmt: skip
    return LLM, SamplingParams


def timed_generate(llm, sampling, prompts: list[list[int]], max_tokens: list[int]) -> float:
    """One generate call (EOS ignored, temperature 0.6); its wall time. Checks every output length."""
    params = [sampling(temperature=TEMPERATURE, ignore_eos=True, max_tokens=n) for n in max_tokens]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    short = sum(len(o["token_ids"]) != n for o, n in zip(outs, max_tokens))
    if short:
        raise RuntimeError(f"nano-vllm: {short} requests did not produce their max_tokens")
    return wall


def run(args) -> dict:
    LLM, SamplingParams = require_nano_vllm()
    spec = ModelSpec.from_hf_config(args.model_dir)
    if args.workload == "nano_recipe":
        prompts, max_tokens = nano_recipe(args.num_seqs)
        warmups = [([[1, 2, 3, 4]], [8])]  # as bench_throughput.py's warm-up request
        limits = dict(max_model_len=4096)  # the recipe's; nano-vllm's defaults otherwise (as its bench)
        counted = sum(max_tokens)
        summary: dict = {"requests": len(prompts), "output_tokens": counted}
    else:
        work = lc.window_workload(args, spec.vocab_size)
        print(lc.describe(work.summary), flush=True)
        prompts, max_tokens = work.prompts, work.output_lens
        warmups = lc.warmup_batches(args.warmup, work, work.summary["vocab"], args.max_model_len)
        limits = dict(max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                      max_num_seqs=args.max_num_seqs)  # fmt: skip
        counted = work.prompt_tokens + work.output_tokens
        summary = dict(work.summary)
    t0 = time.perf_counter()
    llm = LLM(str(args.model_dir), enforce_eager=args.enforce_eager, **limits)
    start_s = time.perf_counter() - t0
    print(f"nano-vllm up in {start_s:.1f} s ({limits})", flush=True)
    t0 = time.perf_counter()
    for batch, lens in warmups:
        timed_generate(llm, SamplingParams, batch, lens)
    warmup_s = time.perf_counter() - t0
    print(f"warm-up {warmup_s:.1f} s; serving {len(prompts)} requests", flush=True)
    wall = timed_generate(llm, SamplingParams, prompts, max_tokens)
    return {
        "system": "nano-vllm",
        "workload": args.workload,
        **summary,
        "block_size": NANO_BLOCK_SIZE,
        **limits,
        "temperature": TEMPERATURE,
        "start_s": round(start_s, 1),
        "warmup_s": round(warmup_s, 1),
        "wall_s": round(wall, 3),
        "tok_per_s": round(counted / wall, 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = lc.parser()  # the long-context workload's flags, so that both systems read the same ones
    ap.description = __doc__
    ap.epilog = (
        "nano_recipe: BENCHMARKS.md's 256 requests, tok/s = sum of max_tokens / wall; long_context: "
        "bench_long_context.py's window and flags, tok/s = (prompt + output tokens) / wall. Block size "
        "256, prefix caching and CUDA graphs are nano-vllm's own; temperature 0.6 (it has no greedy)."
    )
    ap.add_argument(
        "--workload", required=True, choices=["nano_recipe", "long_context"], help="what to serve"
    )
    ap.add_argument("--json", required=True, help="write the summary here")
    ap.add_argument("--num-seqs", type=int, default=256, help="nano_recipe: number of requests")
    args = ap.parse_args(argv)
    if args.model_dir is None:
        raise SystemExit("--model-dir is required (a checkpoint folder with a tokenizer)")
    if args.workload == "long_context" and args.block_size != NANO_BLOCK_SIZE:
        args.block_size = NANO_BLOCK_SIZE  # token ids depend only on the vocabulary rule; say so
        print(f"nano-vllm serves at block size {NANO_BLOCK_SIZE}", flush=True)
    result = run(args)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"nano-vllm {args.workload}: {result['tok_per_s']:,.1f} tok/s ({result['wall_s']} s)", flush=True)


if __name__ == "__main__":
    main()
