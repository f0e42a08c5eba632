"""Qwen3 dense decoder: the Llama-family block plus RMSNorm on each query and key head before
rotary (`q_norm`, `k_norm`); Qwen3-0.6B ties its LM head to the embedding."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
