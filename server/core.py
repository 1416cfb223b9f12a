"""The serving core every protocol shares: the server's state, sampling params, n choices, the engine's
refusals in a protocol's own names, and the one path from prompts to a JSON response or an SSE stream.

A protocol module (server.chat, server.completions, server.messages) turns its request into prompt token ids
(server.prompts, off the event loop) and a Format that writes its response; `generate` (OpenAI's sampling
fields and n choices) or `run` (sampling params the protocol built itself) does the rest.
"""

import asyncio
import json
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minivllm.cache.hints import CacheHints
from minivllm.engine.sampling_params import SamplingParams, StructuredOutput, choice_seed
from minivllm.engine.validation import RequestError, check_request
from minivllm.shadow import ShadowReplay
from server import protocol as p
from server.engine_client import EngineClient
from server.errors import APIError, ClientDisconnected, error_body, named
from server.generation import Delta, Generation, TokenUsage
from server.metrics import Metrics
from server.prefix_report import EXPLAINED, HEADER, MessageLocator, PrefixReport, header_value, log, reports
from server.prompts import PromptBuilder
from server.settings import Settings

MAX_CHOICES = 64
# a keep-alive this often until a stream's first output: clients and proxies with idle timeouts wait out a
# long prefill (OpenAI streams: an SSE comment; Anthropic's: a ping event)
KEEPALIVE_S = 5.0


@dataclass
class ServerState:
    settings: Settings
    engine: EngineClient
    metrics: Metrics
    model_name: str
    token_text: Callable[[int], str]  # one token's text, for logprobs
    prompts: PromptBuilder
    special_token_ids: frozenset[int]  # left out of output text unless a request asks for them
    token_bytes: Callable[[int], bytes]  # one token's own bytes, for logprobs
    streams: set[Generation] = field(default_factory=set)  # the generations of open streams
    shadow: ShadowReplay | None = None  # the cache advice, for a local engine
    # the last requests' prefix-cache reports, oldest first (GET /v1/cache/explain)
    explained: deque[PrefixReport] = field(default_factory=lambda: deque(maxlen=EXPLAINED))

    def end_streams(self, reason: str) -> int:
        """End every open stream with an error event; how many there were."""
        open_now = list(self.streams)
        for gen in open_now:
            gen.fail(reason)
        return len(open_now)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len


def state_for(request: Request, model: str) -> ServerState:
    """The served model a request's `model` names; 404 (naming the served ids) for any other."""
    states: dict[str, ServerState] = request.app.state.models
    if model not in states:
        served = ", ".join(f"`{name}`" for name in states)
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves {served}.",
            param="model",
            code="model_not_found",
        )
    return states[model]


# -- sampling ---------------------------------------------------------------------------------------------
def sampling_params(
    body: p.GenerationRequest,
    max_tokens: int | None,
    logprobs: int | None,
    first_index: int,
    structured: StructuredOutput | None = None,
) -> list[SamplingParams]:
    """The n choices' params for one prompt; choice i of the request samples with choice_seed(seed, i).
    max_tokens None: up to the end of the context (the engine checks what fits)."""
    try:
        return [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=max(body.top_k, 0),
                seed=None if body.seed is None else choice_seed(body.seed, first_index + j),
                stop_token_ids=list(body.stop_token_ids or ()),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                min_p=body.min_p,
                logit_bias=body.token_bias,
                structured_output=structured,
            )
            for j in range(body.n)
        ]
    except ValueError as e:
        raise APIError(400, str(e)) from None


# -- the shared path ----------------------------------------------------------------------------------------
class Format(Protocol):
    """How one protocol writes a generation: the whole response, or its stream of events (SSE text). A
    Format whose stream is more than a chunk per delta (the Responses API's typed events) has a method
    `events(gen, rid, model) -> AsyncIterator[str]` that writes the whole SSE body instead."""

    id_prefix: str
    logprobs: bool
    # None: a stream starts once every choice has its first output. Seconds: the headers and a ping go out
    # at once, then a ping every keepalive_s until then, so that clients with an idle timeout wait out a
    # long prefill (refusals then arrive as the stream's error events)
    keepalive_s: float | None

    def usage(self, counts: TokenUsage) -> dict: ...

    def response(self, rid: str, model: str, per_choice: list[list[Delta]], usage: dict): ...

    def opening(self, rid: str, model: str, usage: dict) -> list[str]: ...

    def chunks(self, rid: str, model: str, d: Delta) -> list: ...

    def frame(self, chunk) -> str: ...

    def closing(self, rid: str, model: str, usage: dict, include_usage: bool) -> list[str]: ...

    def error_events(self, status: int, message: str, param: str | None = None) -> list[str]: ...

    def ping(self) -> str: ...


