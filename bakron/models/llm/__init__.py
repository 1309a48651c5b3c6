"""Llama-family causal language models (Llama, SmolLM2, Qwen3) in numpy/cupy, without PyTorch."""
