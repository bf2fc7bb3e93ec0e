"""Triton kernels of the vLLM plugin, one module per kernel family (kernel + launcher)."""
