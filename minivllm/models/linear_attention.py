"""Linear-attention layers (the gated delta net of Qwen3-Next and Qwen3.5) over a step's flat ragged batch,
each sequence carrying its recurrent state from one step to the next.

A linear layer sees the tokens before t only through a fixed-size state: its convolution's last K - 1
inputs [1, K - 1, conv_dim] and the delta rule's matrix [1, Hv, Dv, Dk] (float32). A sequence's step
starts from its state after its first `start` tokens (none: zeros, at token 0) and ends with its state
after start + num_new, which the runner keeps for the sequence's next step. A prefill chunk runs as one
sequence; the decode tokens of all sequences run as one batch. A sequence may ask for its state at
points inside its chunk (`cuts`, page boundaries): the recurrence is split there, the same arithmetic
token by token, and the states kept for the prefix cache's snapshots.

The arithmetic is mlx-lm's own: its modules' projections, convolution and gated norm, and its
`gated_delta_update` (a Metal kernel on Apple GPUs, a loop of MLX ops over the tokens elsewhere).
"""

import math
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from kernels.paged_attention import AttentionLayout


@dataclass(frozen=True, eq=False)
class RecurrentState:
    """A sequence's linear layers' state after its first `tokens` tokens, one entry per linear layer."""

    tokens: int
    conv: tuple[mx.array, ...]  # [1, K - 1, conv_dim] each
    delta: tuple[mx.array, ...]  # [1, Hv, Dv, Dk] float32 each

    @property
    def arrays(self) -> list[mx.array]:
        return [*self.conv, *self.delta]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


@dataclass
class SequenceStates:
    """One sequence's states through a step: where it starts, where it wants them kept, what it ends with
    (filled layer by layer, in the order of the model's linear layers)."""

    start: RecurrentState | None  # None: zeros (the sequence starts at token 0)
    cuts: tuple[int, ...] = ()  # token counts strictly inside the step's tokens whose states are kept
    conv: list[mx.array] = field(default_factory=list)
    delta: list[mx.array] = field(default_factory=list)
    kept: dict[int, tuple[list[mx.array], list[mx.array]]] = field(default_factory=dict)

    def end(self, tokens: int) -> RecurrentState:
        return RecurrentState(tokens, tuple(self.conv), tuple(self.delta))

    def snapshots(self) -> list[RecurrentState]:
        return [
            RecurrentState(n, tuple(conv), tuple(delta)) for n, (conv, delta) in sorted(self.kept.items())
        ]


@dataclass
class StepStates:
    """The step's sequences' states, in the order of the layout's sequences."""

    seqs: list[SequenceStates]


def projections(la: nn.Module, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The convolution's input [T, conv_dim] (q, k, v), the gate z [T, Hv, Dv], b and a [T, Hv] of the
    flat tokens x [T, hidden]: Qwen3-Next's fused projections (in mlx-lm's head order) or Qwen3.5's."""
    T = x.shape[0]
    if hasattr(la, "in_proj_qkvz"):
        q, k, v, z, b, a = la.fix_query_key_value_ordering(la.in_proj_qkvz(x)[None], la.in_proj_ba(x)[None])
        mixed = mx.concatenate([q.reshape(1, T, -1), k.reshape(1, T, -1), v.reshape(1, T, -1)], axis=-1)
        return mixed[0], z[0], b[0], a[0]
    z = la.in_proj_z(x).reshape(T, la.num_v_heads, la.head_v_dim)
    return la.in_proj_qkv(x), z, la.in_proj_b(x), la.in_proj_a(x)


def state_layout(model: nn.Module, dtype: mx.Dtype) -> list[tuple[tuple[int, ...], mx.Dtype]]:
    """The shapes and dtypes of a RecurrentState's arrays, in its `arrays` order (a snapshot's bytes)."""
    mixers = [b.linear_attn for b in model.model.layers if hasattr(b, "linear_attn")]
    zero = [zeros(la, dtype) for la in mixers]
    return [(z[0].shape, z[0].dtype) for z in zero] + [(z[1].shape, z[1].dtype) for z in zero]


def state_nbytes(model: nn.Module, dtype: mx.Dtype) -> int:
    """The bytes of one sequence's RecurrentState (0 for a model without linear layers)."""
    return sum(math.prod(shape) * dt.size for shape, dt in state_layout(model, dtype))


