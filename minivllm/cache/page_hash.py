"""Chained page hashes: h_i = H(h_{i-1}, tokens of page i), so equal keys mean equal whole prefixes.

Page 0's parent is the root of the request's cache domain: the same for everyone by default, or derived
from a cache salt, so that requests of different domains never share a page (nor learn from hits what
another domain's prompts hold)."""

import numpy as np
import xxhash

ROOT = b"\x00" * 16  # the parent of page 0


def hash_page(parent: bytes, tokens: list[int]) -> bytes:
    """128-bit xxh3 of the parent hash and this page's token ids."""
    return xxhash.xxh3_128_digest(parent + np.asarray(tokens, dtype=np.int64).tobytes())


def root_hash(cache_salt: str | None) -> bytes:
    """The parent of page 0 in the cache domain named by cache_salt (None: the shared domain)."""
    if cache_salt is None:
        return ROOT
    return xxhash.xxh3_128_digest(b"minivllm cache salt\x00" + cache_salt.encode("utf-8", "surrogatepass"))


def extend_page_hashes(hashes: list[bytes], token_ids: list[int], page_size: int, root: bytes = ROOT) -> None:
    """Append the hashes of every full page of token_ids not hashed yet (only full pages are hashed)."""
    for i in range(len(hashes), len(token_ids) // page_size):
        parent = hashes[i - 1] if i else root
        hashes.append(hash_page(parent, token_ids[i * page_size : (i + 1) * page_size]))
