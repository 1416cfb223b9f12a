"""The HTTP server's connections: uvicorn's h11 protocol with what it lacks against idle and slow clients.

uvicorn already closes a connection idle after a response (`timeout_keep_alive`). Added here:

- a header timeout: a request's headers must arrive whole within MINIVLLM_HEADER_TIMEOUT seconds of the
  connection opening (or of its first byte after a response), so a client that trickles them (slowloris), or
  connects and sends nothing, does not hold a descriptor for ever;
- a connection cap (MINIVLLM_MAX_CONNECTIONS): a connection past it first makes room by closing the one idle
  longest (no request in progress), so idle sockets can never lock out /health; when every connection is
  serving a request, the new one is answered 503 in its route's protocol shape, then closed;
- accept errors (out of descriptors all the same) as one log line each, not a traceback.
"""

import asyncio
import logging
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.errors import error_response
from server.settings import Settings

logger = logging.getLogger(__name__)
ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message when accept() fails


def uvicorn_config(app, settings: Settings, **kw) -> uvicorn.Config:
    """uvicorn's config for the app, with the connection settings; kw: host, port, log_level..."""
    return uvicorn.Config(
        app,
        http=guarded_protocol(settings.max_connections, settings.header_timeout),
        timeout_keep_alive=settings.keepalive_timeout,
        **kw,
    )


def guarded_protocol(max_connections: int, header_timeout: float) -> type[H11Protocol]:
    return type(
        "GuardedH11Protocol", (GuardedH11Protocol,), {"cap": max_connections, "timeout": header_timeout}
    )


class GuardedH11Protocol(H11Protocol):
    cap: int = 1000
    timeout: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.idle_since = time.monotonic()
        self.header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()
        if len(self.connections) > self.cap and not self._close_longest_idle():
            self.app = _too_many_connections  # this connection's request gets the refusal
            _warn_refused(self.cap)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # its request's headers are not all here yet
            self._arm_header_timer()
        else:
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self.idle_since = time.monotonic()
        super().on_response_complete()

    @property
    def idle(self) -> bool:
        """No request in progress: waiting for its first request's headers, or kept alive after a response."""
        return self.cycle is None or self.cycle.response_complete

    def _close_longest_idle(self) -> bool:
        others = [
            c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol) and c.idle
        ]
        if not others:
            return False
        min(others, key=lambda c: c.idle_since).close()
        return True

    def close(self) -> None:
        self._cancel_header_timer()
        if not self.transport.is_closing():
            self.transport.close()

    def _arm_header_timer(self) -> None:
        if self.header_timer is None:
            self.header_timer = self.loop.call_later(self.timeout, self.close)

    def _cancel_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None


_last_warning = [float("-inf")]


def _warn_refused(cap: int) -> None:
    """At most one warning a minute: a flood of refused connections must not flood the log."""
    now = time.monotonic()
    if now - _last_warning[0] >= 60:
        _last_warning[0] = now
        logger.warning("refusing connections: all %d serve requests (MINIVLLM_MAX_CONNECTIONS)", cap)


async def _too_many_connections(scope, receive, send) -> None:
    message = "too many connections, all serving requests (MINIVLLM_MAX_CONNECTIONS); retry"
    headers = {"Retry-After": "1", "Connection": "close"}
    await error_response(503, message, path=scope.get("path", ""), headers=headers)(scope, receive, send)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """A failed accept() (no descriptor left) logs one line, not a traceback; asyncio retries it shortly."""
    default = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if context.get("message") == ACCEPT_FAILED:
            logger.error(
                "accept failed: %s (MINIVLLM_MAX_CONNECTIONS stays under the fd limit)",
                context.get("exception"),
            )
        elif default is not None:
            default(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
