"""Rope on a step's flat tokens: the cos and sin computed once per step (minivllm.models.rope) rotate to the
same bits as each mlx-lm module's own call, at every position of a ragged batch; modules that rotate
alike share one table, others (another base) get their own, and unknown modules run their own call."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE

from kernels.paged_attention import build_layout
from minivllm.models import rope as rope_module

HEAD_DIM = 32
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
MODULES = {
    "plain": lambda: nn.RoPE(HEAD_DIM, base=10000.0),
    "linear scaling": lambda: nn.RoPE(HEAD_DIM, base=1000.0, scale=0.25),
    "partial": lambda: nn.RoPE(24, base=10000.0),
    "llama3": lambda: Llama3RoPE(
        HEAD_DIM, max_position_embeddings=4096, base=500000.0, scaling_config=LLAMA3
    ),
    "longrope": lambda: SuScaledRoPE(
        24, max_position_embeddings=4096, original_max_position_embeddings=1024, long_factor=[1.5] * 12
    ),
    "yarn": lambda: YarnRoPE(HEAD_DIM, max_position_embeddings=4096, scaling_factor=4.0),
    "yarn, mscale 1": lambda: YarnRoPE(HEAD_DIM, max_position_embeddings=4096, scaling_factor=1.0),
    # no shared table for these: their own call runs
    "traditional": lambda: nn.RoPE(HEAD_DIM, traditional=True),
    "yarn, traditional": lambda: YarnRoPE(HEAD_DIM, traditional=True, scaling_factor=4.0),
}


class Attention(nn.Module):
    def __init__(self, rope: nn.Module):
        super().__init__()
        self.rope = rope


def ragged_layout():
    """Three sequences: a decode token at position 1000, a chunk of 20 from 40, a fresh prompt of 5."""
    tables = [list(range(0, 70)), list(range(100, 110)), list(range(200, 201))]
    return build_layout(tables, [1000, 40, 0], [1, 20, 5], 16)


def own_call(attn: Attention, x: mx.array, positions: mx.array) -> mx.array:
    T, heads, _ = x.shape
    return attn.rope(x.reshape(T, heads, 1, -1), offset=positions).squeeze(2)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_rope_gives_each_modules_own_bits_at_every_position(name):
    attn, layout = Attention(MODULES[name]()), ragged_layout()
    T = layout.positions.shape[0]
    for heads in (4, 2):  # queries and keys: one table, broadcast per head count
        x = mx.random.normal((T, heads, HEAD_DIM), key=mx.random.key(heads))
        got, expected = rope_module.rope(attn, x, layout), own_call(attn, x, layout.positions)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    tables = [k for k in layout.shared if k[0] == "rope"]
    known = "traditional" not in name
    assert len(tables) == (3 if known else 0)  # the table, and its broadcasts for 4 and 2 heads


def test_layers_that_rotate_alike_share_a_table_and_another_base_gets_its_own():
    layout = ragged_layout()
    T = layout.positions.shape[0]
    layers = [Attention(nn.RoPE(HEAD_DIM, base=10000.0)) for _ in range(3)] + [Attention(nn.RoPE(HEAD_DIM))]
    layers.append(Attention(nn.RoPE(HEAD_DIM, base=1000.0)))  # a local layer's base (Gemma 3)
    x = mx.random.normal((T, 4, HEAD_DIM))
    for attn in layers:
        np.testing.assert_array_equal(
            np.asarray(rope_module.rope(attn, x, layout)), np.asarray(own_call(attn, x, layout.positions))
        )
    assert len([k for k in layout.shared if k[0] == "rope" and len(k) == 2]) == 2


def test_a_module_at_a_freed_modules_id_is_not_taken_for_it():
    """The per-module cache is keyed by id; a new module at an old id must not reuse the old arguments."""
    layout = ragged_layout()
    x = mx.random.normal((layout.positions.shape[0], 2, HEAD_DIM))
    for base in (10000.0, 500.0, 10000.0, 77.0):  # each module freed before the next is made
        attn = Attention(nn.RoPE(HEAD_DIM, base=base))
        layout.shared.clear()
        np.testing.assert_array_equal(
            np.asarray(rope_module.rope(attn, x, layout)), np.asarray(own_call(attn, x, layout.positions))
        )
        del attn


@pytest.mark.parametrize("name", sorted(MODULES))
def test_tokens_rotated_a_few_at_a_time_get_the_same_bits(name):
    """On MLX's CUDA backend the per-token rope of small rotated dims runs a few tokens a call
    (rope_module.cuda_rope_rows); split anywhere, each token keeps its own position's bits."""
    attn, layout = Attention(MODULES[name]()), ragged_layout()
    T = layout.positions.shape[0]
    x = mx.random.normal((T, 4, HEAD_DIM), key=mx.random.key(7))
    whole = rope_module.per_token_rope(attn.rope, x, layout.positions)
    np.testing.assert_array_equal(np.asarray(whole), np.asarray(own_call(attn, x, layout.positions)))
    for rows in (1, 7, T - 1, T):
        split = rope_module.per_token_rope(attn.rope, x, layout.positions, rows)
        np.testing.assert_array_equal(np.asarray(split), np.asarray(whole))


@pytest.mark.parametrize(
    "dims, heads, tokens, one_call",  # what the H200 ran (benchmarks/results/cuda/gpu-check-probe.log)
    [(16, 4, 64, True), (16, 4, 128, False), (16, 2, 512, False), (16, 1, 1024, False), (64, 2, 750, True)],
)
def test_cuda_rope_rows_splits_exactly_the_calls_mlxs_cuda_kernel_failed(dims, heads, tokens, one_call):
    rows = rope_module.cuda_rope_rows(dims, heads)
    assert (rows is None or rows >= tokens) == one_call
    assert rows is None or rows * -(-heads // 4) <= 64  # the block's z within CUDA's limit