DONE = "data: [DONE]\n\n"


class OpenAIEvents:
    """OpenAI's usage and stream framing, which chat and completions share: `data: <json>` chunks, the
    usage chunk last when asked for, `data: [DONE]` at the end (after an error too); an SSE comment at
    once and every KEEPALIVE_S until the first output."""

    keepalive_s: float | None = KEEPALIVE_S

    def usage(self, counts: TokenUsage) -> dict:
        return counts.openai()

    def opening(self, rid: str, model: str, usage: dict) -> list[str]:
        return []

    def frame(self, chunk) -> str:
        return _data(chunk)

    def closing(self, rid: str, model: str, usage: dict, include_usage: bool) -> list[str]:
        usage_chunk = [_data(self.usage_chunk(rid, model, usage))] if include_usage else []
        return usage_chunk + [DONE]

    def error_events(self, status: int, message: str, param: str | None = None) -> list[str]:
        return [_data(error_body(status, message, param=param)), DONE]

    def ping(self) -> str:
        return ": ping\n\n"  # an SSE comment: clients skip it


async def generate(
    request: Request,
    state: ServerState,
    fmt: Format,
    body: p.GenerationRequest,
    prompts: list[list[int]],
    max_tokens: int | None,
    logprobs: int | None,
    structured: StructuredOutput | None = None,
    locate: MessageLocator | None = None,
    names: Mapping[str, str] | None = None,
) -> Response:
    choices = len(prompts) * body.n
    if choices > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} choices per request (prompts x n)", param="n")
    max_waiting = state.settings.max_waiting
    if choices > max_waiting:  # on a busy server every choice must wait: they must fit the queue together
        raise APIError(
            400,
            f"{choices} choices (prompts x n) can never be admitted together: on a busy server they all wait, "
            f"and the waiting queue holds {max_waiting} requests (MINIVLLM_MAX_WAITING)",
            param="n",
        )
    cache = CacheHints(cache_salt(request, getattr(body, "cache_salt", None)))
    params = [
        sampling_params(body, max_tokens, logprobs, i * body.n, structured) for i in range(len(prompts))
    ]
    hidden = state.special_token_ids if body.skip_special_tokens else frozenset()
    return await run(
        request,
        state,
        fmt,
        prompts,
        params,
        body.stop,
        hidden,
        body.stream,
        body.include_usage,
        locate,
        names,
        cache,
    )


async def run(
    request: Request,
    state: ServerState,
    fmt: Format,
    prompts: list[list[int]],
    params: list[list[SamplingParams]],
    stops: list[str],
    hidden: frozenset[int],
    stream: bool,
    include_usage: bool = False,
    locate: MessageLocator | None = None,
    names: Mapping[str, str] | None = None,
    cache: CacheHints | None = None,
) -> Response:
    """Prompts and their choices' params (params[i][j]: choice j of prompt i) -> the response. locate: the
    message holding a prompt token, for the prefix-cache report (server.prefix_report). names: the
    protocol's fields by engine parameter, for a refusal that comes after a stream's headers. cache: the
    requests' cache domain and pins."""
    rid = f"{fmt.id_prefix}-{uuid.uuid4().hex}"
    gen = Generation(state.engine, rid, prompts, params, stops, state.metrics, hidden, names or {}, cache)
    explain = _explainer(request, state, gen, locate)
    streaming = False
    try:
        if stream and fmt.keepalive_s is not None:
            # the stream starts before the engine answers: what the request can be refused for up front
            # is refused here, as an HTTP error (and the prefix-cache report comes as an SSE comment)
            for prompt, plist in zip(prompts, params, strict=True):
                vocab = state.engine.vocab_size
                check_request(prompt, plist[0].max_tokens, plist[0].logit_bias, vocab, state.max_model_len)
            streaming = True
            body = _stream_body(gen, fmt, rid, state.model_name, include_usage)
            return GenerationStream(gen, _with_pings(gen, fmt, body, names or {}, explain))
        await until_disconnect(request, gen.start)
        headers = {HEADER: await until_disconnect(request, explain)}
        if stream:
            streaming = True  # from here the response closes gen
            return GenerationStream(
                gen, _stream_body(gen, fmt, rid, state.model_name, include_usage), headers
            )
        per_choice = await until_disconnect(request, gen.collect)
        usage = fmt.usage(gen.token_usage())
        return JSONResponse(
            fmt.response(rid, state.model_name, per_choice, usage).model_dump(), headers=headers
        )
    finally:
        if not streaming:
            gen.close()


