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

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine, RequestOutput
from minivllm.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    accepted: asyncio.Future  # resolves when the engine took (or refused) the request


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None):
        self.engine = engine or LLMEngine(config or EngineConfig())
        self.tokenizer = self.engine.tokenizer
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.stats_snapshot: dict = self.engine.stats()

    # -- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="minivllm-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the stepping thread and end every open stream. Call it on the event loop's thread."""
        self._stopping.set()
        self._inbox.put(None)  # wake the thread
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.error("engine thread did not stop within %.0f s", timeout)
        for rid, stream in list(self._streams.items()):
            stream.put_nowait(
                RequestOutput(rid, [], finished=True, finish_reason="abort", error="server shutting down")
            )

    # -- requests -----------------------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Raises ValueError / QueueFull before the first output if refused.
        Closing the iterator early (client gone) aborts the request and releases its pages."""
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not self.is_running:
            raise RuntimeError("engine is not running")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        accepted = self._loop.create_future()
        self._inbox.put(_Add(request_id, prompt, params, accepted))
        finished = False
        try:
            await accepted  # re-raises the engine's validation error
            while True:
                out: RequestOutput = await stream.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and accepted.done() and accepted.exception() is None:
                self._inbox.put(_Abort(request_id))
            elif not accepted.done():
                accepted.cancel()
                self._inbox.put(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        if request_id not in self._streams:
            raise KeyError(f"unknown request id {request_id!r}")
        self._inbox.put(_Abort(request_id))

    # -- the stepping thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            block = not self.engine.has_unfinished_requests()
            try:
                self._drain_inbox(block)
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
            except Exception:  # the loop must survive anything a request does
                logger.exception("engine loop error")
                continue
            self.stats_snapshot = self.engine.stats()
            for out in outputs:
                self._loop.call_soon_threadsafe(self._deliver, out)

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
                self.engine.abort_request(item.request_id)  # ids already finished need no abort

    def _add(self, item: _Add) -> None:
        if item.accepted.cancelled():
            return
        try:
            self.engine.add_request(item.request_id, item.prompt, item.params)
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
