"""Graceful shutdown, with a limit. On SIGTERM or SIGINT uvicorn stops accepting connections and waits for
the open ones; streams can run for minutes, so after MINIVLLM_SHUTDOWN_TIMEOUT seconds the streams still
open end with an error event (in their protocol's shape) and the server exits.

The handler wraps uvicorn's own (installed before the app's lifespan runs) and calls it too. Signals can be
handled on the main thread only: a server run on another thread (the tests') keeps uvicorn's behaviour.
"""

import asyncio
import logging
import signal
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def limit_shutdown(
    loop: asyncio.AbstractEventLoop, end_streams: Callable[[], int], timeout_s: float
) -> Callable[[], None]:
    """Install the handlers; end_streams() ends every open stream and says how many. Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    armed = False

    def end() -> None:
        ended = end_streams()
        if ended:
            logger.warning("shutdown: ended %d streams still open after %.0f s", ended, timeout_s)

    def arm() -> None:
        nonlocal armed
        if not armed:
            armed = True
            loop.call_later(timeout_s, end)

    def handler(sig: int, frame) -> None:
        loop.call_soon_threadsafe(arm)
        before = previous[sig]
        if callable(before):
            before(sig, frame)

    for sig in SIGNALS:
        signal.signal(sig, handler)

    def undo() -> None:
        for sig, before in previous.items():
            signal.signal(sig, before)

    return undo
