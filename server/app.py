"""The HTTP server (OpenAI's chat and completions APIs, Anthropic's Messages API): `uvicorn server.app:app`
(settings from MINIVLLM_* variables).

The models load once, in the lifespan, an engine each (MINIVLLM_MODEL's list); each engine's stepping
thread starts there and stops on shutdown. A request's `model` picks the engine (server.core.state_for).
The same app is the Ray Serve ingress of `minivllm serve --replicas N`, given a client of the replicas.
"""

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from minivllm.engine.async_engine import AsyncEngine
from minivllm.models.backend import detect_backend, slow_blas_warning
from minivllm.shadow import ShadowReplay
from server import cache_api, chat, completions, messages, responses, web
from server import protocol as p
from server.connections import guard_running_server, quiet_accept_errors
from server.core import ServerState, state_for
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
        guard_running_server(settings)  # under `uvicorn server.app:app`: serve's connection guard too
        quiet_accept_errors(asyncio.get_running_loop())
        engines = await _engines(settings, engine)
        owned = [e for e in engines.values() if isinstance(e, AsyncEngine) and not e.is_running]
        for eng in owned:
            eng.start()
        shadows = {name: shadow for name, eng in engines.items() if (shadow := _cache_advice(settings, eng))}
        metrics.bind_engines(engines, shadows)
        app.state.models = {
            name: _state(settings, eng, metrics, name, shadows.get(name)) for name, eng in engines.items()
        }
        app.state.server = next(iter(app.state.models.values()))  # the first model: health, web page
        for name, eng in engines.items():
            logger.info("serving %s (max_model_len %d)", name, eng.max_model_len)
        app.state.warnings = [w for w in [slow_blas_warning(detect_backend())] if w]
        for warning in app.state.warnings:
            logger.warning(warning)
        reason = f"server shutting down (open past MINIVLLM_SHUTDOWN_TIMEOUT={settings.shutdown_timeout:g} s)"
        undo = limit_shutdown(
            asyncio.get_running_loop(),
            lambda: sum(st.end_streams(reason) for st in app.state.models.values()),
            settings.shutdown_timeout,
        )
        try:
            yield
        finally:
            undo()
            for st in app.state.models.values():
                st.prompts.close()
            for shadow in shadows.values():
                shadow.close()
            for eng in owned:
                eng.shutdown()  # on the loop thread: it ends the open streams (asyncio queues are not thread-safe)

    # no /docs or /redoc: their pages load scripts from a CDN (this server works offline); /openapi.json stays
    app = FastAPI(title="minivllm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(GatewayMiddleware, metrics=metrics)
    install_error_handlers(app)
    protocols = (chat.router, completions.router, messages.router, responses.router)
    for routes in (router, *protocols, cache_api.router, web.router):
        app.include_router(routes)
    return app


def _cache_advice(settings: Settings, engine: EngineClient) -> ShadowReplay | None:
    """The cache advice of a local engine that records its requests' page hashes (replicas behind a
    router do not report it)."""
    if not isinstance(engine, AsyncEngine) or engine.hash_stream is None:
        return None
    eng = engine.engine
    config = eng.config
    shadow = ShadowReplay(
        engine.hash_stream,
        eng.num_pages,
        config.eviction,
        config.page_size,
        settings.cache_shadow_interval,
        busy=eng.has_unfinished_requests,  # requests running or waiting: the advice waits (ShadowReplay)
    )
    shadow.start()
    return shadow


async def _engines(settings: Settings, engine: EngineClient | None) -> dict[str, EngineClient]:
    """The engine of each served model id: the given one, or one local AsyncEngine per model (loaded one
    after the other, each with its share of the KV budget: Settings.engine_configs)."""
    if engine is not None:
        return {settings.served_model_name: engine}
    configs = settings.engine_configs()
    return {
        name: await asyncio.to_thread(AsyncEngine, config)
        for name, config in zip(settings.served_model_names, configs)
    }


def _state(
    settings: Settings, engine: EngineClient, metrics: Metrics, model_name: str, shadow: ShadowReplay | None
) -> ServerState:
    tokenizer = engine.tokenizer
    prompts = PromptBuilder(tokenizer, engine.max_model_len, long_lane=settings.prompt_lanes)
    return ServerState(
        settings,
        engine,
        metrics,
        model_name,
        tokenizer.token_text,
        prompts,
        tokenizer.special_token_ids,
        tokenizer.token_bytes,
        shadow=shadow,
    )


def _configure_logging(level: str) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("minivllm", "server"):
        logging.getLogger(name).setLevel(level.upper())


router = APIRouter()  # the routes every server has; each protocol module has its own


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request):
    stopped = [name for name, st in request.app.state.models.items() if not st.engine.is_running]
    if stopped:
        return error_response(503, f"engine is not running ({', '.join(stopped)})")
    engine = request.app.state.server.engine
    replicas = sorted(name for name in engine.replica_stats() if name is not None)
    answer = {"status": "ok", "replicas": replicas} if replicas else {"status": "ok"}
    if request.app.state.warnings:  # serving, but something the user should fix (the web page shows it)
        answer["warnings"] = request.app.state.warnings
    return answer


@router.get("/metrics")
async def metrics_endpoint(request: Request):
    metrics: Metrics = request.app.state.server.metrics
    return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(request: Request) -> p.ModelList:
    states: dict[str, ServerState] = request.app.state.models
    return p.ModelList(
        data=[p.ModelCard(id=st.model_name, max_model_len=st.max_model_len) for st in states.values()]
    )


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> p.ModelCard:
    st = state_for(request, model_id)
    return p.ModelCard(id=st.model_name, max_model_len=st.max_model_len)


app = create_app()
