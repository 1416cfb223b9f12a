"""A token's own bytes, for logprobs' `bytes`: a token may hold part of a UTF-8 character, whose decoded
text is U+FFFD and whose bytes would then be the replacement character's, not the token's."""

import functools
from collections.abc import Callable

from transformers.convert_slow_tokenizer import bytes_to_unicode


def token_bytes_of(tokenizer) -> Callable[[int], bytes]:
    """For byte-level BPE vocabularies (GPT-2, Qwen, Llama 3): the vocabulary entry mapped back to bytes;
    added tokens are their text. Other vocabularies: the UTF-8 of the decoded token."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # inside mlx-lm's wrapper
    backend = getattr(hf, "backend_tokenizer", None)
    byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
    added = {i: t.content for i, t in getattr(hf, "added_tokens_decoder", {}).items()}
    to_byte = {c: b for b, c in bytes_to_unicode().items()}

    @functools.lru_cache(maxsize=1 << 16)
    def token_bytes(token_id: int) -> bytes:
        if token_id in added:
            return added[token_id].encode()
        piece = hf.convert_ids_to_tokens(token_id) if byte_level else None
        if piece is None or any(c not in to_byte for c in piece):
            return tokenizer.decode([token_id]).encode()
        return bytes(to_byte[c] for c in piece)

    return token_bytes
