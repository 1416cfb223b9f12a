"""A quantized Linear layer on the CPU backend: a float32 copy for prefill, the levels for decode.

The CPU backend runs quantized weights as float32 (minivllm.models.loader): for a prefill chunk the
product is compute-bound and OpenBLAS's float32 sgemm is the fastest there is. A decode step is not: it
reads every matrix once for a few rows, and float32 is 4 times the bytes of the levels held one byte each. This
layer keeps both and sends each product where it is faster: few rows to kernels.cpu_quantized_matmul
(the levels, one byte a weight, with the checkpoint's scales and biases), the rest to its float32 copy
`dense` (an nn.Linear, or the TransposedLinear minivllm.models.cpu_layout swaps in). Both form the same
weights, level * scale + bias in float32; only the order of the sums differs.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kernels import cpu_quantized_matmul


class DecodeQuantizedLinear(nn.Module):
    def __init__(self, dense: nn.Module, levels: np.ndarray, scales: np.ndarray, biases: np.ndarray):
        """dense: the float32 layer; levels uint8 [out, in]; scales and biases [out, in / group], float16
        or float32. Numpy arrays, not parameters: the model's parameters stay its float32 weights."""
        super().__init__()
        self.dense = dense
        self.levels, self.scales, self.biases = levels, scales, biases
        self.bias = np.asarray(dense["bias"], dtype=np.float32) if "bias" in dense else None

    def __call__(self, x: mx.array) -> mx.array:
        if cpu_quantized_matmul.fits(x):
            return cpu_quantized_matmul.matmul(x, self.levels, self.scales, self.biases, self.bias)
        return self.dense(x)
