"""The disk tier's page file: one KV page, self-describing and checksummed.

A file is a fixed header, the page's token ids (int32) and the page's KV bytes, as the engine laid them out:

    magic, format version, KV layout version, page size, dtype, model digest  (what made the KV)
    chained hash, parent hash                                                (where it sits in a prompt)
    payload length, checksum                                                 (xxh3-128 of everything else)

A page is only ever served when every identity field equals the running engine's, the file has exactly
the length its header says, the checksum holds, and its hash and token ids are the ones asked for. The
header and the token ids are read at start (the index is rebuilt from them); the checksum is verified on
each read, so a start never reads the whole tier.
"""

import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import xxhash

MAGIC = b"MVKVPAGE"
FORMAT_VERSION = 1
# magic, format, layout, page size, dtype, model, hash, parent, payload length, checksum (last: not hashed)
HEADER = struct.Struct("<8sHHI8s16s16s16sQ16s")
CHECKSUM_BYTES = 16
NO_PARENT = b"\x00" * 16  # page 0's parent (the pool's None)
SUFFIX = ".kv"


class BadPageFile(ValueError):
    """A page file that must not be served: another model or layout, truncated, corrupt, or not the page
    asked for. The message says which."""


@dataclass(frozen=True)
class TierIdentity:
    """What produced a page's KV: files of any other identity are never served."""

    model: bytes  # 16-byte digest of the model's weights (minivllm.models.identity)
    page_size: int
    dtype: str  # the KV pools' dtype, e.g. "float32"
    layout: int  # the engine's KV layout version (how a page's K and V bytes are ordered)
    page_bytes: int  # KV bytes of one page

    @property
    def file_bytes(self) -> int:
        return HEADER.size + 4 * self.page_size + self.page_bytes


@dataclass(frozen=True)
class PageHeader:
    hash: bytes
    parent: bytes | None
    tokens: tuple[int, ...]


def file_name(h: bytes) -> str:
    return h.hex() + SUFFIX


def encode_header(identity: TierIdentity, h: bytes, parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """The header (checksum zeroed) and token ids of a page; `checksum` completes it."""
    dtype = identity.dtype.encode("ascii")
    fields = (MAGIC, FORMAT_VERSION, identity.layout, identity.page_size, dtype, identity.model, h)
    header = HEADER.pack(*fields, parent or NO_PARENT, identity.page_bytes, b"\x00" * CHECKSUM_BYTES)
    return header + np.asarray(tokens, dtype="<i4").tobytes()


def checksum(head: bytes, payload: memoryview) -> bytes:
    """xxh3-128 of the header without its checksum field, the token ids and the payload."""
    hasher = xxhash.xxh3_128()
    hasher.update(head[: HEADER.size - CHECKSUM_BYTES])
    hasher.update(head[HEADER.size :])
    hasher.update(payload)
    return hasher.digest()


def with_checksum(head: bytes, digest: bytes) -> bytes:
    return head[: HEADER.size - CHECKSUM_BYTES] + digest + head[HEADER.size :]


def parse_header(head: bytes, identity: TierIdentity) -> tuple[PageHeader, bytes]:
    """The page a file's first identity.file_bytes - page_bytes bytes describe, and its stored checksum.
    BadPageFile unless it was written by this format for this identity."""
    if len(head) < HEADER.size + 4 * identity.page_size:
        raise BadPageFile("truncated header")
    magic, fmt, layout, page_size, dtype, model, h, parent, length, digest = HEADER.unpack_from(head)
    if magic != MAGIC or fmt != FORMAT_VERSION:
        raise BadPageFile("not a page file of this format")
    expected = (identity.layout, identity.page_size, identity.dtype, identity.model, identity.page_bytes)
    found = (layout, page_size, dtype.rstrip(b"\x00").decode("ascii", "replace"), model, length)
    if found != expected:
        names = ("layout", "page size", "dtype", "model", "page bytes")
        wrong = [n for n, a, b in zip(names, found, expected) if a != b]
        raise BadPageFile(f"written for another {', '.join(wrong)}")
    tokens = np.frombuffer(head, dtype="<i4", count=page_size, offset=HEADER.size)
    return PageHeader(h, None if parent == NO_PARENT else parent, tuple(tokens.tolist())), digest


def read_header(path: Path, identity: TierIdentity) -> PageHeader:
    """A page file's header, checked against identity and the file's length (the checksum is not: that
    needs the whole payload, read when the page is)."""
    with _open_regular(path) as f:
        head = f.read(HEADER.size + 4 * identity.page_size)
        size = f.seek(0, 2)
    page, _ = parse_header(head, identity)
    if size != identity.file_bytes:
        raise BadPageFile(f"{size} bytes, expected {identity.file_bytes}")
    if file_name(page.hash) != path.name:
        raise BadPageFile("its name is not its hash")
    return page


def read_page(path: Path, identity: TierIdentity, h: bytes, tokens: tuple[int, ...], out: np.ndarray) -> None:
    """Read the page into out (uint8, page_bytes), verifying all of it. BadPageFile if it is not page h
    with these token ids, intact; OSError (FileNotFoundError: evicted meanwhile) passes through."""
    head = bytearray(HEADER.size + 4 * identity.page_size)
    with _open_regular(path) as f:
        got = f.readinto(head)
        payload = memoryview(out)
        got += f.readinto(payload)
        extra = f.read(1)
    if got != identity.file_bytes or extra:
        raise BadPageFile(f"length {got}{'+' if extra else ''}, expected {identity.file_bytes}")
    page, digest = parse_header(bytes(head), identity)
    if page.hash != h or page.tokens != tokens:
        raise BadPageFile("another page's hash or token ids")
    if checksum(bytes(head), payload) != digest:
        raise BadPageFile("checksum mismatch")


def _open_regular(path: Path) -> BinaryIO:
    """path opened for reading if it is a regular file, not through a link; BadPageFile otherwise. Opened
    without blocking: a named pipe in its place must not hang the reader (a pipe waits for a writer)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadPageFile("not a regular file")
    return os.fdopen(fd, "rb")
