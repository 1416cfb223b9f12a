"""The OpenAI-compatible HTTP server: `uvicorn server.app:app` (settings from MINIVLLM_* variables).

The model loads once, in the lifespan; the engine's stepping thread starts there and stops on shutdown.
"""

import asyncio
import functools
import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response

from minivllm.engine.async_engine import AsyncEngine
from server import protocol as p
from server.completions import (
    ChatFormat,
    CompletionFormat,
    ServerState,
    chat_prompt,
    completion_prompts,
    generate,
)
from server.errors import APIError, error_response, install_error_handlers
from server.metrics import Metrics
from server.settings import Settings

logger = logging.getLogger(__name__)

ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions")


def create_app(settings: Settings | None = None, engine: AsyncEngine | None = None) -> FastAPI:
    """The app. Without settings they are read from the environment at startup; with an engine (tests)
    that engine is used, and started and stopped here unless it already runs."""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal settings
        settings = settings or Settings.from_env()
        _configure_logging(settings.log_level)
        eng = engine or await asyncio.to_thread(AsyncEngine, settings.engine_config())
        owned = not eng.is_running
        if owned:
            eng.start()
        metrics.bind_engine(eng)
        app.state.server = _state(settings, eng, metrics)
        logger.info("serving %s (max_model_len %d)", app.state.server.model_name, eng.engine.max_model_len)
        try:
            yield
        finally:
            if owned:
                eng.shutdown()  # on the loop thread: it ends the open streams (asyncio queues are not thread-safe)

    app = FastAPI(title="minivllm", lifespan=lifespan)
    app.add_middleware(GatewayMiddleware, metrics=metrics)
    install_error_handlers(app)
    _add_routes(app, metrics)
    return app


def _state(settings: Settings, engine: AsyncEngine, metrics: Metrics) -> ServerState:
    tokenizer = engine.tokenizer
    token_text = functools.lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t]))
    return ServerState(settings, engine, metrics, settings.served_model_name, token_text)


def _configure_logging(level: str) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("minivllm", "server"):
        logging.getLogger(name).setLevel(level.upper())


def _add_routes(app: FastAPI, metrics: Metrics) -> None:
    @app.get("/health")
    async def health(request: Request):
        if not request.app.state.server.engine.is_running:
            return error_response(503, "engine is not running")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> p.ModelList:
        st: ServerState = request.app.state.server
        return p.ModelList(data=[p.ModelCard(id=st.model_name, max_model_len=st.max_model_len)])

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        st: ServerState = request.app.state.server
        st.check_model(body.model)
        prompt = chat_prompt(st.engine.tokenizer, body.messages)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        fmt = ChatFormat(st.token_text, body.logprobs)
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await generate(request, st, fmt, body, [prompt], max_tokens, logprobs)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request):
        st: ServerState = request.app.state.server
        st.check_model(body.model)
        if body.echo or body.suffix:
            raise APIError(400, "echo and suffix are not supported", param="echo" if body.echo else "suffix")
        prompts = completion_prompts(st.engine.tokenizer, body.prompt)
        fmt = CompletionFormat(st.token_text, body.logprobs is not None)
        return await generate(request, st, fmt, body, prompts, body.max_tokens, body.logprobs)


class GatewayMiddleware:
    """Bearer-key check on /v1 routes and request counts by endpoint and status. Plain ASGI (not
    BaseHTTPMiddleware), so streaming and disconnect detection pass through untouched."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = 500  # if nothing gets sent

        async def send_observed(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if path.startswith("/v1") and not self._authorized(scope):
                response = error_response(
                    401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key"
                )
                return await response(scope, receive, send_observed)
            await self.app(scope, receive, send_observed)
        finally:
            endpoint = path if path in ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()

    @staticmethod
    def _authorized(scope) -> bool:
        state = getattr(scope["app"].state, "server", None)
        key = state.settings.api_key if state else None
        if not key:
            return True
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


app = create_app()
