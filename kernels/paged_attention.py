"""Paged attention over a flat ragged batch, with MLX ops that run on every backend (Metal, CUDA, CPU).

The KV pool of a layer is one array of shape [num_slots, n_kv_heads, head_dim] with
num_slots = num_pages * page_size; a token at position p of a sequence lives in slot
page_table[p // page_size] * page_size + p % page_size.

A step's tokens are flat: [T, ...] for all sequences together (decode tokens and prefill chunks). For
attention they are gathered into a padded [B, Qmax] grid; each sequence's context is gathered from the
pool through its page table into [B, Lmax]. The layout (indices and mask) is built once per step on the
host and shared by all layers. A fused Metal/CUDA kernel could replace `paged_attention` behind the same
signature; none is verified yet, so this is the only implementation.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass
class AttentionLayout:
    starts: mx.array  # [B] position of each sequence's first new token (the rope offset)
    slot_mapping: mx.array  # [T] pool slot of each new token
    context_slots: mx.array  # [B, Lmax] pool slots of each sequence's context (padding: slot 0)
    query_index: mx.array  # [B, Qmax] flat token index of each padded query (padding: 0)
    flat_index: mx.array  # [T] position of each flat token in the padded [B * Qmax] grid
    mask: mx.array  # [B, 1, Qmax, Lmax] True where a query may attend to a key


def build_layout(
    page_tables: list[list[int]], starts: list[int], num_new: list[int], page_size: int
) -> AttentionLayout:
    """starts[b]: tokens of sequence b already in the pool; num_new[b]: tokens it computes this step."""
    B, qmax = len(starts), max(num_new)
    lmax = max(s + n for s, n in zip(starts, num_new))
    context_slots = np.zeros((B, lmax), dtype=np.int32)
    query_index = np.zeros((B, qmax), dtype=np.int32)
    flat_index = np.zeros(sum(num_new), dtype=np.int32)
    mask = np.zeros((B, 1, qmax, lmax), dtype=bool)
    mask[:, :, :, 0] = True  # padded query rows attend to something, so softmax stays finite
    slot_mapping, t = [], 0
    for b, (table, start, n) in enumerate(zip(page_tables, starts, num_new)):
        length = start + n
        positions = np.arange(length)
        slots = np.asarray(table, dtype=np.int32)[positions // page_size] * page_size + positions % page_size
        context_slots[b, :length] = slots
        slot_mapping.append(slots[start:])
        query_index[b, :n] = np.arange(t, t + n)
        flat_index[t : t + n] = b * qmax + np.arange(n)
        # query i sits at position start + i and sees keys 0 .. start + i (causal)
        mask[b, 0, :n, :length] = positions[None, :] <= (start + np.arange(n))[:, None]
        t += n
    return AttentionLayout(
        starts=mx.array(np.asarray(starts, dtype=np.int32)),
        slot_mapping=mx.array(np.concatenate(slot_mapping)),
        context_slots=mx.array(context_slots),
        query_index=mx.array(query_index),
        flat_index=mx.array(flat_index),
        mask=mx.array(mask),
    )


def write_kv(pool: mx.array, slots: mx.array, values: mx.array) -> None:
    """Scatter new K or V rows into the pool in place.

    MLX arrays are values, but a scatter whose input buffer has no other reference reuses that buffer,
    so the cost is the rows written, not the pool's size. Callers must not keep other references
    to the pool array across the step.
    """
    pool[slots] = values.astype(pool.dtype)


def to_padded(x: mx.array, layout: AttentionLayout) -> mx.array:
    """Flat [T, heads, D] -> padded [B, heads, Qmax, D]: each sequence's new tokens in a row."""
    return x[layout.query_index].transpose(0, 2, 1, 3)


def to_flat(x: mx.array, layout: AttentionLayout) -> mx.array:
    """Padded [B, heads, Qmax, D] -> flat [T, heads, D]."""
    B, heads, qmax, head_dim = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B * qmax, heads, head_dim)[layout.flat_index]


def paged_attention(
    queries: mx.array, k_pool: mx.array, v_pool: mx.array, layout: AttentionLayout, scale: float
) -> mx.array:
    """queries: padded [B, n_heads, Qmax, D] of the new tokens, whose K/V are already in the pools.
    Returns flat [T, n_heads, D]."""
    keys = k_pool[layout.context_slots].transpose(0, 2, 1, 3)  # [B, Hkv, Lmax, D]
    values = v_pool[layout.context_slots].transpose(0, 2, 1, 3)
    out = mx.fast.scaled_dot_product_attention(
        queries, keys.astype(queries.dtype), values.astype(queries.dtype), scale=scale, mask=layout.mask
    )
    return to_flat(out, layout)
