"""Cache advice: the engine's own recent traffic replayed at other pool sizes and policies.

The engine records each request's chained page hashes (minivllm.cache.hash_stream); every `interval_s`,
when requests arrived since the last time, the recorded stream is replayed by `minivllm.replay`'s own code
(so its hit rates are what `minivllm replay` prints for the same stream): the engine's policy and LRU at
0.5x, 1x, 2x and 4x the pool, and the prefix-aware optimum (`belady-prefix`) at 1x, the best any policy could
have done with this pool. The replay is plain Python and seconds long for a long stream: it runs in a worker
process at the lowest CPU priority, never on the stepping thread and never holding the server's GIL, and
only while the engine is idle (see ShadowReplay).

The rates describe the stream as a trace: every request's full pages, one after another (no concurrency,
no pins), in tokens as `minivllm replay` counts them.
"""

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from minivllm.cache.hash_stream import HashStream, RecordedRequest
from minivllm.replay import TraceRequest, replay, resolve_policy

logger = logging.getLogger(__name__)
POOL_FACTORS = (0.5, 1.0, 2.0, 4.0)
OPTIMUM = "belady-prefix"
POLL_S = 0.05  # how often a running replay checks whether the engine got busy


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


def _work(conn: Connection) -> None:
    """The worker process: replays what it is sent, at the lowest CPU priority, until the pipe closes."""
    os.nice(19)
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        conn.send(shadow_rates(*args))


class ShadowReplay:
    """Replays a HashStream in the background; `rates` holds the latest results (empty until the first).

    The replay runs only while the engine is idle: `busy()` (requests running or waiting) keeps a new replay
    from starting and stops the worker process (SIGSTOP) until the engine is idle again. A lower priority is
    not enough: on a machine whose cores all decode, a nice-19 process still takes time slices from one of
    the BLAS threads, and every matmul of the step waits for its slowest thread (measured: 0.56x decode with
    the worker replaying, on a quiet 2-core machine: benchmarks/shadow_cost.py)."""

    def __init__(
        self,
        stream: HashStream,
        capacity: int,
        policy: str,
        page_size: int,
        interval_s: float,
        busy: Callable[[], bool] = lambda: False,
    ):
        self.stream = stream
        self.capacity, self.policy, self.page_size = capacity, policy, page_size
        self.interval_s = interval_s
        self.busy = busy
        self.rates: list[ShadowRate] = []
        self.replayed = 0  # the stream's `recorded` count that the rates are of
        self.runs = 0  # replays finished
        self.pauses = 0  # times the worker was stopped because the engine got busy
        self.replaying = False  # a replay is in the worker now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="minivllm-cache-advice", daemon=True)
        self._worker: BaseProcess | None = None
        self._conn: Connection | None = None

    def start(self) -> None:
        # spawn, not fork: the server's threads (MLX's, the stepping thread) do not survive a fork
        ctx = get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        self._worker = ctx.Process(target=_work, args=(theirs,), name="minivllm-cache-advice", daemon=True)
        self._worker.start()
        theirs.close()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._worker is not None and self._worker.is_alive():
            self._signal(signal.SIGCONT)
            self._worker.terminate()
            self._worker.join(5)
        if self._thread.is_alive():
            self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            recorded = self.stream.recorded
            if recorded == self.replayed or self.busy():
                continue
            try:
                rates = self._replay(self.stream.snapshot())
            except (EOFError, OSError):  # a worker killed (out of memory): no advice, the server goes on
                if not self._stop.is_set():
                    logger.exception("cache advice replay failed; no more advice until restart")
                return
            if rates is None:
                return  # closing
            self.rates, self.replayed = rates, recorded
            self.runs += 1

    def _replay(self, recorded: list[RecordedRequest]) -> list[ShadowRate] | None:
        """One replay in the worker, which is stopped whenever the engine is busy; None if closed meanwhile."""
        self._conn.send((recorded, self.capacity, self.policy, self.page_size))
        self.replaying, paused = True, False
        try:
            while not self._conn.poll(POLL_S):
                if self._stop.is_set():
                    return None
                if self.busy() != paused:
                    paused = not paused
                    self.pauses += paused
                    self._signal(signal.SIGSTOP if paused else signal.SIGCONT)
            if paused:
                self._signal(signal.SIGCONT)
            return self._conn.recv()
        finally:
            self.replaying = False

    def _signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._worker.pid, sig)
