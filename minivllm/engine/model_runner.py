"""Runs one engine step: builds the flat ragged batch, runs the model, samples, evaluates once.

`launch` queues the step on the device, `collect` reads it back: between the two, the engine may build
the next step (LLMEngine.step).
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kernels.paged_attention import build_layout
from minivllm.engine.grammar import MaskCounters, token_bitmasks
from minivllm.engine.sampler import log_softmax, sample
from minivllm.engine.sequence import Sequence
from minivllm.models.families import architecture_of
from minivllm.models.layers import Architecture, KVPools, forward
from minivllm.models.linear_attention import RecurrentState, SequenceStates, StepStates, state_layout
from minivllm.outputs import TokenLogprob

logger = logging.getLogger(__name__)

# How a page's KV is laid out as bytes on disk: the keys of layers 0 .. L-1, then their values, each
# [kv heads, page size, head dim] in the pools' dtype. Part of every page file's identity: bump it when
# this order changes, and no page written before is ever loaded.
KV_LAYOUT_VERSION = 1
# How a hybrid model's recurrent-state snapshot is laid out as bytes on disk: its arrays in
# RecurrentState.arrays' order (each layer's convolution state, then each layer's delta state), C order.
STATE_LAYOUT_VERSION = 1001
# numpy has no bfloat16: its pages travel as the same bits in uint16
_STORED_AS = {mx.bfloat16: mx.uint16}


@dataclass
class KVGeometry:
    """The KV pools' shapes: (kv heads, head dim) of each attention layer that keeps K/V. A hybrid model's
    linear layers keep none, nor do Gemma 4's KV-sharing layers (they read an earlier layer's); Gemma 4's
    global layers have other head counts and sizes than its local ones."""

    layers: tuple[tuple[int, int], ...]
    dtype: mx.Dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def bytes_per_token(self) -> int:
        return 2 * sum(heads * dim for heads, dim in self.layers) * self.dtype.size

    @classmethod
    def of(cls, model: nn.Module, dtype: mx.Dtype) -> "KVGeometry":
        blocks = [b.self_attn for b in model.model.layers if hasattr(b, "self_attn")]
        return cls(tuple(_pool_shape(model, attn) for attn in blocks if getattr(attn, "has_kv", True)), dtype)


def _pool_shape(model: nn.Module, attn: nn.Module) -> tuple[int, int]:
    # mlx-lm's names, or gpt-oss's and the hybrids' modules' own
    heads = getattr(attn, "n_heads", None) or attn.num_attention_heads
    heads_kv = getattr(attn, "n_kv_heads", None) or attn.num_key_value_heads
    # Qwen3's attention modules keep no head_dim, and its head_dim is not hidden_size / heads
    head_dim = (
        getattr(attn, "head_dim", None)
        or getattr(model.args, "head_dim", None)
        or model.args.hidden_size // heads
    )
    return heads_kv, head_dim


@dataclass
class LaunchedStep:
    """A step whose graph is queued on the device; the host reads its results back in collect."""

    seqs: list[Sequence]
    num_tokens: list[int]
    sampling: list[int]  # the indices of seqs that sample this step
    num_rows: list[int] = field(default_factory=list)  # tokens each of those samples: 1 + its draft
    tokens: mx.array | None = None  # [sum(num_rows)], lazy until collected; None: nobody samples
    extra: tuple = ()  # the log-probability arrays of the rows in `want`
    want: list[int] = field(default_factory=list)


@dataclass
class StepOutput:
    # the tokens sampled for the sequence: none while it is still in a prefill chunk, one after its last
    # token, or one per drafted position plus the bonus one when it verified a draft
    tokens: list[int] = field(default_factory=list)
    logprob: TokenLogprob | None = None  # of the one token (requests with logprobs do not draft)


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        geometry: KVGeometry,
        num_pages: int,
        page_size: int,
        mask_counters: MaskCounters,
        cpu_kernel: bool = False,
        state_points: Callable[[object, int, int], list[int]] | None = None,
    ):
        """state_points(cache, start, end): the page boundaries in (start, end] where a hybrid model's
        sequence keeps its recurrent state for a snapshot (KVManager.state_points)."""
        self.model = model
        self.state_points = state_points
        self.cpu_kernel = cpu_kernel  # long-context attention in kernels.cpu_attention (loaded by the engine)
        self.page_size = page_size
        self.geometry = geometry
        self.num_slots = num_pages * page_size
        self.mask_counters = mask_counters
        self.reset_kv()

    @cached_property
    def architecture(self) -> Architecture:
        return architecture_of(self.model)

    def reset_kv(self) -> None:
        g = self.geometry
        # head-major pools: see kernels.paged_attention
        shapes = [(heads, self.num_slots, dim) for heads, dim in g.layers]
        self.kv = None  # let the old pools go before the new ones are allocated
        self.kv = KVPools(
            keys=[mx.zeros(shape, dtype=g.dtype) for shape in shapes],
            values=[mx.zeros(shape, dtype=g.dtype) for shape in shapes],
        )
        mx.eval(self.kv.keys, self.kv.values)

    # -- page KV to and from the disk tier ---------------------------------------------------------------
    def page_payloads(self, pages: list[int]) -> np.ndarray:
        """Copies of the pages' KV as [len(pages), page bytes] uint8, in KV_LAYOUT_VERSION's order. Call on
        the stepping thread after the step's evaluation: one gather of whole pages per pool, then one copy
        to host memory that nothing of the pools refers to (so the next step's writes stay in place)."""
        index = self._page_index(pages)
        n = len(pages)
        # each pool's pages [pages, kv heads, page, head dim], flat per page, pools in order: keys, values
        parts = [
            mx.take(self._by_page(pool), index, axis=1).transpose(1, 0, 2, 3).reshape(n, -1)
            for pool in self.pools
        ]
        stored = mx.concatenate(parts, axis=1).view(_STORED_AS.get(self.geometry.dtype, self.geometry.dtype))
        return np.array(stored).view(np.uint8)

    def write_pages(self, pages: list[int], payloads: np.ndarray) -> None:
        """Put pages' KV read back from disk (page_payloads' layout) into the pools, in place, evaluated.
        Whole pages are scattered (a page's [page size, head dim] block is contiguous in a pool's head):
        2-3x faster than a scatter per token slot after a transpose of all of it, and no copy of it."""
        g, n = self.geometry, len(pages)
        stored = _STORED_AS.get(g.dtype, g.dtype)
        host = payloads.view(np.dtype(str(stored).removeprefix("mlx.core."))).reshape(n, -1)
        x = mx.array(host).view(g.dtype)
        index = self._page_index(pages)
        start = 0
        for k, (heads, dim) in enumerate(g.layers * 2):  # the keys' pools, then the values'
            size = heads * self.page_size * dim
            pools, layer = (self.kv.keys, k) if k < g.num_layers else (self.kv.values, k - g.num_layers)
            part = x[:, start : start + size].reshape(n, heads, self.page_size, dim)
            pools[layer] = self._put_pages(pools[layer], index, part)
            start += size
        mx.eval(self.kv.keys, self.kv.values)

    @property
    def pools(self) -> list[mx.array]:
        """Every pool, in the page payloads' order: each layer's keys, then each layer's values."""
        return self.kv.keys + self.kv.values

    def _by_page(self, pool: mx.array) -> mx.array:
        """A pool [kv heads, slots, head dim] viewed as [kv heads, pages, page size, head dim]."""
        heads, slots, head_dim = pool.shape
        return pool.reshape(heads, slots // self.page_size, self.page_size, head_dim)

    def _put_pages(self, pool: mx.array, index: mx.array, kv: mx.array) -> mx.array:
        """pool with its pages `index` set to kv [pages, kv heads, page size, head dim]. The caller drops
        its reference to pool, so the scatter writes into pool's buffer (nothing else holds it)."""
        by_page = self._by_page(pool)
        by_page[:, index] = kv.transpose(1, 0, 2, 3)
        return by_page.reshape(pool.shape)

    # -- a hybrid model's recurrent-state snapshots to and from the disk tier ---------------------------------
    @cached_property
    def state_layout(self) -> list[tuple[tuple[int, ...], mx.Dtype]]:
        return state_layout(self.model, self.geometry.dtype)

    def state_payloads(self, states: list[RecurrentState]) -> np.ndarray:
        """The states' bytes [len(states), state_bytes] uint8, in STATE_LAYOUT_VERSION's order."""
        rows = [
            np.concatenate(
                [np.array(a.view(_STORED_AS.get(a.dtype, a.dtype))).view(np.uint8).ravel() for a in s.arrays]
            )
            for s in states
        ]
        return np.stack(rows)

    def state_from_payload(self, payload: np.ndarray, tokens: int) -> RecurrentState:
        """A state read back from disk (state_payloads' layout), after `tokens` tokens."""
        arrays, offset = [], 0
        for shape, dtype in self.state_layout:
            stored = _STORED_AS.get(dtype, dtype)
            n = int(np.prod(shape)) * dtype.size
            host = payload[offset : offset + n].view(np.dtype(str(stored).removeprefix("mlx.core.")))
            arrays.append(mx.array(host.reshape(shape)).view(dtype))
            offset += n
        half = len(arrays) // 2
        state = RecurrentState(tokens, tuple(arrays[:half]), tuple(arrays[half:]))
        mx.eval(state.arrays)
        return state

    @staticmethod
    def _page_index(pages: list[int]) -> mx.array:
        return mx.array(np.asarray(pages, dtype=np.int32))

    def launch(
        self, seqs: list[Sequence], num_tokens: list[int], after: "LaunchedStep | None" = None
    ) -> "LaunchedStep":
        """Build the step's graph and queue it (mx.async_eval); `collect` reads its results back.

        after: the step still running before this one. Every seq is then one decode token past it: its
        input is the token `after` samples for it, taken on the device (not read back), at the position
        after its last known token. So the host builds step n+1 while the device runs step n, as mlx-lm does.

        A seq with draft_token_ids verifies them: its inputs are its last token and the draft, and every
        one of them samples (the draw of each drafted position, then the bonus)."""
        if after is None:
            input_ids = []
            for seq, n in zip(seqs, num_tokens):
                input_ids.extend(seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n])
                input_ids.extend(seq.draft_token_ids)  # n counts them: the last token is the one before
            inputs, computed, ahead = mx.array(input_ids), [s.num_computed_tokens for s in seqs], 0
        else:
            # a verification's tokens are known only once accepted on the host: it is never run ahead of
            assert all(r == 1 for r in after.num_rows), "a step built after a draft's verification"
            row_of = {id(after.seqs[i]): row for row, i in enumerate(after.sampling)}
            rows = [row_of[id(s)] for s in seqs]
            # a steady decode asks for every row in order: the tokens themselves, with no gather
            same = rows == list(range(len(after.sampling)))
            inputs = after.tokens if same else after.tokens[mx.array(rows)]
            # `after` computes every token each seq has (Scheduler.schedule_ahead): the new one goes next
            computed, ahead = [len(s.token_ids) for s in seqs], 1
        tables = [s.cache.page_table for s in seqs]
        layout = build_layout(tables, computed, num_tokens, self.page_size, self.cpu_kernel)
        # only sequences whose chunk reaches their last token (and draft) produce new tokens this step
        sampling = [
            i
            for i, (s, c, n) in enumerate(zip(seqs, computed, num_tokens))
            if c + n == len(s.token_ids) + len(s.draft_token_ids) + ahead
        ]
        num_rows = [1 + len(seqs[i].draft_token_ids) for i in sampling]
        step = LaunchedStep(seqs, num_tokens, sampling, num_rows)
        hybrid = self.architecture.num_linear_layers > 0
        if hybrid:  # the linear layers' states: where each seq starts, and the points whose states it keeps
            wanted = [self._state_points(s, c, n) for s, c, n in zip(seqs, computed, num_tokens)]
            self.kv.recurrent = StepStates(
                [self._states_from(s, c, n, w) for s, c, n, w in zip(seqs, computed, num_tokens, wanted)]
            )
        logits = forward(self.architecture, self.model, inputs, self.kv, layout, sampling, num_rows)
        states = self._keep_states(seqs, computed, num_tokens, wanted) if hybrid else []
        if logits is None:
            mx.async_eval(self.kv.keys, self.kv.values, states)
            return step
        # one entry per sampled row; row j of a seq draws the token after its tokens and draft[:j]
        chosen = [seqs[i] for i, r in zip(sampling, num_rows) for _ in range(r)]
        positions = [len(seqs[i].token_ids) + ahead + j for i, r in zip(sampling, num_rows) for j in range(r)]
        # grammar masks depend only on tokens already accepted: computed on the host while the graph
        # is still lazy, so the step keeps its single evaluation (on a GPU; on the CPU a prefill's
        # large element-wise work has already evaluated parts of it, kernels.activations)
        constrained = [row for row, s in enumerate(chosen) if s.matcher is not None]
        assert not (constrained and ahead), "a grammar needs the previous token on the host"
        bitmasks = None
        if constrained:
            matchers = [chosen[row].matcher for row in constrained]
            bitmasks = token_bitmasks(matchers, logits.shape[-1], self.mask_counters)
        step.tokens = sample(logits, chosen, bitmasks, constrained, positions)
        step.want = [row for row, s in enumerate(chosen) if s.params.logprobs is not None]
        step.extra = self._logprob_graph(step.tokens, logits, step.want, chosen) if step.want else ()
        # the step's one evaluation
        mx.async_eval(step.tokens, *step.extra, self.kv.keys, self.kv.values, states)
        return step

    # -- hybrid models' recurrent states --------------------------------------------------------------
    def _state_points(self, seq: Sequence, start: int, n: int) -> set[int]:
        """The page boundaries in (start, start + n] whose states become snapshots (the KV manager's)."""
        return set(self.state_points(seq.cache, start, start + n)) if self.state_points else set()

    def _states_from(self, seq: Sequence, start: int, n: int, wanted: set[int]) -> SequenceStates:
        """Where seq's linear layers start this step (its state after `start` tokens), and where inside the
        step it keeps them: the wanted points, and its latest page boundary."""
        if start == 0:
            begin = None
        elif seq.recurrent is not None and seq.recurrent.tokens == start:
            begin = seq.recurrent
        elif seq.cache.restored_state is not None and seq.cache.restored_state.tokens == start:
            begin = seq.cache.restored_state  # its admission restored a cached prefix
        else:
            raise RuntimeError(f"request {seq.request_id} has no recurrent state after {start} tokens")
        end, size = start + n, self.page_size
        cuts = {p for p in wanted if p < end} | (
            {end // size * size} if start < end // size * size < end else set()
        )
        return SequenceStates(begin, tuple(sorted(cuts)))

    def _keep_states(
        self, seqs: list[Sequence], computed: list[int], num_tokens: list[int], wanted: list[set[int]]
    ) -> list:
        """Each seq's state after the step, its latest page boundary's, and those the KV manager asked
        for (lazy: the step's evaluation computes them); their arrays."""
        arrays = []
        for seq, ss, start, n, points in zip(seqs, self.kv.recurrent.seqs, computed, num_tokens, wanted):
            seq.recurrent = ss.end(start + n)
            kept = ss.snapshots() + ([seq.recurrent] if (start + n) % self.page_size == 0 else [])
            for state in kept:
                seq.boundary_state = state
                if state.tokens in points:
                    seq.kept_states.append(state)
            arrays += seq.recurrent.arrays + [a for state in kept for a in state.arrays]
        self.kv.recurrent = None
        return arrays

    def collect(self, step: "LaunchedStep") -> list[StepOutput]:
        """Wait for a launched step; its new tokens (and log-probabilities), one output per seq."""
        outputs = [StepOutput() for _ in step.seqs]
        if step.tokens is None:
            mx.eval(self.kv.keys, self.kv.values)
            return outputs
        token_list = step.tokens.tolist()
        chosen = [step.seqs[i] for i, r in zip(step.sampling, step.num_rows) for _ in range(r)]
        details = self._logprob_values(step.extra, token_list, step.want, chosen)
        row = 0
        for i, r in zip(step.sampling, step.num_rows):
            outputs[i] = StepOutput(token_list[row : row + r], details[row + r - 1])
            row += r
        return outputs

    @staticmethod
    def _logprob_graph(tokens: mx.array, logits: mx.array, want: list[int], chosen: list[Sequence]):
        """Log-probabilities of the sampled tokens and the top alternatives, for the rows that asked."""
        rows = mx.array(want)
        logprobs = log_softmax(logits[rows].astype(mx.float32))
        picked = mx.take_along_axis(logprobs, tokens[rows][:, None], axis=-1)[:, 0]
        k = max(chosen[r].params.logprobs for r in want)
        if k == 0:
            return (picked,)
        top_ids = mx.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
        top_lps = mx.take_along_axis(logprobs, top_ids, axis=-1)
        order = mx.argsort(-top_lps, axis=-1)
        return (
            picked,
            mx.take_along_axis(top_ids, order, axis=-1),
            mx.take_along_axis(top_lps, order, axis=-1),
        )

    @staticmethod
    def _logprob_values(
        extra, tokens: list[int], want: list[int], chosen: list[Sequence]
    ) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(chosen)
        if not extra:
            return out
        picked = extra[0].tolist()
        top_ids, top_lps = (extra[1].tolist(), extra[2].tolist()) if len(extra) > 1 else (None, None)
        for i, row in enumerate(want):
            k = chosen[row].params.logprobs
            top = list(zip(top_ids[i][:k], top_lps[i][:k])) if k else []
            out[row] = TokenLogprob(tokens[row], picked[i], top)
        return out
