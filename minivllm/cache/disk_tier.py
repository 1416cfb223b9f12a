"""The disk tier: KV pages kept on disk under the RAM pool, across restarts.

One file per page (minivllm.cache.page_file) in `<dir>/pages/`, named by its chained hash. The tier holds
bytes the engine hands it and hands them back; it knows nothing of MLX.

- Writes are write-behind: the engine copies each newly published page out of the pools after the step
  and queues it (`write`); a writer thread writes a temporary file and renames it into place, so a file
  is either whole or absent, whatever moment the process dies at. The queue never blocks the step loop:
  past MAX_PENDING_BYTES new pages are dropped (counted), not queued.
- Reads run on a reader thread (`read`): the request waits for its pages, nobody else does.
- The index (hash -> token ids) lives in memory and is rebuilt at start from the files' headers, oldest
  first by modification time (a read touches its file); files of another model, page size, dtype or
  layout, truncated ones and leftover temporary files are deleted. A page's checksum is verified when it
  is read; a corrupt one is deleted and the request computes it instead.
- The budget: the tier never holds more files than fit in capacity_bytes, counted in allocated blocks;
  the policy (EVICTION, the class the trace replay runs) picks which page to delete. A page pinned in the
  RAM pool (`pin`, minivllm.cache.pins) is not deleted while pinned: the policy is given it back as a use
  and evicts another (unless pins would fill the whole budget).
- One process per directory: an exclusive flock on `<dir>/lock`, else DiskTierBusy.
"""

import errno
import fcntl
import logging
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minivllm.cache.eviction import make_policy
from minivllm.cache.page_file import (
    SUFFIX,
    BadPageFile,
    TierIdentity,
    checksum,
    encode_header,
    file_name,
    read_header,
    read_page,
    with_checksum,
)

logger = logging.getLogger(__name__)

# LRU over writes and disk reads: measured against adaptive and s3fifo with `minivllm replay --disk-capacity`
# (docs/disk-tier.md): adaptive is no better overall (better on one Mooncake trace, worse on the other).
EVICTION = "lru"
DEFAULT_FRACTION = 0.1  # of the free disk, when no budget is set
DEFAULT_MAX_BYTES = 20 << 30
MAX_PENDING_BYTES = 256 << 20  # the write queue's bound
TEMP_SUFFIX = ".tmp"
WARN_EVERY_S = 60.0  # write failures (a full disk) are logged at most this often


class DiskTierBusy(RuntimeError):
    """Another process holds the directory."""


def default_capacity(directory: Path) -> int:
    """10% of the disk's free space, at most 20 GiB."""
    return min(int(shutil.disk_usage(directory).free * DEFAULT_FRACTION), DEFAULT_MAX_BYTES)


@dataclass(frozen=True)
class PageRecord:
    """A page as the index knows it."""

    hash: bytes
    parent: bytes | None
    tokens: tuple[int, ...]


@dataclass
class DiskCounters:
    pages_written: int = 0
    pages_read: int = 0  # pages read back and verified
    pages_evicted: int = 0  # deleted for room
    pages_rejected: int = 0  # files deleted unread: another identity, truncated, corrupt, leftovers
    writes_dropped: int = 0  # pages not written because the queue was full
    write_errors: int = 0  # pages whose write failed (full disk, I/O error)


@dataclass(eq=False)
class DiskRead:
    """Consecutive pages of one prompt, read on the reader thread. Rows 0 .. num_ok - 1 of payloads hold
    the first num_ok pages, verified; the read stops at the first page it cannot serve."""

    records: list[PageRecord]
    payloads: np.ndarray  # [len(records), page_bytes] uint8
    num_ok: int = 0
    done: bool = False  # set under the tier's condition
    cancelled: bool = False  # the request no longer wants them: the reader stops early


@dataclass
class _Write:
    records: list[PageRecord]
    payloads: np.ndarray  # [len(records), page_bytes] uint8


