"""The serving core every protocol shares: the server's state, the one path from a typed conversation
(server.conversation) to the engine, and the one stream loop from its typed events (server.events) to a
protocol's writer, as a JSON response or an SSE stream.

A protocol module (server.chat, server.messages, server.responses; server.completions for raw prompts)
parses its request into a Conversation; `prepare_chat` templates and tokenizes it (server.prompts, off the
event loop), checks its tools and builds its grammar and each choice's sampling params; `serve` runs it and
hands the events to the protocol's Writer.
"""

import asyncio
import json
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minivllm.cache.hints import CacheHints
from minivllm.engine.sampling_params import SamplingParams, StructuredOutput, choice_seed
from minivllm.engine.validation import RequestError, check_request
from minivllm.shadow import ShadowReplay
from server.conversation import Conversation, ThinkingMode
from server.engine_client import EngineClient
from server.errors import APIError, ClientDisconnected, error_body, named
from server.events import Answer, ChoiceEvents, Event, Failed, ThinkMarkers
from server.generation import Delta, Generation, ThinkingBudget, Usage
from server.harmony import HarmonyEvents, HarmonyFormat
from server.metrics import Metrics
from server.prefix_report import EXPLAINED, HEADER, MessageLocator, PrefixReport, header_value, log, reports
from server.prompts import PromptBuilder
from server.settings import Settings
from server.structured import harmony_grammar, output_grammar
from server.tools import ToolCalling

logger = logging.getLogger(__name__)

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


# -- from a conversation to the engine -------------------------------------------------------------------
@dataclass
class Prepared:
    """What the serving core made of a conversation: the prompt, the tools, the output's grammar, each
    choice's sampling params, and how its output reads."""

    prompts: list[list[int]]
    params: list[list[SamplingParams]]  # params[i][j]: choice j of prompt i
    cache: CacheHints  # the requests' prefix-cache domain and pins
    tools: ToolCalling | None = None
    think: ThinkMarkers | None = None
    window_bound: bool = False  # max_tokens was more than the context has room for: clamped
    locate: MessageLocator | None = None
    ignored: tuple[str, ...] = ()  # the request's fields accepted without effect (x-minivllm-ignored)
    thinking_budget: ThinkingBudget | None = None
    harmony: HarmonyFormat | None = None  # the output is Harmony (gpt-oss), read by its parser
    show_thinking: bool = True  # with harmony: reasoning is always written; False drops it

    def choice_events(self) -> list[ChoiceEvents | HarmonyEvents]:
        n = sum(map(len, self.params))
        if self.harmony is not None:
            tools = self.tools.tools if self.tools else None
            return [
                HarmonyEvents(i, self.harmony, tools, self.show_thinking, self.window_bound) for i in range(n)
            ]
        return [ChoiceEvents(i, self.tools, self.think, self.window_bound) for i in range(n)]


async def prepare_chat(request: Request, st: ServerState, conv: Conversation) -> Prepared:
    """A conversation's prompt (templated and tokenized off the event loop), tools, grammar and params."""
    tools = ToolCalling.of(conv, st.engine.tokenizer)
    template_tools = tools and tools.template_tools()
    shown = conv.thinking.mode != ThinkingMode.OFF
    harmony = st.prompts.harmony
    if harmony is not None:
        # a forced output's grammar starts with the reasoning where the request asks for it (effort, a
        # budget, thinking on: within that budget); otherwise, as on every model, with the output itself
        asked = conv.thinking.mode == ThinkingMode.ON
        structured = harmony_grammar(conv, tools, harmony, conv.thinking.budget_tokens if asked else 0)
        stops = tuple(dict.fromkeys(conv.sampling.stop_token_ids + harmony.stop_tokens))
        conv = replace(conv, sampling=replace(conv.sampling, stop_token_ids=stops))
    else:
        structured = output_grammar(conv, tools)
    thinks = st.prompts.thinks
    # a grammar holds the whole output, from its first token: no thinking before a forced call or JSON
    thinking = None if not thinks else shown and structured is None
    with protocol_names(conv.names):
        # only the prompt must fit: max_tokens is an upper bound (clamp_max_tokens)
        prompt = await until_disconnect(
            request, lambda: st.prompts.chat(conv.turns, None, template_tools, thinking, conv.thinking)
        )
    pins = await until_disconnect(request, lambda: _pins(st, conv, template_tools, prompt))
    max_tokens, window_bound = clamp_max_tokens(st, conv.max_tokens, len(prompt))
    params = sampling_params(conv, max_tokens, 0, structured)
    cache = CacheHints(cache_salt(request, conv.cache_salt), pins)

    def locate(token: int):
        return st.prompts.message_at(conv.turns, template_tools, prompt, token, conv.thinking)

    think = think_markers(st.engine.tokenizer, prompt) if thinks and thinking else None
    # effort and budgets act on a model that thinks (Harmony's set its reasoning level)
    ignored = conv.ignored + (() if thinks or harmony else conv.thinking_fields)
    budget = None
    end = think and st.engine.tokenizer.added_token_id(think.end)
    if end is not None and conv.thinking.budget_tokens is not None:
        budget = ThinkingBudget(end, conv.thinking.budget_tokens)
    elif harmony is not None and shown and structured is None and conv.thinking.budget_tokens is not None:
        budget = ThinkingBudget(harmony.ids["<|end|>"], conv.thinking.budget_tokens, harmony.next_message)
    return Prepared(
        [prompt], [params], cache, tools, think, window_bound, locate, ignored, budget, harmony, shown
    )