def _explainer(
    request: Request, state: ServerState, gen: Generation, locate: MessageLocator | None
) -> Callable[[], Awaitable[str]]:
    """Once gen has started: its prefix-cache reports, logged and kept for /v1/cache/explain; the header."""

    async def explain() -> str:
        found = await reports(gen, request.url.path, locate)
        log(found)
        state.explained.extend(found)
        return header_value(found)

    return explain


class GenerationStream(StreamingResponse):
    """An SSE response that closes its generation however it ends: finished, failed, never started, or the
    client gone (watched here too: under ASGI spec 2.4 Starlette only notices on a failed send)."""

    def __init__(self, gen: Generation, events: AsyncIterator[str], headers: dict[str, str] | None = None):
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.gen = gen

    async def __call__(self, scope, receive, send) -> None:
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        watcher.add_done_callback(lambda t: t.cancelled() or self.gen.close())
        streams = scope["app"].state.server.streams
        streams.add(self.gen)
        try:
            await super().__call__(scope, receive, send)
        finally:
            streams.discard(self.gen)
            watcher.cancel()
            self.gen.close()


def _stream_body(
    gen: Generation, fmt: Format, rid: str, model: str, include_usage: bool
) -> AsyncIterator[str]:
    """The SSE body of a started generation: the format's own events, or a chunk per delta."""
    if hasattr(fmt, "events"):
        return fmt.events(gen, rid, model)
    return _sse(gen, fmt, rid, model, include_usage)


async def _with_pings(
    gen: Generation,
    fmt: Format,
    body: AsyncIterator[str],
    names: Mapping[str, str],
    explain: Callable[[], Awaitable[str]],
) -> AsyncIterator[str]:
    """Start gen with pings while it waits, then the prefix-cache report as an SSE comment (the headers
    left before the engine had admitted the request), then the body; a refusal ends the stream as its
    error events, naming the request's field (names: as for protocol_names)."""
    try:
        try:
            async for ping in _start_with_pings(gen, fmt.keepalive_s, fmt.ping):
                yield ping
        except (APIError, RequestError) as e:
            refusal = named(e, names) if isinstance(e, RequestError) else e
            for event in fmt.error_events(refusal.status, refusal.message, refusal.param):
                yield event
            return
        yield f": {HEADER}: {await explain()}\n\n"
        async for event in body:
            yield event
    finally:
        gen.close()


async def _sse(gen: Generation, fmt: Format, rid: str, model: str, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body; if the client goes away, the generation is closed and this ends."""
    try:
        for event in fmt.opening(rid, model, fmt.usage(gen.token_usage())):
            yield event
        async for d in gen.deltas():
            if d.error:
                for event in fmt.error_events(d.error_status, d.error, d.error_param):
                    yield event
                return
            if d.text or d.finish_reason or (fmt.logprobs and d.logprobs):
                for chunk in fmt.chunks(rid, model, d):
                    yield fmt.frame(chunk)
        if gen.closed:
            return  # the client is gone
        for event in fmt.closing(rid, model, fmt.usage(gen.token_usage()), include_usage):
            yield event
    finally:
        gen.close()


async def _start_with_pings(gen: Generation, every_s: float, ping: Callable[[], str]) -> AsyncIterator[str]:
    """Start gen: a ping at once, then one every every_s until every choice has its first output. A
    refusal is raised."""
    start = asyncio.ensure_future(gen.start())
    try:
        yield ping()
        while not (await asyncio.wait({start}, timeout=every_s))[0]:
            yield ping()
        start.result()
    finally:
        start.cancel()


def _data(payload) -> str:
    text = (
        payload.model_dump_json(exclude_none=True)
        if hasattr(payload, "model_dump_json")
        else json.dumps(payload)
    )
    return f"data: {text}\n\n"


def cache_salt(request: Request, salt: str | None) -> str | None:
    """The request's prefix-cache domain: its API key's (with several keys configured, each key its own),
    refined by the request's own cache_salt. A prompt cached in one domain is never restored in another,
    so hits cannot reveal what another domain's prompts hold."""
    key = request.scope.get("state", {}).get("key_domain")
    if not key:
        return salt
    return key if salt is None else f"{key}\x00{salt}"


@contextmanager
def protocol_names(names: Mapping[str, str]):
    """The engine's refusals (RequestError, in the engine's parameter names) as 400s that name the
    request's own field: names maps engine parameter -> this protocol's field."""
    try:
        yield
    except RequestError as e:
        raise named(e, names) from None


async def until_disconnect(request: Request, work: Callable[[], Awaitable]):
    """Run work() until done, or until the client disconnects (then cancel it, raise ClientDisconnected)."""
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientDisconnected()


async def _wait_disconnect(receive) -> None:
    """Return when the client disconnects (the request body has been read, so receive() waits for that)."""
    while (await receive())["type"] != "http.disconnect":
        pass
