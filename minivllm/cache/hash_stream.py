"""The chained-hash stream of the engine's own requests, for the cache advice (minivllm.shadow).

Each request's full-page hashes, as 64-bit integers, and its prompt length: what a trace line of
`minivllm replay` holds (no token content is kept). Bounded by requests and by page hashes in all (8 bytes
each), oldest first out. Recorded on the stepping thread, read by the advice's thread: a lock guards it.
"""

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

MAX_PAGE_HASHES = 1 << 20  # 8 MiB of hashes, whatever the request count allows


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    hash_ids: np.ndarray  # uint64: each full page's chained hash, its first 8 bytes
    input_length: int  # prompt tokens


class HashStream:
    def __init__(self, max_requests: int, max_page_hashes: int = MAX_PAGE_HASHES):
        self.max_requests = max_requests
        self.max_page_hashes = max_page_hashes
        self._requests: deque[RecordedRequest] = deque()
        self._page_hashes = 0
        self._lock = threading.Lock()
        self.recorded = 0  # requests recorded since start (the advice replays when it moves)

    def record(self, page_hashes: list[bytes], input_length: int) -> None:
        ids = np.frombuffer(b"".join(h[:8] for h in page_hashes), dtype="<u8").copy()
        with self._lock:
            self._requests.append(RecordedRequest(ids, input_length))
            self._page_hashes += len(ids)
            while len(self._requests) > self.max_requests or self._page_hashes > self.max_page_hashes:
                self._page_hashes -= len(self._requests.popleft().hash_ids)
            self.recorded += 1

    def snapshot(self) -> list[RecordedRequest]:
        """The recorded requests, oldest first."""
        with self._lock:
            return list(self._requests)
