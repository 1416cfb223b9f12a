"""Models: architectures, loading and the compute backend.

`backend` (picks the compute path and preloads OpenBLAS before MLX is imported), `families` (the
architectures the forward runs, checked at load), `layers` (the forward over a flat ragged batch) with one
file per family's block (`qwen2`, `phi3`, `gemma3_text`), `loader` (model references -> mlx-lm modules and
tokenizer), `gguf_import` (GGUF -> MLX model directory) and `default_model` (the offline default model).
It may import `kernels`; nothing of `minivllm.engine`, `minivllm.cache` or the entry points.
"""
