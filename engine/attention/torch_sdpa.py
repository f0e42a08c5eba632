"""Reference backend in plain torch: per sequence, gather its pages and run masked SDPA.

Runs anywhere (CPU tests, any block size) and handles every step kind: prefill, chunked prefill over
cached prefixes, decode and mixed batches. Slow by design; it is the yardstick for the flash backends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata


class TorchSDPABackend(AttentionBackend):
    name = "torch"
    graph_safe = False  # loops over host-side lengths: never captured
    reads_new_kv = False  # gathers pages

    @staticmethod
    def supports_block_size(block_size: int) -> bool:
        return block_size > 0

    @classmethod
    def unavailable_reason(cls, device: torch.device) -> str | None:
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        tables = metadata.block_tables
        start = 0
        for i, (q_len, ctx) in enumerate(zip(metadata.query_lens_cpu, metadata.context_lens_cpu)):
            if q_len == 0:  # a padding sequence (engine/step_graphs.py): no queries, no keys
                continue
            blocks = tables[i, : -(-ctx // block_size)].long()
            keys = k_cache[blocks].flatten(0, 1)[:ctx]
            values = v_cache[blocks].flatten(0, 1)[:ctx]
            out[start : start + q_len] = paged_reference(q[start : start + q_len], keys, values, scale)
            start += q_len
        return out


def paged_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last `len(q)` positions of a context over all `len(keys)` keys
    (bottom-right aligned mask). q [Lq, H, D], keys/values [Lk, Hkv, D] -> [Lq, H, D]."""
    q_len, ctx = q.shape[0], keys.shape[0]
    rows = torch.arange(q_len, device=q.device).unsqueeze(1) + (ctx - q_len)
    mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1],
    )
    return out.transpose(0, 1)
