"""Chained page hashes: h_i = H(h_{i-1}, tokens of page i), so equal keys mean equal whole prefixes."""

import numpy as np
import xxhash

ROOT = b"\x00" * 16  # the parent of page 0


def hash_page(parent: bytes, tokens: list[int]) -> bytes:
    """128-bit xxh3 of the parent hash and this page's token ids."""
    return xxhash.xxh3_128_digest(parent + np.asarray(tokens, dtype=np.int64).tobytes())


def extend_page_hashes(hashes: list[bytes], token_ids: list[int], page_size: int) -> None:
    """Append the hashes of every full page of token_ids not hashed yet (only full pages are hashed)."""
    for i in range(len(hashes), len(token_ids) // page_size):
        parent = hashes[i - 1] if i else ROOT
        hashes.append(hash_page(parent, token_ids[i * page_size : (i + 1) * page_size]))
