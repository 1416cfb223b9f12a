"""RMSNorm compiled on the CPU (minivllm.models.rms_norm): the same bits as the module's own call for
mlx-lm's RMSNorm and Gemma's (1 + w) one, whatever a step's token count, for every width and eps in one
process (one shapeless compile serves every shape)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.gemma3_text import RMSNorm as GemmaRMSNorm

from minivllm.models.rms_norm import rms_norm


def module(kind, width: int, eps: float) -> nn.Module:
    norm = kind(width, eps=eps)
    norm.weight = mx.random.normal((width,), key=mx.random.key(width))
    return norm


@pytest.mark.parametrize("kind", [nn.RMSNorm, GemmaRMSNorm], ids=["mlx-lm", "gemma"])
def test_compiled_norm_gives_the_modules_own_bits(kind):
    for width, eps in [(128, 1e-6), (896, 1e-6), (32, 1e-5), (128, 1e-5)]:
        norm = module(kind, width, eps)
        for shape in [(1, width), (7, width), (300, width), (5, 4, width)]:  # decode, prefill, q/k heads
            for scale in (1e-3, 1.0, 50.0):  # a mean of squares near eps, and far above it
                x = scale * mx.random.normal(shape, key=mx.random.key(len(shape) + shape[0]))
                np.testing.assert_array_equal(np.asarray(rms_norm(norm, x)), np.asarray(norm(x)))


def test_other_dtypes_and_modules_run_their_own_call():
    norm = module(nn.RMSNorm, 64, 1e-6)
    x = mx.random.normal((3, 64)).astype(mx.bfloat16)
    assert rms_norm(norm, x).dtype == norm(x).dtype
    np.testing.assert_array_equal(
        np.asarray(rms_norm(norm, x).astype(mx.float32)), np.asarray(norm(x).astype(mx.float32))
    )
    layer_norm = nn.LayerNorm(64)
    x = mx.random.normal((3, 64))
    np.testing.assert_array_equal(np.asarray(rms_norm(layer_norm, x)), np.asarray(layer_norm(x)))
