"""Carry a GGUF tensor's quantization over into MLX's affine format, exactly where the format allows.

MLX stores a quantized matrix as b-bit levels q packed into uint32 words, with one scale and one bias per
group of consecutive weights in a row: w = scale * q + bias (what `mx.dequantize` computes). The GGUF
block types below are that very form over groups of 32, so their blocks are re-packed, not re-quantized:

    Q8_0  w = d * x, x int8            -> 8-bit, q = x + 128,  scale d,         bias -128 d
    Q4_0  w = d * (x - 8)              -> 4-bit, q = x,        scale d,         bias -8 d
    Q5_0  w = d * (x - 16)             -> 5-bit, q = x,        scale d,         bias -16 d
    Q4_1  w = d * x + m                -> 4-bit, q = x,        scale d,         bias m
    Q5_1  w = d * x + m                -> 5-bit, q = x,        scale d,         bias m
    Q4_K  w = d*sc_j * x - dmin*m_j    -> 4-bit, q = x,        scale d*sc_j,    bias -dmin*m_j (per 32-sub-block j)
    Q5_K  likewise                     -> 5-bit

Every product above is exact in float32 (an 11-bit float16 mantissa times at most 8 bits of integer), so
MLX reproduces `gguf.quants.dequantize` value for value. Any other type (Q6_K, whose 16-wide sub-blocks
have their own scales; Q2_K, Q3_K, the IQ types) goes through `fit_grid`: per group of 32 it looks for an
evenly spaced grid holding the dequantized values exactly, and uses the narrowest MLX width that holds
every group; groups without one make the tensor 8-bit, with those groups rounded (max error reported).
"""

from collections.abc import Callable
from dataclasses import dataclass

import gguf.quants
import mlx.core as mx
import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

GROUP_SIZE = 32
MLX_BITS = (2, 3, 4, 5, 6, 8)
FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
MLX_CHECK_ROWS = 64  # rows per tensor whose packed words verification also reads with MLX's kernel
CHUNK_WEIGHTS = 1 << 20  # weights transcoded at a time: the float32 temporaries (4 MB) stay in cache


class TranscodeError(ValueError):
    """MLX's weights do not reproduce the GGUF's dequantization (a bug, or a corrupt tensor)."""


@dataclass(slots=True)
class AffineWeight:
    """A matrix in MLX's affine format, before packing: w = scales * q + biases per group of 32."""

    q: np.ndarray  # uint8 levels in [0, 2**bits), shape (rows, cols)
    scales: np.ndarray  # float32, shape (rows, cols // GROUP_SIZE)
    biases: np.ndarray  # float32, same shape
    bits: int
    tolerance: float = 0.0  # error verification accepts: 0.0 (exact), or about half a step if rounded

    def values(self) -> np.ndarray:
        """The float32 weights MLX computes from these: scale * q, then + bias, each rounded to float32."""
        rows, cols = self.q.shape
        w = np.multiply(self.q.reshape(rows, -1, GROUP_SIZE), self.scales[..., None], dtype=np.float32)
        w += self.biases[..., None]
        return w.reshape(rows, cols)


# -- exact decoders: raw blocks (n, type_size) uint8 -> levels (n, block), scales and biases (n, block / 32)
def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 levels: the low nibbles are elements 0-15, the high nibbles elements 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes -> 32 bits: bit i of the little-endian uint32 is element i's fifth bit, shifted into place."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


def _decode_q8_0(b: np.ndarray):
    d = _f16(b[:, :2])
    return b[:, 2:] ^ np.uint8(0x80), d, -128 * d  # int8 x + 128 == its bits with the sign bit flipped


def _decode_q4_0(b: np.ndarray):
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:]), d, -8 * d


def _decode_q5_0(b: np.ndarray):
    d = _f16(b[:, :2])
    return _nibbles(b[:, 6:]) | _fifth_bits(b[:, 2:6]), d, -16 * d


