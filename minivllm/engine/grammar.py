"""Grammar-constrained decoding with llguidance: compiled matchers, and the token masks they give.

A request with structured output carries an `LLMatcher`: it starts at the grammar's beginning, advances
with each accepted token, and tells which tokens may come next. Compiling a grammar (and building the
llguidance tokenizer, ~2 s for a 150k vocabulary, once) happens on the caller's thread, never on the
stepping thread: the async engine compiles in a worker before handing the request over. Compiled
grammars are cached by their text (bounded by bytes), so every request with the same schema gets a cheap
copy.
"""

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.hf
import numpy as np
from llguidance import LLMatcher
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from minivllm.engine.sampling_params import StructuredOutput
from minivllm.engine.validation import RequestError

logger = logging.getLogger(__name__)

# Compact JSON with json.dumps's separators: no free whitespace, so a model cannot emit newlines forever
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for a spec (also the compile cache's key)."""
    if spec.lark is not None:
        return LLMatcher.grammar_from_lark(spec.lark)
    schema = spec.json_schema if spec.json_schema is not None else {"type": "object"}
    return LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


MAX_GRAMMAR_BYTES = 1 << 20  # a schema's grammar text; past it: a 400 (llguidance's state grows ~50x)
CACHE_GRAMMAR_BYTES = 8 << 20  # grammar text held compiled in the cache: a few hundred MB of state at most


class GrammarCompiler:
    """Thread-safe: the async engine calls it from worker threads. Compiled grammars are cached by their
    text, least recently used first out, bounded by the bytes of their texts (a compiled grammar's memory
    grows with its text: a 75,000-value enum holds ~50 MB), not by their number."""

    def __init__(
        self,
        hf_tokenizer,
        vocab_size: int,
        eos_token_ids: set[int],
        cache_bytes: int = CACHE_GRAMMAR_BYTES,
        max_grammar_bytes: int = MAX_GRAMMAR_BYTES,
    ):
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self.cache_bytes = cache_bytes
        self.max_grammar_bytes = max_grammar_bytes
        # (cache domain, grammar text) -> compiled, LRU order: a domain never gets another's compiled grammar,
        # whose missing compile time would tell it which schemas that tenant uses
        self._cache: OrderedDict[tuple[str | None, str], LLMatcher] = OrderedDict()
        self.cached_bytes = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                start = time.perf_counter()
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                )
                logger.info("grammar tokenizer built in %.2f s", time.perf_counter() - start)
            return self._tokenizer

    def matcher(self, spec: StructuredOutput, domain: str | None = None) -> LLMatcher:
        """A fresh matcher at the start of spec's grammar, compiled once per cache domain (the request's API
        key and cache_salt). Raises RequestError (param structured_output) for a grammar that cannot be
        built, or followed even to its first token."""
        try:
            text = grammar_text(spec)
        except (ValueError, TypeError, RuntimeError) as e:
            raise grammar_error(e) from None
        if len(text) > self.max_grammar_bytes:
            raise RequestError(
                f"the grammar is {len(text):,} bytes; at most {self.max_grammar_bytes:,} are compiled "
                "(a schema that large, e.g. an enum of tens of thousands of values, costs ~50x in memory)",
                param="structured_output",
            )
        return self._compiled((domain, text)).deep_copy()

    def _compiled(self, key: tuple[str | None, str]) -> LLMatcher:
        with self._lock:
            matcher = self._cache.get(key)
            if matcher is not None:
                self._cache.move_to_end(key)
                return matcher
        matcher = self._compile(key[1])  # outside the lock: compiles of different grammars go side by side
        with self._lock:
            if key not in self._cache:
                self._cache[key] = matcher
                self.cached_bytes += len(key[1])
            while self.cached_bytes > self.cache_bytes and len(self._cache) > 1:
                (_, old), _ = self._cache.popitem(last=False)
                self.cached_bytes -= len(old)
        return matcher

    def _compile(self, grammar: str) -> LLMatcher:
        try:
            matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        except (ValueError, TypeError, RuntimeError) as e:
            raise grammar_error(e) from None
        if not matcher.is_error():  # some limits only show at the first mask (llguidance's "too many items")
            fill_next_token_bitmask(matcher.deep_copy(), allocate_token_bitmask(1, self.vocab_size), 0)
        if matcher.is_error():
            raise grammar_error(matcher.get_error())
        return matcher


MAX_ERROR_CHARS = 300  # llguidance's errors can carry its whole parser state: keep the cause


def grammar_error(cause) -> RequestError:
    """The request's grammar at fault, in its first line only (no parser state); also for a grammar that
    breaks the engine's limits only after some tokens."""
    first_line = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    if len(first_line) > MAX_ERROR_CHARS:
        first_line = first_line[:MAX_ERROR_CHARS] + "..."
    return RequestError(f"invalid grammar: {first_line}", param="structured_output")


@dataclass
class MaskCounters:
    masks: int = 0  # token masks computed (one per constrained request per step)
    seconds: float = 0.0  # host time computing masks and advancing matchers


def token_bitmasks(matchers: list[LLMatcher], vocab_size: int, counters: MaskCounters) -> np.ndarray:
    """[len(matchers), ceil(vocab_size / 32)] int32: bit t % 32 of word t // 32 is set when the matcher
    accepts token t next (llguidance's layout; the sampler unpacks it on the device)."""
    start = time.perf_counter()
    bitmask = allocate_token_bitmask(len(matchers), vocab_size)
    for row, matcher in enumerate(matchers):
        fill_next_token_bitmask(matcher, bitmask, row)
    counters.masks += len(matchers)
    counters.seconds += time.perf_counter() - start
    return bitmask


def advance(matcher: LLMatcher, token: int, counters: MaskCounters) -> None:
    """Feed an accepted token to the matcher (the mask allowed it, so this cannot fail)."""
    start = time.perf_counter()
    matcher.consume_token(token)
    counters.seconds += time.perf_counter() - start
