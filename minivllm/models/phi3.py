"""The Phi-3 block (Phi-3, Phi-3.5, Phi-4-mini): the Llama-family block with fused projections, one
qkv_proj for queries, keys and values and one gate_up_proj for the SwiGLU's two halves. Rope may cover
part of each head (partial_rotary_factor: mlx-lm's rope module rotates its first dims only).
"""

import mlx.core as mx
import mlx.nn as nn

from kernels.activations import swiglu
from kernels.paged_attention import AttentionLayout
from minivllm.models.layers import Architecture, Block, KVPools, store_kv
from minivllm.models.rms_norm import rms_norm
from minivllm.models.rope import rope


def project(attn: nn.Module, x: mx.array, layout: AttentionLayout) -> tuple[mx.array, mx.array, mx.array]:
    """Queries, keys (both rope applied) and values of the flat tokens x: [T, heads, head_dim] each."""
    T, q_size, kv_size = x.shape[0], attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    q, k, v = mx.split(attn.qkv_proj(x), [q_size, q_size + kv_size], axis=-1)
    q = rope(attn, q.reshape(T, attn.n_heads, -1), layout)
    k = rope(attn, k.reshape(T, attn.n_kv_heads, -1), layout)
    return q, k, v.reshape(T, attn.n_kv_heads, -1)


def write_block_kv(
    block: nn.Module, h: mx.array, kv: KVPools, layer: int, layout: AttentionLayout
) -> mx.array:
    """Every new token's K/V into the layer's pools; returns the queries (the fused projection makes
    them in the same product: the last block's are sliced to the sampled rows afterwards)."""
    q, k, v = project(block.self_attn, rms_norm(block.input_layernorm, h), layout)
    store_kv(kv, layer, layout, k, v)
    return q


def mlp(module: nn.Module, x: mx.array) -> mx.array:
    gate, up = mx.split(module.gate_up_proj(x), 2, axis=-1)
    return module.down_proj(swiglu(gate, up))


def roped(attn: nn.Module, q: mx.array, layout: AttentionLayout) -> mx.array:
    return q  # write_block_kv made the queries already


def after_attention(block: nn.Module, h: mx.array, r: mx.array) -> mx.array:
    h = h + r
    return h + mlp(block.mlp, rms_norm(block.post_attention_layernorm, h))


ARCHITECTURE = Architecture(Block(write_block_kv, roped, after_attention), write_block_kv)
