"""kernels/cpu_quantized_matmul.cpp: decode-sized products read a quantized layer's levels, and give the
product of its float32 weights (the same weights, the sums in another order)."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kernels import cpu_quantized_matmul
from minivllm.models.backend import Backend
from minivllm.models.loader import _levels, cache_dir, load_model
from minivllm.models.quantized_linear import DecodeQuantizedLinear
from tests.tiny_model import make_tiny_4bit_model

CPU = Backend("cpu", "test")


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not cpu_quantized_matmul.load(cache_dir() / "kernels"):
        pytest.skip("no C++ compiler")


def quantized(out_features: int, in_features: int, bits: int, group: int, bias: bool, seed: int):
    mx.random.seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    layer.update({k: mx.random.normal(v.shape) for k, v in layer.parameters().items()})
    return nn.QuantizedLinear.from_linear(layer, group_size=group, bits=bits)


def float64_product(x: np.ndarray, layer: nn.QuantizedLinear) -> np.ndarray:
    w = mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
    y = x.astype(np.float64) @ np.array(w, np.float64).T
    return y + np.array(layer.bias, np.float64) if "bias" in layer else y


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_the_kernel_gives_the_product_of_the_dequantized_weights(bits, group):
    layer = quantized(200, 384, bits, group, bias=bits % 2 == 0, seed=bits * group)
    levels, scales, biases = _levels(layer)
    bias = np.array(layer.bias) if "bias" in layer else None
    for rows in (1, 3, 8, 9, 16):  # one pass of up to 8 rows, then more
        x = mx.random.normal((rows, 384))
        y = np.array(cpu_quantized_matmul.matmul(x, levels, scales, biases, bias))
        expected = float64_product(np.array(x), layer)
        assert y.shape == (rows, 200)
        assert np.abs(y - expected).max() <= 1e-5 * np.abs(expected).max()


def test_float32_scales_are_kept_where_float16_would_round_them():
    layer = quantized(64, 128, 4, 32, bias=False, seed=1)
    # as checkpoints store them (the loader has made them float32 by the time it reads the levels)
    layer.scales, layer.biases = (
        a.astype(mx.float16).astype(mx.float32) for a in (layer.scales, layer.biases)
    )
    x = mx.random.normal((2, 128))
    for precision in (np.float16, np.float32):
        if precision == np.float32:
            layer.scales = layer.scales * (1 + 2**-15)  # past float16's precision
        levels, scales, biases = _levels(layer)
        assert scales.dtype == biases.dtype == precision
        expected = float64_product(np.array(x), layer)
        y = np.array(cpu_quantized_matmul.matmul(x, levels, scales, biases, None))
        assert np.abs(y - expected).max() <= 1e-5 * np.abs(expected).max()


def test_decode_sized_products_go_to_the_kernel_and_prefill_sized_ones_to_the_float32_copy(monkeypatch):
    source = quantized(96, 256, 5, 32, bias=True, seed=2)
    dense = nn.Linear(256, 96)
    dense.weight = mx.dequantize(source.weight, source.scales, source.biases, 32, 5)
    dense.bias = source.bias
    layer = DecodeQuantizedLinear(dense, *_levels(source))
    calls, matmul = [], cpu_quantized_matmul.matmul
    monkeypatch.setattr(cpu_quantized_matmul, "matmul", lambda x, *a: calls.append(x.shape) or matmul(x, *a))
    assert cpu_quantized_matmul.MAX_ROWS == 4
    for shape in [(1, 1, 256), (2, 2, 256), (1, 5, 256), (3, 256)]:
        x = mx.random.normal(shape)
        y = layer(x)
        assert y.shape == (*shape[:-1], 96)
        expected = float64_product(np.array(x).reshape(-1, 256), source).reshape(y.shape)
        assert np.abs(np.array(y) - expected).max() <= 1e-5 * np.abs(expected).max()
    assert calls == [(1, 1, 256), (2, 2, 256), (3, 256)]  # 5 rows: the float32 copy


@pytest.mark.parametrize("mode", ["compiled", "mlx"])
def test_a_quantized_checkpoint_keeps_its_levels_only_where_the_kernel_runs(tiny_model_dir, tmp_path, mode):
    q4 = make_tiny_4bit_model(tiny_model_dir, tmp_path / "q4")
    model, _, _ = load_model(str(q4), CPU, "transposed", mode)
    kept = [name for name, m in model.named_modules() if isinstance(m, DecodeQuantizedLinear)]
    linear = [name for name, m in model.named_modules() if name.endswith(("proj", "lm_head"))]
    assert kept == (linear if mode == "compiled" else [])
    assert not any(isinstance(p, np.ndarray) for p in model.parameters().values())
