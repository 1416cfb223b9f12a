"""RMSNorm in three graph nodes on the CPU backend instead of eleven.

`mx.fast.rms_norm` has no CPU kernel: MLX composes it (a cast, square, mean, eps added, rsqrt, product,
cast, the weight's product, with their broadcasts), and on the CPU each graph node costs its dispatch
(docs/how-it-works.md, "Graph nodes per step"). The same operations under `mx.compile` fuse all but the
reduction: three nodes, the same bits (tests/test_rms_norm.py). On a GPU `mx.fast.rms_norm` is one kernel
and the module's own call runs; so it does for norm modules this file does not know and other dtypes.
"""

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma3_text import RMSNorm as GemmaRMSNorm

# the norm modules whose call is mx.fast.rms_norm(x, offset + weight, eps): their weight's offset
OFFSETS = {nn.RMSNorm: 0.0, GemmaRMSNorm: 1.0}


def rms_norm(module: nn.Module, x: mx.array) -> mx.array:
    """module(x), for an RMSNorm module of mlx-lm's."""
    offset = OFFSETS.get(type(module))
    weight = module.weight
    if offset is None or x.dtype != mx.float32 or weight.dtype != mx.float32 or mx.default_device() != mx.cpu:
        return module(x)
    key = (module.eps, offset)
    fn = _compiled.get(key)
    if fn is None:
        fn = _compiled[key] = _compile(module.eps, offset)
    return fn(x, weight)


# (eps, offset) -> the compiled norm; shapeless: any token count, rank and width without a new trace
_compiled: dict[tuple, Callable] = {}


def _compile(eps: float, offset: float) -> Callable:
    def norm(x: mx.array, weight: mx.array) -> mx.array:
        # mx.fast.rms_norm's own composition on the CPU, operation for operation (float32 in and out)
        if offset:
            weight = offset + weight
        y = x * mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + mx.array(eps, mx.float32))
        return y * weight

    return mx.compile(norm, shapeless=True)
