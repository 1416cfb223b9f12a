"""Greedy reference outputs from mlx-lm itself, for parity tests.

The reference runs the weights as minivllm does on this backend: float32 (dequantized, with the
product scale * q + bias formed in float32) on the CPU, as stored (quantized stays quantized) on a GPU.
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step

from minivllm.models.backend import detect_backend
from minivllm.models.loader import dequantize_to_float32


class MlxLmReference:
    def __init__(self, model_dir):
        self.model, self.tokenizer = mlx_lm.load(str(model_dir))
        if not detect_backend().is_gpu:
            self.model = dequantize_to_float32(self.model)

    def greedy(self, prompt: list[int], max_tokens: int, prefill_step_size: int = 2048) -> list[int]:
        """prefill_step_size: mlx-lm's prefill chunk (smaller ones are faster for long prompts on the CPU)."""
        steps = generate_step(
            mx.array(prompt), self.model, max_tokens=max_tokens, prefill_step_size=prefill_step_size
        )
        return [int(t) for t, _ in steps]
