"""Qwen2 / Qwen3 / Llama-family forward over a flat ragged batch with paged KV (minivllm.models.families
says which configs it runs exactly).

The modules and weights are mlx-lm's own (loaded by `mlx_lm.load`, so every checkpoint layout, 4-bit
quantization and rope scaling it supports works here); this file only replaces the forward pass:
tokens of all sequences are flat [T] through the linear layers and rope; attention reads each
sequence's context through its page table in kernels.paged_attention.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from kernels.activations import swiglu
from kernels.paged_attention import AttentionLayout, QueryRows, paged_attention, write_kv


@dataclass
class KVPools:
    keys: list[mx.array]  # per layer [n_kv_heads, num_slots, head_dim]
    values: list[mx.array]


def write_layer_kv(attn: nn.Module, x: mx.array, kv: KVPools, layer: int, layout: AttentionLayout) -> None:
    """The keys and values of every new token of the step into the layer's pools."""
    T = x.shape[0]
    # rope on the flat tokens: each is a length-1 sequence at its own position (an offset per token),
    # so nothing is padded and every backend's batched rope applies
    k = _qk_norm(attn, "k_norm", attn.k_proj(x).reshape(T, attn.n_kv_heads, -1))
    k = attn.rope(k.reshape(T, attn.n_kv_heads, 1, -1), offset=layout.positions)
    v = attn.v_proj(x).reshape(T, attn.n_kv_heads, -1)
    write_kv(kv.keys[layer], layout.slot_mapping, k.squeeze(2))
    write_kv(kv.values[layer], layout.slot_mapping, v)


def attention(attn: nn.Module, x: mx.array, kv: KVPools, layer: int, layout: AttentionLayout) -> mx.array:
    """The queries of the tokens `layout` describes over the pools (their own K/V already written)."""
    T = x.shape[0]
    q = _qk_norm(attn, "q_norm", attn.q_proj(x).reshape(T, attn.n_heads, -1))
    q = attn.rope(q.reshape(T, attn.n_heads, 1, -1), offset=layout.positions)
    out = paged_attention(q.squeeze(2), kv.keys[layer], kv.values[layer], layout, attn.scale)
    return attn.o_proj(out)


def _qk_norm(attn: nn.Module, name: str, x: mx.array) -> mx.array:
    """Qwen3's per-head RMSNorm of queries and keys, before rope (absent in Qwen2 / Llama)."""
    norm = getattr(attn, name, None)
    return x if norm is None else norm(x)


def mlp(module: nn.Module, x: mx.array) -> mx.array:
    if not hasattr(module, "gate_proj"):
        return module(x)  # not the Llama-family SwiGLU: the model's own
    return module.down_proj(swiglu(module.gate_proj(x), module.up_proj(x)))


def decoder_layer(
    block: nn.Module,
    h: mx.array,
    kv: KVPools,
    layer: int,
    layout: AttentionLayout,
    queries: QueryRows | None = None,
) -> mx.array:
    """One transformer block over the flat tokens. queries: only these rows go on past the K/V write."""
    x = block.input_layernorm(h)
    write_layer_kv(block.self_attn, x, kv, layer, layout)
    if queries is not None:
        h, x, layout = h[queries.rows], x[queries.rows], queries.layout
    h = h + attention(block.self_attn, x, kv, layer, layout)
    return h + mlp(block.mlp, block.post_attention_layernorm(h))


def forward(
    model: nn.Module,
    input_ids: mx.array,
    kv: KVPools,
    layout: AttentionLayout,
    sampling: list[int],
    num_rows: list[int] | None = None,
) -> mx.array | None:
    """Logits of the last new token of each sequence in `sampling` (indices into layout.seqs), or of its
    last num_rows[j] new tokens (a speculative step verifies several), in order: [sum of rows, vocab].
    None when no sequence samples (the step only fills the pools)."""
    body = model.model
    h = body.embed_tokens(input_ids)
    *inner, last = body.layers
    for i, block in enumerate(inner):
        h = decoder_layer(block, h, kv, i, layout)
    # The last block's output feeds only the logits: every token's K/V still goes into the pool, but
    # its queries, attention and MLP are computed for the sampled rows alone (a prefill chunk's last
    # token, a verification's drafted positions), which saves 1/num_layers of a prefill step.
    if not sampling:
        write_layer_kv(last.self_attn, last.input_layernorm(h), kv, len(inner), layout)
        return None
    h = body.norm(decoder_layer(last, h, kv, len(inner), layout, layout.last_tokens(sampling, num_rows)))
    if getattr(model, "lm_head", None) is not None:
        return model.lm_head(h)
    return body.embed_tokens.as_linear(h)
