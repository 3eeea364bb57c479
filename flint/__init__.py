"""flint: the fastest batch-1 LLM decoder on Hopper GPUs.

One persistent CUDA kernel runs a whole int4 decode step; a PyTorch reference decoder checks it;
speculative decoding rides on top. Start with `flint chat --selftest` (README).
"""
__version__ = "0.1.0"
