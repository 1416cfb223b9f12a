"""The transcode's building blocks against MLX itself: packing, numpy dequantization, grid fitting."""

import mlx.core as mx
import numpy as np
import pytest

from minivllm.models.gguf_transcode import (
    MLX_BITS,
    dequantize_affine,
    fit_grid,
    narrowest_float,
    pack_levels,
    unpack_levels,
)


@pytest.mark.parametrize("bits", MLX_BITS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_packing_and_dequantization_match_mlx(bits, group_size):
    rng = np.random.default_rng(bits * group_size)
    q = rng.integers(0, 2**bits, (24, 256), dtype=np.uint8)
    packed = pack_levels(q, bits)
    assert packed.dtype == np.uint32 and packed.shape == (24, 256 * bits // 32)
    np.testing.assert_array_equal(unpack_levels(packed, bits), q)
    scales = rng.standard_normal((24, 256 // group_size)).astype(np.float32)
    biases = rng.standard_normal((24, 256 // group_size)).astype(np.float32)
    by_mlx = mx.dequantize(mx.array(packed), mx.array(scales), mx.array(biases), group_size, bits)
    np.testing.assert_array_equal(dequantize_affine(packed, scales, biases, bits), np.array(by_mlx))
    # and words MLX packed itself: read back as levels (scale 1, bias 0), we pack them into the same words
    wq, *_ = mx.quantize(mx.array(rng.standard_normal((24, 256)).astype(np.float32)), group_size, bits)
    ones, zeros = mx.ones(scales.shape), mx.zeros(scales.shape)
    levels = np.array(mx.dequantize(wq, ones, zeros, group_size, bits)).astype(np.uint8)
    np.testing.assert_array_equal(pack_levels(levels, bits), np.array(wq))


def test_fit_grid_finds_the_narrowest_exact_width():
    rng = np.random.default_rng(0)
    step = np.float32(3 / 128)  # few mantissa bits, so step * k is exact
    levels = rng.integers(0, 64, (16, 64))
    levels[:, ::32] = 0  # every group spans 0..63: 6 bits, no fewer
    levels[:, 1::32] = 63
    w = (levels * step - np.float32(0.375)).astype(np.float32)
    affine = fit_grid(w)
    assert (affine.bits, affine.max_error, affine.tolerance) == (6, 0.0, 0.0)
    np.testing.assert_array_equal(affine.q, levels)
    constant = fit_grid(np.full((2, 64), 0.25, np.float32))  # a constant group: step 0
    assert constant.bits == 2 and constant.max_error == 0.0


def test_fit_grid_rounds_to_8_bits_when_no_grid_fits():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    affine = fit_grid(w)
    assert affine.bits == 8 and 0 < affine.max_error <= affine.tolerance
    recon = affine.scales.repeat(32, 1) * affine.q + affine.biases.repeat(32, 1)
    half_step = (np.ptp(w.reshape(16, 2, 32), axis=-1) / 255 / 2).repeat(32, 1)
    assert (np.abs(recon - w) <= half_step * 1.001).all()


def test_fit_grid_keeps_exact_groups_exact_in_an_8_bit_tensor():
    rng = np.random.default_rng(2)
    exact = (rng.integers(0, 200, (4, 32)) * np.float32(1 / 64)).astype(np.float32)  # 8 bits
    exact[:, 0], exact[:, 1] = 0, np.float32(1 / 64)  # the smallest gap is the step
    noisy = rng.standard_normal((4, 32)).astype(np.float32)
    affine = fit_grid(np.concatenate([exact, noisy], axis=1))
    assert affine.bits == 8
    recon = affine.scales.repeat(32, 1) * affine.q + affine.biases.repeat(32, 1)
    np.testing.assert_array_equal(recon[:, :32], exact)


def test_narrowest_float():
    assert narrowest_float(np.array([0.5, -3.0, 1 / 1024], np.float32)) == np.float16
    assert narrowest_float(np.array([0.1], np.float32)) == np.float32  # 0.1 is not a float16
    assert narrowest_float(np.array([1e6], np.float32)) == np.float32  # beyond float16's range
