"""Runs one engine step: builds the flat ragged batch, runs the model, samples, evaluates once."""

import logging
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kernels.paged_attention import build_layout
from minivllm.engine.grammar import MaskCounters, token_bitmasks
from minivllm.engine.sampler import log_softmax, sample
from minivllm.engine.sequence import Sequence, TokenLogprob
from minivllm.models.qwen2 import KVPools, forward

logger = logging.getLogger(__name__)


@dataclass
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: mx.Dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.size

    @classmethod
    def of(cls, model: nn.Module, dtype: mx.Dtype) -> "KVGeometry":
        attn = model.model.layers[0].self_attn
        head_dim = getattr(attn, "head_dim", None) or model.args.hidden_size // attn.n_heads
        return cls(len(model.model.layers), attn.n_kv_heads, head_dim, dtype)


@dataclass
class StepOutput:
    token: int | None  # None while the sequence is still in a prefill chunk
    logprob: TokenLogprob | None = None


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        geometry: KVGeometry,
        num_pages: int,
        page_size: int,
        mask_counters: MaskCounters,
    ):
        self.model = model
        self.page_size = page_size
        self.geometry = geometry
        self.num_slots = num_pages * page_size
        self.mask_counters = mask_counters
        self.reset_kv()

    def reset_kv(self) -> None:
        g = self.geometry
        shape = (g.num_kv_heads, self.num_slots, g.head_dim)  # head-major: see kernels.paged_attention
        self.kv = None  # let the old pools go before the new ones are allocated
        self.kv = KVPools(
            keys=[mx.zeros(shape, dtype=g.dtype) for _ in range(g.num_layers)],
            values=[mx.zeros(shape, dtype=g.dtype) for _ in range(g.num_layers)],
        )
        mx.eval(self.kv.keys, self.kv.values)

    def step(self, seqs: list[Sequence], num_tokens: list[int]) -> list[StepOutput]:
        input_ids = []
        for seq, n in zip(seqs, num_tokens):
            input_ids.extend(seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n])
        layout = build_layout(
            [s.page_table for s in seqs], [s.num_computed_tokens for s in seqs], num_tokens, self.page_size
        )
        # only sequences whose chunk reaches their last token produce a new token this step
        sampling = [
            i
            for i, (s, n) in enumerate(zip(seqs, num_tokens))
            if s.num_computed_tokens + n == len(s.token_ids)
        ]
        ends = np.cumsum(num_tokens) - 1
        outputs = [StepOutput(None) for _ in seqs]
        if not sampling:
            logits_index = mx.array([0], dtype=mx.int32)  # the graph still has to write the KV
        else:
            logits_index = mx.array(ends[sampling].astype(np.int32))
        logits = forward(
            self.model,
            mx.array(input_ids),
            self.kv,
            layout,
            logits_index,
        )
        if not sampling:
            mx.eval(self.kv.keys, self.kv.values)
            return outputs
        chosen = [seqs[i] for i in sampling]
        # grammar masks depend only on tokens already accepted: computed on the host while the graph
        # is still lazy, so the step keeps its single evaluation
        constrained = [row for row, s in enumerate(chosen) if s.matcher is not None]
        bitmasks = None
        if constrained:
            matchers = [chosen[row].matcher for row in constrained]
            bitmasks = token_bitmasks(matchers, logits.shape[-1], self.mask_counters)
        tokens = sample(logits, chosen, bitmasks, constrained)
        want = [row for row, s in enumerate(chosen) if s.params.logprobs is not None]
        extra = self._logprob_graph(tokens, logits, want, chosen) if want else ()
        mx.eval(tokens, *extra, self.kv.keys, self.kv.values)  # the step's one evaluation
        token_list = tokens.tolist()
        details = self._logprob_values(extra, token_list, want, chosen)
        for row, i in enumerate(sampling):
            outputs[i] = StepOutput(token_list[row], details[row])
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