def zeros(la: nn.Module, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """A layer's state before any token."""
    conv = mx.zeros((1, la.conv_kernel_size - 1, la.conv_dim), dtype=dtype)
    return conv, mx.zeros((1, la.num_v_heads, la.head_v_dim, la.head_k_dim), dtype=mx.float32)


def recur(
    la: nn.Module, conv: mx.array, delta: mx.array, mixed: mx.array, a: mx.array, b: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """The layer over n consecutive tokens of B sequences (mixed [B, n, conv_dim], a and b [B, n, Hv]) from
    their states (conv [B, K - 1, conv_dim], delta [B, Hv, Dv, Dk]): outputs [B, n, Hv, Dv] and the
    states after them, as mlx-lm's module computes them."""
    B, n, _ = mixed.shape
    conv_input = mx.concatenate([conv, mixed], axis=1)
    conv = mx.contiguous(conv_input[:, -(la.conv_kernel_size - 1) :, :])
    out = nn.silu(la.conv1d(conv_input))
    q, k, v = (
        t.reshape(B, n, heads, dim)
        for t, heads, dim in zip(
            mx.split(out, [la.key_dim, 2 * la.key_dim], axis=-1),
            (la.num_k_heads, la.num_k_heads, la.num_v_heads),
            (la.head_k_dim, la.head_k_dim, la.head_v_dim),
        )
    )
    q, k = normalize_qk(q, k, inv_scale=la.head_k_dim**-0.5, eps=1e-6)
    y, delta = gated_delta_update(
        q, k, v, a, b, la.A_log, la.dt_bias, delta, None, use_kernel=not la.training
    )
    return y, conv, delta


def linear_attention(
    la: nn.Module, x: mx.array, layout: AttentionLayout, states: StepStates, layer: int
) -> mx.array:
    """The output [T, hidden] of the model's linear layer number `layer` for the step's flat normed inputs
    x [T, hidden]; each sequence's states go from states.seqs[j].start to its end (appended to its conv
    and delta lists, which the layers before this one filled)."""
    mixed, z, b, a = projections(la, x)
    starts = [0]
    for seq in layout.seqs:
        starts.append(starts[-1] + seq.num_new)
    begin = [_state_at(la, s.start, layer, x.dtype) for s in states.seqs]
    ys: list[mx.array | None] = [None] * len(layout.seqs)
    decode = [j for j, seq in enumerate(layout.seqs) if seq.num_new == 1]
    if decode:  # one batch, one token each
        rows = mx.array([starts[j] for j in decode]) if len(decode) < len(layout.seqs) else None
        pick = (lambda t: t[rows]) if rows is not None else (lambda t: t)
        conv = mx.concatenate([begin[j][0] for j in decode]) if len(decode) > 1 else begin[decode[0]][0]
        delta = mx.concatenate([begin[j][1] for j in decode]) if len(decode) > 1 else begin[decode[0]][1]
        y, conv, delta = recur(la, conv, delta, pick(mixed)[:, None], pick(a)[:, None], pick(b)[:, None])
        for i, j in enumerate(decode):
            ys[j] = y[i]
            states.seqs[j].conv.append(conv[i : i + 1])
            states.seqs[j].delta.append(delta[i : i + 1])
    for j, seq in enumerate(layout.seqs):
        if seq.num_new != 1:
            ys[j] = _sequence(
                la, states.seqs[j], begin[j], seq.start, slice(starts[j], starts[j + 1]), mixed, a, b
            )
    y = mx.concatenate(ys) if len(ys) > 1 else ys[0]
    return la.out_proj(la.norm(y, z).reshape(x.shape[0], -1))


def _state_at(la: nn.Module, start: RecurrentState | None, layer: int, dtype: mx.Dtype) -> tuple:
    return zeros(la, dtype) if start is None else (start.conv[layer], start.delta[layer])


def _sequence(
    la: nn.Module,
    seq: SequenceStates,
    begin: tuple[mx.array, mx.array],
    start: int,
    rows: slice,
    mixed: mx.array,
    a: mx.array,
    b: mx.array,
) -> mx.array:
    """One sequence's chunk, split at its cuts (whose states it keeps): outputs [n, Hv, Dv]."""
    conv, delta = begin
    bounds = [start, *seq.cuts, start + rows.stop - rows.start]
    ys = []
    for lo, hi in zip(bounds, bounds[1:]):
        part = slice(rows.start + lo - start, rows.start + hi - start)
        y, conv, delta = recur(la, conv, delta, mixed[part][None], a[part][None], b[part][None])
        ys.append(y[0])
        if hi != bounds[-1]:
            kept = seq.kept.setdefault(hi, ([], []))
            kept[0].append(conv)
            kept[1].append(delta)
    seq.conv.append(conv)
    seq.delta.append(delta)
    return mx.concatenate(ys) if len(ys) > 1 else ys[0]
