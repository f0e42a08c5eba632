"""Engine throughput on BENCHMARKS.md's long-context offline batch (a shipped trace's window, all at
once), with the run's compute / bandwidth floor, the fraction of it reached and the prefix hit rate.

    PYTHONPATH=. python3 benchmarks/bench_long_context.py --block-size 256 --out out/long
    PYTHONPATH=. python3 benchmarks/bench_long_context.py --small --out /tmp/long   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from engine.memory import kv_bytes_per_token, param_bytes
from engine.model_spec import ModelSpec
from traces.loaders import load, load_shipped, shipped_names
from traces.schema import Trace, synthetic_vocab_size
from traces.transforms import time_window

DEFAULT_WINDOW = "590:700"  # 367 requests, 3.34M prompt tokens, 68,578 output tokens (see --help)
REFERENCE = "375 requests, 3.30M prompt tokens (about 37% in shared prefixes), 122,557 output tokens"
H200_TFLOPS, H200_TBPS = 797.0, 4.25  # BENCHMARKS.md: bf16 8192^3 matmul, device-to-device copy
WARMUPS = ("none", "request", "prefix", "workload")
EPILOG = """\
The requests of --window whose prompts are at most --max-prompt tokens; token ids synthesised from
the trace's prefix hashes as engine.replay makes them; output lengths from the trace, EOS ignored;
random weights of a real shape. Throughput = (prompt + output tokens) / wall time of the generate
call, from an empty prefix cache. Floor, per recorded step: FLOPs = 2 x layer matrix params x tokens
computed + 2 x LM-head params x sequences sampled + causal attention over the tokens computed; bytes =
weights once + the KV of every context token read + the new tokens' KV written; the per-step floor
sums the larger of FLOPs / --peak-tflops and bytes / --peak-tbps. The workload and floor functions
import no torch: the nano-vllm side-by-side child (nano_vllm_peer.py) reuses them."""


# --------------------------------------------------------------------------- workload (torch-free)


@dataclass(frozen=True)
class Workload:
    """The timed requests: the trace rows, their prompts as token-id lists, their output lengths,
    and what was chosen (`summary`, JSON-ready)."""

    trace: Trace
    prompts: list[list[int]]
    output_lens: list[int]
    summary: dict

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def parse_window(text: str) -> tuple[float, float]:
    """'590:700' -> (590.0, 700.0) seconds of trace time."""
    try:
        start, end = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"window: expected START:END in seconds, got {text!r}") from None
    if end <= start:
        raise argparse.ArgumentTypeError(f"window: END ({end}) must be > START ({start})")
    return start, end


def load_trace(name_or_path: str) -> Trace:
    """A shipped trace by name (e.g. mooncake_synthetic), else a trace file."""
    return load_shipped(name_or_path) if name_or_path in shipped_names() else load(name_or_path)


def select_requests(
    trace: Trace,
    window: tuple[float, float],
    max_prompt: int,
    max_requests: int | None = None,
    max_output: int | None = None,
) -> tuple[Trace, dict]:
    """Rows arriving in `window` with prompt_len <= max_prompt (the first max_requests of them, output
    lengths capped at max_output when given); the trace and what was chosen."""
    win = time_window(trace, *window)
    df = win.df
    keep = df.loc[df["prompt_len"] <= max_prompt]
    if max_requests is not None:
        keep = keep.iloc[:max_requests]
    keep = keep.reset_index(drop=True)
    if max_output is not None:
        keep = keep.assign(output_len=np.minimum(keep["output_len"].to_numpy(), max_output))
    if keep.empty:
        raise SystemExit(
            f"{trace.name}: no request in window {window[0]:g}:{window[1]:g} s fits --max-prompt"
        )
    chosen = win.with_frame(keep, validate=False)
    summary = {
        "trace": trace.name,
        "window_s": list(window),
        "requests_in_window": len(df),
        "requests": len(keep),
        "dropped_long_prompts": int((df["prompt_len"] > max_prompt).sum()),
        "max_prompt": max_prompt,
        "prompt_tokens": int(keep["prompt_len"].sum()),
        "output_tokens": int(keep["output_len"].sum()),
        "max_prompt_len": int(keep["prompt_len"].max()),
        "shared_prefix_tokens": shared_prefix_tokens(chosen),
    }
    return chosen, summary


def shared_prefix_tokens(trace: Trace) -> int:
    """Prompt tokens in leading prefix blocks that an earlier request of `trace` already had (the
    sharing an infinite cache could use; 0 without prefix ids)."""
    if not trace.has_prefix_ids:
        return 0
    seen: set[int] = set()
    shared = 0
    lens = trace.df["prompt_len"].to_numpy()
    for i in range(len(trace)):
        key, matched, leading = 0, 0, True
        for block_id in trace.prefix_ids(i).tolist():
            key = hash((key, block_id))
            leading = leading and key in seen
            matched += leading
            seen.add(key)
        shared += min(matched * trace.prefix_block_size, int(lens[i]))
    return shared


def token_vocab(vocab_size: int, block_size: int) -> int:
    """How many distinct synthetic token values prompts take: the replay's (and simulator's) rule."""
    return synthetic_vocab_size(vocab_size, block_size)


def build_workload(trace: Trace, summary: dict, vocab: int, salt: int = 0) -> Workload:
    """Token ids from the trace's prefix hashes (Trace.token_ids, as engine.replay makes them)."""
    prompts = [trace.token_ids(i, vocab, salt) for i in range(len(trace))]
    lens = trace.df["output_len"].astype(int).tolist()
    return Workload(trace, prompts, lens, {**summary, "vocab": vocab})


