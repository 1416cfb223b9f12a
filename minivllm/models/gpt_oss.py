"""The gpt-oss block: sliding-window and full-attention layers as the config's layer_types list them,
attention sinks (a learned logit per head in each softmax, which `layers.attend` passes on), biased
q/k/v/o projections, yarn rope, and a mixture of experts run as mlx-lm's own module (a router's top-k,
their softmax weights, SwitchGLU's experts with gpt-oss's clamped SwiGLU). Norms before attention and
before the MLP, as Llama's; the module names its head counts num_attention_heads / num_key_value_heads.

A sliding-window layer still writes every position's K/V into the pool and keeps all its pages (other
layers and the prefix cache need them); its attention masks by position.
"""

import mlx.core as mx
import mlx.nn as nn

from kernels.paged_attention import AttentionLayout
from minivllm.models.layers import Architecture, Block, KVPools, store_kv
from minivllm.models.qwen2 import after_attention
from minivllm.models.rms_norm import rms_norm
from minivllm.models.rope import rope


def write_block_kv(
    block: nn.Module, h: mx.array, kv: KVPools, layer: int, layout: AttentionLayout
) -> mx.array:
    """Every new token's keys (rope applied) and values into the layer's pools; returns the block's
    normed input."""
    attn, x = block.self_attn, rms_norm(block.input_layernorm, h)
    T, heads_kv = x.shape[0], attn.num_key_value_heads
    k = rope(attn, attn.k_proj(x).reshape(T, heads_kv, -1), layout)
    store_kv(kv, layer, layout, k, attn.v_proj(x).reshape(T, heads_kv, -1))
    return x


def queries(attn: nn.Module, x: mx.array, layout: AttentionLayout) -> mx.array:
    return rope(attn, attn.q_proj(x).reshape(x.shape[0], attn.num_attention_heads, -1), layout)


def architecture(model: nn.Module) -> Architecture:
    body = model.model
    windows = tuple(body.window_size if kind == "sliding_attention" else None for kind in body.layer_types)
    return Architecture(Block(write_block_kv, queries, after_attention, windows), write_block_kv)
