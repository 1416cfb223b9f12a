"""Qwen2 / Llama-family forward over a flat ragged batch with paged KV.

The modules and weights are mlx-lm's own (loaded by `mlx_lm.load`, so every checkpoint layout, 4-bit
quantization and rope scaling it supports works here); this file only replaces the forward pass:
tokens of all sequences are flat [T] through the linear layers; attention gathers them per sequence
and goes through kernels.paged_attention.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from kernels.paged_attention import AttentionLayout, paged_attention, to_flat, to_padded, write_kv


@dataclass
class KVPools:
    keys: list[mx.array]  # per layer [num_slots, n_kv_heads, head_dim]
    values: list[mx.array]


def attention(attn: nn.Module, x: mx.array, kv: KVPools, layer: int, layout: AttentionLayout) -> mx.array:
    T = x.shape[0]
    # rope on the padded [B, heads, Qmax, D] grid with one offset per sequence (its new tokens are
    # consecutive positions): the batched form mlx-lm uses, which every backend supports
    q = attn.rope(to_padded(attn.q_proj(x).reshape(T, attn.n_heads, -1), layout), offset=layout.starts)
    k = attn.rope(to_padded(attn.k_proj(x).reshape(T, attn.n_kv_heads, -1), layout), offset=layout.starts)
    v = attn.v_proj(x).reshape(T, attn.n_kv_heads, -1)
    write_kv(kv.keys[layer], layout.slot_mapping, to_flat(k, layout))
    write_kv(kv.values[layer], layout.slot_mapping, v)
    out = paged_attention(q, kv.keys[layer], kv.values[layer], layout, attn.scale)
    return attn.o_proj(out.reshape(T, -1))


def forward(
    model: nn.Module,
    input_ids: mx.array,
    kv: KVPools,
    layout: AttentionLayout,
    logits_index: mx.array,
) -> mx.array:
    """Logits [len(logits_index), vocab] for the flat tokens at logits_index (each sampling sequence's last)."""
    body = model.model
    h = body.embed_tokens(input_ids)
    for i, block in enumerate(body.layers):
        h = h + attention(block.self_attn, block.input_layernorm(h), kv, i, layout)
        h = h + block.mlp(block.post_attention_layernorm(h))
    h = body.norm(h[logits_index])
    if getattr(model, "lm_head", None) is not None:
        return model.lm_head(h)
    return body.embed_tokens.as_linear(h)


def check_supported(model: nn.Module) -> None:
    """The forward above needs the Llama-family module layout."""
    try:
        attn = model.model.layers[0].self_attn
        needed = (
            attn.q_proj,
            attn.k_proj,
            attn.v_proj,
            attn.o_proj,
            attn.rope,
            attn.n_heads,
            attn.n_kv_heads,
        )
    except AttributeError as e:
        raise ValueError(f"unsupported architecture {getattr(model, 'model_type', '?')!r}: {e}") from e
    del needed
