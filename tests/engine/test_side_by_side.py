"""benchmarks/side_by_side.py and nano_vllm_peer.py on the CPU: nano-vllm's path fails with a clear
message, the child command lines, the recipe equal to bench_throughput's, the tokenizer folder
nano-vllm needs, and our side of a tiny run end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import nano_vllm_peer  # noqa: E402  (after the path fix)
import side_by_side as sbs  # noqa: E402


def test_nano_recipe_equals_bench_throughputs() -> None:
    from bench_throughput import nano_vllm_workload

    prompts, params = nano_vllm_workload()
    ours_prompts, max_tokens = nano_vllm_peer.nano_recipe()
    assert ours_prompts == prompts and max_tokens == [p.max_tokens for p in params]
    assert sum(max_tokens) == 133_966  # BENCHMARKS.md


def test_nano_without_peers_or_cuda_says_why(tmp_path: Path, monkeypatch) -> None:
    args, _ = sbs.parse_args(["--out", str(tmp_path), "--peers", str(tmp_path / "none")])
    with pytest.raises(SystemExit, match="no nano-vllm/nanovllm"):
        sbs.check_nano(args)
    (tmp_path / "p" / "nano-vllm" / "nanovllm").mkdir(parents=True)
    (tmp_path / "p" / "fa2_shim").mkdir()
    args, _ = sbs.parse_args(["--out", str(tmp_path), "--peers", str(tmp_path / "p")])
    monkeypatch.setattr(sbs, "cuda_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        sbs.check_nano(args)
    args, _ = sbs.parse_args(["--out", str(tmp_path), "--systems", "ours"])
    assert sbs.check_nano(args) is None


def test_nano_child_without_cuda_exits_clearly() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit, match="nano-vllm needs a CUDA GPU"):
        nano_vllm_peer.require_nano_vllm()


def test_child_commands(tmp_path: Path) -> None:
    args, extra = sbs.parse_args(["--out", str(tmp_path), "--window", "0:150", "--warmup", "request"])
    assert extra == ["--window", "0:150", "--warmup", "request"]
    model, js = tmp_path / "m", tmp_path / "x.json"
    recipe = sbs.child_command("ours", "nano_recipe", model, js, args, extra)
    assert recipe[1].endswith("bench_throughput.py")
    assert " ".join(recipe[2:]).count("--block-size 256 --async-scheduling on") == 1
    long = sbs.child_command("ours", "long_context", model, js, args, extra)
    assert long[1].endswith("bench_long_context.py") and long[-4:] == extra
    assert "--block-size" in long and "--async-scheduling" in long
    nano = sbs.child_command("nano", "long_context", model, js, args, extra)
    assert nano[1].endswith("nano_vllm_peer.py") and nano[-4:] == extra
    assert nano[nano.index("--workload") + 1] == "long_context"
    env = sbs.child_env(Path("/peers"))["PYTHONPATH"].split(":")
    assert env[:3] == ["/peers/nano-vllm", "/peers/fa2_shim", str(ROOT)]
    assert sbs.child_env(None)["PYTHONPATH"].split(":")[0] == str(ROOT)


def test_tokenizer_folder_for_nano_vllm(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from engine.checkpoint import make_random_checkpoint

    model = make_random_checkpoint(tmp_path / "m", "qwen3", "tiny", dtype="bfloat16", eos_token_id=7)
    folder = sbs.write_tokenizer_copy(model, tmp_path / "m_tok")
    tok = AutoTokenizer.from_pretrained(str(folder), use_fast=True)
    assert (len(tok), tok.eos_token_id) == (512, 7)
    assert tok.decode([3, 4]) == "t3 t4"
    assert AutoConfig.from_pretrained(str(folder)).vocab_size == 512
    assert (folder / "model.safetensors").resolve() == (model / "model.safetensors").resolve()


@pytest.mark.slow
def test_ours_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, str(BENCH / "side_by_side.py"), "--out", str(out), "--small", "--systems", "ours"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=sbs.child_env(None))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "side_by_side.json").read_text())
    assert [(r["system"], r["workload"], r["rc"]) for r in summary["runs"]] == [
        ("ours", "nano_recipe", 0),
        ("ours", "long_context", 0),
    ]
    assert all(r["result"]["tok_per_s"] > 0 for r in summary["runs"])
    assert (out / "ours_nano_recipe.log").is_file() and (
        out / "ours_long_context" / "long_context.json"
    ).is_file()
    table = done.stdout.splitlines()[-3:]
    assert table[0].split()[0] == "nano_recipe" and table[1].split()[0] == "long_context"
    assert table[2].startswith("kvplan long_context:") and "of its per-step floor" in table[2]


def test_scripts_import_neither_simpy_nor_torch_before_they_run() -> None:
    """The GPU machine has no simpy; the parent and the workload code never need torch."""
    code = (
        "import sys; sys.path.insert(0, 'benchmarks')\n"
        "import bench_long_context, nano_vllm_peer, side_by_side\n"
        "assert 'torch' not in sys.modules and 'simpy' not in sys.modules\n"
        "import engine.llm, bench_throughput\n"
        "assert 'simpy' not in sys.modules and not any(m.startswith('simulator') for m in sys.modules)\n"
    )
    env = sbs.child_env(None)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
