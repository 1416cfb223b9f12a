"""Request text into prompt token ids, off the event loop, refusing early what cannot fit.

Templating and tokenizing take seconds for a long text (about 4 s for 1 MB here), so they run on a worker
thread and the event loop keeps serving /health and the open streams meanwhile. One thread per tokenizer, not
a pool around one: transformers switches special-token parsing on and off per call by setting a flag on the
shared Rust tokenizer, so concurrent encodes can get each other's setting (seen: a few in a hundred). So that
short prompts never wait behind a long one, texts over LONG_TEXT_CHARS go to a second lane: its own thread
and its own copy of the tokenizer.

A text that cannot fit is refused before it is tokenized whole: by its length (no token is longer than the
longest vocabulary entry), and, for a text much longer than the context in typical tokens, by counting the
tokens of its pieces only until they pass the context (cut where no pre-tokenizer joins a word across).

Every string of a chat request that the template renders is text, never control tokens: a special-token
string (`<|im_start|>system`) in a message's content or name, a tool's description or schema (keys and
values), or a past call's name or arguments (keys and values) is tokenized as plain text, while the control
tokens the template writes itself stay control tokens. A raw /v1/completions prompt is the caller's own full
prompt: special-token strings in it are parsed as the tokens they name. A fill-in-the-middle prompt and suffix
are plain text around the FIM tokens the server writes.
"""

import asyncio
import bisect
import copy
import inspect
import os
import re
import unicodedata
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from minivllm.engine.validation import RequestError, check_context_length
from minivllm.models.tokenizer import Tokenizer
from server import generic_tools
from server.conversation import Role, Thinking, Turn
from server.errors import APIError
from server.harmony import HarmonyFormat, writes_harmony
from server.tools import template_turns

LONG_TEXT_CHARS = (
    1 << 16
)  # a request with more characters of text is templated and tokenized in the long lane
NORMALIZED_PIECE = 1 << 16  # characters normalized per call
COUNTED_PIECE = 1 << 15  # characters tokenized per piece while counting a long text's tokens
TYPICAL_TOKEN_CHARS = 8  # a text over this many characters per token of room is counted in pieces first
CUT_SLACK = 2  # tokens a cut between pieces may add (a prefix-space marker, a word split differently)
# a run with no such cut for a whole piece (digits, CJK, base64) is cut inside a word: its last token and
# the next piece's first may split what the whole text merges (2 seen on Qwen's BPE; 8 leaves room)
HARD_CUT_SLACK = 8
# cuts between pieces: after a newline before a non-space, or before a space between two letters; every
# byte-level and SentencePiece pre-tokenizer ends a word there
SAFE_CUT = re.compile(r"\n(?=\S)|(?<=[^\W\d_])(?= [^\W\d_])")
JOINING_CATEGORIES = {"Mn", "Mc", "Me", "Cf", "Cs"}  # marks, joiners, halves of a pair: not a start
CHANGED_ACROSS_A_CUT = 8  # characters a normalizer may add or save across a cut between pieces
MARK = "\ue000{}\ue001"  # stands for marked string k in a rendering (private-use characters)
MARK_RE = re.compile("\ue000([0-9]+)\ue001")
# fill-in-the-middle tokens by their spellings: prefix, suffix, middle (the prefix-suffix-middle order the
# models were trained on), and the token that ends the middle
FIM_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|endoftext|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<|endoftext|>"),  # StarCoder, SantaCoder
)


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    end: int | None  # the model writes it after the middle: where a fill-in-the-middle completion stops


def fim_tokens(tokenizer: Tokenizer) -> FimTokens | None:
    """The model's FIM tokens, if its tokenizer has one of the known spellings as added tokens."""
    for spelling in FIM_SPELLINGS:
        ids = [tokenizer.added_token_id(s) for s in spelling]
        if None not in ids[:3]:
            return FimTokens(*ids)
    return None


