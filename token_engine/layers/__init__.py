"""Attention over the paged KV pool (prefill and decode) and the Llama family's blocks (`blocks.py`), each with its
CUDA kernels."""
