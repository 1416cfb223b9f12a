"""Batch sampling with per-request parameters, built lazily into the step's graph.

Filters come from mlx-lm (apply_top_k / apply_top_p); each sampling row draws with its own PRNG key derived
from the request's seed and its output position, so a seeded request is reproducible whatever batch it
shares a step with.
"""

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from minivllm.sampling_params import SamplingParams


def sample(logits: mx.array, params: list[SamplingParams], seeds: list[int], positions: list[int]):
    """logits [B, V] -> (tokens [B], logprobs [B, V] float32)."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    greedy = mx.argmax(logprobs, axis=-1)
    if all(p.greedy for p in params):
        return greedy, logprobs
    rows = []
    for i, (p, seed, pos) in enumerate(zip(params, seeds, positions)):
        if p.greedy:
            rows.append(greedy[i])
            continue
        row = logprobs[i : i + 1]
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            row = apply_top_k(row, p.top_k)
        if p.top_p < 1.0:
            row = apply_top_p(row, p.top_p)
        key = mx.random.key((seed * 1_000_003 + pos) % (1 << 63))
        rows.append(mx.random.categorical(row * (1.0 / p.temperature), key=key)[0])
    return mx.stack(rows).astype(greedy.dtype), logprobs
