"""Shared values of the engine tests (a module of its own: two test folders have a conftest, so
`from conftest import ...` breaks when both are collected in one run)."""

from __future__ import annotations

import functools
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]

MAX_NEW_TOKENS = 12
# A small engine on the CPU (torch attention): few KV blocks and a small token budget, so that the
# prompts of `make_prompts` chunk, share cached prefixes and mix prefills with decodes.
CPU_ENGINE = dict(
    block_size=16,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=512,
    num_kv_blocks=128,
    attention_backend="torch",
    device="cpu",
)


def make_prompts(vocab: int = 512, seed: int = 0) -> list[list[int]]:
    """Mixed lengths; prompts 1-2 share a 40-token prefix, prompts 4-5 a 272-token one (a full
    256-token block), so prefix caching hits at block sizes 16 and 256."""
    rng = random.Random(seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    short_prefix, long_prefix = draw(40), draw(272)
    return [
        draw(3),
        short_prefix + draw(9),
        short_prefix + draw(30),
        draw(70),
        long_prefix + draw(20),
        long_prefix + draw(5),
        draw(1),
    ]


def run_interpreted(worker: str, cases: dict[str, Any], folder: Path) -> dict[str, Any]:
    """Run `worker` (a script: argv[1] the saved cases, argv[2] where to save its outputs) under
    Triton's interpreter in a subprocess (TRITON_INTERPRET must be set before triton is first
    imported); returns what it saved."""
    torch.save(cases, folder / "cases.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", worker, str(folder / "cases.pt"), str(folder / "out.pt")],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(folder / "out.pt")


# The serving envelope of issue 25 (docs/CALIBRATION.md): Qwen3-0.6B on an H200 with async scheduling,
# max_model_len 32768, max_num_batched_tokens 8192 and the engine's own cache, 71,457 blocks of 16.
def h200_limits():
    from engine.profiling import SweepLimits

    return SweepLimits(256, 8192, 32768, 71457 * 16, "chunked", 16, async_scheduling=True)


@functools.cache
def h200_plan():
    """The sweep of `h200_limits` and its planned steps (computed once a session: seconds)."""
    from engine.profiling import plan_steps, sweep

    limits = h200_limits()
    work = sweep(limits)
    return work, plan_steps(work, limits, vocab=100_000, eos_token_id=151645)
