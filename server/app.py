"""The HTTP server (OpenAI's chat and completions APIs, Anthropic's Messages API): `uvicorn server.app:app`
(settings from MINIVLLM_* variables).

The model loads once, in the lifespan; the engine's stepping thread starts there and stops on shutdown.
The same app is the Ray Serve ingress of `minivllm serve --replicas N`, given a client of the replicas.
"""

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from minivllm.engine.async_engine import AsyncEngine
from server import chat, completions, messages, responses, web
from server import protocol as p
from server.connections import quiet_accept_errors
from server.core import ServerState
from server.engine_client import EngineClient
from server.errors import error_response, install_error_handlers
from server.gateway import GatewayMiddleware
from server.metrics import Metrics
from server.prompts import PromptBuilder
from server.settings import Settings
from server.shutdown import limit_shutdown

logger = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, engine: EngineClient | None = None) -> FastAPI:
    """The app. Without settings they are read from the environment at startup; with an engine (tests,
    the Ray Serve ingress) that engine is used; a local AsyncEngine is started and stopped here unless it
    already runs."""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal settings
        settings = settings or Settings.from_env()
        _configure_logging(settings.log_level)
        quiet_accept_errors(asyncio.get_running_loop())
        eng = engine or await asyncio.to_thread(AsyncEngine, settings.engine_config())
        owned = isinstance(eng, AsyncEngine) and not eng.is_running
        if owned:
            eng.start()
        metrics.bind_engine(eng)
        app.state.server = _state(settings, eng, metrics)
        logger.info("serving %s (max_model_len %d)", app.state.server.model_name, eng.max_model_len)
        reason = f"server shutting down (open past MINIVLLM_SHUTDOWN_TIMEOUT={settings.shutdown_timeout:g} s)"
        undo = limit_shutdown(
            asyncio.get_running_loop(),
            lambda: app.state.server.end_streams(reason),
            settings.shutdown_timeout,
        )
        try:
            yield
        finally:
            undo()
            app.state.server.prompts.close()
            if owned:
                eng.shutdown()  # on the loop thread: it ends the open streams (asyncio queues are not thread-safe)

    # no /docs or /redoc: their pages load scripts from a CDN (this server works offline); /openapi.json stays
    app = FastAPI(title="minivllm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(GatewayMiddleware, metrics=metrics)
    install_error_handlers(app)
    for routes in (router, chat.router, completions.router, messages.router, responses.router, web.router):
        app.include_router(routes)
    return app


def _state(settings: Settings, engine: EngineClient, metrics: Metrics) -> ServerState:
    tokenizer = engine.tokenizer
    prompts = PromptBuilder(tokenizer, engine.max_model_len, long_lane=settings.prompt_lanes)
    return ServerState(
        settings,
        engine,
        metrics,
        settings.served_model_name,
        tokenizer.token_text,
        prompts,
        tokenizer.special_token_ids,
        tokenizer.token_bytes,
    )


def _configure_logging(level: str) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("minivllm", "server"):
        logging.getLogger(name).setLevel(level.upper())


router = APIRouter()  # the routes every server has; each protocol module has its own


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request):
    engine = request.app.state.server.engine
    if not engine.is_running:
        return error_response(503, "engine is not running")
    replicas = sorted(name for name in engine.replica_stats() if name is not None)
    return {"status": "ok", "replicas": replicas} if replicas else {"status": "ok"}


@router.get("/metrics")
async def metrics_endpoint(request: Request):
    metrics: Metrics = request.app.state.server.metrics
    return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(request: Request) -> p.ModelList:
    st: ServerState = request.app.state.server
    return p.ModelList(data=[p.ModelCard(id=st.model_name, max_model_len=st.max_model_len)])


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> p.ModelCard:
    st: ServerState = request.app.state.server
    st.check_model(model_id)
    return p.ModelCard(id=st.model_name, max_model_len=st.max_model_len)


app = create_app()