def warmup_batches(
    kind: str, workload: Workload, vocab: int, max_model_len: int = 32768
) -> list[tuple[list[list[int]], list[int]]]:
    """Batches (prompts, max_tokens) served before the timed run, one generate call each.

    request: one 4-token request (the nano-vllm recipe's); prefix: that, then a prompt of 1,024
    tokens (at most half of max_model_len) and one sharing its first three quarters (a prefill over a
    cached prefix); workload: the whole workload with other token ids (salt 1: same shapes and
    sharing, no hit on the timed run's blocks)."""
    if kind not in WARMUPS:
        raise ValueError(f"warmup: {kind!r} is not one of {WARMUPS}")
    batches: list[tuple[list[list[int]], list[int]]] = []
    if kind in ("request", "prefix"):
        batches.append(([[1, 2, 3, 4]], [8]))
    if kind == "prefix":
        rng = random.Random(1)
        n = min(1024, max_model_len // 2)
        first = [rng.randrange(vocab) for _ in range(n)]
        batches.append(([first], [8]))
        batches.append(([first[: 3 * n // 4] + [rng.randrange(vocab) for _ in range(n // 4)]], [8]))
    if kind == "workload":
        salted = build_workload(workload.trace, workload.summary, vocab, salt=1)
        batches.append((salted.prompts, salted.output_lens))
    return batches


def window_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """The timed workload of the parsed arguments, for a model of `vocab_size` at args.block_size."""
    trace, summary = select_requests(
        load_trace(args.trace), args.window, args.max_prompt, args.max_requests, args.max_output
    )
    return build_workload(trace, summary, token_vocab(vocab_size, args.block_size))


def describe(summary: dict) -> str:
    s = summary
    return (
        f"{s['trace']} window {s['window_s'][0]:g}:{s['window_s'][1]:g} s: {s['requests']} requests "
        f"({s['dropped_long_prompts']} of {s['requests_in_window']} dropped with prompts > {s['max_prompt']}), "
        f"{s['prompt_tokens']:,} prompt tokens (longest {s['max_prompt_len']:,}; "
        f"{s['shared_prefix_tokens'] / s['prompt_tokens']:.0%} in prefixes an earlier request had), "
        f"{s['output_tokens']:,} output tokens; reference: {REFERENCE}"
    )


# --------------------------------------------------------------------------- floor (torch-free)


@dataclass(frozen=True)
class ModelCosts:
    """Per-token and per-step costs of a model: matrix parameters of the layers and of the LM head,
    attention FLOPs per (query, key) pair over all layers, weight bytes, KV bytes per token."""

    layer_matrix_params: int
    head_params: int
    attn_flops_per_pair: int
    weight_bytes: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, spec: ModelSpec) -> ModelCosts:
        h, d = spec.hidden_size, spec.head_dim
        attn = h * spec.num_heads * d * 2 + 2 * h * spec.num_kv_heads * d  # q, o; k, v
        mlp = 3 * h * spec.intermediate_size
        return cls(
            layer_matrix_params=spec.num_layers * (attn + mlp),
            head_params=spec.vocab_size * h,
            attn_flops_per_pair=4 * spec.num_layers * spec.num_heads * d,  # QK^T and PV, 2 FLOPs a MAC
            weight_bytes=param_bytes(spec),
            kv_bytes_per_token=kv_bytes_per_token(spec),
        )


def step_costs(steps: pd.DataFrame, costs: ModelCosts) -> tuple[np.ndarray, np.ndarray]:
    """(FLOPs, bytes) each recorded step needs at least.

    FLOPs: 2 x layer matrix params x tokens computed, 2 x LM-head params x sequences sampled, and
    causal attention over the tokens computed (prefills: the record's prefill_attn_work; decode
    steps: every context token plus itself; the decodes of mixed steps are left out). Bytes: all
    weights once, the KV of every context token read once, the new tokens' KV written once."""
    tokens = steps["total_num_scheduled_tokens"].to_numpy(dtype=float)
    context = steps["num_context_tokens"].to_numpy(dtype=float)
    decode = (steps["kind"] == "decode").to_numpy()
    sampled = np.where(decode, steps["num_decode_seqs"], steps["num_prefill_seqs"]).astype(float)
    pairs = np.where(decode, context + tokens, steps["prefill_attn_work"].to_numpy(dtype=float))
    flops = (
        2.0 * costs.layer_matrix_params * tokens
        + 2.0 * costs.head_params * sampled
        + float(costs.attn_flops_per_pair) * pairs
    )
    nbytes = float(costs.weight_bytes) + float(costs.kv_bytes_per_token) * (context + tokens)
    return flops, nbytes


def run_floor(
    steps: pd.DataFrame, costs: ModelCosts, wall_s: float, tokens: int, tflops: float, tbps: float
) -> dict:
    """The run's compute floor, bandwidth floor and per-step floor (sum over steps of the larger of
    the two), in seconds; the fraction of the per-step floor the wall time reached, and the tok/s
    of `tokens` (prompt + output) at that floor."""
    flops, nbytes = step_costs(steps, costs)
    compute_s, bandwidth_s = flops / (tflops * 1e12), nbytes / (tbps * 1e12)
    per_step = float(np.maximum(compute_s, bandwidth_s).sum())
    return {
        "tflops": tflops,
        "tbps": tbps,
        "tflop": float(flops.sum()) / 1e12,
        "bytes_gb": float(nbytes.sum()) / 1e9,
        "compute_floor_s": float(compute_s.sum()),
        "bandwidth_floor_s": float(bandwidth_s.sum()),
        "per_step_floor_s": per_step,
        "fraction_of_floor": per_step / wall_s if wall_s > 0 else None,
        "tok_per_s_at_floor": tokens / per_step if per_step > 0 else None,
    }


# --------------------------------------------------------------------------- our engine


def make_model(preset: str, device: str, vocab_size: int | None = None) -> Path:
    """A random-weight checkpoint of `preset`'s real shapes in a temporary folder."""
    from engine.checkpoint import make_random_checkpoint

    overrides = {"vocab_size": vocab_size} if vocab_size else {}
    dtype = "float32" if device == "cpu" else "bfloat16"
    draw_on = "cuda" if device == "cuda" else "cpu"
    out = Path(tempfile.mkdtemp()) / preset
    return make_random_checkpoint(out, "qwen3", preset, seed=0, dtype=dtype, device=draw_on, **overrides)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """engine.LLM's arguments, as bench_throughput.py builds them plus the long-context limits."""
    kwargs = dict(
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        policy=args.policy,
        attention_backend=args.backend,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling == "on",
    )
    if args.device == "cpu":
        kwargs.update(device="cpu", dtype="float32", num_kv_blocks=args.num_kv_blocks)
    return kwargs


def serve(llm, prompts: list[list[int]], output_lens: list[int], temperature: float) -> float:
    """One generate call of every prompt (EOS ignored); its wall time in seconds."""
    from engine.sampling_params import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for n in output_lens]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    short = [i for i, (o, n) in enumerate(zip(outs, output_lens)) if len(o["token_ids"]) != n]
    if short:
        reasons = sorted({outs[i]["finish_reason"] for i in short})
        raise RuntimeError(f"{len(short)} requests did not produce their output length (finish: {reasons})")
    return wall


def start_engine(args: argparse.Namespace, model_dir: Path):
    """engine.LLM on `model_dir` as the arguments ask; (the engine, its start-up seconds)."""
    from engine.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(model_dir, **engine_kwargs(args))
    start_s = time.perf_counter() - t0
    print(f"engine up in {start_s:.1f} s: backend {llm.attention_backend}, "
          f"{llm.runner.num_kv_blocks} KV blocks of {args.block_size}", flush=True)  # fmt: skip
    return llm, start_s


def warm_up(llm, args: argparse.Namespace, work: Workload) -> float:
    """The --warmup batches, then an empty prefix cache and step records; seconds taken."""
    t0 = time.perf_counter()
    for prompts, lens in warmup_batches(args.warmup, work, work.summary["vocab"], args.max_model_len):
        serve(llm, prompts, lens, args.temperature)
    llm.reset_prefix_cache()
    llm.recorder.reset()
    llm.num_async_steps = 0
    return time.perf_counter() - t0


def engine_summary(llm, args: argparse.Namespace) -> dict:
    """The engine's settings and counters after the timed run (prefix hits: its block manager's)."""
    bm = llm.block_manager
    return {
        "backend": llm.attention_backend,
        "device": args.device,
        "block_size": args.block_size,
        "num_kv_blocks": llm.runner.num_kv_blocks,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "policy": args.policy,
        "async_scheduling": llm.async_scheduling,
        "async_steps": llm.num_async_steps,
        "temperature": args.temperature,
        "warmup": args.warmup,
        "preemptions": llm.scheduler.num_preemptions,
        "prefix_hit_tokens": bm.num_prefix_hit_tokens,
        "prefix_queried_tokens": bm.num_prefix_queried_tokens,
        "prefix_hit_rate": round(bm.prefix_hit_rate, 4),
    }


def run_ours(args: argparse.Namespace) -> dict:
    """Start the engine, warm it up, serve the window once from an empty prefix cache; the summary."""
    model_dir = Path(args.model_dir or make_model(args.preset, args.device, args.vocab_size))
    spec = ModelSpec.from_hf_config(model_dir)
    work = window_workload(args, spec.vocab_size)
    print(describe(work.summary), flush=True)
    llm, start_s = start_engine(args, model_dir)
    warmup_s = warm_up(llm, args, work)
    print(f"warm-up ({args.warmup}) {warmup_s:.1f} s; serving {len(work.prompts)} requests", flush=True)
    wall = serve(llm, work.prompts, work.output_lens, args.temperature)
    steps = llm.recorder.to_dataframe()
    if args.out:
        llm.recorder.save(Path(args.out) / "steps.parquet")
    total = work.prompt_tokens + work.output_tokens
    result = {
        **work.summary,
        "model": spec.name,
        **engine_summary(llm, args),
        "start_s": round(start_s, 1),
        "warmup_s": round(warmup_s, 1),
        "wall_s": round(wall, 3),
        "tok_per_s": round(total / wall, 1),
        "steps": len(steps),
        "compiled_steps": int(steps["compiled"].sum()),
        "floor": run_floor(steps, ModelCosts.of(spec), wall, total, args.peak_tflops, args.peak_tbps),
    }
    llm.close()
    return result


# --------------------------------------------------------------------------- command line


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, description and epilog kept as written."""


SMALL = dict(
    preset="tiny", device="cpu", max_prompt=700, max_requests=6, max_output=6,
    max_model_len=1024, max_num_batched_tokens=256, backend="torch",
)  # fmt: skip


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, epilog=EPILOG, formatter_class=HelpFormatter
    )  # fmt: skip
    ap.add_argument("--trace", default="mooncake_synthetic", help="shipped trace name or trace file")
    ap.add_argument("--window", type=parse_window, default=DEFAULT_WINDOW,
                    help=f"START:END seconds of trace time; the default is about the size of the "
                    f"reference run: {REFERENCE.replace('%', '%%')}")  # fmt: skip
    ap.add_argument("--max-prompt", type=int, default=30_000, help="keep requests with prompts up to this")
    ap.add_argument(
        "--max-requests", type=int, help="keep only the first N requests of the window (all if unset)"
    )
    ap.add_argument("--max-output", type=int, help="cap each output length (smoke runs; none if unset)")
    ap.add_argument("--model-dir", help="HF checkpoint folder; without one, random weights of --preset")
    ap.add_argument("--preset", default="qwen3-0.6b", help="engine/checkpoint.py preset for random weights")
    ap.add_argument("--vocab-size", type=int, help="override the preset's vocabulary size (unset: keep it)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: float32, torch attention")
    ap.add_argument("--block-size", type=int, default=256, help="KV block size (16 or 256 measured)")
    ap.add_argument("--async-scheduling", default="on", choices=["on", "off"], help="overlap decode steps")
    ap.add_argument("--warmup", default="prefix", choices=WARMUPS, help="what runs before the timed run")
    ap.add_argument("--max-model-len", type=int, default=32768, help="engine max_model_len")
    ap.add_argument("--max-num-batched-tokens", type=int, default=32768, help="engine token budget a step")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="engine max_num_seqs")
    ap.add_argument("--policy", default="chunked", choices=["chunked", "prefill_first"], help="scheduler")
    ap.add_argument("--backend", default="auto", help="attention backend (auto, flash_attn_cute, torch, ...)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--num-kv-blocks", type=int, default=512, help="KV blocks on a CPU (a GPU sizes its own)")
    ap.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (nano-vllm's 0.6)")
    ap.add_argument("--peak-tflops", type=float, default=H200_TFLOPS, help="matrix ceiling, TFLOP/s")
    ap.add_argument("--peak-tbps", type=float, default=H200_TBPS, help="memory ceiling, TB/s")
    ap.add_argument("--small", action="store_true",
                    help=f"CPU smoke run: {', '.join(f'{k}={v}' for k, v in SMALL.items())}")  # fmt: skip
    ap.add_argument(
        "--out", help="write long_context.json and steps.parquet into this folder (unset: print only)"
    )
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Arguments, with --small's values where the command line left the default."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.small:
        for key, value in SMALL.items():
            if getattr(args, key) == ap.get_default(key):
                setattr(args, key, value)
    return args


def print_table(r: dict) -> None:
    f = r["floor"]
    rows = [
        ("requests", f"{r['requests']}"),
        ("prompt / output tokens", f"{r['prompt_tokens']:,} / {r['output_tokens']:,}"),
        ("block size, async", f"{r['block_size']}, {r['async_scheduling']}"),
        ("engine start, warm-up s", f"{r['start_s']}, {r['warmup_s']}"),
        ("wall s", f"{r['wall_s']}"),
        ("throughput tok/s", f"{r['tok_per_s']:,.1f}"),
        ("prefix hit rate", f"{r['prefix_hit_rate']:.1%} ({r['prefix_hit_tokens']:,} tokens)"),
        ("steps (compiled)", f"{r['steps']} ({r['compiled_steps']})"),
        ("compute floor s", f"{f['compute_floor_s']:.4g} ({f['tflop']:.4g} TFLOP at {f['tflops']:g} TFLOP/s)"),
        ("bandwidth floor s", f"{f['bandwidth_floor_s']:.4g} ({f['bytes_gb']:.4g} GB at {f['tbps']:g} TB/s)"),
        ("per-step floor s", f"{f['per_step_floor_s']:.4g} (tok/s at the floor: {f['tok_per_s_at_floor'] or 0:,.0f})"),
        ("fraction of floor", f"{f['fraction_of_floor']:.3f}"),
    ]  # fmt: skip
    for key, value in rows:
        print(f"{key:>24}  {value}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    result = run_ours(args)
    if args.out:
        (Path(args.out) / "long_context.json").write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    return result


if __name__ == "__main__":
    main()
