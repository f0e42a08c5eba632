"""Fixtures for the engine data-plane tests: tiny random Qwen3 / Llama checkpoints (float32, made
once per session with transformers' classes) and HF transformers' greedy outputs on them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from engine_helpers import MAX_NEW_TOKENS, make_prompts  # noqa: E402  (after the path fix)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny tensors: intra-op threads only add contention (24x slower on a busy 2-core runner)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
