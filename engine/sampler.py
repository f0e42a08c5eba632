"""Batched sampling with per-request temperature, top-k and top-p; temperature 0 is greedy argmax.

Sampling draws with the exponential-race trick (argmax of p / E, E ~ Exp(1)), which needs no
host sync; top-k / top-p masking (a sort of the logits) runs only when some request asks for it.
"""

from __future__ import annotations

import torch


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(
        self,
        logits: torch.Tensor,  # [S, V]
        temperatures: torch.Tensor,  # [S] float32, 0 = greedy
        top_ks: torch.Tensor | None = None,  # [S] int32, -1 = off
        top_ps: torch.Tensor | None = None,  # [S] float32, 1 = off
        all_greedy: bool = False,
    ) -> torch.Tensor:
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        if all_greedy:
            return greedy
        is_greedy = temperatures == 0
        scaled = logits / torch.where(is_greedy, 1.0, temperatures).unsqueeze(1)
        if top_ks is not None and top_ps is not None:
            scaled = apply_top_k_top_p(scaled, top_ks, top_ps)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        sampled = probs.div_(noise.clamp_min_(1e-10)).argmax(dim=-1)
        return torch.where(is_greedy, greedy, sampled)


def apply_top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits outside each row's top-k and top-p (nucleus) sets."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_ks > 0, top_ks, vocab).clamp(max=vocab).long()
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    drop |= mass_before >= top_ps.unsqueeze(1)
    drop[:, 0] = False  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
