"""The disk tier alone (no model): page files, reads of what was written, LRU within the budget, the index
rebuilt at start, one process per directory."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minivllm.cache.disk_tier import DiskTier, DiskTierBusy, PageRecord
from minivllm.cache.page_file import (
    BadPageFile,
    TierIdentity,
    checksum,
    encode_header,
    file_name,
    read_header,
    read_page,
    with_checksum,
)

REPO = Path(__file__).resolve().parent.parent


IDENTITY = TierIdentity(model=b"m" * 16, page_size=4, dtype="float32", layout=1, page_bytes=64)


def test_a_second_tier_on_a_directory_in_use_is_refused(tmp_path):
    first = DiskTier(tmp_path, 1 << 20, IDENTITY)
    with pytest.raises(DiskTierBusy, match=f"in use by another minivllm process \\(pid {os.getpid()}\\)"):
        DiskTier(tmp_path, 1 << 20, IDENTITY)
    first.close()
    DiskTier(tmp_path, 1 << 20, IDENTITY).close()  # released on close


def test_a_second_process_on_the_directory_is_refused(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, IDENTITY)
    code = (
        "import sys\nfrom minivllm.cache.disk_tier import DiskTier, DiskTierBusy\n"
        f"from minivllm.cache.page_file import TierIdentity\nidentity = {IDENTITY!r}\n"
        "try:\n    DiskTier(sys.argv[1], 1 << 20, identity)\nexcept DiskTierBusy as e:\n    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True
    )
    assert f"pid {os.getpid()}" in out.stdout, out.stderr[-2000:]
    tier.close()


def _pages(n, seed=0):
    rng = np.random.default_rng(seed)
    records = [
        PageRecord(bytes([seed, i]) * 8, bytes([seed, i - 1]) * 8 if i else None, (seed, i, 0, 1))
        for i in range(n)
    ]
    return records, rng.integers(0, 256, (n, IDENTITY.page_bytes), dtype=np.uint8)


def _read(tier, records):
    read = tier.read(records)
    tier.wait_for_reads([read], timeout=60)
    assert read.done
    return read


def test_the_tier_reads_back_what_it_wrote_and_evicts_least_recently_used(tmp_path):
    block = os.statvfs(tmp_path).f_frsize
    tier = DiskTier(tmp_path, 5 * block, IDENTITY)  # five page files
    records, payloads = _pages(4)
    tier.write(records, payloads)
    tier.flush()
    tokens = [t for r in records for t in r.tokens]
    assert tier.lookup([r.hash for r in records], tokens, 0) == records
    assert tier.lookup([r.hash for r in records], [9] + tokens[1:], 0) == []  # equal token ids needed
    read = _read(tier, records[:2])
    assert read.num_ok == 2 and np.array_equal(read.payloads, payloads[:2])
    more, more_payloads = _pages(3, seed=1)
    tier.write(more, more_payloads)
    tier.flush()
    # pages 0 and 1 were read (used) after 2 and 3 were written: 2 and 3 go first
    assert [tier.contains(r.hash) for r in records] == [True, True, False, False]
    assert tier.stats()["kv_disk_pages_evicted"] == 2 and tier.num_pages == 5
    tier.close()
    rebuilt = DiskTier(tmp_path, 5 * block, IDENTITY)
    assert rebuilt.num_pages == 5 and rebuilt.contains(records[0].hash)
    rebuilt.close()


def _page_file(tmp_path, identity=IDENTITY, h=b"h" * 16, tokens=(1, 2, 3, 4)):
    payload = np.arange(identity.page_bytes, dtype=np.uint8)
    head = encode_header(identity, h, None, tokens)
    path = tmp_path / file_name(h)
    path.write_bytes(with_checksum(head, checksum(head, memoryview(payload))) + payload.tobytes())
    return path, payload


def test_a_page_file_reads_back_only_as_the_page_it_is(tmp_path):
    path, payload = _page_file(tmp_path)
    out = np.empty(IDENTITY.page_bytes, dtype=np.uint8)
    read_page(path, IDENTITY, b"h" * 16, (1, 2, 3, 4), out)
    assert np.array_equal(out, payload)
    assert read_header(path, IDENTITY).tokens == (1, 2, 3, 4)
    with pytest.raises(BadPageFile, match="another page"):
        read_page(path, IDENTITY, b"h" * 16, (1, 2, 3, 5), out)
    for field, value in [("model", b"x" * 16), ("dtype", "bfloat16"), ("layout", 2), ("page_size", 8)]:
        other = TierIdentity(**{**IDENTITY.__dict__, field: value})
        with pytest.raises(BadPageFile, match="written for another"):
            read_header(path, other)


def test_a_damaged_page_file_is_refused(tmp_path):
    path, _ = _page_file(tmp_path)
    out = np.empty(IDENTITY.page_bytes, dtype=np.uint8)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(BadPageFile, match="checksum"):
        read_page(path, IDENTITY, b"h" * 16, (1, 2, 3, 4), out)
    os.truncate(path, len(data) - 1)
    with pytest.raises(BadPageFile, match="bytes, expected"):
        read_header(path, IDENTITY)
    with pytest.raises(BadPageFile, match="length"):
        read_page(path, IDENTITY, b"h" * 16, (1, 2, 3, 4), out)


def test_files_the_tier_cannot_serve_are_deleted_at_start(tmp_path):
    pages = tmp_path / "pages"
    pages.mkdir()
    _page_file(pages)  # good
    _page_file(pages, TierIdentity(**{**IDENTITY.__dict__, "model": b"x" * 16}), h=b"o" * 16)  # another model
    (pages / ".abc.123.tmp").write_bytes(b"half a page")  # a write killed before its rename
    renamed, _ = _page_file(pages, h=b"r" * 16)
    renamed.rename(pages / file_name(b"s" * 16))  # its name is not its hash
    tier = DiskTier(tmp_path, 1 << 20, IDENTITY)
    assert tier.num_pages == 1 and tier.contains(b"h" * 16)
    assert sorted(p.name for p in pages.iterdir()) == [file_name(b"h" * 16)]
    assert tier.stats()["kv_disk_pages_rejected"] == 3
    tier.close()


@pytest.mark.timeout(60)
def test_entries_that_are_not_files_are_left_alone_and_the_pages_still_served(tmp_path):
    """A named pipe or a directory with a page's name, a link to a page, a subdirectory: the tier starts
    (a pipe, opened, would wait for a writer for ever), indexes the real pages and touches none of them."""
    pages = tmp_path / "pages"
    pages.mkdir()
    _page_file(pages)
    os.mkfifo(pages / file_name(b"p" * 16))
    (pages / file_name(b"d" * 16)).mkdir()
    (pages / "sub").mkdir()
    (pages / file_name(b"l" * 16)).symlink_to(pages / file_name(b"h" * 16))
    (pages / "junk").write_bytes(b"junk")
    tier = DiskTier(tmp_path, 1 << 20, IDENTITY)
    assert tier.num_pages == 1 and tier.contains(b"h" * 16)
    assert tier.stats()["kv_disk_pages_rejected"] == 1  # the junk file, deleted
    assert {p.name for p in pages.iterdir()} == {file_name(h * 16) for h in (b"h", b"p", b"d", b"l")} | {
        "sub"
    }
    tier.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["pipe", "directory", "link"])
def test_a_page_replaced_by_something_else_is_refused_not_waited_on(tmp_path, kind):
    (tmp_path / "elsewhere").mkdir()
    target, _ = _page_file(tmp_path / "elsewhere")  # the same page, outside the tier's directory
    path = tmp_path / target.name
    if kind == "pipe":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(target)
    out = np.empty(IDENTITY.page_bytes, dtype=np.uint8)
    with pytest.raises((BadPageFile, OSError)):
        read_page(path, IDENTITY, b"h" * 16, (1, 2, 3, 4), out)
