"""The transcode's building blocks against MLX itself: packing, numpy dequantization, grid fitting."""

import gguf.quants
import mlx.core as mx
import mlx.nn
import numpy as np
import pytest

from minivllm.models.gguf_transcode import (
    MLX_BITS,
    AffineWeight,
    fit_grid,
    gguf_values,
    narrowest_float,
    pack_levels,
    unpack_levels,
)
from minivllm.models.loader import dequantize_to_float32


@pytest.mark.parametrize("bits", MLX_BITS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_packing_and_dequantization_match_mlx(bits, group_size):
    rng = np.random.default_rng(bits * group_size)
    q = rng.integers(0, 2**bits, (24, 256), dtype=np.uint8)
    packed = pack_levels(q, bits)
    assert packed.dtype == np.uint32 and packed.shape == (24, 256 * bits // 32)
    np.testing.assert_array_equal(unpack_levels(packed, bits), q)
    scales = rng.standard_normal((24, 256 // group_size)).astype(np.float16)
    biases = rng.standard_normal((24, 256 // group_size)).astype(np.float16)
    by_mlx = mx.dequantize(
        mx.array(packed), mx.array(scales, mx.float32), mx.array(biases, mx.float32), group_size, bits
    )
    if group_size == 32:  # the values transcode verifies against gguf's
        affine = AffineWeight(q, scales.astype(np.float32), biases.astype(np.float32), bits)
        np.testing.assert_array_equal(affine.values(), np.array(by_mlx))
    # the CPU loader's float32 weights: exactly mx.dequantize's in float32, float16 scales or not
    layer = mlx.nn.QuantizedLinear(256, 24, bias=False, group_size=group_size, bits=bits)
    layer.update({"weight": mx.array(packed), "scales": mx.array(scales), "biases": mx.array(biases)})
    model = dequantize_to_float32(mlx.nn.Sequential(layer))
    assert isinstance(model.layers[0], mlx.nn.Linear) and model.layers[0].weight.dtype == mx.float32
    np.testing.assert_array_equal(np.array(model.layers[0].weight), np.array(by_mlx))
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
    assert (affine.bits, affine.tolerance) == (6, 0.0)
    np.testing.assert_array_equal(affine.values(), w)
    np.testing.assert_array_equal(affine.q, levels)
    constant = fit_grid(np.full((2, 64), 0.25, np.float32))  # a constant group: step 0
    assert constant.bits == 2 and (constant.values() == 0.25).all()


def test_fit_grid_rounds_to_8_bits_when_no_grid_fits():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    affine = fit_grid(w)
    recon = affine.values()
    assert affine.bits == 8 and 0 < np.abs(recon - w).max() <= affine.tolerance
    half_step = (np.ptp(w.reshape(16, 2, 32), axis=-1) / 255 / 2).repeat(32, 1)
    assert (np.abs(recon - w) <= half_step * 1.001).all()


def test_fit_grid_keeps_exact_groups_exact_in_an_8_bit_tensor():
    rng = np.random.default_rng(2)
    exact = (rng.integers(0, 200, (4, 32)) * np.float32(1 / 64)).astype(np.float32)  # 8 bits
    exact[:, 0], exact[:, 1] = 0, np.float32(1 / 64)  # the smallest gap is the step
    noisy = rng.standard_normal((4, 32)).astype(np.float32)
    affine = fit_grid(np.concatenate([exact, noisy], axis=1))
    assert affine.bits == 8
    np.testing.assert_array_equal(affine.values()[:, :32], exact)


def test_gguf_values_are_gguf_dequantize():
    """Many rows at once, the same values as gguf.quants.dequantize (which takes 16 rows at a time),
    for every type gguf dequantizes, grid-based IQ types included; random blocks, NaNs and all."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.constants import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    rng = np.random.default_rng(3)
    types = [q for q in Q if q.name in vars(gguf.quants) and q not in (Q.F32, Q.F16)]
    assert {Q.Q6_K, Q.Q2_K, Q.IQ2_XXS, Q.IQ4_NL} <= set(types)
    for qtype in types:
        block, type_size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (37, 2 * type_size), dtype=np.uint8)  # 37 rows: not a multiple of 16
        with np.errstate(all="ignore"):  # random float16 fields include infinities
            got, want = gguf_values(raw, qtype), dequantize(raw, qtype)
        assert got.shape == (37, 2 * block) and got.dtype == np.float32, qtype.name
        np.testing.assert_array_equal(got, want, err_msg=qtype.name)


@pytest.mark.parametrize("narrow_rows", [slice(0, 4), slice(4, 8)])
def test_transcode_in_row_chunks_keeps_the_widest_width(monkeypatch, narrow_rows):
    """Chunks of rows are transcoded one by one; a chunk that fits a narrower grid (here Q6_K rows whose
    levels are 0 or 1, 2 bits) is packed at the width the whole tensor needs (6 bits)."""
    from gguf.constants import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    from minivllm.models import gguf_transcode as gt

    blocks = np.random.default_rng(4).integers(0, 256, (8, 210), dtype=np.uint8)  # a Q6_K block per row
    blocks[:, 208:210] = np.full((8, 1), 0.01, np.float16).view(np.uint8)  # d
    blocks[:, 192:208:2] = blocks[:, 193:208:2]  # paired 16-wide sub-blocks share a scale: exact grids
    blocks[narrow_rows, :128] &= 0x11  # low bits 0 or 1 ...
    blocks[narrow_rows, 128:192] = 0  # ... and no high bits
    monkeypatch.setattr(gt, "CHUNK_WEIGHTS", 4 * 256)
    t = gt.transcode("w.weight", blocks, Q.Q6_K, (8, 256))
    assert t.bits == 6 and t.max_error == 0.0
    got = mx.dequantize(mx.array(t.packed), mx.array(t.scales), mx.array(t.biases), 32, t.bits)
    np.testing.assert_array_equal(np.array(got), dequantize(blocks, Q.Q6_K))
    narrow = gt.transcode("w.weight", blocks[narrow_rows], Q.Q6_K, (4, 256))
    assert narrow.bits == 2


def test_narrowest_float():
    assert narrowest_float(np.array([0.5, -3.0, 1 / 1024], np.float32)) == np.float16
    assert narrowest_float(np.array([0.1], np.float32)) == np.float32  # 0.1 is not a float16
    assert narrowest_float(np.array([1e6], np.float32)) == np.float32  # beyond float16's range