def prepare_prompts(
    request: Request, st: ServerState, conv: Conversation, prompts: list[list[int]]
) -> Prepared:
    """Raw prompts (/v1/completions): each prompt's choices' params, max_tokens clamped per prompt."""
    params, window_bound = [], False
    for i, prompt in enumerate(prompts):
        max_tokens, clamped = clamp_max_tokens(st, conv.max_tokens, len(prompt))
        window_bound |= clamped
        params.append(sampling_params(conv, max_tokens, i * conv.sampling.n))
    cache = CacheHints(cache_salt(request, conv.cache_salt))
    return Prepared(prompts, params, cache, window_bound=window_bound, ignored=conv.ignored)


def clamp_max_tokens(st: ServerState, max_tokens: int | None, prompt_tokens: int) -> tuple[int | None, bool]:
    """max_tokens is an upper bound on every route: asking more than the context has room for runs to the
    end of the context (None), never a 400; the bool says it was clamped (the finish is the context's).
    The server's own bound (MINIVLLM_MAX_OUTPUT_TOKENS) applies first."""
    cap = st.settings.max_output_tokens
    if cap is not None:
        max_tokens = cap if max_tokens is None else min(max_tokens, cap)
    if max_tokens is None or prompt_tokens + max_tokens <= st.max_model_len:
        return max_tokens, False
    return None, True


async def _pins(
    st: ServerState, conv: Conversation, tools: list[dict] | None, prompt: list[int]
) -> tuple[tuple[int, float], ...]:
    """The conversation's breakpoints (turns before the pin's end, TTL) as the engine's pins (prompt
    tokens, TTL)."""
    if not conv.pins:
        return ()
    ends = await st.prompts.message_ends(conv.turns, tools, prompt, [k for k, _ in conv.pins], conv.thinking)
    return tuple((tokens, ttl) for tokens, (_, ttl) in zip(ends, conv.pins, strict=True) if tokens > 0)


def think_markers(tokenizer, prompt: list[int]) -> ThinkMarkers:
    """The model's think markers; the output starts in thinking where the generation prompt opened it."""
    wrapper = tokenizer.wrapper
    # as many tokens as the start marker takes (Gemma 4's `<|channel>thought` is several), and a few more
    tail_tokens = len(tokenizer.encode(wrapper.think_start, add_special_tokens=False)) + 3
    tail = tokenizer.decode(prompt[-tail_tokens:])
    return ThinkMarkers(wrapper.think_start, wrapper.think_end, tail.rstrip().endswith(wrapper.think_start))


def sampling_params(
    conv: Conversation,
    max_tokens: int | None,
    first_index: int,
    structured: StructuredOutput | None = None,
) -> list[SamplingParams]:
    """The n choices' params for one prompt; choice i of the request samples with choice_seed(seed, i).
    max_tokens None: up to the end of the context (the engine checks what fits)."""
    s = conv.sampling
    try:
        return [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=max(s.top_k, 0),
                seed=None if s.seed is None else choice_seed(s.seed, first_index + j),
                stop_token_ids=list(s.stop_token_ids),
                ignore_eos=s.ignore_eos,
                logprobs=conv.logprobs,
                presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty,
                repetition_penalty=s.repetition_penalty,
                min_p=s.min_p,
                logit_bias=dict(s.logit_bias),
                structured_output=structured,
            )
            for j in range(s.n)
        ]
    except ValueError as e:
        raise APIError(400, str(e)) from None


