"""The pieces every family's forward shares: the KV pools, K/V writes on flat tokens, paged attention,
the logits, and the walk over the blocks.

A step's tokens of all sequences are flat [T] through the linear layers and rope; attention reads each
sequence's context through its page table in kernels.paged_attention. The modules and weights are
mlx-lm's own (loaded by `mlx_lm.load`); a family's file (qwen2, phi3, gemma3_text) says only how one of
its blocks computes.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kernels.paged_attention import AttentionLayout, QueryRows, paged_attention, write_kv
from minivllm.models.rms_norm import rms_norm


@dataclass
class KVPools:
    """What the layers read and write besides their weights: the KV pools of the attention layers and, in
    hybrid models, the step's recurrent states of the linear layers (minivllm.models.linear_attention's
    StepStates, set by the runner for each step)."""

    keys: list[mx.array]  # per attention layer [n_kv_heads, num_slots, head_dim]
    values: list[mx.array]
    recurrent: Any = None


def qk_norm(attn: nn.Module, name: str, x: mx.array) -> mx.array:
    """The per-head RMSNorm of queries or keys before rope (Qwen3, Gemma 3); absent in Qwen2 / Llama."""
    norm = getattr(attn, name, None)
    return x if norm is None else rms_norm(norm, x)


def store_kv(kv: KVPools, layer: int, layout: AttentionLayout, keys: mx.array, values: mx.array) -> None:
    """A step's new keys (rope applied) and values, [T, n_kv_heads, D], into the layer's pools."""
    kv.keys[layer] = write_kv(kv.keys[layer], layout, keys)
    kv.values[layer] = write_kv(kv.values[layer], layout, values)


def attend(
    attn: nn.Module,
    queries: mx.array,
    kv: KVPools,
    layer: int,
    layout: AttentionLayout,
    window: int | None = None,
) -> mx.array:
    """The output projection of the queries [T, n_heads, D] (rope applied) over the pools, which hold
    their own K/V already; window: a sliding-window layer's. The module's attention sinks too, where it
    has them (gpt-oss's, whose module names its scale sm_scale)."""
    scale, sinks = getattr(attn, "scale", None) or attn.sm_scale, getattr(attn, "sinks", None)
    out = paged_attention(queries, kv.keys[layer], kv.values[layer], layout, scale, window, sinks)
    return attn.o_proj(out)


def only_rows(rows: QueryRows | None, layout: AttentionLayout, *xs: mx.array) -> tuple:
    """The layout and arrays of the rows that go on past a block's K/V write (all when rows is None)."""
    if rows is None:
        return layout, *xs
    return rows.layout, *(x[rows.rows] for x in xs)


# (block, h, kv, layer, layout, rows) -> h: one block over the flat tokens; rows: only these go on past
# the K/V write (the last block's sampled rows)
DecoderLayer = Callable[[nn.Module, mx.array, KVPools, int, AttentionLayout, QueryRows | None], mx.array]
# (block, h, kv, layer, layout): a block's K/V write alone (the last block of a step nobody samples in)
WriteKV = Callable[[nn.Module, mx.array, KVPools, int, AttentionLayout], object]


@dataclass(frozen=True)
class Block:
    """One transformer block over the flat tokens, from a family's parts:
    write_kv (block, h, kv, layer, layout) writes the K/V and returns what `queries` (attn, it, layout)
    makes the queries of; after_attention (block, h, attention output) -> the block's output;
    windows: each layer's sliding window (None: it attends to the whole context), empty where none has
    one."""

    write_kv: Callable[[nn.Module, mx.array, KVPools, int, AttentionLayout], mx.array]
    queries: Callable[[nn.Module, mx.array, AttentionLayout], mx.array]
    after_attention: Callable[[nn.Module, mx.array, mx.array], mx.array]
    windows: tuple[int | None, ...] = ()

    def __call__(
        self,
        block: nn.Module,
        h: mx.array,
        kv: KVPools,
        layer: int,
        layout: AttentionLayout,
        rows: QueryRows | None,
    ) -> mx.array:
        attn = block.self_attn
        x = self.write_kv(block, h, kv, layer, layout)
        layout, h, x = only_rows(rows, layout, h, x)
        window = self.windows[layer] if self.windows else None
        return self.after_attention(
            block, h, attend(attn, self.queries(attn, x, layout), kv, layer, layout, window)
        )


def embed(model: nn.Module, input_ids: mx.array) -> mx.array:
    return model.model.embed_tokens(input_ids)


@dataclass(frozen=True)
class Architecture:
    """How a family's blocks compute; the walk over them (forward) is shared."""

    decoder_layer: DecoderLayer
    write_block_kv: WriteKV
    embed: Callable[[nn.Module, mx.array], mx.array] = embed
    num_linear_layers: int = 0  # hybrid models' layers with a recurrent state (and no KV pool)
    # (model, input ids, embedded input) -> what every block reads besides h, made once per step and kept
    # in layout.shared[STEP_INPUTS] (Gemma 4's per-layer inputs)
    step_inputs: Callable[[nn.Module, mx.array, mx.array], Any] | None = None
    logit_softcap: float | None = None  # the logits as softcap * tanh(logits / softcap) (Gemma 4's)


STEP_INPUTS = "step inputs"


def forward(
    arch: Architecture,
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
    h = arch.embed(model, input_ids)
    if arch.step_inputs is not None:
        layout.shared[STEP_INPUTS] = arch.step_inputs(model, input_ids, h)
    body = model.model
    *inner, last = body.layers
    for i, block in enumerate(inner):
        h = arch.decoder_layer(block, h, kv, i, layout, None)
    # The last block's output feeds only the logits: every token's K/V still goes into the pool, but
    # its queries, attention and MLP are computed for the sampled rows alone (a prefill chunk's last
    # token, a verification's drafted positions), which saves 1/num_layers of a prefill step.
    if not sampling:
        arch.write_block_kv(last, h, kv, len(inner), layout)
        return None
    rows = layout.last_tokens(sampling, num_rows)
    h = rms_norm(body.norm, arch.decoder_layer(last, h, kv, len(inner), layout, rows))
    head = getattr(model, "language_model", model)  # Qwen3.5 keeps its text model's head there
    logits = head.lm_head(h) if getattr(head, "lm_head", None) is not None else body.embed_tokens.as_linear(h)
    if arch.logit_softcap:
        return mx.tanh(logits / arch.logit_softcap) * arch.logit_softcap  # mlx-lm's order of operations
    return logits
