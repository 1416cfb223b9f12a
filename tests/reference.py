"""Greedy reference outputs from mlx-lm itself, for parity tests.

The reference runs the weights as minivllm does on this backend: float32 (dequantized) on the CPU,
as stored (4-bit stays 4-bit) on a GPU.
"""

import minivllm  # noqa: F401  (loads OpenBLAS before anything imports mlx)

# isort: split
import mlx.core as mx
import mlx_lm
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.utils import dequantize_model

from minivllm.models.backend import detect_backend


class MlxLmReference:
    def __init__(self, model_dir):
        self.model, self.tokenizer = mlx_lm.load(str(model_dir))
        if not detect_backend().is_gpu:
            self.model = dequantize_model(self.model)
            self.model.update(tree_map(lambda p: p.astype(mx.float32), self.model.parameters()))

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        return [int(t) for t, _ in generate_step(mx.array(prompt), self.model, max_tokens=max_tokens)]