DEFAULT_THINKING = Thinking()


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, long_lane: bool = False):
        """long_lane: long texts are templated and tokenized by a second builder, on its own thread with its
        own copy of the tokenizer (a copy takes a second or two)."""
        if "sanitize_control_tokens" not in inspect.signature(tokenizer.hf.apply_chat_template).parameters:
            raise RuntimeError(
                "this transformers cannot keep control tokens in chat messages as plain text "
                "(apply_chat_template(sanitize_control_tokens=...)); upgrade transformers"
            )
        # gpt-oss's Harmony: rendered and read by openai-harmony, not by the template (server.harmony)
        self.harmony = HarmonyFormat(tokenizer) if writes_harmony(tokenizer.chat_template) else None
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.control_ids = {
            t: i for i, t in tokenizer.added_tokens.items() if i in tokenizer.special_token_ids
        }
        # longest first: a control string that holds a shorter one is found whole
        special = sorted(self.control_ids, key=len, reverse=True)
        self.control_strings = re.compile(f"({'|'.join(map(re.escape, special))})") if special else None
        # what a mark stands for: a control string, or a mark character that the request itself holds
        self.marked = [*special, "\ue000", "\ue001"]
        self.mark_of = {m: MARK.format(k) for k, m in enumerate(self.marked)}
        self.to_mark = re.compile("|".join(map(re.escape, self.marked)))
        # no token covers more characters of normalized text than the longest vocabulary entry (byte-level
        # entries spell one character per byte), so a text of C such characters has at least C / this tokens
        self.max_token_chars = max(len(t) for t in tokenizer.get_vocab())
        self.normalizer = tokenizer.normalizer
        # templates that know no "developer" role would drop such a message: it is the system role renamed
        self.developer_role = "developer" if "developer" in str(tokenizer.chat_template or "") else "system"
        self.system_anywhere = self._renders_system_anywhere()
        # a model that writes its reasoning between think markers its template knows (Qwen3's <think>), and
        # a template that switches thinking on and off by a keyword (Qwen3's enable_thinking)
        template, start = str(tokenizer.chat_template or ""), getattr(tokenizer.wrapper, "think_start", None)
        self.thinks = bool(start) and start in template
        self.thinking_switch = "enable_thinking" in template
        self.fim = fim_tokens(tokenizer)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-prompts")
        self.long = (
            PromptBuilder(Tokenizer(copy.deepcopy(tokenizer.wrapper)), max_model_len) if long_lane else self
        )

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)
        if self.long is not self:
            self.long.close()

    async def chat(
        self,
        turns: Sequence[Turn],
        max_tokens: int | None,
        tools: list[dict] | None = None,
        thinking: bool | None = None,
        reasoning: Thinking = DEFAULT_THINKING,
    ) -> list[int]:
        """tools: the request's tools, for the template to render (None: no tools in the prompt); for a
        template without a tool-call format, the server renders them, and past calls and results, itself.
        thinking: on or off, for a template with a thinking switch (None: the template's default).
        reasoning: the request's thinking, for Harmony's reasoning level."""
        if self.harmony is not None:
            chars = _chars([t.text for t in turns], tools)
            return await self._off_loop(chars, "_harmony_ids", turns, max_tokens, tools, reasoning)
        dicts, tools = self._turns(turns, tools)
        chars = _chars(dicts, tools)
        return await self._off_loop(chars, "_chat_ids", dicts, max_tokens, tools, self._kwargs(thinking))

    def _kwargs(self, thinking: bool | None) -> dict:
        return {"enable_thinking": thinking} if self.thinking_switch and thinking is not None else {}

    def _turns(self, turns: Sequence[Turn], tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
        """The turns as template turns, and the tools for the template (see chat). A system turn after the
        first stays where it is (a later instruction must not change the prefix of every earlier turn): as
        a system turn where the template renders one there, otherwise folded into the next user turn."""
        dicts = template_turns(turns)
        for turn in dicts:
            if turn["role"] == Role.DEVELOPER:
                turn["role"] = self.developer_role
        if not self.system_anywhere:
            dicts = _fold_late_system_turns(dicts)
        if not self.tokenizer.has_tool_calling:
            dicts, tools = generic_tools.render(dicts, tools), None
        return dicts, tools

    def _renders_system_anywhere(self) -> bool:
        """Whether the template renders a system turn between user turns (Qwen's do; many raise)."""
        probe = [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "system", "content": "\ue000probe"},
            {"role": "user", "content": "c"},
        ]
        try:
            text = self.tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
        except Exception:
            return False
        return text.count("\ue000probe") == 1 and text.index("\ue000probe") > text.index("b")

    async def message_at(
        self,
        turns: Sequence[Turn],
        tools: list[dict] | None,
        ids: list[int],
        token: int,
        reasoning: Thinking = DEFAULT_THINKING,
    ) -> int | None:
        """The index of the turn whose templated text holds prompt token `token` (ids: the prompt chat()
        made of these turns); None if the template cannot render a part of the conversation."""
        if self.harmony is not None:
            ends = await self.message_ends(turns, tools, ids, list(range(1, len(turns) + 1)), reasoning)
            return min(bisect.bisect_right(ends, token), len(turns) - 1) if all(ends) else None
        dicts, tools = self._turns(turns, tools)
        if len(dicts) != len(turns):  # turns folded or merged: no index maps back
            return None
        return await self._off_loop(_chars(dicts, tools), "_message_at", dicts, tools, ids, token)

    async def message_ends(
        self,
        turns: Sequence[Turn],
        tools: list[dict] | None,
        ids: list[int],
        ends: list[int],
        reasoning: Thinking = DEFAULT_THINKING,
    ) -> list[int]:
        """For each k in ends, the prompt tokens before turn k (k = len(turns): the whole conversation,
        less the generation prompt); 0 where the template cannot render a part of it."""
        if self.harmony is not None:
            return await self._off_loop(0, "_harmony_ends", turns, tools, reasoning, ids, ends)
        dicts, tools = self._turns(turns, tools)
        if len(dicts) != len(turns):
            return [0] * len(ends)
        return await self._off_loop(_chars(dicts, tools), "_message_ends", dicts, tools, ids, ends)

    async def completion(self, prompt, max_tokens: int | None) -> list[list[int]]:
        """A string, a list of token ids, or a list of either (several prompts)."""
        if isinstance(prompt, str):
            prompts = [prompt]
        elif not prompt or isinstance(prompt[0], int):
            return [list(prompt)]
        else:
            prompts = prompt
        if all(not isinstance(x, str) for x in prompts):
            return [list(x) for x in prompts]
        return await self._off_loop(_chars(prompts), "_completion_ids", prompts, max_tokens)

    async def infill(self, prompt, suffix: str, max_tokens: int | None) -> list[list[int]]:
        """Fill-in-the-middle: each prompt (text or token ids, one or several) is the prefix before the
        suffix, in the model's FIM tokens; prompt and suffix texts are plain text."""
        if self.fim is None:
            spellings = "; ".join(" ".join(s[:3]) for s in FIM_SPELLINGS)
            raise APIError(
                400, f"suffix: this model has no fill-in-the-middle tokens ({spellings})", param="suffix"
            )
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            prompt = [prompt]
        return await self._off_loop(_chars(prompt, suffix), "_infill_ids", prompt, suffix, max_tokens)

    async def _off_loop(self, chars: int, method: str, *args):
        """builder.method(*args) on the worker of the lane for a request of this many characters of text."""
        builder = self.long if chars > LONG_TEXT_CHARS else self
        return await asyncio.get_running_loop().run_in_executor(
            builder.worker, getattr(builder, method), *args
        )

    # -- on the worker thread ---------------------------------------------------------------------------
    def _chat_ids(
        self,
        turns: list[dict],
        max_tokens: int | None,
        tools: list[dict] | None = None,
        kwargs: dict | None = None,
    ) -> list[int]:
        kwargs = kwargs or {}
        try:
            text = self._render(turns, tools, **kwargs)
            self._check_fits(text, max_tokens)
            if not self._holds_control_strings(turns, tools):
                return self.tokenizer.encode(text, add_special_tokens=False)  # as apply_chat_template does
            marked = self._render(self._mark(turns), self._mark(tools), **kwargs)
            if self._unmark(marked) != text:  # the template rewrote a marked string
                return self._guarded_ids(turns, tools, marked, kwargs)
            return self._ids_with_plain_strings(marked)
        except (APIError, RequestError):
            raise
        except Exception as e:  # no template, or one that rejects these messages
            raise RequestError(f"cannot apply the chat template: {e}", param="prompt") from None

    def _harmony_ids(
        self, turns: Sequence[Turn], max_tokens: int | None, tools: list[dict] | None, reasoning: Thinking
    ) -> list[int]:
        ids = self.harmony.prompt(turns, tools, reasoning)
        check_context_length(self.max_model_len, len(ids), max_tokens)
        return ids

    def _harmony_ends(
        self,
        turns: Sequence[Turn],
        tools: list[dict] | None,
        reasoning: Thinking,
        ids: list[int],
        ends: list[int],
    ) -> list[int]:
        try:
            return self.harmony.message_ends(turns, tools, reasoning, ids, ends)
        except RequestError:
            return [0] * len(ends)

    def _render(self, turns: list[dict], tools: list[dict] | None, **kwargs) -> str:
        return self.tokenizer.apply_chat_template(
            turns, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
        )

    # Where messages start: message k starts where the rendering of the first k messages (no generation
    # prompt) stops agreeing with the whole rendering; character offsets and token offsets convert through
    # the prompt's text, decoded once in chunks (TextOffsets). Only when asked: a miss, or breakpoints.
    def _message_at(
        self, turns: list[dict], tools: list[dict] | None, ids: list[int], token: int
    ) -> int | None:
        try:
            full = self._render(turns, tools)
            char = TextOffsets(self.tokenizer.decode, ids).char_of(token)
            lo, hi = 0, len(turns) - 1  # the last message starting at or before char
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._start(turns, tools, mid, full) <= char:
                    lo = mid
                else:
                    hi = mid - 1
            return lo
        except Exception:  # a template that refuses a part of the conversation: no index
            return None

    def _message_ends(self, turns: list[dict], tools: list[dict] | None, ids: list[int], ends: list[int]):
        try:
            full = self._render(turns, tools)
            offsets = TextOffsets(self.tokenizer.decode, ids)
            return [offsets.tokens_before(self._start(turns, tools, k, full)) for k in ends]
        except Exception:
            return [0] * len(ends)

    def _start(self, turns: list[dict], tools: list[dict] | None, k: int, full: str) -> int:
        """Characters of the whole rendering before message k."""
        part = self.tokenizer.apply_chat_template(
            turns[:k], tools=tools, add_generation_prompt=False, tokenize=False
        )
        return len(part) if full.startswith(part) else len(os.path.commonprefix([part, full]))

    def _holds_control_strings(self, *values) -> bool:
        return self.control_strings is not None and any(map(self.control_strings.search, _strings(*values)))

    def _mark(self, value):
        """value (strings, dicts with their keys, lists) with a mark in place of each control string in it."""
        if isinstance(value, str):
            return self.to_mark.sub(lambda m: self.mark_of[m[0]], value)
        if isinstance(value, dict):
            return {self._mark(k): self._mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._mark(v) for v in value]
        return value

    def _unmark(self, text: str) -> str:
        return MARK_RE.sub(lambda m: self.marked[int(m[1])], text)

    def _ids_with_plain_strings(self, marked: str) -> list[int]:
        """The rendering of marked strings holds only the template's own control strings: those are control
        tokens, and the text between them, marks restored, is plain text (as a whole, so that BPE merges
        across a control string's edge as in plain text)."""
        pieces = self.control_strings.split(marked)  # text, control string, text, ...
        ids: list[int] = []
        for j, piece in enumerate(pieces):
            if j % 2:
                ids.append(self.control_ids[piece])
            elif piece:
                ids += self.tokenizer.encode(
                    self._unmark(piece), add_special_tokens=False, split_special_tokens=True
                )
        return ids

    def _guarded_ids(
        self, turns: list[dict], tools: list[dict] | None, marked: str, kwargs: dict
    ) -> list[int]:
        """For a template that rewrote a marked string: transformers' own guard, close to plain text. It
        leaves dict keys, and strings the template escapes, as they are: refuse a prompt with more control
        tokens than the template wrote itself."""
        ids = self.tokenizer.apply_chat_template(
            turns,
            tools=tools,
            add_generation_prompt=True,
            tokenize=True,
            sanitize_control_tokens=True,
            **kwargs,
        )
        ids = list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        controls = set(self.control_ids.values())
        if sum(i in controls for i in ids) > len(self.control_strings.findall(marked)):
            raise RequestError("control tokens in this request cannot be kept as text", param="prompt")
        return ids

    def _completion_ids(self, prompts: list, max_tokens: int | None) -> list[list[int]]:
        for x in prompts:
            if isinstance(x, str):
                self._check_fits(x, max_tokens)
        return [self.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in prompts]

    def _infill_ids(self, prompts: list, suffix: str, max_tokens: int | None) -> list[list[int]]:
        for x in prompts:
            self._check_fits((x if isinstance(x, str) else "") + suffix, max_tokens)
        fim, after = self.fim, self._plain_ids(suffix)
        return [
            [fim.prefix, *(self._plain_ids(x) if isinstance(x, str) else x), fim.suffix, *after, fim.middle]
            for x in prompts
        ]

    def _plain_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    def _check_fits(self, text: str, max_tokens: int | None) -> None:
        """Refuse, before tokenizing it whole, a text that cannot fit the context with its completion."""
        room = self.max_model_len - (max_tokens or 1)
        if len(text) > room * self.max_token_chars:
            check_context_length(self.max_model_len, self.min_tokens(text), max_tokens, at_least=True)
        if len(text) > room * TYPICAL_TOKEN_CHARS:  # most likely too long: count until that is sure
            check_context_length(
                self.max_model_len, self.tokens_at_least(text, room), max_tokens, at_least=True
            )

    def tokens_at_least(self, text: str, room: int) -> int:
        """A lower bound on the tokens of text, counted piece by piece until it passes room (then the rest
        is not tokenized): each piece's tokens, less CUT_SLACK per cut."""
        count = 0
        for piece, slack in _pieces(text, COUNTED_PIECE):
            count += len(self.tokenizer.encode(piece, add_special_tokens=False)) - slack
            if count > room:
                break
        return count

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of text: no token covers more characters of the normalized text than
        the longest vocabulary entry has (normalization, e.g. NFC, may shorten the text, so count after it)."""
        return max(0, -(-self._normalized_length(text) // self.max_token_chars))

    def _normalized_length(self, text: str) -> int:
        """At most len(normalize(text)). The Rust normalizer holds the GIL (about 0.2 s per MB here), so it
        runs on pieces, each a short hold; across each cut a normalizer may change a few characters (a
        composition of up to 4 code points, a prepended marker, a replaced pair), so give them back."""
        if self.normalizer is None:
            return len(text)
        starts = range(0, len(text), NORMALIZED_PIECE)
        pieces = sum(len(self.normalizer.normalize_str(text[i : i + NORMALIZED_PIECE])) for i in starts)
        return pieces - CHANGED_ACROSS_A_CUT * max(0, len(starts) - 1)


class TextOffsets:
    """Where a prompt's tokens fall in its text. The text's length up to each chunk of tokens comes from
    decoding the chunks once (decoding every prefix probed would cost a whole decode each); a chunk ends
    on a whole character (a cut inside one would count it twice, as U+FFFD); within a chunk a probe
    decodes at most a chunk."""

    CHUNK = 256
    MAX_CHARACTER_TOKENS = 8  # tokens a chunk may grow by to end on a whole character

    def __init__(self, decode: Callable[[list[int]], str], ids: list[int], chunk: int = CHUNK):
        self.decode = decode
        self.ids = ids
        self.bounds = [0]  # each chunk's first token, and the end
        self.starts = [0]  # characters before each chunk, and in all
        while self.bounds[-1] < len(ids):
            i = self.bounds[-1]
            j = min(i + chunk, len(ids))
            text = decode(ids[i:j])
            while text.endswith("\ufffd") and j < min(len(ids), i + chunk + self.MAX_CHARACTER_TOKENS):
                j += 1
                text = decode(ids[i:j])
            self.bounds.append(j)
            self.starts.append(self.starts[-1] + len(text))

    def char_of(self, token: int) -> int:
        """Characters of the text before token `token`."""
        c = bisect.bisect_right(self.bounds, token) - 1
        return self.starts[c] + len(self.decode(self.ids[self.bounds[c] : token]))

    def tokens_before(self, char: int) -> int:
        """The most tokens whose text is at most char characters long."""
        c = min(max(0, bisect.bisect_right(self.starts, char) - 1), len(self.bounds) - 1)
        lo, hi = self.bounds[c], self.bounds[min(c + 1, len(self.bounds) - 1)]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.char_of(mid) <= char:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _fold_late_system_turns(turns: list[dict]) -> list[dict]:
    """For a template that renders a system turn only first: each later one joins the next user turn (or,
    with none next, becomes a user turn of its own), in place."""
    out: list[dict] = []
    pending: list[str] = []
    for k, turn in enumerate(turns):
        if turn["role"] == "system" and k > 0:
            pending.append(turn["content"])
            continue
        if pending and turn["role"] == "user":
            turn = {**turn, "content": "\n\n".join([*pending, turn["content"]])}
            pending = []
        elif pending:
            out.append({"role": "user", "content": "\n\n".join(pending)})
            pending = []
        out.append(turn)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def _pieces(text: str, size: int) -> Iterator[tuple[str, int]]:
    """text in pieces of `size` to `2 * size` characters (the last may be shorter), each with the tokens
    its cut may add: at SAFE_CUT where one comes in time, else inside the run, before a character that
    starts a grapheme (a run with no safe cut must not make the whole text one piece)."""
    start, slack = 0, 0
    while start < len(text):
        cut = SAFE_CUT.search(text, start + size, start + 2 * size)
        if cut or start + 2 * size >= len(text):
            end = cut.end() if cut else len(text)
            yield text[start:end], slack
            start, slack = end, CUT_SLACK
            continue
        end = start + size
        while end < len(text) and unicodedata.category(text[end]) in JOINING_CATEGORIES:
            end += 1
        yield text[start:end], slack
        start, slack = end, HARD_CUT_SLACK


def _chars(*values) -> int:
    """The characters of every string in values (what templating and tokenizing them costs)."""
    return sum(map(len, _strings(*values)))


def _strings(*values) -> Iterator[str]:
    """Every string in values: strings, and the keys and values of dicts and lists, nested."""
    for value in values:
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            for k, v in value.items():
                yield from _strings(k, v)
        elif isinstance(value, list):
            yield from _strings(*value)