def _decode_q4_1(b: np.ndarray):
    return _nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _decode_q5_1(b: np.ndarray):
    return _nibbles(b[:, 8:]) | _fifth_bits(b[:, 4:8]), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-block header -> per-32 scale d*sc_j and bias -dmin*m_j (gguf unpacks the 6-bit pairs)."""
    sc, m = Q4_K.get_scale_min(b[:, 4:16])
    return _f16(b[:, :2]) * sc.astype(np.float32), -(_f16(b[:, 2:4]) * m.astype(np.float32))


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 levels: byte chunk c holds sub-block 2c in its low nibbles, 2c+1 in its high ones."""
    n = qs.shape[0]
    return np.stack([qs.reshape(n, 4, 32) & 0x0F, qs.reshape(n, 4, 32) >> 4], axis=2).reshape(n, 256)


def _decode_q4_k(b: np.ndarray):
    return _k_nibbles(b[:, 16:]), *_k_scales(b)


def _decode_q5_k(b: np.ndarray):
    n = b.shape[0]
    qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # bit j: sub-block j
    return _k_nibbles(b[:, 48:]) | ((qh & 1) << 4).reshape(n, 256), *_k_scales(b)


Decoder = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
EXACT_DECODERS: dict[GGMLQuantizationType, tuple[int, Decoder]] = {
    GGMLQuantizationType.Q8_0: (8, _decode_q8_0),
    GGMLQuantizationType.Q4_0: (4, _decode_q4_0),
    GGMLQuantizationType.Q5_0: (5, _decode_q5_0),
    GGMLQuantizationType.Q4_1: (4, _decode_q4_1),
    GGMLQuantizationType.Q5_1: (5, _decode_q5_1),
    GGMLQuantizationType.Q4_K: (4, _decode_q4_k),
    GGMLQuantizationType.Q5_K: (5, _decode_q5_k),
}


def decode_exact(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> AffineWeight:
    bits, decode = EXACT_DECODERS[qtype]
    _, type_size = GGML_QUANT_SIZES[qtype]
    q, scales, biases = decode(np.ascontiguousarray(raw).reshape(-1, type_size))
    rows, cols = shape
    return AffineWeight(q.reshape(rows, cols), scales.reshape(rows, -1), biases.reshape(rows, -1), bits)


# -- any other type: find an exact grid per group of 32, or round to 8 bits ------------------------------
def fit_grid(w: np.ndarray) -> AffineWeight:
    """Affine levels for float weights (rows, cols): exact where each group lies on an evenly spaced grid.

    A group's grid step is its smallest gap between distinct values; the group is exact when every value
    is min + step * k with step * k representable in float32 (so MLX's float32 arithmetic gives it back
    whatever its rounding order). The tensor's width is the narrowest MLX width holding every group's
    levels; a group with no exact grid within 8 bits makes the tensor 8-bit and is rounded to its
    min-max 8-bit grid (error at most half a step).
    """
    rows, cols = w.shape
    groups = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, GROUP_SIZE)
    q, steps, lows, exact = _exact_grids(groups)
    rounded = ~exact
    bits = 8 if rounded.any() else next(b for b in MLX_BITS if q.max(initial=0) < 2**b)
    if rounded.any():
        q[rounded], steps[rounded] = _round_to_8_bits(groups[rounded], lows[rounded])
    # Half a step, plus float32 rounding of the reconstruction (2**-23 relative, twice for margin).
    slack = steps[rounded] / 2 + np.abs(groups[rounded]).max(-1, initial=0.0) * 2**-22
    return AffineWeight(
        q.reshape(rows, cols),
        steps.reshape(rows, -1),
        lows.reshape(rows, -1),
        bits,
        float(slack.max(initial=0.0)),
    )


