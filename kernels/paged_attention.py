"""Paged attention over a flat ragged batch, with MLX ops that run on every backend (Metal, CUDA, CPU).

The KV pool of a layer (keys and values alike) is one array [n_kv_heads, num_slots, head_dim] with
num_slots = num_pages * page_size; the token at position p of a sequence lives in slot
page_table[p // page_size] * page_size + p % page_size. Head-major, so that a range of slots is, for
every head, a row-contiguous [n, head_dim] matrix: a slice of the pool feeds the attention matmuls as a
view, with no copy.

A step's tokens are flat: [T, ...] for all sequences together (decode tokens and prefill chunks).
Attention runs per sequence and reads its context through its page table as runs of consecutive pages
(the page pool places a request's pages consecutively where it can, so one run is the common case):
  - one run: `mx.fast.scaled_dot_product_attention` on views of the pool (not for a softmax on numpy);
  - a few runs: scores per run, concatenated (head_dim times smaller than the keys), one softmax, the
    values summed run by run, the same arithmetic as MLX's own unfused attention;
  - more than MAX_RUNS runs: the context's pages are gathered into one copy first (bounded graph size).
Prefill chunks go in blocks of BLOCK queries; a block sees the keys up to its own last position, so the
key blocks the causal mask hides entirely are never computed. A decode token's query heads that share a
KV head are stacked as the rows of one matrix, so each KV head is read once, not once per query head.
On the CPU backend, a large prefill block's softmax goes through numpy (kernels.activations: MLX's CPU
exp is one element at a time), and other attention with many scores is split by KV heads over one MLX
stream per core (MLX runs a CPU stream's element-wise ops on one thread).

On the CPU backend, where the engine loaded the compiled kernel (kernels.cpu_attention, the default), a
sequence's attention with many scores (long contexts) goes there instead, in one call per layer: the
MLX-ops path below stays the reference it is tested against, and the path of every other backend.

The layout (runs, positions, slots) is built once per step on the host, in O(pages + new tokens), and
shared by all layers. A fused Metal/CUDA kernel could replace `paged_attention` behind the same
signature; none is verified on a GPU yet, so this is the only implementation.
"""

import os
from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

from kernels import cpu_attention
from kernels.activations import on_numpy, softmax_numpy

BLOCK = 128  # prefill queries per causal block
MAX_RUNS = 16  # more runs of pages than this: gather the context into one copy
PYTHON_MAX_PAGES = 64  # longer page tables find their runs with numpy
PARALLEL_MIN_SCORES = 1 << 16  # CPU: attention with fewer scores than this is not split over cores


@dataclass
class SequenceContext:
    start: int  # tokens of the sequence already in the pool: the position of its first new token
    num_new: int  # tokens it computes this step (consecutive in the flat batch)
    runs: list[tuple[int, int]]  # (first slot, slots) covering positions 0 .. start + num_new - 1, in order
    pages: mx.array | None = None  # its pages, when there are too many runs to slice


@dataclass
class AttentionLayout:
    seqs: list[SequenceContext]
    page_size: int
    positions: mx.array  # [T] position of each flat token in its sequence (its rope offset)
    slot_mapping: mx.array  # [T] pool slot of each new token
    cpu_kernel: bool = False  # attention with many scores in kernels.cpu_attention (the engine loaded it)
    # what the model derives from the layout once per step for every layer (rope's cos and sin, the K/V
    # writes' slot index)
    shared: dict = field(default_factory=dict)

    def last_tokens(self, seq_indices: list[int], counts: list[int] | None = None) -> "QueryRows | None":
        """The last counts[j] new tokens (one by default) of each given sequence seq_indices[j], as rows of
        the flat batch and their own layout (the same contexts, those queries only); None when that is
        every token already. Several rows of one sequence: a speculative step's verified positions."""
        counts = counts or [1] * len(seq_indices)
        if len(seq_indices) == len(self.seqs) and all(s.num_new == c for s, c in zip(self.seqs, counts)):
            return None
        ends = np.cumsum([s.num_new for s in self.seqs])
        if all(c == 1 for c in counts):  # the common case: one row per sequence
            rows_np = ends[seq_indices] - 1
        else:
            rows_np = np.concatenate([np.arange(ends[i] - c, ends[i]) for i, c in zip(seq_indices, counts)])
        rows = mx.array(rows_np.astype(np.int32))
        seqs = [
            replace(self.seqs[i], start=self.seqs[i].start + self.seqs[i].num_new - c, num_new=c)
            for i, c in zip(seq_indices, counts)
        ]
        layout = AttentionLayout(
            seqs, self.page_size, self.positions[rows], self.slot_mapping[rows], self.cpu_kernel
        )
        return QueryRows(rows, layout)

    def slot_index(self, heads: int, head_dim: int) -> mx.array:
        """slot_mapping as put_along_axis's index into a pool [heads, slots, head_dim], [heads, T,
        head_dim]: built once per step, and every layer's K and V writes share it."""
        key = ("slot index", heads, head_dim)
        if key not in self.shared:
            T = self.slot_mapping.shape[0]
            self.shared[key] = mx.broadcast_to(self.slot_mapping.reshape(1, T, 1), (heads, T, head_dim))
        return self.shared[key]


