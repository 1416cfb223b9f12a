"""Paged attention against a dense float64 reference, for every way a context can lie in the pool:
one run of pages (views), a few runs (scores joined before the softmax), many runs (pages gathered),
decode tokens and prefill chunks longer than one causal block, in one flat batch; with MLX ops and with
the CPU backend's compiled kernel (kernels.cpu_attention)."""

import random
import sys

import mlx.core as mx
import numpy as np
import pytest

from kernels import activations, cpu_attention
from kernels import paged_attention as pa
from minivllm.models.backend import OPENBLAS_PATH

HEADS, KV_HEADS, HEAD_DIM, PAGE = 4, 2, 8, 4
NUM_PAGES = 400


def reference(queries, k_pool, v_pool, tables, starts, num_new, scale, window=None, sinks=None):
    """Plain causal attention per sequence over its context gathered slot by slot, in float64; window:
    each query sees only the keys of its last `window` positions; sinks: a logit per head that joins
    each softmax's denominator."""
    q = np.asarray(queries, dtype=np.float64)
    k_pool, v_pool = np.asarray(k_pool, np.float64), np.asarray(v_pool, np.float64)
    rep, out, t = HEADS // KV_HEADS, [], 0
    for table, start, n in zip(tables, starts, num_new):
        length = start + n
        pos = np.arange(length)
        slots = np.asarray(table)[pos // PAGE] * PAGE + pos % PAGE
        k = np.repeat(k_pool[:, slots], rep, axis=0)  # [H, S, D]
        v = np.repeat(v_pool[:, slots], rep, axis=0)
        qs = q[t : t + n].transpose(1, 0, 2) * scale  # [H, n, D]
        scores = qs @ k.transpose(0, 2, 1)
        query_pos = (start + np.arange(n))[:, None]
        scores[:, pos[None, :] > query_pos] = -np.inf
        if window is not None:
            scores[:, pos[None, :] <= query_pos - window] = -np.inf
        if sinks is not None:
            column = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], (*scores.shape[:2], 1))
            scores = np.concatenate([column, scores], axis=-1)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        probs = probs[..., 1:] if sinks is not None else probs
        out.append((probs @ v).transpose(1, 0, 2).reshape(n, -1))
        t += n
    return np.concatenate(out)


@pytest.fixture(params=["loops", "blas"])
def compiled(request, tmp_path_factory, monkeypatch):
    """The CPU attention kernel, built here and taken for every attention (not only long contexts), its
    products as plain loops (as for decode tokens) or with BLAS (as for prefill blocks)."""
    assert cpu_attention.load(OPENBLAS_PATH, tmp_path_factory.getbasetemp() / "kernels")
    monkeypatch.setattr(cpu_attention, "MIN_SCORES", 0)
    monkeypatch.setattr(cpu_attention, "FEW_ROWS", 1 << 30 if request.param == "loops" else 0)
    monkeypatch.setattr(cpu_attention, "BLOCK", 16)  # several causal blocks in the short chunks here
    calls, attention = [], cpu_attention.attention
    monkeypatch.setattr(cpu_attention, "attention", lambda *a: calls.append(a[3]) or attention(*a))
    return calls  # each call's start


def run(tables, starts, num_new, seed=0, window=None, cpu_kernel=False, sinks=False):
    rng = np.random.default_rng(seed)
    k_pool = mx.array(rng.standard_normal((KV_HEADS, NUM_PAGES * PAGE, HEAD_DIM)).astype(np.float32))
    v_pool = mx.array(rng.standard_normal((KV_HEADS, NUM_PAGES * PAGE, HEAD_DIM)).astype(np.float32))
    queries = mx.array(rng.standard_normal((sum(num_new), HEADS, HEAD_DIM)).astype(np.float32))
    # sink logits as large as the scores' (some heads' sinks take most of a row's weight)
    sink = mx.array((3 * rng.standard_normal(HEADS)).astype(np.float32)) if sinks else None
    layout = pa.build_layout(tables, starts, num_new, PAGE, cpu_kernel)
    out = pa.paged_attention(queries, k_pool, v_pool, layout, HEAD_DIM**-0.5, window, sink)
    expected = reference(queries, k_pool, v_pool, tables, starts, num_new, HEAD_DIM**-0.5, window, sink)
    return np.asarray(out), expected, layout


def contiguous(first, n):
    return list(range(first, first + n))


def test_page_runs():
    assert pa.page_runs([3, 4, 5, 9, 10, 2], PAGE, 21) == [(12, 12), (36, 8), (8, 1)]
    assert pa.page_runs([7, 8, 9], PAGE, 8) == [(28, 8)]  # pages past the context are not read
    assert pa.page_runs([5], PAGE, 1) == [(20, 1)]


