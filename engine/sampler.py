"""Batched sampling with per-request temperature, top-k and top-p; temperature 0 is greedy argmax.

Sampling draws with the exponential-race trick (argmax of p / E, E ~ Exp(1)), which needs no
host sync; top-k / top-p masking (a sort of the logits) runs only when some request asks for it.
On CUDA the argmaxes run in Triton (engine/layers/argmax.py: the same result as torch's, and an
all-greedy batch needs no float copy of its logits) unless the kernel config's `triton_argmax` is off.
"""

from __future__ import annotations

import torch

from engine import envs
from engine.layers import argmax


class Sampler:
    def __init__(self, generator: torch.Generator | None = None, triton_argmax: bool | None = None) -> None:
        """`triton_argmax`: argmax CUDA logits in Triton (the model runner passes its kernel config's;
        default: where Triton is installed, as the active kernel config says, `envs.current`)."""
        self.generator = generator
        if triton_argmax is None:
            triton_argmax = argmax.available() and envs.current("triton_argmax")
        self.triton_argmax = triton_argmax

    def __call__(
        self,
        logits: torch.Tensor,  # [S, V]
        temperatures: torch.Tensor,  # [S] float32, 0 = greedy
        top_ks: torch.Tensor | None = None,  # [S] int32, -1 = off
        top_ps: torch.Tensor | None = None,  # [S] float32, 1 = off
        all_greedy: bool = False,
    ) -> torch.Tensor:
        if all_greedy:
            return self.argmax_rows(logits)
        logits = logits.float()
        greedy = self.argmax_rows(logits)
        is_greedy = temperatures == 0
        scaled = logits / torch.where(is_greedy, 1.0, temperatures).unsqueeze(1)
        if top_ks is not None and top_ps is not None:
            scaled = apply_top_k_top_p(scaled, top_ks, top_ps)
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        sampled = self.argmax_rows(probs.div_(noise.clamp_min_(1e-10)))
        return torch.where(is_greedy, greedy, sampled)

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """`x.float().argmax(-1)` (int64), through the Triton kernels where they serve."""
        if self.triton_argmax and argmax.serves(x):
            return argmax.argmax(x)
        return x.float().argmax(dim=-1)


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
