"""benchmarks/bench_long_context.py on the CPU: the default window's size, token ids as the replay
makes them, the floor's arithmetic on hand-made steps, and a tiny end-to-end run with prefix hits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_long_context as lc  # noqa: E402  (after the path fix)

from engine.model_spec import ModelSpec  # noqa: E402
from traces.schema import synthetic_vocab_size  # noqa: E402


def test_default_window_is_about_the_reference_size() -> None:
    args = lc.parse_args([])
    trace, summary = lc.select_requests(lc.load_trace(args.trace), args.window, args.max_prompt)
    assert (summary["requests"], summary["prompt_tokens"], summary["output_tokens"]) == (
        367,
        3_342_571,
        68_578,
    )
    assert summary["max_prompt_len"] <= 30_000 and trace.df["prompt_len"].max() <= 30_000
    assert summary["dropped_long_prompts"] == summary["requests_in_window"] - summary["requests"]


def test_token_ids_are_the_replays() -> None:
    args = lc.parse_args(["--max-requests", "5"])
    work = lc.window_workload(args, vocab_size=151936)
    vocab = synthetic_vocab_size(151936, 256)  # what engine.replay asks at block 256
    assert work.summary["vocab"] == vocab == 256
    assert work.prompts == [work.trace.token_ids(i, vocab) for i in range(5)]
    assert [len(p) for p in work.prompts] == work.trace.df["prompt_len"].tolist()


def test_warmup_batches() -> None:
    work = lc.window_workload(lc.parse_args(["--max-requests", "3"]), vocab_size=512)
    assert lc.warmup_batches("none", work, 256) == []
    assert lc.warmup_batches("request", work, 256) == [([[1, 2, 3, 4]], [8])]
    _, (a, _), (b, _) = lc.warmup_batches("prefix", work, 256, max_model_len=1024)
    assert len(a[0]) == len(b[0]) == 512 and a[0][:384] == b[0][:384] and a[0][384:] != b[0][384:]
    ((prompts, lens),) = lc.warmup_batches("workload", work, 256)
    assert lens == work.output_lens and [len(p) for p in prompts] == [len(p) for p in work.prompts]
    assert prompts != work.prompts  # other ids: no hit on the timed run's blocks


def test_floor_of_hand_made_steps() -> None:
    spec = ModelSpec("m", "Qwen3ForCausalLM", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     hidden_size=32, intermediate_size=64, vocab_size=100, tie_word_embeddings=True)  # fmt: skip
    costs = lc.ModelCosts.of(spec)
    assert costs.layer_matrix_params == 2 * (32 * 32 * 2 + 2 * 32 * 16 + 3 * 32 * 64)
    assert (costs.head_params, costs.attn_flops_per_pair) == (3200, 4 * 2 * 4 * 8)
    assert costs.kv_bytes_per_token == 2 * 2 * 2 * 8 * 2  # K and V, 2 layers, 2 heads, d 8, bf16
    steps = pd.DataFrame(
        {
            "kind": ["prefill", "decode"],
            "total_num_scheduled_tokens": [100, 2],
            "num_context_tokens": [0, 200],
            "num_decode_seqs": [0, 2],
            "num_prefill_seqs": [1, 0],
            "prefill_attn_work": [100 * 101 / 2, 0.0],
        }
    )
    flops, nbytes = lc.step_costs(steps, costs)
    p, h, a = costs.layer_matrix_params, costs.head_params, costs.attn_flops_per_pair
    assert flops.tolist() == [2 * p * 100 + 2 * h + a * 5050, 2 * p * 2 + 2 * h * 2 + a * 202]
    w, kv = costs.weight_bytes, costs.kv_bytes_per_token
    assert nbytes.tolist() == [w + kv * 100, w + kv * 202]
    floor = lc.run_floor(steps, costs, wall_s=1.0, tokens=302, tflops=1e-9, tbps=1e-9)  # 1 kFLOP/s, 1 kB/s
    per_step = sum(max(f, b) for f, b in zip(flops, nbytes)) / 1e3
    assert floor["per_step_floor_s"] == pytest.approx(per_step)
    assert floor["compute_floor_s"] == pytest.approx(flops.sum() / 1e3)
    assert floor["fraction_of_floor"] == pytest.approx(per_step)
    assert floor["tok_per_s_at_floor"] == pytest.approx(302 / per_step)


def write_shared_trace(path: Path) -> Path:
    """Four mooncake-format requests: the second and third share the first one's two 512-token blocks."""
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
        {"timestamp": 1000, "input_length": 1200, "output_length": 4, "hash_ids": [0, 1, 3]},
        {"timestamp": 2000, "input_length": 1030, "output_length": 2, "hash_ids": [0, 1, 4]},
        {"timestamp": 3000, "input_length": 300, "output_length": 5, "hash_ids": [5]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_end_to_end_on_cpu_with_prefix_hits(tmp_path: Path) -> None:
    trace = write_shared_trace(tmp_path / "shared.jsonl")
    out = tmp_path / "out"
    argv = ["--small", "--trace", str(trace), "--window", "0:10", "--max-prompt", "2000",
            "--max-model-len", "2048", "--block-size", "16", "--out", str(out)]  # fmt: skip
    result = lc.main(argv)
    saved = json.loads((out / "long_context.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert (out / "steps.parquet").is_file()
    assert (saved["requests"], saved["prompt_tokens"], saved["output_tokens"]) == (4, 3630, 14)
    assert saved["shared_prefix_tokens"] == 2 * 1024
    assert (saved["prefix_queried_tokens"], saved["prefix_hit_tokens"]) == (3630, 2 * 1024)
    assert saved["prefix_hit_rate"] == round(2048 / 3630, 4)
    wall = saved["wall_s"]  # rounded to 1 ms: a CPU run of some 50 ms is 1 % off by rounding alone
    assert 3644 / (wall + 5e-4) - 0.05 <= saved["tok_per_s"] <= 3644 / (wall - 5e-4) + 0.05
    assert saved["floor"]["per_step_floor_s"] > 0 and saved["floor"]["fraction_of_floor"] > 0
    assert (saved["device"], saved["backend"], saved["async_scheduling"]) == ("cpu", "torch", True)