@pytest.mark.parametrize("num_pages", [pa.PYTHON_MAX_PAGES, pa.PYTHON_MAX_PAGES + 1, 300])
def test_page_runs_of_long_tables_cover_the_context_page_by_page(num_pages):
    """Short tables are scanned in Python, long ones with numpy: both give every position's slot."""
    rng = random.Random(num_pages)
    table = rng.sample(range(4 * num_pages), num_pages)
    table[5:40] = range(1000, 1035)  # one long run among many short ones
    length = num_pages * PAGE - 3
    slots = [s for first, n in pa.page_runs(table, PAGE, length) for s in range(first, first + n)]
    assert slots == [table[p // PAGE] * PAGE + p % PAGE for p in range(length)]


@pytest.mark.parametrize(
    "tables, starts, num_new",
    [
        ([contiguous(10, 80)], [0], [300]),  # a prefill chunk of three causal blocks, one run
        ([contiguous(10, 80)], [250], [60]),  # a later chunk: keys before it and within it
        ([contiguous(10, 80)], [317], [1]),  # decode, one run: stacked query heads
        (  # decode and prefill together, each context in a few runs
            [[5, 6, 7, 30, 31, 2] + contiguous(100, 30), [50, 51, 52, 8, 9, 200], contiguous(300, 3)],
            [100, 17, 0],
            [1, 5, 9],
        ),
        ([[3, 4, 9, 10, 20, 21, 22, 40] + contiguous(60, 10)], [30], [20]),  # a window over several runs
        ([contiguous(1, 40)[::-1]], [120], [35]),  # every page its own run: gathered
        ([list(range(0, 160, 2))], [317], [1]),  # decode over 80 one-page runs: gathered
    ],
)
@pytest.mark.parametrize("split", ["never", "always"])
@pytest.mark.parametrize("softmax", ["mlx", "numpy"])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_matches_dense_attention(tables, starts, num_new, split, softmax, window, sinks, monkeypatch):
    # split: attention divided by KV heads over the CPU streams (one per core) or kept whole;
    # softmax: MLX's attention everywhere, or every prefill block's softmax through numpy (as large
    # ones on the CPU; decode keeps MLX's attention either way); window: a sliding-window layer's
    # (shorter than the contexts, and not a multiple of the page size: it starts mid-page and mid-run)
    monkeypatch.setattr(pa, "PARALLEL_MIN_SCORES", 0 if split == "always" else 1 << 62)
    monkeypatch.setattr(activations, "NUMPY_MIN_ELEMENTS", 0 if softmax == "numpy" else 1 << 62)
    out, expected, layout = run(tables, starts, num_new, window=window, sinks=sinks)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "tables, starts, num_new",
    [
        ([contiguous(10, 80)], [0], [300]),  # a prefill chunk of many causal blocks, one run
        ([contiguous(10, 80)], [250], [60]),  # a later chunk, its first block a partial one
        ([contiguous(10, 80)], [317], [1]),  # decode
        (  # decode and prefill together, each context in a few runs, a chunk's keys across runs
            [[5, 6, 7, 30, 31, 2] + contiguous(100, 30), [50, 51, 52, 8, 9, 200], contiguous(300, 3)],
            [100, 17, 0],
            [1, 5, 9],
        ),
        ([contiguous(1, 40)[::-1]], [120], [35]),  # every page its own run (read in place, not gathered)
        ([list(range(0, 160, 2))], [317], [1]),  # decode over 80 one-page runs
    ],
)
@pytest.mark.parametrize("window", [None, 37, 3])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_compiled_kernel_matches_dense_attention(tables, starts, num_new, window, sinks, compiled):
    # window 37: starts mid-page and mid-run; 3: shorter than a causal block, so the block's first
    # rows see keys its last rows do not
    out, expected, layout = run(tables, starts, num_new, window=window, cpu_kernel=True, sinks=sinks)
    assert compiled == starts  # every sequence went to the kernel
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=1e-4)


def test_layout_positions_slots_and_the_gather_threshold():
    tables = [contiguous(10, 5), list(range(0, 2 * (pa.MAX_RUNS + 1), 2))]
    layout = pa.build_layout(tables, [6, 0], [2, 3], PAGE)
    assert layout.positions.tolist() == [6, 7, 0, 1, 2]
    assert layout.slot_mapping.tolist() == [10 * PAGE + 6, 11 * PAGE + 3, 0, 1, 2]
    assert layout.seqs[0].runs == [(40, 8)] and layout.seqs[0].pages is None
    assert layout.seqs[1].runs == [(0, 3)]  # only pages that hold the context count
    many = pa.build_layout([tables[1]], [4 * pa.MAX_RUNS], [4], PAGE)
    assert len(many.seqs[0].runs) == pa.MAX_RUNS + 1 and many.seqs[0].pages is not None


