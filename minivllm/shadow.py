"""Cache advice: the engine's own recent traffic replayed at other pool sizes and policies.

The engine records each request's chained page hashes (minivllm.cache.hash_stream); every `interval_s`,
when requests arrived since the last time, the recorded stream is replayed by `minivllm.replay`'s own code
(so its hit rates are what `minivllm replay` prints for the same stream): the engine's policy and LRU at
0.5x, 1x, 2x and 4x the pool, and the prefix-aware optimum (`belady-prefix`) at 1x, the best any policy could
have done with this pool. The replay is plain Python and seconds long for a long stream: it runs in a worker
process at the lowest CPU priority, never on the stepping thread and never holding the server's GIL.

The rates describe the stream as a trace: every request's full pages, one after another (no concurrency,
no pins), in tokens as `minivllm replay` counts them.
"""

import logging
import os
import threading
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

from minivllm.cache.hash_stream import HashStream, RecordedRequest
from minivllm.replay import TraceRequest, replay, resolve_policy

logger = logging.getLogger(__name__)
POOL_FACTORS = (0.5, 1.0, 2.0, 4.0)
OPTIMUM = "belady-prefix"


@dataclass(frozen=True)
class ShadowRate:
    policy: str
    pool_factor: float
    capacity: int  # pages
    hit_rate: float  # prompt tokens restored / prompt tokens


def trace_of(recorded: Iterable[RecordedRequest]) -> list[TraceRequest]:
    return [TraceRequest(r.hash_ids.tolist(), r.input_length) for r in recorded]


def shadow_rates(
    recorded: list[RecordedRequest], capacity: int, policy: str, page_size: int
) -> list[ShadowRate]:
    """The advice's replays of recorded requests for a pool of `capacity` pages whose policy is `policy`
    (in the worker: the hashes travel to it as arrays, they become a trace there)."""
    trace = trace_of(recorded)
    rates = []
    for name in dict.fromkeys((resolve_policy(policy), "lru")):
        for factor in POOL_FACTORS:
            pages = max(1, round(capacity * factor))
            rates.append(
                ShadowRate(name, factor, pages, replay(trace, name, pages, page_size).token_hit_rate)
            )
    rates.append(
        ShadowRate(OPTIMUM, 1.0, capacity, replay(trace, OPTIMUM, capacity, page_size).token_hit_rate)
    )
    return rates


def _lowest_priority() -> None:
    os.nice(19)


class ShadowReplay:
    """Replays a HashStream in the background; `rates` holds the latest results (empty until the first)."""

    def __init__(self, stream: HashStream, capacity: int, policy: str, page_size: int, interval_s: float):
        self.stream = stream
        self.capacity, self.policy, self.page_size = capacity, policy, page_size
        self.interval_s = interval_s
        self.rates: list[ShadowRate] = []
        self.replayed = 0  # the stream's `recorded` count that the rates are of
        self.runs = 0  # replays finished
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="minivllm-cache-advice", daemon=True)
        self._workers: ProcessPoolExecutor | None = None

    def start(self) -> None:
        # spawn, not fork: the server's threads (MLX's, the stepping thread) do not survive a fork
        self._workers = ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_lowest_priority)
        self._thread.start()

    def close(self, wait: bool = False) -> None:
        """wait: until the worker process has finished its replay and exited."""
        self._stop.set()
        if self._workers is not None:
            self._workers.shutdown(wait=wait, cancel_futures=True)
        if self._thread.is_alive():
            self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            recorded = self.stream.recorded
            if recorded == self.replayed:
                continue
            recorded_now = self.stream.snapshot()
            try:
                job = self._workers.submit(
                    shadow_rates, recorded_now, self.capacity, self.policy, self.page_size
                )
                self.rates = job.result()
            except Exception:  # a broken worker (killed, out of memory) ends the advice, not the server
                if not self._stop.is_set():
                    logger.exception("cache advice replay failed; no more advice until restart")
                return
            self.replayed = recorded
            self.runs += 1
