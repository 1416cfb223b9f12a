"""The model's tokenizer, with one public face for the engine and every protocol.

mlx-lm loads it as a TokenizerWrapper (chat template, tool-call format) around transformers' tokenizer,
which holds the Rust `tokenizers` one. This class is the only place that reaches inside them; the
methods keep transformers' names and arguments, so code written against a Hugging Face tokenizer reads
the same.
"""

import functools
from collections.abc import Callable

from tokenizers.decoders import DecodeStream
from transformers.convert_slow_tokenizer import bytes_to_unicode


class Tokenizer:
    def __init__(self, wrapper):
        self.wrapper = wrapper  # mlx-lm's TokenizerWrapper
        self.hf = wrapper._tokenizer  # transformers' tokenizer (mlx-lm keeps it in a private attribute)
        self.backend = getattr(self.hf, "backend_tokenizer", None)  # the Rust tokenizer, if fast
        self.eos_token_ids: set[int] = set(wrapper.eos_token_ids)
        added = getattr(self.hf, "added_tokens_decoder", {})
        self.added_tokens: dict[int, str] = {i: t.content for i, t in added.items()}
        self._added_ids = {text: i for i, text in self.added_tokens.items()}
        self.special_token_ids = frozenset(i for i, t in added.items() if t.special)
        self.special_tokens: list[str] = [t.content for t in added.values() if t.special]
        self.token_bytes: Callable[[int], bytes] = functools.lru_cache(maxsize=1 << 16)(self._token_bytes)
        self.token_text: Callable[[int], str] = functools.lru_cache(maxsize=1 << 16)(
            lambda t: self.decode([t])
        )

    # -- text <-> ids ---------------------------------------------------------------------------------
    def encode(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False
    ) -> list[int]:
        """split_special_tokens=True: special-token strings in text are plain text, not control tokens."""
        return self.hf.encode(
            text, add_special_tokens=add_special_tokens, split_special_tokens=split_special_tokens
        )

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self) -> Callable[[int], str | None]:
        """Incremental decoding: step(token) gives the new text, None while a character is incomplete;
        the concatenation equals decoding all tokens at once."""
        stream = DecodeStream(skip_special_tokens=False)
        return lambda token: stream.step(self.backend, token)

    def apply_chat_template(self, messages: list[dict], **kwargs):
        return self.wrapper.apply_chat_template(messages, **kwargs)

    def added_token_id(self, text: str) -> int | None:
        """The id of the added token spelled `text`, or None if text is no added token (a lookup: it
        never encodes, so it changes no state of the shared tokenizer)."""
        return self._added_ids.get(text)

    def get_vocab(self) -> dict[str, int]:
        return self.hf.get_vocab()

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.hf.convert_tokens_to_ids(token)

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.hf.convert_ids_to_tokens(token_id)

    @property
    def chat_template(self) -> str | None:
        return self.hf.chat_template

    @property
    def normalizer(self):
        return getattr(self.backend, "normalizer", None)

    # -- tool calls (mlx-lm infers the format from the chat template) ---------------------------------
    @property
    def has_tool_calling(self) -> bool:
        return bool(self.wrapper.has_tool_calling)

    @property
    def tool_call_start(self) -> str | None:
        return self.wrapper.tool_call_start

    @property
    def tool_call_end(self) -> str | None:
        return self.wrapper.tool_call_end

    @property
    def tool_parser(self):
        return self.wrapper.tool_parser

    # -- one token's bytes ----------------------------------------------------------------------------
    def _token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (logprobs' `bytes`): a token may hold part of a UTF-8 character, whose
        decoded text is U+FFFD. Byte-level BPE vocabularies (GPT-2, Qwen, Llama 3) map the vocabulary entry
        back to bytes; added tokens are their text; other vocabularies the UTF-8 of the decoded token."""
        if token_id in self.added_tokens:
            return self.added_tokens[token_id].encode()
        piece = self.convert_ids_to_tokens(token_id) if _byte_level(self.backend) else None
        if piece is None or any(c not in _UNICODE_TO_BYTE for c in piece):
            return self.decode([token_id]).encode()
        return bytes(_UNICODE_TO_BYTE[c] for c in piece)


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def _byte_level(backend) -> bool:
    return backend is not None and type(backend.decoder).__name__ == "ByteLevel"