def _exact_grids(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Levels (valid where exact), step, minimum and whether the grid is exact, per group."""
    ordered = np.sort(groups, axis=-1)
    gaps = np.diff(ordered, axis=-1)
    steps = np.where(gaps > 0, gaps, np.inf).min(-1)
    steps = np.where(np.isfinite(steps), steps, 0).astype(np.float32)  # 0: a constant group
    lows = ordered[:, 0]
    step64, low64 = steps.astype(np.float64)[:, None], lows.astype(np.float64)[:, None]
    k = np.rint((groups - low64) / np.where(step64 > 0, step64, 1))
    product = step64 * k
    exact = ((product + low64 == groups) & (product.astype(np.float32) == product)).all(-1)
    exact &= k.max(-1) < 256
    return np.where(exact[:, None], k, 0).astype(np.uint8), steps, lows, exact


def _round_to_8_bits(groups: np.ndarray, lows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    steps = (groups.max(-1) - lows) / np.float32(255)
    k = np.rint((groups - lows[:, None]) / np.where(steps > 0, steps, 1)[:, None])
    return np.clip(k, 0, 255).astype(np.uint8), steps.astype(np.float32)


# -- packing and verification ------------------------------------------------------------------------------
# Packing works on eight levels at a time: eight b-bit levels are exactly b bytes of MLX's little-endian
# bit stream, and eight uint8 levels are one uint64. Moving the levels between 8-bit lanes and b-bit
# fields takes three shift-and-mask steps (pairs, quads, halves), each over the whole tensor at once.
def _lane_masks(bits: int) -> list[tuple[int, np.uint64, int]]:
    """(width of the moved field, mask of fields at each lane start, lane width) per step, innermost first."""
    out = []
    for lane, per_lane in ((16, 1), (32, 2), (64, 4)):
        field = (1 << (bits * per_lane)) - 1
        mask = sum(field << start for start in range(0, 64, lane))
        out.append((bits * per_lane, np.uint64(mask), lane // 2))
    return out


def pack_levels(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 levels (rows, cols) -> MLX's packed uint32 (rows, cols * bits / 32)."""
    rows, cols = q.shape
    q = np.ascontiguousarray(q)
    if bits == 8:  # one level per byte already
        return q.view(np.uint32)
    if bits == 4:  # two per byte, the even element in the low nibble
        return np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << 4)).view(np.uint32)
    x = q.reshape(-1, 8).view(np.uint64).ravel().copy()  # level j in byte j
    for width, mask, half in _lane_masks(bits):  # pull each lane's upper half down next to its lower half
        upper = x >> np.uint64(half - width)
        upper &= mask << np.uint64(width)
        x &= mask
        x |= upper
    packed = np.ascontiguousarray(x.view(np.uint8).reshape(-1, 8)[:, :bits])
    return packed.reshape(rows, cols * bits // 8).view(np.uint32)


def unpack_levels(packed: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of `pack_levels`: MLX's packed uint32 (rows, n) -> uint8 levels (rows, n * 32 / bits)."""
    rows = packed.shape[0]
    packed_bytes = np.ascontiguousarray(packed).view(np.uint8)
    if bits == 8:
        return packed_bytes
    if bits == 4:
        return np.stack([packed_bytes & 0x0F, packed_bytes >> 4], axis=-1).reshape(rows, -1)
    eights = np.zeros((packed.size * 4 // bits, 8), np.uint8)
    eights[:, :bits] = packed_bytes.reshape(-1, bits)
    x = eights.view(np.uint64).ravel()
    for width, mask, half in reversed(_lane_masks(bits)):  # push each upper field out to its lane's half
        upper = x & (mask << np.uint64(width))
        upper <<= np.uint64(half - width)
        x &= mask
        x |= upper
    return x.view(np.uint8).reshape(rows, -1)


def narrowest_float(*arrays: np.ndarray) -> np.dtype:
    """float16 when every value survives the round trip through it, otherwise float32."""
    with np.errstate(over="ignore"):
        fits = all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in arrays)
    return np.dtype(np.float16 if fits else np.float32)


def gguf_values(raw: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """gguf's own dequantization of rows of quantized blocks, as float32 (rows, cols).

    `gguf.quants.dequantize` runs its type's `dequantize_rows` over groups of 16 rows; each block
    dequantizes on its own, so running it over a larger chunk of rows gives the same values, faster.
    """
    kind = getattr(gguf.quants, qtype.name, None)
    if kind is None or not hasattr(kind, "dequantize_rows"):
        raise TranscodeError(f"gguf cannot dequantize {qtype.name} tensors")
    kind.init_grid()  # the IQ types' lookup grids, built on first use (as `dequantize` does)
    return kind.dequantize_rows(np.ascontiguousarray(raw))


@dataclass(slots=True)
class TranscodedWeight:
    """A GGUF matrix in MLX's format, verified against the GGUF's dequantization."""

    packed: np.ndarray  # uint32 (rows, cols * bits / 32)
    scales: np.ndarray  # float16 where every scale and bias fits it exactly, else float32
    biases: np.ndarray
    bits: int
    max_error: float  # largest |MLX weight - GGUF dequantized|; 0.0: exact
    head: np.ndarray  # the float32 weights of the first rows, for to_mlx's check with MLX's kernel

    @property
    def scale_dtype(self) -> str:
        return self.scales.dtype.name


def transcode(
    name: str,
    raw: np.ndarray,
    qtype: GGMLQuantizationType,
    shape: tuple[int, int],
    *,
    float32_scales: bool = False,
) -> TranscodedWeight:
    """One quantized 2-D GGUF tensor -> MLX packed weight, scales and biases; numpy only (thread-safe).

    Raises TranscodeError unless the weights MLX computes from them (scale * q + bias in float32) are
    gguf's dequantized values: equal for exact types, within the stated tolerance otherwise. Scales are
    float16 where that holds them exactly, unless `float32_scales`: an embedding needs that, since MLX's
    quantized embedding returns its rows in the scales' dtype.
    """
    rows, cols = shape
    step = max(1, CHUNK_WEIGHTS // cols)
    parts, max_error, head = [], 0.0, np.empty((0, cols), np.float32)
    for start in range(0, rows, step):  # chunks of rows: the float temporaries stay small and in cache
        chunk = raw[start : start + step]
        reference = gguf_values(chunk, qtype)
        n = reference.shape[0]
        affine = decode_exact(chunk, qtype, (n, cols)) if qtype in EXACT_DECODERS else fit_grid(reference)
        got = affine.values()
        err = 0.0 if np.array_equal(got, reference) else float(np.abs(got - reference).max())
        if not err <= affine.tolerance:  # also catches NaN
            kind = "equal" if affine.tolerance == 0 else f"within {affine.tolerance:.3g}"
            raise TranscodeError(
                f"{name}: {qtype.name} -> {affine.bits}-bit MLX weights are not {kind} to GGUF's "
                f"(max error {err:.3g} in rows {start}-{start + n - 1})"
            )
        max_error = max(max_error, err)
        if start == 0:  # what MLX's kernel must give for the first rows (to_mlx)
            head = got[:MLX_CHECK_ROWS].copy()
        parts.append(affine)
    bits = max(p.bits for p in parts)  # chunks may fit narrower grids; the widest holds every level
    scales, biases = (np.concatenate([getattr(p, k) for p in parts]) for k in ("scales", "biases"))
    dtype = np.dtype(np.float32) if float32_scales else narrowest_float(scales, biases)
    packed = np.concatenate([pack_levels(p.q, bits) for p in parts])
    return TranscodedWeight(packed, scales.astype(dtype), biases.astype(dtype), bits, max_error, head)


def to_mlx(name: str, t: TranscodedWeight) -> dict[str, mx.array]:
    """The MLX arrays under `name`'s stem, once MLX's own kernel has dequantized the first rows the same.

    `transcode` checked every value from the levels; this checks the packed words as MLX reads them.
    Packing treats every row alike, so a packing slip shows in the first rows.
    """
    stem = name.removesuffix(".weight")
    arrays = {
        name: mx.array(t.packed),
        f"{stem}.scales": mx.array(t.scales),
        f"{stem}.biases": mx.array(t.biases),
    }
    rows = slice(0, len(t.head))
    by_mlx = mx.dequantize(
        arrays[name][rows],
        arrays[f"{stem}.scales"][rows].astype(mx.float32),
        arrays[f"{stem}.biases"][rows].astype(mx.float32),
        group_size=GROUP_SIZE,
        bits=t.bits,
    )
    if not np.array_equal(np.array(by_mlx), t.head):
        raise TranscodeError(f"{name}: mx.dequantize disagrees with the packed levels (a packing bug)")
    return arrays
