"""How to sample one request's tokens and when to stop: the sampler reads the first three fields,
the scheduler `max_tokens` and `ignore_eos`. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature: must be >= 0, got {self.temperature}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k: must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p: must be in (0, 1], got {self.top_p}")
        if self.max_tokens <= 0:
            raise ValueError(f"SamplingParams.max_tokens: must be >= 1, got {self.max_tokens}")
