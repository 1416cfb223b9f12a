"""Rope on a step's flat tokens [T, heads, D], each token at its own position.

mlx-lm's rope modules call `mx.fast.rope`, which on the CPU backend has no kernel: each call composes
its positions, frequencies, cos and sin (about twenty graph nodes) before the rotation itself. Every
layer's queries and keys rotate at the same positions in a step, so on the CPU the step computes each
rope module's cos and sin once (`mx.fast.rope` of a unit vector with the module's own arguments: exactly
the cos and sin it composes) and each call does the rotation alone, with the same operations as that
composition, so the same bits. On a tiny model's decode step that is a third of the graph's nodes
(benchmarks/families.py). On a GPU `mx.fast.rope` is one fused kernel and each call runs it; so do the
rope modules this file does not know (their arguments are their own).
"""

import functools
import weakref
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE

from kernels.paged_attention import AttentionLayout
from minivllm.models.backend import detect_backend


@dataclass(frozen=True)
class RopeArgs:
    """A rope module as `mx.fast.rope`'s arguments (not traditional: the halves of the rotated dims)."""

    dims: int
    input_scale: float  # the rotated dims of x are multiplied by it first (longrope's and yarn's mscale)
    base: float | None
    scale: float
    freqs: mx.array | None

    def key(self) -> tuple:
        """Equal for modules that rotate alike: each layer has its own module, most of them the same."""
        freqs = None if self.freqs is None else np.array(self.freqs).tobytes()
        return (self.dims, self.input_scale, self.base, self.scale, freqs)


def rope_args(module: nn.Module) -> RopeArgs | None:
    """The module's arguments where its call is `mx.fast.rope` of them alone; None for any other."""
    kind = type(module)
    if kind is nn.RoPE and not module.traditional:
        return RopeArgs(module.dims, 1.0, module.base, module.scale, None)
    if kind is Llama3RoPE and not module.traditional:
        return RopeArgs(module.dims, 1.0, None, 1.0, module._freqs)
    if kind is SuScaledRoPE:
        return RopeArgs(module.dim, module._scale, None, 1.0, module._freqs)
    if kind is YarnRoPE and not module.traditional:
        return RopeArgs(module.dims, module.mscale, None, 1.0, module._freqs)
    return None


def rope(attn: nn.Module, x: mx.array, layout: AttentionLayout) -> mx.array:
    """x [T, heads, D] rotated at layout.positions by the attention module's rope."""
    T, heads, _ = x.shape
    args, key = _known(attn.rope)
    if args is None or x.dtype != mx.float32 or mx.default_device() != mx.cpu:
        dims = args.dims if args is not None else getattr(attn.rope, "dims", x.shape[-1])
        rows = cuda_rope_rows(dims, heads) if _on_cuda() else None
        return per_token_rope(attn.rope, x, layout.positions, rows)
    cos, sin = _tables(layout, key, args, heads)
    half = args.dims // 2
    x1, x2 = x[..., :half], x[..., half : args.dims]
    if args.input_scale != 1.0:
        x1, x2 = x1 * args.input_scale, x2 * args.input_scale
    parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]  # mx.fast.rope's own order of operations
    if args.dims < x.shape[-1]:
        parts.append(x[..., args.dims :])
    return mx.concatenate(parts, axis=-1)


def per_token_rope(module: nn.Module, x: mx.array, positions: mx.array, rows: int | None = None) -> mx.array:
    """Each token of x [T, heads, D] a length-1 sequence with its own offset: nothing is padded, any
    backend's rope applies. rows: at most that many tokens a call (None: all of them in one)."""
    T, heads, D = x.shape
    x = x.reshape(T, heads, 1, D)
    if rows is None or rows >= T:
        return module(x, offset=positions).squeeze(2)
    parts = [module(x[i : i + rows], offset=positions[i : i + rows]) for i in range(0, T, rows)]
    return mx.concatenate(parts).squeeze(2)


def cuda_rope_rows(dims: int, heads: int) -> int | None:
    """How many tokens one `mx.fast.rope` call may rotate on MLX's CUDA backend (0.32), None for any.

    Its kernel sizes the thread block from (dims / 2, 1, tokens * ceil(heads / 4)), handing out powers of
    two to the three in turn up to 1,024 threads. Below 32 rotated dims the first stops at 8 or less, so
    the third reaches 128 once tokens * ceil(heads / 4) does: beyond CUDA's limit of 64 on a block's z,
    and the launch fails ("invalid argument"). Measured on an H200 (benchmarks/results/cuda/): 16 dims
    fail at 128 tokens of 4 heads, 512 of 2 and 1,024 of 1, and pass at 64 of 4; 64 dims pass at 750 of
    2. Real models rotate 32 dims or more; tiny test models rotate 16."""
    if dims >= 32:
        return None
    return max(1, 64 // -(-heads // 4))


@functools.cache
def _on_cuda() -> bool:
    return detect_backend().name == "cuda"


# id(module) -> (a weak reference to it, its RopeArgs, their key): once per module, not per call
_modules: dict[int, tuple[weakref.ref, RopeArgs | None, tuple | None]] = {}


def _known(module: nn.Module) -> tuple[RopeArgs | None, tuple | None]:
    known = _modules.get(id(module))
    if known is None or known[0]() is not module:  # a new module, or another one at a freed one's id
        args = rope_args(module)
        known = _modules[id(module)] = (weakref.ref(module), args, args and args.key())
    return known[1], known[2]


def _tables(layout: AttentionLayout, key: tuple, args: RopeArgs, heads: int) -> tuple[mx.array, mx.array]:
    """The step's cos and sin [T, heads, dims / 2] for the module's key, computed once per step and
    broadcast once per head count (queries and keys), so no rotation broadcasts them again."""
    shared = layout.shared
    if ("rope", key, heads) not in shared:
        if ("rope", key) not in shared:
            shared["rope", key] = _cos_sin(args, layout.positions)
        T, half = layout.positions.shape[0], args.dims // 2
        shared["rope", key, heads] = tuple(mx.broadcast_to(t, (T, heads, half)) for t in shared["rope", key])
    return shared["rope", key, heads]


def _cos_sin(args: RopeArgs, positions: mx.array) -> tuple[mx.array, mx.array]:
    """[T, 1, dims / 2] each: the unit vector (1 in the first half, 0 in the second) rotates to (cos, sin)
    exactly (1 * c - 0 * s = c, 1 * s + 0 * c = s)."""
    T, half = positions.shape[0], args.dims // 2
    unit = mx.concatenate([mx.ones((T, 1, 1, half)), mx.zeros((T, 1, 1, half))], axis=-1)
    kwargs = {"base": args.base, "scale": args.scale, "offset": positions, "freqs": args.freqs}
    rotated = mx.fast.rope(unit, args.dims, traditional=False, **kwargs).reshape(T, 1, args.dims)
    return rotated[..., :half], rotated[..., half:]