# -- the shared path ----------------------------------------------------------------------------------------
class Writer(Protocol):
    """How one protocol writes a generation: the whole response from its answers, or its stream of SSE
    events, one or more per typed event (server.events)."""

    id_prefix: str
    # None: a stream starts once every choice has its first output. Seconds: the headers and a ping go out
    # at once, then a ping every keepalive_s until then, so that clients with an idle timeout wait out a
    # long prefill (refusals then arrive as the stream's error events)
    keepalive_s: float | None

    def response(self, rid: str, model: str, answers: list[Answer], usage: Usage) -> dict: ...

    def opening(self, rid: str, model: str, usage: Usage) -> list[str]: ...

    def event(self, rid: str, model: str, event: Event) -> list[str]: ...

    def closing(self, rid: str, model: str, usage: Usage) -> list[str]: ...

    def failure(self, rid: str, model: str, failed: Failed, usage: Usage) -> list[str]: ...

    def ping(self) -> str: ...


def sse(payload, event: str | None = None) -> str:
    """One server-sent event: `data: <json>` (a pydantic model, a dict, or a string as it is), named or not."""
    if hasattr(payload, "model_dump_json"):
        data = payload.model_dump_json(exclude_none=True)
    elif isinstance(payload, str):
        data = payload
    else:
        data = json.dumps(payload, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"


IGNORED_HEADER = "x-minivllm-ignored"
_logged_ignored: set[str] = set()


def ignored_headers(ignored: tuple[str, ...]) -> dict[str, str]:
    """The x-minivllm-ignored header: the request fields accepted without effect (each logged once)."""
    if not ignored:
        return {}
    for path in ignored:
        if path not in _logged_ignored:
            _logged_ignored.add(path)
            logger.info("accepted without effect (named in %s): %s", IGNORED_HEADER, path)
    return {IGNORED_HEADER: ",".join(dict.fromkeys(ignored))}


async def serve(
    request: Request, st: ServerState, conv: Conversation, prepared: Prepared, writer: Writer
) -> Response:
    """A prepared conversation -> the response: whole, or streamed through the writer."""
    choices = sum(map(len, prepared.params))
    if choices > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} choices per request (prompts x n)", param="n")
    max_waiting = st.settings.max_waiting
    if choices > max_waiting:  # on a busy server every choice must wait: they must fit the queue together
        raise APIError(
            400,
            f"{choices} choices (prompts x n) can never be admitted together: on a busy server they all wait, "
            f"and the waiting queue holds {max_waiting} requests (MINIVLLM_MAX_WAITING)",
            param="n",
        )
    hidden = _hidden_tokens(st, conv, prepared)
    rid = f"{writer.id_prefix}-{uuid.uuid4().hex}"
    gen = Generation(
        st.engine,
        rid,
        prepared.prompts,
        prepared.params,
        list(conv.stops),
        st.metrics,
        hidden,
        conv.names,
        prepared.thinking_budget,
        prepared.cache,
    )
    explain = _explainer(request, st, gen, prepared.locate)
    stream = _Stream(gen, writer, rid, st.model_name, prepared.choice_events())
    headers = ignored_headers(prepared.ignored)
    streaming = False
    try:
        if conv.stream and writer.keepalive_s is not None:
            # the stream starts before the engine answers: what the request can be refused for up front
            # is refused here, as an HTTP error (and the prefix-cache report comes as an SSE comment)
            for prompt, plist in zip(prepared.prompts, prepared.params, strict=True):
                vocab = st.engine.vocab_size
                with protocol_names(conv.names):
                    check_request(prompt, plist[0].max_tokens, plist[0].logit_bias, vocab, st.max_model_len)
            streaming = True
            return GenerationStream(gen, stream.with_pings(explain), headers)
        with protocol_names(conv.names):
            await until_disconnect(request, gen.start)
        headers[HEADER] = await until_disconnect(request, explain)
        if conv.stream:
            streaming = True  # from here the response closes gen
            return GenerationStream(gen, stream.body(), headers)
        per_choice = await until_disconnect(request, gen.collect)
        answers = stream.answers(per_choice)
        body = writer.response(rid, st.model_name, answers, stream.usage())
        return JSONResponse(body, headers=headers)
    finally:
        if not streaming:
            gen.close()


def _hidden_tokens(st: ServerState, conv: Conversation, prepared: Prepared) -> frozenset[int]:
    """The tokens that add no output text: the special tokens, unless the request asks for them; a model's
    think markers stay in the text, to be split off as thinking."""
    if not conv.hide_special_tokens:
        return frozenset()
    if prepared.think is None:
        return st.special_token_ids
    tok = st.engine.tokenizer
    markers = (prepared.think.start, prepared.think.end)  # either may be several tokens (Gemma 4's start)
    return st.special_token_ids - {t for m in markers for t in tok.encode(m, add_special_tokens=False)}


