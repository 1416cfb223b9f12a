"""What every HTTP request passes before the app: the API-key check on /v1 routes (`Authorization: Bearer
<key>`, or Anthropic's `x-api-key: <key>`), the request-size limit, the body timeout, and the request counts
by endpoint and status. Its errors take the shape of the route's protocol (server.errors).

Plain ASGI (not BaseHTTPMiddleware), so streaming and disconnect detection pass through untouched. The size
limit holds before anything parses the body: a Content-Length over it is answered at once without reading,
and a chunked body is counted as it arrives and refused the moment it passes the limit. The bytes of all
bodies in flight are bounded too; bodies still arriving give way to a new one (the one whose last piece
came longest ago first), so clients that stall half-way through large bodies cannot lock out the others.
"""

import asyncio
import hashlib
import hmac
import ipaddress
from collections import OrderedDict
from dataclasses import dataclass, field

from starlette.exceptions import HTTPException

from server.errors import error_response
from server.metrics import Metrics

ENDPOINTS = (
    "/",
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/cache/stats",
    "/v1/cache/explain",
    "/v1/cache/pin",
)


class RequestTooLarge(HTTPException):
    """Raised from receive() while the app reads the body; FastAPI lets HTTPExceptions through, so the
    app's error handlers answer it (OpenAI-shaped) like any other error."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body is larger than {limit} bytes (MINIVLLM_MAX_REQUEST_BYTES)")


class TooManyBodies(HTTPException):
    """The bodies of the requests in flight would pass MINIVLLM_MAX_INFLIGHT_BODY_BYTES: retry shortly."""

    def __init__(self, budget: int):
        message = (
            f"request bodies in flight would pass {budget} bytes (MINIVLLM_MAX_INFLIGHT_BODY_BYTES); retry"
        )
        super().__init__(429, message, headers={"Retry-After": "1"})


class BodyStalled(HTTPException):
    """No piece of the request's body came for MINIVLLM_BODY_TIMEOUT seconds: its bytes and its connection
    are let go (a client that stops half-way must not hold them)."""

    def __init__(self, timeout: float):
        message = f"the request body stopped arriving for {timeout:g} s (MINIVLLM_BODY_TIMEOUT)"
        super().__init__(408, message, headers={"Connection": "close"})


class BodyDropped(HTTPException):
    """The body, still arriving, was let go to make room for another request's (the one whose last piece
    came longest ago goes first): bodies that stall cannot hold MINIVLLM_MAX_INFLIGHT_BODY_BYTES."""

    def __init__(self, budget: int):
        message = (
            f"the request body was still arriving when other requests needed its room in the {budget} bytes "
            "of bodies in flight (MINIVLLM_MAX_INFLIGHT_BODY_BYTES); retry"
        )
        super().__init__(408, message, headers={"Connection": "close", "Retry-After": "1"})


@dataclass(eq=False)
class _Body:
    """A request's body as the gateway counts it: the bytes it holds and, while it is still arriving, the
    event that stops it."""

    held: int = 0
    arriving: bool = True
    stopped: asyncio.Event = field(default_factory=asyncio.Event)


class GatewayMiddleware:
    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics
        self.body_bytes = 0  # bytes of the bodies of the requests in flight (each parsed body lives as long)
        # the bodies still arriving, the one whose last piece came longest ago first
        self.arriving: OrderedDict[_Body, None] = OrderedDict()

    def _make_room(self, needed: int, budget: int, keep: _Body | None = None) -> bool:
        """Whether `needed` more bytes fit the budget, after stopping bodies still arriving (but `keep`),
        the one whose last piece came longest ago first. A stopped body's bytes count as gone at once:
        its request ends with BodyDropped."""
        while self.body_bytes + needed > budget:
            victim = next((b for b in self.arriving if b is not keep), None)
            if victim is None:
                return False
            self._let_go(victim)
            victim.stopped.set()
        return True

    def _let_go(self, body: _Body) -> None:
        self.arriving.pop(body, None)
        self.body_bytes -= body.held
        body.held = 0

    def _limited(self, receive, body: _Body, limit: int, budget: int, timeout: float):
        """receive(), counting body bytes: past `limit` for this request it raises RequestTooLarge, past
        `budget` for all requests in flight (once bodies still arriving have given way) TooManyBodies,
        instead of returning them; while the body is incomplete, a wait past `timeout` for its next piece
        raises BodyStalled, and a stop for another request's room BodyDropped. (Once it is whole, receive
        waits for the client's disconnect, for as long as a stream runs: no timeout then.)"""

        async def receive_limited():
            if not body.arriving:
                return await receive()
            message = await _next_piece(receive, body, timeout, budget)
            body.arriving = message["type"] == "http.request" and message.get("more_body", False)
            if message["type"] == "http.request":
                n = len(message.get("body", b""))
                body.held += n
                self.body_bytes += n
                if body.held > limit:
                    raise RequestTooLarge(limit)
                if not self._make_room(0, budget, keep=body):
                    raise TooManyBodies(budget)
            if body.arriving:
                self.arriving.move_to_end(body)  # its last piece came now
            else:
                self.arriving.pop(body, None)
            return message

        return receive_limited

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = 500  # if nothing gets sent
        body = _Body()  # this request's body bytes, counted in self.body_bytes

        async def send_observed(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            state = getattr(scope["app"].state, "server", None)
            if not _host_allowed(scope, state):
                response = error_response(
                    400, "this server does not answer to that Host (MINIVLLM_ALLOWED_HOSTS)", path=path
                )
                return await response(scope, receive, send_observed)
            key = _request_key(scope, state)
            if key:  # the key's own prefix-cache domain (server.core.cache_salt)
                scope.setdefault("state", {})["key_domain"] = key_domain(key)
            if path.startswith("/v1") and key is None:
                response = error_response(
                    401,
                    "missing or invalid API key (Authorization: Bearer <key>, or x-api-key: <key>)",
                    path=path,
                    code="invalid_api_key",
                )
                return await response(scope, receive, send_observed)
            limit = state.settings.max_request_bytes if state else None
            if limit is None:
                return await self.app(scope, receive, send_observed)
            declared = _content_length(scope)
            budget = state.settings.max_inflight_body_bytes
            refusal = None
            if declared is not None and declared > limit:
                refusal = RequestTooLarge(limit)
            elif declared and not self._make_room(declared, budget):
                refusal = TooManyBodies(budget)
            if refusal is not None:
                response = error_response(
                    refusal.status_code, refusal.detail, path=path, headers=refusal.headers
                )
                return await response(scope, receive, send_observed)
            self.arriving[body] = None
            receive = self._limited(receive, body, limit, budget, state.settings.body_timeout)
            await self.app(scope, receive, send_observed)
        finally:
            self._let_go(body)
            endpoint = path if path in ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()


async def _next_piece(receive, body: _Body, timeout: float, budget: int) -> dict:
    """The next ASGI message, unless the body stalls for `timeout` (BodyStalled) or is stopped to make
    room for another (BodyDropped) first."""
    piece, stop = asyncio.ensure_future(receive()), asyncio.ensure_future(body.stopped.wait())
    try:
        done, _ = await asyncio.wait((piece, stop), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not piece.done():
            piece.cancel()
    if piece in done:
        return piece.result()
    if body.stopped.is_set():
        raise BodyDropped(budget)
    raise BodyStalled(timeout)


def _request_key(scope, state) -> str | None:
    """The accepted key the request carries ("" when the server needs none), or None if it carries none
    of them: as a bearer token, or in x-api-key (Anthropic's clients send it there). Every accepted key is
    compared, in constant time, so the timing tells nothing."""
    keys = state.settings.accepted_keys if state else ()
    if not keys:
        return ""
    headers = dict(scope["headers"])
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    offered = token.strip().encode() if scheme.lower() == "bearer" else headers.get(b"x-api-key", b"").strip()
    matches = [hmac.compare_digest(offered, k.encode()) for k in keys]
    return keys[matches.index(True)] if offered and any(matches) else None


def _host_allowed(scope, state) -> bool:
    """localhost and IP addresses always (a DNS-rebinding page comes with a host name it controls), other
    names only when listed in MINIVLLM_ALLOWED_HOSTS ("*": any)."""
    raw = dict(scope["headers"]).get(b"host")
    if raw is None:
        return True  # HTTP/1.0 and in-process clients: nothing a browser sends
    host = raw.decode("latin-1").strip().lower()
    host = (
        host[1 : host.index("]")] if host.startswith("[") and "]" in host else host.rpartition(":")[0] or host
    )
    if host == "localhost" or host.endswith(".localhost") or _is_ip(host):
        return True
    allowed = (state.settings.allowed_hosts or ()) if state else ()
    return "*" in allowed or host in {h.lower() for h in allowed}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def key_domain(key: str) -> str:
    """A key's prefix-cache domain: a digest, so the key itself never travels with the request."""
    return hashlib.sha256(b"minivllm key domain\x00" + key.encode()).hexdigest()[:32]


def _content_length(scope) -> int | None:
    raw = dict(scope["headers"]).get(b"content-length")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None  # the ASGI server refuses a malformed length before we see the request
