"""The HTTP server's connections: uvicorn's h11 protocol with what it lacks against idle and slow clients.

uvicorn already closes a connection idle after a response (`timeout_keep_alive`) and cancels what is still
running a while after a shutdown began (`timeout_graceful_shutdown`). Added here:

- a header timeout: a request's headers must arrive whole within MINIVLLM_HEADER_TIMEOUT seconds of the
  connection opening (or of its first byte after a response), so a client that trickles them (slowloris), or
  connects and sends nothing, does not hold a descriptor for ever;
- a connection cap (MINIVLLM_MAX_CONNECTIONS): a connection past it first makes room by closing the one
  that has waited longest without sending anything (idle, or stalled in its headers or body: nothing the
  engine works on), so such sockets can never lock out /health; when every connection is being served, the
  new one is answered 503 in its route's protocol shape, then closed. The waiting connections are kept in
  the order of their last byte, so a burst of thousands costs O(1) each;
- accept errors (out of descriptors all the same) as one log line each, not a traceback.

`minivllm serve` builds uvicorn's config with them (uvicorn_config); under `uvicorn server.app:app` the
app's lifespan hands them to the uvicorn server that runs it (guard_running_server), before it listens.
"""

import asyncio
import logging
import signal
import time
from collections import OrderedDict

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.errors import error_response
from server.settings import Settings

logger = logging.getLogger(__name__)
ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message when accept() fails
SHUTDOWN_GRACE_S = 1.0  # after MINIVLLM_SHUTDOWN_TIMEOUT ends the streams, uvicorn cancels what remains


def uvicorn_config(app, settings: Settings, **kw) -> uvicorn.Config:
    """uvicorn's config for the app, with the connection settings; kw: host, port, log_level..."""
    return uvicorn.Config(
        app,
        http=guarded_protocol(settings.max_connections, settings.header_timeout),
        timeout_keep_alive=settings.keepalive_timeout,
        timeout_graceful_shutdown=settings.shutdown_timeout + SHUTDOWN_GRACE_S,
        **kw,
    )


def guard_running_server(settings: Settings) -> None:
    """Under `uvicorn server.app:app` (called from the app's lifespan, before uvicorn listens): give the
    uvicorn server running the app the same connection guard and shutdown limit as `minivllm serve`. The
    server is found by the signal handler it installed (uvicorn does, on the main thread); one that
    `minivllm serve` built is guarded already."""
    server = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    if not isinstance(server, uvicorn.Server) or issubclass(
        server.config.http_protocol_class, GuardedH11Protocol
    ):
        return
    config = server.config
    config.http_protocol_class = guarded_protocol(settings.max_connections, settings.header_timeout)
    config.timeout_keep_alive = settings.keepalive_timeout
    if config.timeout_graceful_shutdown is None:
        config.timeout_graceful_shutdown = settings.shutdown_timeout + SHUTDOWN_GRACE_S
    logger.info(
        "connections guarded: at most %d, headers within %g s",
        settings.max_connections,
        settings.header_timeout,
    )


def guarded_protocol(max_connections: int, header_timeout: float) -> type[H11Protocol]:
    """The protocol class of one server: its own cap, timeout and book of waiting connections."""
    book = {"cap": max_connections, "timeout": header_timeout, "waiting": OrderedDict()}
    return type("GuardedH11Protocol", (GuardedH11Protocol,), book)


class GuardedH11Protocol(H11Protocol):
    cap: int = 1000
    timeout: float = 10.0
    # connections no request of which is being served (waiting for its headers or its body, or idle after a
    # response), the one whose last byte came longest ago first; shared by the server's connections
    waiting: OrderedDict

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()
        self._wait()
        if len(self.connections) > self.cap and not self._close_longest_waiting():
            self.app = _too_many_connections  # this connection's request gets the refusal
            _warn_refused(self.cap)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if self.transport.is_closing():
            self._stop_waiting()
        elif state is h11.IDLE:  # its request's headers are not all here yet
            self._arm_header_timer()
            self._wait()
        elif state is h11.SEND_BODY:  # headers whole, body still coming: it may stall there too
            self._cancel_header_timer()
            self._wait()
        else:  # the request is whole: it is being served
            self._cancel_header_timer()
            self._stop_waiting()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._stop_waiting()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._wait()  # kept alive, idle

    def _wait(self) -> None:
        """In the book of waiting connections, as the one that sent a byte last."""
        self.waiting[self] = None
        self.waiting.move_to_end(self)

    def _stop_waiting(self) -> None:
        self.waiting.pop(self, None)

    def _close_longest_waiting(self) -> bool:
        victim = next((c for c in self.waiting if c is not self), None)
        if victim is None:
            return False
        victim.close()
        return True

    def close(self) -> None:
        self._cancel_header_timer()
        self._stop_waiting()  # at once: the next connection of a burst must pick another victim
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
