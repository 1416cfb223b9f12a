"""The Gemma 4 block (text), over mlx-lm's own modules (mlx_lm.models.gemma4_text).

Local layers attend within a sliding window, global ones to the whole context, each kind with its own
head size, KV head count and rope (the global layers' proportional rope turns a quarter of each head);
queries and keys are RMS-normed per head, values too (without a weight), and attention is unscaled. The
last `num_kv_shared_layers` layers compute no K/V: each reads the pool of the last earlier layer of its
kind (mlx-lm's `previous_kvs`), so only the first layers have pools (KVGeometry counts them). Norms after
attention and after the feed-forward as well as before each; the feed-forward is gelu-tanh gated, or
(26B) that MLP beside routed experts, each with its own norms. The 2B/4B models add per-layer inputs: a
second embedding of the token, per layer, mixed with a projection of the embedded input, gates a
residual branch after each block; they are computed once per step from the token ids
(`Architecture.step_inputs`). Each block's output is scaled by its `layer_scalar`; the logits are
soft-capped (`Architecture.logit_softcap`).
"""

import mlx.core as mx
import mlx.nn as nn

from kernels.paged_attention import AttentionLayout, QueryRows
from minivllm.models.layers import STEP_INPUTS, Architecture, KVPools, attend, only_rows, store_kv
from minivllm.models.rms_norm import rms_norm
from minivllm.models.rope import rope


def embed(model: nn.Module, input_ids: mx.array) -> mx.array:
    return model.model.embed_tokens(input_ids) * model.model.embed_scale


def per_layer_inputs(model: nn.Module, input_ids: mx.array, h: mx.array) -> mx.array | None:
    """[T, layers, per-layer size]: each token's input to every block's gate (None without them), as
    mlx-lm's `_get_per_layer_inputs` and `_project_per_layer_inputs` make them from the embedded input h."""
    body = model.model
    if not body.hidden_size_per_layer_input:
        return None
    shape = (h.shape[0], len(body.layers), body.hidden_size_per_layer_input)
    embedded = (body.embed_tokens_per_layer(input_ids) * body.embed_tokens_per_layer_scale).reshape(shape)
    projected = (body.per_layer_model_projection(h) * body.per_layer_projection_scale).reshape(shape)
    projected = rms_norm(body.per_layer_projection_norm, projected)
    return (projected + embedded) * body.per_layer_input_scale


def architecture(model: nn.Module) -> Architecture:
    body = model.model
    pools = body.previous_kvs  # layer -> the layer whose K/V it reads (itself where it has its own)
    windows = [body.window_size if b.self_attn.is_sliding else None for b in body.layers]

    def write_block_kv(block: nn.Module, h: mx.array, kv: KVPools, layer: int, layout: AttentionLayout):
        """A layer with its own K/V writes them; returns the block's normed input."""
        attn, x = block.self_attn, rms_norm(block.input_layernorm, h)
        if attn.has_kv:
            T = x.shape[0]
            k = attn.k_proj(x).reshape(T, attn.n_kv_heads, attn.head_dim)
            v = k if attn.use_k_eq_v else attn.v_proj(x).reshape(T, attn.n_kv_heads, attn.head_dim)
            k = rope(attn, rms_norm(attn.k_norm, k), layout)
            store_kv(kv, layer, layout, k, attn.v_norm(v))
        return x

    def decoder_layer(
        block: nn.Module,
        h: mx.array,
        kv: KVPools,
        layer: int,
        layout: AttentionLayout,
        rows: QueryRows | None,
    ) -> mx.array:
        attn = block.self_attn
        x = write_block_kv(block, h, kv, layer, layout)
        inputs = layout.shared.get(STEP_INPUTS)
        gate_input = None if inputs is None else inputs[:, layer]
        layout, h, x = only_rows(rows, layout, h, x)
        if gate_input is not None and rows is not None:
            gate_input = gate_input[rows.rows]
        q = rms_norm(attn.q_norm, attn.q_proj(x).reshape(x.shape[0], attn.n_heads, attn.head_dim))
        out = attend(attn, rope(attn, q, layout), kv, pools[layer], layout, windows[layer])
        h = h + rms_norm(block.post_attention_layernorm, out)
        h = h + rms_norm(block.post_feedforward_layernorm, feed_forward(block, h))
        if gate_input is not None:
            gate = block.per_layer_projection(nn.gelu_approx(block.per_layer_input_gate(h)) * gate_input)
            h = h + rms_norm(block.post_per_layer_input_norm, gate)
        return h * block.layer_scalar

    softcap = model.final_logit_softcapping
    return Architecture(
        decoder_layer, write_block_kv, embed, step_inputs=per_layer_inputs, logit_softcap=softcap
    )


def feed_forward(block: nn.Module, h: mx.array) -> mx.array:
    """The gated MLP, or (enable_moe_block) the MLP and the routed experts, each normed, summed."""
    dense = block.mlp(rms_norm(block.pre_feedforward_layernorm, h))
    if not block.enable_moe:
        return dense
    indices, weights = block.router(h)
    routed = block.experts(rms_norm(block.pre_feedforward_layernorm_2, h), indices, weights)
    return rms_norm(block.post_feedforward_layernorm_1, dense) + rms_norm(
        block.post_feedforward_layernorm_2, routed
    )
