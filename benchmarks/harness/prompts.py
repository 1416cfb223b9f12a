"""Prompts of an exact token length, optionally sharing a prefix of another prompt."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which but "
    "all were when we there can more if will one about so out up into has them these its some would "
    "cache page token prefix request leader follower batch kernel memory latency throughput decode "
    "prefill attention model layer weight matrix vector queue scheduler engine server client stream "
    "river mountain forest city harbor market garden window library bridge tower island valley desert "
    "quickly slowly carefully quietly brightly often rarely always never again together apart "
    "red green blue yellow silver golden ancient modern small large narrow wide heavy light "
    "build measure compare reuse publish evict restore compute wait release admit finish begin"
).split()
QUESTION = "Summarize the document above in one sentence."


@dataclass
class Prompt:
    messages: list[dict[str, str]]
    token_ids: list[int]  # the templated prompt as the client's tokenizer sees it
    shared_tokens: int = 0  # leading tokens identical to the prompt it was built from

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)


def load_tokenizer(model_dir: Path):
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _messages(document: str) -> list[dict[str, str]]:
    # The document goes first, in a system message: prompts from different seeds then share only the
    # "<|im_start|>system\n" header (fewer than 16 tokens, so never a whole cache page).
    return [{"role": "system", "content": document}, {"role": "user", "content": QUESTION}]


def chat_token_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def filler_text(seed: int, n_chars: int) -> str:
    """Deterministic varied prose: different seeds differ from their first word."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_chars:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(10, 9999)))
        sentence = " ".join(words).capitalize() + ". "
        out.append(sentence)
        size += len(sentence)
    return "".join(out)


def chars_per_token(tokenizer, seed: int = 0) -> float:
    """How many characters of filler text one token holds, measured on a sample."""
    sample = filler_text(seed, 2000)
    return len(sample) / max(1, len(tokenizer.encode(sample, add_special_tokens=False)))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """Largest x in [lo, hi] with ok(x), assuming ok is (near) monotone and ok(lo) holds."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def make_prompt(
    tokenizer, n_tokens: int, seed: int, *, share: Prompt | None = None, fraction: float = 0.0
) -> Prompt:
    """A chat prompt of about n_tokens templated tokens (at most n_tokens, usually within 1-2).

    With `share`, the prompt starts with the first `fraction` of share's tokens (page-exactness is not
    promised; `shared_tokens` reports the actual common prefix) and continues with seed's own text.
    fraction 1.0 returns share itself: an identical request.
    """
    if share is not None and fraction >= 1.0:
        return Prompt(share.messages, share.token_ids, share.n_tokens)
    head = ""
    if share is not None and fraction > 0.0:
        base = share.messages[0]["content"]
        target = round(fraction * share.n_tokens)
        probe = filler_text(seed, 400)

        def shared(c: int) -> int:
            return _common_prefix(chat_token_ids(tokenizer, _messages(base[:c] + probe)), share.token_ids)

        head = base[: _largest(0, len(base), lambda c: shared(c) <= target)]
    # Estimate characters per token from a sample, then over-generate and trim by binary search.
    own = filler_text(seed, int(n_tokens * chars_per_token(tokenizer, seed) * 1.5) + 200)

    def length(c: int) -> int:
        return len(chat_token_ids(tokenizer, _messages(head + own[:c])))

    cut = _largest(0, len(own), lambda c: length(c) <= n_tokens)
    messages = _messages(head + own[:cut])
    ids = chat_token_ids(tokenizer, messages)
    return Prompt(messages, ids, _common_prefix(ids, share.token_ids) if share else 0)


def expected_restore(shared_tokens: int, prompt_tokens: int, page_size: int) -> int:
    """The restore rule: whole pages of the shared prefix, and never the prompt's last token."""
    return (min(shared_tokens, prompt_tokens - 1) // page_size) * page_size