@dataclass
class _Stream:
    """The one stream loop: a started generation's deltas -> each choice's events -> the writer's SSE."""

    gen: Generation
    writer: Writer
    rid: str
    model: str
    choices: list[ChoiceEvents]

    def usage(self) -> Usage:
        """The generation's usage, with the thinking tokens the choices' events counted."""
        return replace(self.gen.usage(), reasoning=sum(c.thinking_tokens for c in self.choices))

    def answers(self, per_choice: list[list[Delta]]) -> list[Answer]:
        answers = [Answer(c.index) for c in self.choices]
        for deltas, events, answer in zip(per_choice, self.choices, answers, strict=True):
            for d in deltas:
                for event in events.feed(d):
                    answer.add(event)
        return answers

    async def body(self) -> AsyncIterator[str]:
        """The SSE body; if the client goes away, the generation is closed and this ends."""
        w, rid, model = self.writer, self.rid, self.model
        try:
            for text in w.opening(rid, model, self.usage()):
                yield text
            async for d in self.gen.deltas():
                for event in self.choices[d.index].feed(d):
                    if isinstance(event, Failed):
                        for text in w.failure(rid, model, event, self.usage()):
                            yield text
                        return
                    for text in w.event(rid, model, event):
                        yield text
            if self.gen.closed:
                return  # the client is gone
            for text in w.closing(rid, model, self.usage()):
                yield text
        finally:
            self.gen.close()

    async def with_pings(self, explain: Callable[[], Awaitable[str]]) -> AsyncIterator[str]:
        """Start the generation with pings while it waits, then the prefix-cache report as an SSE comment
        (the headers left before the engine had admitted the request), then the body; a refusal ends the
        stream as the writer's error events, naming the request's field."""
        gen, w = self.gen, self.writer
        try:
            try:
                async for ping in _start_with_pings(gen, w.keepalive_s, w.ping):
                    yield ping
            except (APIError, RequestError) as e:
                refusal = named(e, gen.names) if isinstance(e, RequestError) else e
                failed = Failed(0, refusal.status, refusal.message, refusal.param)
                for text in w.failure(self.rid, self.model, failed, self.usage()):
                    yield text
                return
            yield f": {HEADER}: {await explain()}\n\n"
            async for text in self.body():
                yield text
        finally:
            gen.close()


class OpenAIEvents:
    """OpenAI's stream framing, which chat and completions share: `data: <json>` chunks, the usage chunk
    last when asked for, `data: [DONE]` at the end (after an error too); an SSE comment at once and every
    KEEPALIVE_S until the first output."""

    keepalive_s: float | None = KEEPALIVE_S

    def __init__(self, include_usage: bool):
        self.include_usage = include_usage

    def opening(self, rid: str, model: str, usage: Usage) -> list[str]:
        return []

    def closing(self, rid: str, model: str, usage: Usage) -> list[str]:
        usage_chunk = [sse(self.usage_chunk(rid, model, usage.openai()))] if self.include_usage else []
        return usage_chunk + [DONE]

    def failure(self, rid: str, model: str, failed: Failed, usage: Usage) -> list[str]:
        return [sse(error_body(failed.status, failed.message, param=failed.param)), DONE]

    def ping(self) -> str:
        return ": ping\n\n"  # an SSE comment: clients skip it

    def usage_chunk(self, rid: str, model: str, usage: dict): ...


DONE = "data: [DONE]\n\n"


def _explainer(
    request: Request, state: ServerState, gen: Generation, locate: MessageLocator | None
) -> Callable[[], Awaitable[str]]:
    """Once gen has started: its prefix-cache reports, logged and kept for /v1/cache/explain; the header."""

    async def explain() -> str:
        found = await reports(gen, request.url.path, locate)
        for report in found:
            report.domain = key_domain(request)
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


def key_domain(request: Request) -> str | None:
    """The cache domain of the request's API key (several keys configured), or None."""
    return request.scope.get("state", {}).get("key_domain")


def cache_salt(request: Request, salt: str | None) -> str | None:
    """The request's prefix-cache domain: its API key's (with several keys configured, each key its own),
    refined by the request's own cache_salt. A prompt cached in one domain is never restored in another,
    so hits cannot reveal what another domain's prompts hold."""
    key = key_domain(request)
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
