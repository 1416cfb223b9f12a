"""SwiGLU and softmax: the numpy path (large float32 arrays on the CPU backend) against MLX's."""

import mlx.core as mx
import numpy as np
import pytest

from kernels import activations


@pytest.fixture
def numpy_path(monkeypatch):
    monkeypatch.setattr(activations, "NUMPY_MIN_ELEMENTS", 0)


def gates(rng) -> mx.array:
    g = rng.standard_normal((33, 70)).astype(np.float32) * 4
    g[0, :6] = [-1e4, -100, -88.8, 88.8, 100, 1e4]  # exp(-g) overflows or underflows
    return mx.array(g)


def test_swiglu_numpy_matches_mlx(numpy_path):
    rng = np.random.default_rng(0)
    gate, up = gates(rng), mx.array(rng.standard_normal((33, 70)).astype(np.float32))
    got = np.asarray(activations.swiglu(gate, up))
    g64, u64 = np.asarray(gate, np.float64), np.asarray(up, np.float64)
    with np.errstate(over="ignore"):
        expected = g64 / (1 + np.exp(-g64)) * u64
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(got, np.asarray(activations.swiglu_mlx(gate, up)), rtol=2e-6, atol=1e-30)


def test_softmax_numpy_matches_mlx_with_masked_scores():
    rng = np.random.default_rng(1)
    s = rng.standard_normal((2, 3, 17, 40)).astype(np.float32) * 10
    s[..., 20:] = np.finfo(np.float32).min  # what the causal mask writes
    s[0, 0, 0, :5] = [80, 90, 100, -80, 0]
    scores = mx.array(s)
    got = np.asarray(activations.softmax_numpy(scores))
    np.testing.assert_allclose(got.sum(-1), 1, rtol=1e-6)
    assert (got[..., 20:] == 0).all()
    np.testing.assert_allclose(got, np.asarray(mx.softmax(scores, axis=-1, precise=True)), atol=1e-7)


def test_only_large_float32_work_leaves_the_graph():
    big = activations.NUMPY_MIN_ELEMENTS
    assert activations.on_numpy(mx.float32, big) == (mx.default_device() == mx.cpu)
    assert not activations.on_numpy(mx.float32, big - 1)  # decode-sized work stays lazy
    assert not activations.on_numpy(mx.float16, big)  # numpy has no SIMD half-precision exp
