"""Vocabulary-parallel token embedding and LM head: each rank holds a contiguous slice of the vocab.

The embedding zeroes ids outside this rank's slice and all-reduces; the head gathers every rank's
logits on rank 0 (the rank that samples). With one rank both are a plain `F.embedding` / `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.distributed import all_reduce, gather_last_dim, resolve_tp


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = resolve_tp(tp_rank, tp_size)
        if num_embeddings % self.tp_size:
            raise ValueError(
                f"vocab_size: {num_embeddings} is not divisible by tensor_parallel_size {self.tp_size}"
            )
        self.num_embeddings = num_embeddings
        self.per_rank = num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        param.data.copy_(loaded.narrow(0, self.vocab_start, self.per_rank))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mask = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mask.unsqueeze(-1)
        return all_reduce(out, self.tp_size)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = hidden @ W^T over this rank's vocab slice, gathered to the full vocabulary on rank 0
    (None on the other ranks)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return gather_last_dim(F.linear(hidden_states, self.weight), self.tp_rank, self.tp_size)