class DiskTier:
    def __init__(self, directory: str | Path, capacity_bytes: int, identity: TierIdentity):
        self.directory = Path(directory)
        self.pages_dir = self.directory / "pages"
        self.identity = identity
        self.pages_dir.mkdir(parents=True, exist_ok=True)
        block = os.statvfs(self.pages_dir).f_frsize or 4096
        self.page_disk_bytes = -(-identity.file_bytes // block) * block  # what a file occupies
        self.capacity_bytes = capacity_bytes
        capacity_pages = capacity_bytes // self.page_disk_bytes
        if capacity_pages < 1:
            raise ValueError(f"kv_disk_bytes={capacity_bytes} holds no page of {self.page_disk_bytes} bytes")
        self._lock_file = _lock(self.directory / "lock")
        self.policy = make_policy(EVICTION, capacity_pages)
        self.counters = DiskCounters()
        self._index: dict[bytes, PageRecord] = {}  # pages whose file is in place
        self._pinned: set[bytes] = set()  # pages pinned in the RAM pool: kept while they are
        self._mutex = threading.Lock()  # index, policy, counters, pending bytes: shared with the threads
        self._read_done = threading.Condition(self._mutex)
        self._pending_bytes = 0
        self._last_warning = -WARN_EVERY_S
        self._rebuild()
        self._writes: queue.Queue[_Write | None] = queue.Queue()
        self._reads: queue.Queue[DiskRead | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._write_loop, name="minivllm-kv-disk-writer", daemon=True),
            threading.Thread(target=self._read_loop, name="minivllm-kv-disk-reader", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- the index (any thread) -----------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return len(self._index)

    def contains(self, h: bytes) -> bool:
        with self._mutex:
            return h in self._index

    def lookup(self, hashes: list[bytes], token_ids: list[int], first: int) -> list[PageRecord]:
        """The pages on disk that continue a prompt: hashes[0], hashes[1], ... (pages first, first + 1, ...
        of token_ids) up to the first miss. A hit needs equal token ids too, as in RAM."""
        size = self.identity.page_size
        found = []
        with self._mutex:
            for i, h in enumerate(hashes, start=first):
                record = self._index.get(h)
                if record is None or record.tokens != tuple(token_ids[i * size : (i + 1) * size]):
                    break
                found.append(record)
        return found

    def stats(self) -> dict:
        with self._mutex:
            c = self.counters
            return {
                "kv_disk_pages": len(self._index),
                "kv_disk_bytes": len(self._index) * self.page_disk_bytes,
                "kv_disk_capacity_bytes": self.capacity_bytes,
                "kv_disk_pages_written": c.pages_written,
                "kv_disk_pages_read": c.pages_read,
                "kv_disk_pages_evicted": c.pages_evicted,
                "kv_disk_pages_rejected": c.pages_rejected,
                "kv_disk_writes_dropped": c.writes_dropped,
                "kv_disk_write_errors": c.write_errors,
                "kv_disk_bytes_written": c.pages_written * self.identity.page_bytes,
                "kv_disk_bytes_read": c.pages_read * self.identity.page_bytes,
            }

    # -- writes ---------------------------------------------------------------------------------------
    def write(self, records: list[PageRecord], payloads: np.ndarray) -> None:
        """Queue pages for the writer (payloads: [len(records), page_bytes] uint8, owned by the tier from
        now on). Never blocks: with MAX_PENDING_BYTES already queued they are dropped."""
        with self._mutex:
            if self._pending_bytes + payloads.nbytes > MAX_PENDING_BYTES:
                self.counters.writes_dropped += len(records)
                self._warn("disk tier: write queue full (the disk is slower than publication); pages dropped")
                return
            self._pending_bytes += payloads.nbytes
        self._writes.put(_Write(records, payloads))

    def flush(self) -> None:
        """Wait until every queued page is written (or failed): tests, benchmarks, shutdown."""
        self._writes.join()

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            try:
                for record, payload in zip(item.records, item.payloads):
                    self._write_page(record, payload)
            except Exception:
                logger.exception("disk tier: writer failed on a batch of %d pages", len(item.records))
            finally:
                with self._mutex:
                    self._pending_bytes -= item.payloads.nbytes
                self._writes.task_done()
        self._writes.task_done()

    def _write_page(self, record: PageRecord, payload: np.ndarray) -> None:
        h = record.hash
        with self._mutex:
            if h in self._index or h in self.policy:
                return
            evicted = self._evict_for(h, record.parent)
            admitted = h in self.policy
        self._delete(evicted)
        if not admitted:
            return
        path = self.pages_dir / file_name(h)
        temp = self.pages_dir / f".{h.hex()}.{os.getpid()}{TEMP_SUFFIX}"
        head = encode_header(self.identity, h, record.parent, record.tokens)
        try:
            with open(temp, "wb") as f:
                f.write(with_checksum(head, checksum(head, memoryview(payload))))
                f.write(memoryview(payload))
            os.replace(temp, path)  # atomic: the file is whole or absent
        except OSError as e:
            temp.unlink(missing_ok=True)
            with self._mutex:
                self.policy.remove(h)
                self.counters.write_errors += 1
                full = " (disk full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
                self._warn(f"disk tier: cannot write pages to {self.pages_dir}{full}: {e}; serving on")
            return
        with self._mutex:
            self._index[h] = record
            self.counters.pages_written += 1

    def _evict_for(self, h: bytes, parent: bytes | None) -> list[bytes]:
        """Admit h to the policy (mutex held); the pages it evicts, unindexed, for the caller to delete. A
        pinned page the policy gives up is given back to it as a use (it evicts another in turn)."""
        pending = self._use(h, parent)
        evicted = []
        keep = len(self._pinned) < self.policy.capacity  # else protecting them could never end
        while pending:
            e = pending.pop(0)
            record = self._index.get(e)
            if keep and e in self._pinned and record is not None:
                pending += self._use(e, record.parent)
                continue
            self._index.pop(e, None)
            evicted.append(e)
        self.counters.pages_evicted += len(evicted)
        return evicted

    def _use(self, h: bytes, parent: bytes | None) -> list[bytes]:
        evicted = self.policy.access(h, parent)
        self.policy.release(h)  # a read copies the page out: no request holds a file
        return evicted

    def pin(self, hashes: list[bytes]) -> None:
        """Keep these pages' files (those on disk, and those written later) until unpinned."""
        with self._mutex:
            self._pinned.update(hashes)

    def unpin(self, hashes: list[bytes]) -> None:
        with self._mutex:
            self._pinned.difference_update(hashes)

    def _delete(self, hashes: list[bytes]) -> None:
        for h in hashes:
            _unlink(self.pages_dir / file_name(h))

    def _warn(self, message: str) -> None:
        """Log a warning at most once a WARN_EVERY_S (mutex held): a full disk fails every write."""
        now = time.monotonic()
        if now - self._last_warning >= WARN_EVERY_S:
            self._last_warning = now
            c = self.counters
            logger.warning(
                "%s (so far %d write errors, %d pages dropped)", message, c.write_errors, c.writes_dropped
            )

    # -- reads ----------------------------------------------------------------------------------------
    def read(self, records: list[PageRecord]) -> DiskRead:
        """Start reading pages (from lookup) on the reader thread; poll .done or wait_for_reads."""
        read = DiskRead(records, np.empty((len(records), self.identity.page_bytes), dtype=np.uint8))
        self._reads.put(read)
        return read

    def wait_for_reads(self, reads: list[DiskRead], timeout: float) -> None:
        """Until one of reads is done, at most timeout seconds."""
        with self._read_done:
            self._read_done.wait_for(lambda: any(r.done for r in reads), timeout)

    def _read_loop(self) -> None:
        while (read := self._reads.get()) is not None:
            try:
                self._read_pages(read)
            except Exception:
                logger.exception("disk tier: reader failed")
            finally:
                with self._read_done:
                    read.done = True
                    self._read_done.notify_all()

    def _read_pages(self, read: DiskRead) -> None:
        for i, record in enumerate(read.records):
            if read.cancelled:
                return
            path = self.pages_dir / file_name(record.hash)
            try:
                read_page(path, self.identity, record.hash, record.tokens, read.payloads[i])
            except FileNotFoundError:  # evicted since the lookup
                self._forget(record.hash, rejected=False)
                return
            except BadPageFile as e:
                logger.warning("disk tier: deleting %s, never served: %s", path.name, e)
                self._forget(record.hash, rejected=True)
                return
            except OSError as e:
                logger.warning("disk tier: cannot read %s: %s", path.name, e)
                return
            _touch(path)  # its recency survives a restart
            with self._mutex:
                if record.hash in self._index:
                    self.policy.access(record.hash)
                    self.policy.release(record.hash)
                self.counters.pages_read += 1
            read.num_ok = i + 1

    def _forget(self, h: bytes, rejected: bool) -> None:
        with self._mutex:
            if self._index.pop(h, None) is not None:
                self.policy.remove(h)
            self.counters.pages_rejected += rejected
        self._delete([h])

    # -- start and stop -------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """The index from the files' headers, oldest first; whatever cannot be served is deleted."""
        start = time.perf_counter()
        found: list[tuple[int, PageRecord]] = []
        foreign = 0
        for entry in os.scandir(self.pages_dir):
            path = Path(entry.path)
            if not entry.is_file(follow_symlinks=False):  # a directory, pipe, socket or link: not ours
                foreign += 1
                continue
            try:
                if not entry.name.endswith(SUFFIX):
                    raise BadPageFile(
                        "a leftover temporary file" if entry.name.endswith(TEMP_SUFFIX) else "not a page"
                    )
                page = read_header(path, self.identity)
                found.append((entry.stat().st_mtime_ns, PageRecord(page.hash, page.parent, page.tokens)))
            except (BadPageFile, OSError) as e:
                logger.debug("disk tier: deleting %s: %s", entry.name, e)
                _unlink(path)
                self.counters.pages_rejected += 1
        found.sort(key=lambda item: item[0])
        for _, record in found:
            self._delete(self._evict_for(record.hash, record.parent))  # a smaller budget than last time
            if record.hash in self.policy:
                self._index[record.hash] = record
        self.counters.pages_evicted = 0  # the budget's trim is not traffic
        logger.info(
            "disk tier %s: %d pages (%.1f MiB of %.1f MiB) indexed in %.2f s; %d unusable files deleted",
            self.directory,
            len(self._index),
            len(self._index) * self.page_disk_bytes / 2**20,
            self.capacity_bytes / 2**20,
            time.perf_counter() - start,
            self.counters.pages_rejected,
        )
        if foreign:
            logger.warning(
                "disk tier %s: %d entries that are not files (directories, pipes, links) left alone",
                self.pages_dir,
                foreign,
            )

    def close(self) -> None:
        """Write what is queued, stop the threads, release the directory."""
        if self._lock_file.closed:
            return
        self._writes.put(None)
        self._reads.put(None)
        for t in self._threads:
            t.join()
        self._lock_file.close()  # releases the flock


def _lock(path: Path):
    """Hold path's exclusive flock for the tier's lifetime (released when the file closes, or the process
    dies); DiskTierBusy naming the holder if another process has it."""
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise DiskTierBusy(
            f"the KV disk directory {path.parent} is in use by another minivllm process (pid {holder}); "
            "give each engine its own MINIVLLM_KV_DISK_DIR"
        ) from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _unlink(path: Path) -> None:
    """Delete a page file; one that cannot be deleted (a directory put in its place, a read-only disk)
    is left, and only logged: the tier serves on."""
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        logger.debug("disk tier: cannot delete %s: %s", path.name, e)


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except OSError:
        pass  # recency is a hint