def test_the_last_rows_of_each_sequence_attend_as_in_the_whole_batch():
    """last_tokens: the sampled rows alone (the last layer of forward), one per sequence or several (a
    verification's drafted positions), give the same attention as those rows of the whole step."""
    tables, starts, num_new = (
        [contiguous(10, 80), contiguous(100, 10), contiguous(200, 10)],
        [40, 7, 0],
        [9, 1, 30],
    )
    out, _, layout = run(tables, starts, num_new)
    rng = np.random.default_rng(0)  # the pools and queries `run` made
    k_pool = mx.array(rng.standard_normal((KV_HEADS, NUM_PAGES * PAGE, HEAD_DIM)).astype(np.float32))
    v_pool = mx.array(rng.standard_normal((KV_HEADS, NUM_PAGES * PAGE, HEAD_DIM)).astype(np.float32))
    queries = mx.array(rng.standard_normal((sum(num_new), HEADS, HEAD_DIM)).astype(np.float32))
    assert layout.last_tokens([0, 1, 2], [9, 1, 30]) is None  # every row already
    for seq_indices, counts, rows in [([0, 2], None, [8, 39]), ([0, 2], [9, 2], list(range(9)) + [38, 39])]:
        picked = layout.last_tokens(seq_indices, counts)
        assert picked.rows.tolist() == rows
        part = pa.paged_attention(queries[picked.rows], k_pool, v_pool, picked.layout, HEAD_DIM**-0.5)
        np.testing.assert_allclose(np.asarray(part), out[rows], atol=1e-5, rtol=1e-5)


def test_kv_write_lands_in_the_slots():
    pool = mx.zeros((KV_HEADS, 16, HEAD_DIM))
    values = mx.arange(3 * KV_HEADS * HEAD_DIM, dtype=mx.float32).reshape(3, KV_HEADS, HEAD_DIM)
    slots = mx.array([5, 0, 9])
    pool = pa.write_kv(pool, pa.AttentionLayout([], PAGE, mx.zeros(3, mx.int32), slots), values)
    got = np.asarray(pool)
    for row, slot in enumerate([5, 0, 9]):
        np.testing.assert_array_equal(got[:, slot], np.asarray(values)[row])
    assert np.count_nonzero(got.sum(axis=(0, 2))) == 3


def test_split_attention_runs_from_any_thread(monkeypatch):
    """MLX streams belong to a thread; the engine steps on its own thread (AsyncEngine)."""
    import threading

    monkeypatch.setattr(pa, "PARALLEL_MIN_SCORES", 0)
    tables, starts, num_new = [contiguous(10, 80)], [250], [60]
    results = []
    for _ in range(2):
        thread = threading.Thread(target=lambda: results.append(run(tables, starts, num_new)[:2]))
        thread.start()
        thread.join()
    assert len(results) == 2
    for out, expected in results:
        np.testing.assert_allclose(out, expected, atol=2e-5, rtol=1e-4)


def test_kv_write_reuses_the_pools_buffer():
    """The scatter writes into the pool's own buffer when nothing else holds it (a copy per write would
    cost the pool's size every layer of every step); with another reference it must copy."""
    pool = mx.zeros((KV_HEADS, 1 << 20, HEAD_DIM))
    layout = pa.AttentionLayout([], PAGE, mx.zeros(3, mx.int32), mx.array([5, 0, 9]))
    values = mx.ones((3, KV_HEADS, HEAD_DIM))
    mx.eval(pool, values, layout.slot_index(KV_HEADS, HEAD_DIM))
    size = pool.nbytes
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    pool = pa.write_kv(pool, layout, values)
    mx.eval(pool)
    assert mx.get_peak_memory() - before < size // 4
    kept = pool
    mx.reset_peak_memory()
    copied = pa.write_kv(kept, layout, values * 2)
    mx.eval(copied)
    assert mx.get_peak_memory() - before >= size  # the measurement sees a copy when there is one
    assert (
        np.asarray(kept)[:, 5].sum() == KV_HEADS * HEAD_DIM
        and np.asarray(copied)[:, 5, 0].tolist() == [2.0] * KV_HEADS
    )


@pytest.mark.parametrize("softmax", ["mlx", "numpy"])
def test_as_many_kv_heads_as_query_heads_matches_dense_attention(softmax, monkeypatch):
    """No groups of query heads (multi-head attention): prefill chunks and a decode token over a few runs."""
    monkeypatch.setattr(sys.modules[__name__], "KV_HEADS", HEADS)
    monkeypatch.setattr(activations, "NUMPY_MIN_ELEMENTS", 0 if softmax == "numpy" else 1 << 62)
    tables = [[5, 6, 7, 30, 31, 2] + contiguous(100, 30), [50, 51, 52, 8, 9, 200], contiguous(300, 40)]
    out, expected, layout = run(tables, [100, 17, 0], [1, 5, 150])
    assert [len(s.runs) for s in layout.seqs] == [4, 3, 1]
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


def test_without_a_compiler_the_kernel_is_not_loaded_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cpu_attention, "_library", None)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert not cpu_attention.load(OPENBLAS_PATH, tmp_path)
    assert not cpu_attention.loaded() and "no C++ compiler" in caplog.text
    # a compiler that fails: not loaded either, the compiler's message logged
    broken = tmp_path / "broken-compiler"
    broken.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    assert not cpu_attention.load(OPENBLAS_PATH, tmp_path / "build")
    assert "internal error" in caplog.text and not list((tmp_path / "build").glob("*.so"))
