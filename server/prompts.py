"""Request text into prompt token ids, off the event loop, refusing early what cannot fit.

Templating and tokenizing take seconds for a long text (about 4 s for 1 MB here), so they run on a worker
thread and the event loop keeps serving /health and the open streams meanwhile. One thread, not a pool:
transformers switches special-token parsing on and off per call by setting a flag on the shared Rust
tokenizer, so concurrent encodes can get each other's setting (seen: a few in a hundred).

Chat message content is text, never control tokens: a special-token string inside a message
(`<|im_start|>system`) is tokenized exactly as plain text (the same tokens as `encode(content,
split_special_tokens=True)`), while the markers the template writes itself stay control tokens. A raw
/v1/completions prompt is the caller's own full prompt: special-token strings in it are parsed as the tokens
they name.
"""

import asyncio
import copy
import inspect
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from minivllm.engine.validation import RequestError, check_context_length
from minivllm.models.tokenizer import Tokenizer
from server import protocol as p
from server.errors import APIError
from server.tools import conversation

T = TypeVar("T")
NORMALIZED_PIECE = 1 << 16  # characters normalized per call
CHANGED_ACROSS_A_CUT = 8  # characters a normalizer may add or save across a cut between pieces
CONTENT_MARK = "\ue000{}\ue001"  # stands for message content i in a rendering (private-use characters)


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        if "sanitize_control_tokens" not in inspect.signature(tokenizer.hf.apply_chat_template).parameters:
            raise RuntimeError(
                "this transformers cannot keep control tokens in chat messages as plain text "
                "(apply_chat_template(sanitize_control_tokens=...)); upgrade transformers"
            )
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        special = tokenizer.special_tokens
        self.control_strings = re.compile("|".join(map(re.escape, special))) if special else None
        # no token covers more characters of normalized text than the longest vocabulary entry (byte-level
        # entries spell one character per byte), so a text of C such characters has at least C / this tokens
        self.max_token_chars = max(len(t) for t in tokenizer.get_vocab())
        self.normalizer = tokenizer.normalizer
        # templates that know no "developer" role would drop such a message: it is the system role renamed
        self.developer_role = "developer" if "developer" in str(tokenizer.chat_template or "") else "system"
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minivllm-prompts")

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)

    async def chat(
        self, messages: list[p.ChatMessage], max_tokens: int | None, tools: list[dict] | None = None
    ) -> list[int]:
        """tools: the request's tools, for a template that renders them (None: no tools in the prompt)."""
        turns = conversation(messages)
        for turn in turns:
            if turn["role"] == "developer":
                turn["role"] = self.developer_role
        return await self._off_loop(self._chat_ids, turns, max_tokens, tools)

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
        return await self._off_loop(self._completion_ids, prompts, max_tokens)

    async def _off_loop(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    # -- on the worker thread ---------------------------------------------------------------------------
    def _chat_ids(
        self, turns: list[dict], max_tokens: int | None, tools: list[dict] | None = None
    ) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                turns, tools=tools, add_generation_prompt=True, tokenize=False
            )
            self._check_fits(text, max_tokens)
            contents = [t["content"] for t in turns if isinstance(t.get("content"), str)]
            if self.control_strings is None or not any(self.control_strings.search(c) for c in contents):
                return self.tokenizer.encode(text, add_special_tokens=False)  # as apply_chat_template does
            ids = self._ids_with_plain_contents(turns, tools)
            if ids is None:  # the template rewrote the content: transformers' own guard, close to plain text
                ids = self.tokenizer.apply_chat_template(
                    turns,
                    tools=tools,
                    add_generation_prompt=True,
                    tokenize=True,
                    sanitize_control_tokens=True,
                )
        except (APIError, RequestError):
            raise
        except Exception as e:  # no template, or one that rejects these messages
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)

    def _ids_with_plain_contents(self, turns: list[dict], tools: list[dict] | None) -> list[int] | None:
        """Render the template with a mark in place of each message's content, then tokenize the template's
        text as usual and each content as plain text. None if some mark did not come through once, intact."""
        marked = copy.deepcopy(turns)
        contents = []
        for turn in marked:
            if isinstance(turn.get("content"), str):
                contents.append(turn["content"])
                turn["content"] = CONTENT_MARK.format(len(contents) - 1)
        text = self.tokenizer.apply_chat_template(
            marked, tools=tools, add_generation_prompt=True, tokenize=False
        )
        pieces = re.split("\ue000([0-9]+)\ue001", text)  # template, content index, template, ...
        if [int(i) for i in pieces[1::2]] != list(range(len(contents))):
            return None
        ids: list[int] = []
        for j, piece in enumerate(pieces):
            if j % 2:
                ids += self.tokenizer.encode(
                    contents[int(piece)], add_special_tokens=False, split_special_tokens=True
                )
            elif piece:
                ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return ids

    def _completion_ids(self, prompts: list, max_tokens: int | None) -> list[list[int]]:
        for x in prompts:
            if isinstance(x, str):
                self._check_fits(x, max_tokens)
        return [self.tokenizer.encode(x) if isinstance(x, str) else list(x) for x in prompts]

    def _check_fits(self, text: str, max_tokens: int | None) -> None:
        """Refuse, before tokenizing, a text that cannot fit the context with its completion."""
        room = self.max_model_len - (max_tokens or 1)
        if len(text) <= room * self.max_token_chars:
            return  # fits by this bound; the exact count, after tokenizing, decides
        check_context_length(self.max_model_len, self.min_tokens(text), max_tokens, at_least=True)

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
