"""The Gemma 3 block (text): local layers attend within a sliding window, every
sliding_window_pattern-th layer globally, each kind with its own rope base (mlx-lm's modules carry
them); RMSNorms scale by (1 + w); a norm after attention and after the MLP as well as before each; the
embeddings are scaled by sqrt(hidden_size); the MLP is gelu-tanh gated; queries are scaled by
query_pre_attn_scalar^-0.5 (the module's `scale`) and q/k are RMS-normed per head.

A sliding-window layer still writes every position's K/V into the pool and keeps all its pages (other
layers and the prefix cache need them); its attention masks by position.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma3_text import clip_residual

from minivllm.models.layers import Architecture, Block
from minivllm.models.qwen2 import queries, write_block_kv
from minivllm.models.rms_norm import rms_norm


def embed(model: nn.Module, input_ids: mx.array) -> mx.array:
    h = model.model.embed_tokens(input_ids)
    # the scale rounded to bfloat16 (Gemma's weights' dtype), as mlx-lm and Hugging Face compute it
    return h * mx.array(model.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)


def after_attention(block: nn.Module, h: mx.array, r: mx.array) -> mx.array:
    # clip_residual: mlx-lm's residual sum, clipped to the float16 range for float16 activations
    h = clip_residual(h, rms_norm(block.post_attention_layernorm, r))
    r = block.mlp(rms_norm(block.pre_feedforward_layernorm, h))  # mlx-lm's gelu-tanh gated MLP
    return clip_residual(h, rms_norm(block.post_feedforward_layernorm, r))


def architecture(model: nn.Module) -> Architecture:
    window = model.args.sliding_window
    windows = tuple(window if b.self_attn.is_sliding else None for b in model.model.layers)
    block = Block(write_block_kv, queries, after_attention, windows)
    return Architecture(block, write_block_kv, embed)
