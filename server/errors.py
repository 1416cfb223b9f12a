"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`, and the handlers that make
every failure one of them (never a bare 500 page or a crash). Anthropic's routes (/v1/messages...) answer
in Anthropic's shape instead: `{"type": "error", "error": {"type", "message"}}`."""

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.engine.validation import RequestError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"  # and the paths under it


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After on a 429

    def response(self, path: str = "") -> JSONResponse:
        return error_response(
            self.status, self.message, path=path, param=self.param, code=self.code, headers=self.headers
        )


def named(e: RequestError, names: Mapping[str, str]) -> APIError:
    """The engine's refusal as a 400 naming the request's own field (names: engine parameter -> field)."""
    field = names.get(e.param, e.param)
    message = e.message
    # the message names the field too (clients often show only the message), except OpenAI's own wording
    if field and e.code != "context_length_exceeded" and not message.startswith(field):
        message = f"{field}: {message}"
    return APIError(400, message, param=field, code=e.code)


class ClientDisconnected(Exception):
    """The client went away before the response; its requests were aborted."""


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": _printable(message), "type": kind, "param": _printable(param), "code": code}}


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict:
    """Anthropic's error has no param field: the message names it (as Anthropic's own messages do)."""
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": _printable(message)}}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def _printable(text: str | None) -> str | None:
    """Text that encodes as UTF-8: a message may echo client input, which can hold lone surrogates."""
    return text if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(
    status: int,
    message: str,
    *,
    path: str = "",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The error in the shape of the protocol that path belongs to."""
    if is_anthropic(path):
        body = anthropic_error_body(status, message, param)
    else:
        body = error_body(status, message, param=param, code=code)
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(ClientDisconnected, _disconnected)
    app.add_exception_handler(Exception, _unexpected)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response(request.url.path)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    path = request.url.path
    if first.get("type") == "json_invalid":
        message = f"invalid JSON body: {first.get('msg', '')}"
        return error_response(400, message, path=path, code="invalid_json")
    messages = "; ".join(
        f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: {e.get('msg')}" for e in errors
    )
    return error_response(400, messages or "invalid request", path=path, param=param)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), path=request.url.path, headers=exc.headers)


async def _disconnected(request: Request, exc: ClientDisconnected) -> Response:
    return Response(status_code=499)  # nobody reads it; the status shows in the metrics


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}", path=request.url.path)
