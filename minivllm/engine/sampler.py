"""Batch sampling with per-request parameters, built lazily into the step's graph.

Logits first go through what changes them, each applied only to the rows that ask for it (a request
without bias, penalties or a grammar pays nothing): logit bias, repetition penalty, presence and
frequency penalties (the order of mlx-lm's and vLLM's processors), then the grammar mask. Greedy rows
take the argmax: no softmax over the vocabulary (a logsumexp over 150k entries costs ~2 ms a row on the
CPU backend). Sampled rows scale by temperature, apply mlx-lm's top-k / top-p / min-p filters, and draw
with their own PRNG key derived from the request's seed and output position, so a seeded request is
reproducible whatever batch it shares a step with.
"""

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from minivllm.engine.sequence import Sequence


def sample(
    logits: mx.array,
    seqs: list[Sequence],
    bitmasks: np.ndarray | None = None,
    masked_rows=(),
    positions: list[int] | None = None,
) -> mx.array:
    """logits [B, V] -> tokens [B], for seqs[i] at row i (a seq has several rows when a step verifies its
    draft). bitmasks[j]: the tokens row masked_rows[j] may take, one bit each (llguidance's layout).
    positions[i]: how many tokens come before the one row i draws (default len(token_ids): the next one;
    more for a step built ahead or a drafted position), so that each draw is the one of its position."""
    logits = logits.astype(mx.float32)  # a new array: the updates below leave the caller's logits alone
    logits = apply_logit_bias(logits, seqs)
    logits = apply_penalties(logits, seqs)
    if bitmasks is not None:
        rows = mx.array(masked_rows)
        logits[rows] = mx.where(unpack_bits(mx.array(bitmasks), logits.shape[-1]), logits[rows], -mx.inf)
    greedy = mx.argmax(logits, axis=-1)
    if all(s.params.greedy for s in seqs):
        return greedy
    positions = positions or [len(s.token_ids) for s in seqs]
    rows = []
    for i, (s, position) in enumerate(zip(seqs, positions)):
        p = s.params
        if p.greedy:
            rows.append(greedy[i])
            continue
        row = logits[i : i + 1] * (1.0 / p.temperature)
        if 0 < p.top_k < row.shape[-1]:
            row = apply_top_k(row, p.top_k)
        if p.top_p < 1.0:
            row = apply_top_p(log_softmax(row), p.top_p)
        if p.min_p > 0:
            row = apply_min_p(row, p.min_p)
        key = mx.random.key((s.seed * 1_000_003 + position) % (1 << 63))
        rows.append(mx.random.categorical(row, key=key)[0])
    return mx.stack(rows).astype(greedy.dtype)


def apply_logit_bias(logits: mx.array, seqs: list[Sequence]) -> mx.array:
    rows, tokens, biases = [], [], []
    for i, s in enumerate(seqs):
        for token, bias in s.params.logit_bias.items():
            rows.append(i)
            tokens.append(token)
            biases.append(bias)
    if not rows:
        return logits
    return logits.at[mx.array(rows), mx.array(tokens)].add(mx.array(biases, dtype=mx.float32))


def apply_penalties(logits: mx.array, seqs: list[Sequence]) -> mx.array:
    """Repetition penalty over prompt and output, then presence / frequency over the output (vLLM's
    scopes), on the penalized rows only, from token counts scattered on the device."""
    penalized = [i for i, s in enumerate(seqs) if s.params.penalized]
    if not penalized:
        return logits
    params = [seqs[i].params for i in penalized]
    rows = mx.array(penalized)
    x = logits[rows]
    shape = x.shape

    repeat = [j for j, p in enumerate(params) if p.repetition_penalty != 1]
    if repeat:
        seen = _token_counts(shape, [(j, seqs[penalized[j]].token_ids) for j in repeat]) > 0
        penalty = mx.array([p.repetition_penalty for p in params], dtype=mx.float32)[:, None]
        x = mx.where(seen, mx.where(x > 0, x / penalty, x * penalty), x)

    counts = _token_counts(shape, [(j, seqs[i].output_token_ids) for j, i in enumerate(penalized)])
    frequency = mx.array([p.frequency_penalty for p in params], dtype=mx.float32)[:, None]
    presence = mx.array([p.presence_penalty for p in params], dtype=mx.float32)[:, None]
    x = x - frequency * counts - presence * (counts > 0)

    logits[rows] = x
    return logits


def _token_counts(shape: tuple[int, int], rows: list[tuple[int, list[int]]]) -> mx.array:
    """[n, V] counts of each row's tokens."""
    counts = mx.zeros(shape, dtype=mx.float32)
    row_ids = np.concatenate([np.full(len(tokens), j, dtype=np.int32) for j, tokens in rows])
    if not len(row_ids):
        return counts
    token_ids = np.concatenate([np.asarray(tokens, dtype=np.int32) for _, tokens in rows])
    return counts.at[mx.array(row_ids), mx.array(token_ids)].add(1.0)


def unpack_bits(words: mx.array, n: int) -> mx.array:
    """[R, W] int32 -> [R, n] bool: bit k of word w is column 32 w + k."""
    bits = mx.right_shift(words[:, :, None], mx.arange(32, dtype=mx.int32)) & 1
    return bits.reshape(words.shape[0], -1)[:, :n].astype(mx.bool_)


def log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)
