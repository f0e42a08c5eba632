"""Tensor-parallel-ready building blocks of the decoder models (nano-vllm's layers, vLLM's names).

With one rank every layer is a plain torch module; with several, each parameter's `weight_loader`
keeps this rank's shard, row-parallel layers and the vocab-parallel embedding all-reduce their
outputs, and the LM head gathers the logits on rank 0.
"""
