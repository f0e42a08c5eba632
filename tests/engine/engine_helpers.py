"""Shared values of the engine tests (a module of its own: two test folders have a conftest, so
`from conftest import ...` breaks when both are collected in one run)."""

from __future__ import annotations

import random

MAX_NEW_TOKENS = 12


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
