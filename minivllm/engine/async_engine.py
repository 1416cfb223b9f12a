"""The async engine: one background thread steps the engine; each request is an async token stream.

All engine state is touched only by the stepping thread. The event loop hands it new requests and
aborts through a queue, and receives outputs through `loop.call_soon_threadsafe`, so no lock guards the
scheduler or the pool.
"""

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from llguidance import LLMatcher

from minivllm.cache.hints import CacheHints
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sampling_params import SamplingParams
from minivllm.engine.validation import RequestError
from minivllm.outputs import EngineStats, FinishReason, RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    matcher: LLMatcher | None  # the compiled grammar of params.structured_output
    cache: CacheHints | None
    accepted: asyncio.Future  # resolves when the engine took (or refused) the request


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config or EngineConfig())
        self.tokenizer = self.engine.tokenizer
        self.hash_stream = self.engine.hash_stream  # the requests' page hashes, for the cache advice
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.stats_snapshot: EngineStats = self.engine.stats()

    # -- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def replica_stats(self) -> dict[str | None, EngineStats]:
        """The engine's latest stats; one process is one unnamed replica (the server's common view of
        a single engine and of several behind a router)."""
        return {None: self.stats_snapshot}

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the stepping thread and end every open stream. Call it on the event loop's thread."""
        self._stopping.set()
        self._inbox.put(None)  # wake the thread
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("engine thread did not stop within %.0f s", timeout)
        if not self.is_running:  # never on a thread that still steps
            self.engine.close()  # the disk tier's queued pages, then its directory lock
        self._close_streams("server shutting down")

    def _close_streams(self, reason: str) -> None:
        for rid, stream in list(self._streams.items()):
            stream.put_nowait(
                RequestOutput(rid, [], finished=True, finish_reason=FinishReason.ABORT, error=reason)
            )

    # -- requests -----------------------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, cache: CacheHints | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (cache: its cache domain and pins). Raises RequestError / QueueFull before the first output if refused.
        Closing the iterator early (client gone) aborts the request and releases its pages."""
        if request_id in self._streams:
            raise RequestError(f"duplicate request id {request_id!r}", param="request_id")
        if not self.is_running:
            raise RuntimeError("engine is not running")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream  # before any await: a second request with this id is refused
        accepted = self._loop.create_future()
        finished = False
        try:
            matcher = None
            if params.structured_output is not None:  # compiled in a worker, never on the stepping thread
                domain = cache.salt if cache else None
                matcher = await asyncio.to_thread(
                    self.engine.grammars.matcher, params.structured_output, domain
                )
            self._inbox.put(_Add(request_id, prompt, params, matcher, cache, accepted))
            await accepted  # re-raises the engine's validation error
            while True:
                out: RequestOutput = await stream.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            refused = accepted.done() and not accepted.cancelled() and accepted.exception() is not None
            if not finished and not refused:
                # Cancelled at any await point, even after the engine took the request but before its
                # acceptance arrived here: the abort follows the add through the same queue, and the
                # engine ignores an abort for an id it does not hold.
                accepted.cancel()
                self._inbox.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        if request_id not in self._streams:
            raise KeyError(f"unknown request id {request_id!r}")
        self._inbox.put(_Abort(request_id))

    # -- the stepping thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._drain_inbox(block=not self.engine.has_unfinished_requests())
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
            except Exception as e:  # LLMEngine.step handles its own faults: this is the last resort
                logger.exception("engine loop error; failing every request")
                try:
                    outputs = self.engine.fail(list(self.engine.requests.values()), e)
                except Exception:
                    logger.exception("the engine cannot recover; stopping it")
                    self._loop.call_soon_threadsafe(self._close_streams, f"engine stopped: {e}")
                    return
            self._send(outputs)  # first: nothing below may hold a stream back
            try:
                self.stats_snapshot = self.engine.stats()
            except Exception:
                logger.exception("engine stats failed; /metrics keeps the previous snapshot")

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if isinstance(item, _Add):
                self._add(item)
            elif isinstance(item, _Abort) and item.request_id in self.engine.requests:
                self._abort(item.request_id)  # ids already finished need no abort

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception as e:  # fail the request instead: it must not run on with nobody listening
            logger.exception("abort of %s failed", request_id)
            self._send(self.engine.fail([self.engine.requests[request_id]], e))

    def _send(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self._loop.call_soon_threadsafe(self._deliver, out)

    def _add(self, item: _Add) -> None:
        if item.accepted.cancelled():
            return
        try:
            self.engine.add_request(item.request_id, item.prompt, item.params, item.matcher, item.cache)
        except Exception as e:
            self._loop.call_soon_threadsafe(_settle, item.accepted, e)
            return
        self._loop.call_soon_threadsafe(_settle, item.accepted, None)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.put_nowait(out)


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
