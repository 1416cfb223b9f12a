"""Models: architectures, loading and the compute backend.

`backend` (picks the compute path and preloads OpenBLAS before MLX is imported), `qwen2` (the
Llama-family forward over a flat ragged batch), `loader` (model references -> mlx-lm modules and
tokenizer), `gguf_import` (GGUF -> MLX model directory) and `default_model` (the offline default model).
It may import `kernels`; nothing of `minivllm.engine`, `minivllm.cache` or the entry points.
"""
