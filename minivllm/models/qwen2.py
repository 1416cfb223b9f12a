"""The Llama-family block: Qwen2, Qwen3 (q/k norms), Llama, Mistral, Qwen3-MoE and GLM-4.5 MoE (experts in
place of the MLP), over a flat ragged batch with paged KV (minivllm.models.families says which configs run).

Separate projections q/k/v/o, rope, a norm before attention and one before the MLP; the MLP is SwiGLU,
or a sparse block run as mlx-lm's own module: Qwen3-MoE's (a softmax router, the top-k experts, their
weights renormalized when norm_topk_prob, the experts' SwiGLU through SwitchGLU's gather matmuls) or
GLM-4.5's (sigmoid scores with a correction bias, the top experts within the best groups, scaled, and a
shared expert beside them).
"""

import mlx.core as mx
import mlx.nn as nn

from kernels.activations import swiglu
from kernels.paged_attention import AttentionLayout
from minivllm.models.layers import Architecture, Block, KVPools, qk_norm, store_kv
from minivllm.models.rms_norm import rms_norm
from minivllm.models.rope import rope


def write_block_kv(
    block: nn.Module, h: mx.array, kv: KVPools, layer: int, layout: AttentionLayout
) -> mx.array:
    """The keys and values of every new token of the step into the layer's pools; returns the block's
    normed input."""
    attn, x = block.self_attn, rms_norm(block.input_layernorm, h)
    T = x.shape[0]
    k = rope(attn, qk_norm(attn, "k_norm", attn.k_proj(x).reshape(T, attn.n_kv_heads, -1)), layout)
    store_kv(kv, layer, layout, k, attn.v_proj(x).reshape(T, attn.n_kv_heads, -1))
    return x


def queries(attn: nn.Module, x: mx.array, layout: AttentionLayout) -> mx.array:
    q = qk_norm(attn, "q_norm", attn.q_proj(x).reshape(x.shape[0], attn.n_heads, -1))
    return rope(attn, q, layout)


def mlp(module: nn.Module, x: mx.array) -> mx.array:
    if not hasattr(module, "gate_proj"):
        return module(x)  # a sparse block, Qwen3-MoE's or GLM-4.5's (families admits no other module here)
    return module.down_proj(swiglu(module.gate_proj(x), module.up_proj(x)))


def after_attention(block: nn.Module, h: mx.array, r: mx.array) -> mx.array:
    h = h + r
    return h + mlp(block.mlp, rms_norm(block.post_attention_layernorm, h))


ARCHITECTURE = Architecture(Block(write_block_kv, queries, after_attention), write_block_kv)
