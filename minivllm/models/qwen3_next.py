"""The hybrid blocks of Qwen3-Next and Qwen3.5 (text): most layers are linear attention (a gated delta net
with a recurrent state per sequence, minivllm.models.linear_attention), every full_attention_interval-th
is full attention over the paged KV.

The attention layers have q/k norms, rope on part of each head, and a gate: q_proj gives the queries and
a gate per head, and the attention's output times sigmoid(gate) goes into o_proj. The MLP is SwiGLU, or
Qwen3-Next's sparse block (a router's top-k, SwitchGLU's experts, a gated shared expert) run as mlx-lm's
own module. Only attention layers have KV pools: the pools are numbered by attention layer, the linear
layers' states by linear layer.
"""

import mlx.core as mx
import mlx.nn as nn

from kernels.paged_attention import AttentionLayout, QueryRows, paged_attention
from minivllm.models.layers import Architecture, KVPools, only_rows, qk_norm, store_kv
from minivllm.models.linear_attention import linear_attention
from minivllm.models.qwen2 import after_attention
from minivllm.models.rms_norm import rms_norm
from minivllm.models.rope import rope


def is_linear(block: nn.Module) -> bool:
    return hasattr(block, "linear_attn")


def write_attention_kv(block: nn.Module, h: mx.array, kv: KVPools, pool: int, layout: AttentionLayout):
    attn, x = block.self_attn, rms_norm(block.input_layernorm, h)
    T, heads_kv = x.shape[0], attn.num_key_value_heads
    k = rope(attn, qk_norm(attn, "k_norm", attn.k_proj(x).reshape(T, heads_kv, -1)), layout)
    store_kv(kv, pool, layout, k, attn.v_proj(x).reshape(T, heads_kv, -1))
    return x


def attention_layer(
    block: nn.Module, h: mx.array, kv: KVPools, pool: int, layout: AttentionLayout, rows: QueryRows | None
) -> mx.array:
    attn = block.self_attn
    x = write_attention_kv(block, h, kv, pool, layout)
    layout, h, x = only_rows(rows, layout, h, x)
    R = x.shape[0]
    q, gate = mx.split(attn.q_proj(x).reshape(R, attn.num_attention_heads, -1), 2, axis=-1)
    q = rope(attn, qk_norm(attn, "q_norm", q), layout)
    out = paged_attention(q, kv.keys[pool], kv.values[pool], layout, attn.scale)
    return after_attention(block, h, attn.o_proj(out * mx.sigmoid(gate.reshape(R, -1))))


def linear_layer(
    block: nn.Module, h: mx.array, kv: KVPools, index: int, layout: AttentionLayout, rows: QueryRows | None
) -> mx.array:
    """Every token goes through the recurrence (the states need them all); only `rows` go on past it."""
    r = linear_attention(block.linear_attn, rms_norm(block.input_layernorm, h), layout, kv.recurrent, index)
    layout, h, r = only_rows(rows, layout, h, r)
    return after_attention(block, h, r)


def architecture(model: nn.Module) -> Architecture:
    """Each layer's own index among its kind: its KV pool, or its place in a sequence's states."""
    linear = [is_linear(b) for b in model.model.layers]
    index = [sum(linear[:i]) if lin else i - sum(linear[:i]) for i, lin in enumerate(linear)]

    def decoder_layer(block, h, kv, layer, layout, rows):
        run = linear_layer if linear[layer] else attention_layer
        return run(block, h, kv, index[layer], layout, rows)

    def write_block_kv(block, h, kv, layer, layout):
        if linear[layer]:
            return linear_layer(block, h, kv, index[layer], layout, None)
        return write_attention_kv(block, h, kv, index[layer], layout)

    return Architecture(decoder_layer, write_block_kv, num_linear_layers=sum(linear))
