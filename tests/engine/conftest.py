"""Fixtures for the engine data-plane tests: tiny random Qwen3 / Llama checkpoints (float32, made
once per session with transformers' classes) and HF transformers' greedy outputs on them."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny tensors: intra-op threads only add contention (24x slower on a busy 2-core runner)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from engine.checkpoint import make_random_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {
        arch: make_random_checkpoint(root / arch, arch, "tiny", seed=1, dtype="float32", init_std=0.2)
        for arch in ("qwen3", "llama")
    }


@pytest.fixture(scope="session")
def hf_greedy(checkpoints) -> dict[str, list[list[int]]]:
    """HF transformers `generate` (greedy, no EOS stop) on every prompt, per architecture."""
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for arch, path in checkpoints.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.generation_config.eos_token_id = None
        results = []
        for prompt in make_prompts():
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            results.append(gen[0, len(prompt) :].tolist())
        out[arch] = results
    return out