@dataclass
class QueryRows:
    rows: mx.array  # [R] indices into the step's flat tokens
    layout: AttentionLayout  # those tokens alone


def page_runs(pages: list[int], page_size: int, length: int) -> list[tuple[int, int]]:
    """(first slot, slots) of each run of consecutive pages holding positions 0 .. length - 1."""
    needed = -(-length // page_size)
    firsts = _run_firsts(pages, needed)
    ends = firsts[1:] + [needed]
    runs = [(int(pages[f]) * page_size, (e - f) * page_size) for f, e in zip(firsts, ends)]
    first, n = runs[-1]
    runs[-1] = (first, n - (needed * page_size - length))
    return runs


def _run_firsts(pages: list[int], needed: int) -> list[int]:
    """The indices of the pages (of the first `needed`) that begin a run: a loop for the common short
    table, where numpy's calls would cost more than the loop (a decode step builds a layout per step)."""
    if needed <= PYTHON_MAX_PAGES:
        return [0] + [i for i in range(1, needed) if pages[i] != pages[i - 1] + 1]
    return [0] + (np.flatnonzero(np.diff(np.asarray(pages[:needed])) != 1) + 1).tolist()


def build_layout(
    page_tables: list[list[int]],
    starts: list[int],
    num_new: list[int],
    page_size: int,
    cpu_kernel: bool = False,
) -> AttentionLayout:
    """starts[b]: tokens of sequence b already in the pool; num_new[b]: tokens it computes this step;
    cpu_kernel: attention with many scores goes to kernels.cpu_attention."""
    seqs, positions, slots = [], [], []
    for table, start, n in zip(page_tables, starts, num_new):
        length = start + n
        runs = page_runs(table, page_size, length)
        many = len(runs) > MAX_RUNS
        pages = mx.array(table[: -(-length // page_size)], dtype=mx.int32) if many else None
        seqs.append(SequenceContext(start, n, runs, pages))
        new = range(start, length)
        positions.extend(new)
        slots.extend(table[p // page_size] * page_size + p % page_size for p in new)
    return AttentionLayout(
        seqs=seqs,
        page_size=page_size,
        positions=mx.array(positions, dtype=mx.int32),
        slot_mapping=mx.array(slots, dtype=mx.int32),
        cpu_kernel=cpu_kernel,
    )


def write_kv(pool: mx.array, layout: AttentionLayout, values: mx.array) -> mx.array:
    """The pool [n_kv_heads, num_slots, head_dim] with the step's new K or V rows (values [T, n_kv_heads,
    head_dim]) in their slots.

    MLX arrays are values, but put_along_axis writes into its input's buffer when nothing else refers to
    it, so the cost is the rows written, not the pool's size: the caller replaces its reference to the
    pool with the result and keeps no other across the step. Two graph nodes per write (a transpose and
    the scatter), where indexing `pool[:, slots]` builds its index arrays again at every write.
    """
    heads, _, head_dim = pool.shape
    values = values.transpose(1, 0, 2).astype(pool.dtype)  # no graph node when the dtypes agree
    return mx.put_along_axis(pool, layout.slot_index(heads, head_dim), values, axis=1)


def paged_attention(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    layout: AttentionLayout,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """queries: flat [T, n_heads, D] of the new tokens, whose K/V are already in the pools. window: a
    sliding-window layer's, where the query at position p sees the keys of positions p - window + 1 .. p
    (the pool still holds every position: other layers and the prefix cache need them). sinks: [n_heads]
    attention sinks (gpt-oss's), one more logit per head in each query's softmax, with no value.
    Returns flat [T, n_heads * D]."""
    outs, t = [], 0
    for seq in layout.seqs:
        q = queries[t : t + seq.num_new]
        t += seq.num_new
        if layout.cpu_kernel and cpu_attention.fits(q, seq.start + seq.num_new):
            args = (q, k_pool, v_pool, seq.start, seq.runs, scale, window, sinks)
            outs.append(cpu_attention.attention(*args))
            continue
        keys, values, runs = _context(k_pool, v_pool, seq, layout.page_size)
        for r0 in range(0, seq.num_new, BLOCK):
            r1 = min(seq.num_new, r0 + BLOCK)
            visible = seq.start + r1  # keys of positions first .. visible - 1
            first = 0 if window is None else max(0, seq.start + r0 - window + 1)
            k, v = _views(keys, runs, first, visible), _views(values, runs, first, visible)
            outs.append(_attend_parallel(q[r0:r1], k, v, scale, window, sinks))
    return mx.concatenate(outs) if len(outs) > 1 else outs[0]


def _context(k_pool: mx.array, v_pool: mx.array, seq: SequenceContext, page_size: int):
    """The arrays a sequence's context lives in, [1, Hkv, N, D], and its runs in them."""
    if seq.pages is None:
        return k_pool[None], v_pool[None], seq.runs
    runs = [(0, seq.start + seq.num_new)]
    return _gather_pages(k_pool, seq.pages, page_size), _gather_pages(v_pool, seq.pages, page_size), runs


def _gather_pages(pool: mx.array, pages: mx.array, page_size: int) -> mx.array:
    """A copy of the given pages, in order: [1, Hkv, len(pages) * page_size, D]."""
    heads, num_slots, head_dim = pool.shape
    by_page = pool.reshape(heads, num_slots // page_size, page_size * head_dim)
    return by_page[:, pages].reshape(1, heads, -1, head_dim)


def _views(array: mx.array, runs: list[tuple[int, int]], first: int, limit: int) -> list[mx.array]:
    """Slices of array [1, Hkv, N, D] holding the context's positions first .. limit - 1."""
    out, position = [], 0  # position: the context position of the run's first slot
    for slot, n in runs:
        lo, hi = max(first, position), min(limit, position + n)
        if lo < hi:
            out.append(array[:, :, slot + lo - position : slot + hi - position])
        position += n
        if position >= limit:
            break
    return out


def cpu_streams() -> list:
    """One stream per core on the CPU backend (MLX runs each CPU stream's ops on its own thread); just
    the default stream on a GPU, which parallelises within each op. MLX streams belong to a thread: the
    extra ones are thread-local streams, so whichever thread steps the engine gets its own."""
    global _extra_streams
    if _extra_streams is None:
        cores = min(os.cpu_count() or 1, 8) if mx.default_device() == mx.cpu else 1
        _extra_streams = [mx.new_thread_local_stream(mx.cpu) for _ in range(cores - 1)]
    return [mx.default_stream(mx.default_device())] + _extra_streams


_extra_streams: list | None = None
Pieces = list[mx.array]  # a context's keys or values, as consecutive pieces [1, Hkv, S_i, D]


def _attend_parallel(
    q: mx.array, keys: Pieces, values: Pieces, scale: float, window=None, sinks=None
) -> mx.array:
    """_attend, split by KV heads over the CPU's cores when there are many scores. On the CPU backend
    element-wise work (the softmax's exp above all, ~11 ns an element) runs on one thread per stream;
    the heads are independent, so their groups run side by side and the results are the same."""
    L, H, D = q.shape
    heads_kv = keys[0].shape[1]
    scores = L * H * sum(k.shape[2] for k in keys)
    streams = cpu_streams()[:heads_kv] if scores >= PARALLEL_MIN_SCORES else []
    # the split exists for MLX's one-thread exp: a softmax on numpy is faster alone
    if len(streams) < 2 or _prefill_on_numpy(q.dtype, L, H, keys):
        return _attend(q, keys, values, scale, window, sinks)
    rep, outs = H // heads_kv, []
    for g, stream in enumerate(streams):
        h0, h1 = g * heads_kv // len(streams), (g + 1) * heads_kv // len(streams)
        with mx.stream(stream):
            k, v = [x[:, h0:h1] for x in keys], [x[:, h0:h1] for x in values]
            s = None if sinks is None else sinks[h0 * rep : h1 * rep]
            outs.append(_attend(q[:, h0 * rep : h1 * rep], k, v, scale, window, s).reshape(L, -1, D))
    return mx.concatenate(outs, axis=1).reshape(L, H * D)


def _attend(q: mx.array, keys: Pieces, values: Pieces, scale: float, window=None, sinks=None) -> mx.array:
    """q: [L, H, D], the last L positions of the context; keys/values: the context in order, as pieces
    [1, Hkv, S_i, D]. Causal attention (within `window` positions, when given; with a sink logit per
    head, when given); returns [L, H * D]."""
    L, H, D = q.shape
    heads_kv = keys[0].shape[1]
    # one query sees every key: stack the query heads sharing a KV head as rows (not with sinks, which
    # MLX's attention takes per head, not per row)
    stacked = L == 1 and sinks is None
    if stacked:
        q, causal = q.reshape(1, heads_kv, H // heads_kv, D), False
    else:
        q, causal = q.transpose(1, 0, 2)[None], L > 1
    # a prefill block's large softmax goes through numpy on the CPU (kernels.activations); decode keeps
    # MLX's attention, without a host round trip per layer
    numpy_softmax = causal and _prefill_on_numpy(q.dtype, L, H, keys)
    if len(keys) == 1 and not numpy_softmax:
        mask = _causal_mask(L, keys[0].shape[2], window) if causal else None
        args = {} if sinks is None else {"sinks": sinks.astype(q.dtype)}
        out = mx.fast.scaled_dot_product_attention(q, keys[0], values[0], scale=scale, mask=mask, **args)
    else:
        out = _attend_runs(q, keys, values, scale, causal, window, numpy_softmax, sinks)
    if stacked:
        return out.reshape(1, H * D)
    return out[0].transpose(1, 0, 2).reshape(L, H * D)


def _prefill_on_numpy(dtype: mx.Dtype, L: int, H: int, keys: list[mx.array]) -> bool:
    return L > 1 and on_numpy(dtype, L * H * sum(k.shape[2] for k in keys))


def _visible(L: int, S: int, window: int | None) -> mx.array:
    """[L, S]: which keys each of L queries (the last L of S context positions) sees: those up to its
    own position and, in a sliding window, only the last `window` of them."""
    queries, keys = mx.arange(S - L, S)[:, None], mx.arange(S)[None]
    visible = keys <= queries
    return visible if window is None else visible & (keys > queries - window)


def _causal_mask(L: int, S: int, window: int | None) -> mx.array | str:
    """The context starts at the first query's window, so a window cuts only when S > window; MLX's own
    "causal" mask where none does."""
    return "causal" if window is None or S <= window else _visible(L, S, window)


def _attend_runs(q, keys, values, scale, causal, window=None, numpy_softmax=False, sinks=None) -> mx.array:
    """Attention over a context split into pieces, without joining them: like MLX's unfused
    scaled_dot_product_attention (scale, scores, mask, precise softmax, values) with the scores of all
    pieces concatenated before the softmax and the values' products summed piece by piece; sinks, as
    MLX's: a first column of each head's sink logit, dropped after the softmax."""
    B, H, L, D = q.shape
    heads_kv = keys[0].shape[1]
    q = q * mx.array(scale, dtype=q.dtype)
    if H > heads_kv:  # query heads sharing a KV head: a group axis (a decode token's are rows already)
        q = q.reshape(B, heads_kv, H // heads_kv, L, D)
        keys, values = [k[:, :, None] for k in keys], [v[:, :, None] for v in values]
    parts = [q @ k.swapaxes(-1, -2) for k in keys]
    scores = mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    if causal:
        visible = _visible(L, scores.shape[-1], window)
        scores = mx.where(visible, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    if sinks is not None:
        column = sinks.astype(scores.dtype).reshape(*scores.shape[1:-2], 1, 1)  # per query head
        scores = mx.concatenate([mx.broadcast_to(column, (*scores.shape[:-1], 1)), scores], axis=-1)
    probs = softmax_numpy(scores) if numpy_softmax else mx.softmax(scores, axis=-1, precise=True)
    if sinks is not None:
        probs = probs[..., 1:]
    out, offset = None, 0
    for v in values:
        n = v.shape[-2]
        part = probs[..., offset : offset + n] @ v
        out = part if out is None else out + part
        offset += n
    return out.reshape(B, H, L, D)
