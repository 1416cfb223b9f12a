"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, for the anthropic SDKs and
Claude Code.

The request becomes a chat conversation (server.protocol's messages: system, user, assistant with tool
calls, tool results) templated like any chat (server.prompts); tools and tool_choice become the same call
grammar as chat's (server.tools, server.structured); the serving core generates. MessagesFormat writes the
Message, or its stream of events (message_start, content blocks, message_delta, message_stop), with pings
while the prompt is prefilled.
"""

import json
from dataclasses import dataclass, field, replace

from fastapi import APIRouter, Request

from minivllm.cache.hints import TTL_DEFAULT_S, TTL_MAX_S, CacheHints
from minivllm.engine.sampling_params import SamplingParams, StructuredOutput
from server import anthropic_protocol as a
from server import protocol as p
from server.core import KEEPALIVE_S, ServerState, cache_salt, protocol_names, run, state_for, until_disconnect
from server.errors import APIError, anthropic_error_body
from server.generation import Delta, TokenUsage
from server.structured import output_grammar
from server.tools import ToolCalling, ToolCallStream

router = APIRouter()
MAX_BREAKPOINTS = 4  # blocks with cache_control in one request, as at Anthropic
CHOICES = {"any": "required", "auto": "auto", "none": "none"}  # Anthropic's tool_choice -> ToolCalling's


@router.post("/v1/messages")
async def messages(body: a.MessagesRequest, request: Request):
    st = state_for(request, body.model)
    tools = tool_calling(body, st.engine.tokenizer)
    structured = output(body, tools)
    forced = tools is not None and tools.forced
    names = {
        "prompt": "messages",
        "max_tokens": "max_tokens",
        "structured_output": "tool_choice" if forced else "output_config.format",
    }
    turns, owners = conversation_of(body)
    template_tools = tools and tools.template_tools()
    with protocol_names(names):
        # only the prompt must fit: as at Anthropic (its newer models), an answer that reaches the end of
        # the context before max_tokens stops there, stop_reason "model_context_window_exceeded" (Claude
        # Code asks for 32000 tokens whatever the context)
        prompt = await until_disconnect(request, lambda: st.prompts.chat(turns, None, template_tools))
        fits = len(prompt) + body.max_tokens <= st.max_model_len
        marks = breakpoints(body, turns, owners)
        pins = await until_disconnect(request, lambda: pinned(st, turns, template_tools, prompt, marks))
        salt = cache_salt(request, None)  # the API key's cache domain, as on the other protocols
        params = sampling(body, structured, body.max_tokens if fits else None)
        cache = CacheHints(salt, pins)
        fmt = MessagesFormat(tools, window_bound=not fits)
        stops = body.stop_sequences or []

        def locate(token: int):
            return st.prompts.message_at(turns, template_tools, prompt, token)

        hidden = st.special_token_ids
        return await run(
            request,
            st,
            fmt,
            [prompt],
            [[params]],
            stops,
            hidden,
            body.stream,
            locate=locate,
            names=names,
            cache=cache,
        )


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: a.CountTokensRequest, request: Request) -> a.TokenCount:
    """The prompt's tokens, as /v1/messages would template them: what its usage's input_tokens,
    cache_read_input_tokens and cache_creation_input_tokens add up to."""
    st = state_for(request, body.model)
    tools = tool_calling(body, st.engine.tokenizer)
    output(body, tools)  # refused here as there
    with protocol_names({"prompt": "messages"}):
        prompt = await until_disconnect(request, lambda: build_prompt(st, body, tools, None))
    return a.TokenCount(input_tokens=len(prompt))


# -- the request --------------------------------------------------------------------------------------------
def tool_calling(body: a.CountTokensRequest, tokenizer) -> ToolCalling | None:
    tools = [_function_tool(t) for t in body.tools or []]
    choice = body.tool_choice or a.ToolChoice(type="auto")
    mode = p.NamedFunction(name=choice.name) if choice.type == "tool" else CHOICES[choice.type]
    text_answer = body.output_config is None or body.output_config.format is None
    calling = ToolCalling.build(tools, mode, not choice.disable_parallel_tool_use, tokenizer, text_answer)
    if any(t.strict for t in body.tools or ()) and not (calling and calling.forced):
        # a call the model makes on its own is read from its text, not held to the schema
        raise APIError(
            400, 'strict tool inputs need a forced call (tool_choice "any" or "tool")', param="tools"
        )
    return calling


def _function_tool(tool: a.Tool) -> p.Tool:
    """An Anthropic tool as the function tool that chat templates and the call grammar take (constructed:
    Anthropic's names may be longer than OpenAI's)."""
    fn = p.FunctionDefinition.model_construct(
        name=tool.name, description=tool.description, parameters=tool.input_schema, strict=None
    )
    return p.Tool.model_construct(type="function", function=fn)


def output(body: a.CountTokensRequest, tools: ToolCalling | None) -> StructuredOutput | None:
    fmt = body.output_config and body.output_config.format
    return output_grammar(fmt is not None, fmt and fmt.schema_, tools, "output_config.format")


def sampling(
    body: a.MessagesRequest,
    structured: StructuredOutput | None,
    max_tokens: int | None,
) -> SamplingParams:
    """max_tokens None: up to the end of the context."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            structured_output=structured,
        )
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def build_prompt(
    st: ServerState, body: a.CountTokensRequest, tools: ToolCalling | None, max_tokens: int | None
) -> list[int]:
    return await st.prompts.chat(conversation(body), max_tokens, tools and tools.template_tools())


def conversation(body: a.CountTokensRequest) -> list[p.ChatMessage]:
    return conversation_of(body)[0]


def conversation_of(body: a.CountTokensRequest) -> tuple[list[p.ChatMessage], list[int]]:
    """The request as chat messages, and for each the index of the request message it ends with (-1: the
    system prompt). The system prompt comes first (less Claude Code's billing header); a user message's
    tool_result blocks become tool messages and its text blocks user messages, in their order; an
    assistant message's tool_use blocks become its tool calls. Consecutive messages of one role are one
    turn, as at Anthropic."""
    if body.messages[-1].role == "assistant":
        raise APIError(
            400,
            "a last assistant message (prefill) is not supported: end with a user message",
            param="messages",
        )
    turns, owners = [], []
    system = body.system_text()
    if system is not None:
        turns.append(p.ChatMessage(role="system", content=system))
        owners.append(-1)
    for i, m in enumerate(body.messages):
        new = _assistant_turn(m) if m.role == "assistant" else _user_turns(m)
        turns += new
        owners += [i] * len(new)
    return _merged(turns, owners)


def breakpoints(
    body: a.MessagesRequest, turns: list[p.ChatMessage], owners: list[int]
) -> list[tuple[int, float]]:
    """The request's cache_control breakpoints as (k, TTL): each pins the prompt up to the start of chat
    message k. A block of the system prompt pins the system prompt; a tool, the system prompt and the tools
    (chat templates render tools there, before the first message); a block of a message, through the end
    of the turn that holds it; the request's own cache_control, the whole conversation."""
    system = 1 if owners and owners[0] == -1 else 0
    marks = []
    for block in body.system if isinstance(body.system, list) and system else ():
        if block.cache_control is not None:
            marks.append((1, _ttl(block.cache_control)))
    for tool in body.tools or ():
        if tool.cache_control is not None:
            marks.append((system, _ttl(tool.cache_control)))
    for i, m in enumerate(body.messages):
        for b in m.blocks():
            if b.cache_control is not None:
                turn = next(t for t, owner in enumerate(owners) if owner >= i)  # merged into a later one
                marks.append((turn + 1, _ttl(b.cache_control)))
    if body.cache_control is not None:
        marks.append((len(turns), _ttl(body.cache_control)))
    if len(marks) > MAX_BREAKPOINTS:
        raise APIError(
            400,
            f"cache_control: at most {MAX_BREAKPOINTS} blocks may have cache_control, found {len(marks)}",
            param="cache_control",
        )
    return marks


async def pinned(
    st: ServerState, turns: list[p.ChatMessage], tools: list[dict] | None, prompt: list[int], marks: list
) -> tuple[tuple[int, float], ...]:
    """The breakpoints as the engine's pins: (prompt tokens before message k, TTL) each."""
    if not marks:
        return ()
    ends = await st.prompts.message_ends(turns, tools, prompt, [k for k, _ in marks])
    return tuple((tokens, ttl) for tokens, (_, ttl) in zip(ends, marks, strict=True) if tokens > 0)


def _ttl(control: a.CacheControl) -> float:
    return TTL_MAX_S if control.ttl == "1h" else TTL_DEFAULT_S


def _assistant_turn(m: a.Message) -> list[p.ChatMessage]:
    blocks = m.blocks()
    calls = [
        p.ToolCall(
            id=b.id, function=p.FunctionCall(name=b.name, arguments=json.dumps(b.input, ensure_ascii=False))
        )
        for b in blocks
        if b.type == "tool_use"
    ]
    text = a.join_text([b for b in blocks if b.type == "text"])
    return [p.ChatMessage(role="assistant", content=text, tool_calls=calls or None)]


def _user_turns(m: a.Message) -> list[p.ChatMessage]:
    turns, texts = [], []
    for b in [*m.blocks(), None]:  # None: the end, which closes the last run of text blocks
        if b is not None and b.type == "text":
            texts.append(b)
            continue
        if texts:
            turns.append(p.ChatMessage(role="user", content=a.join_text(texts)))
            texts = []
        if b is not None:
            result = b.text()
            if b.is_error:  # the template has no place for it: the result says so itself
                result = f"Error: {result}" if result else "Error"
            turns.append(p.ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=result))
    return turns


def _merged(turns: list[p.ChatMessage], owners: list[int]) -> tuple[list[p.ChatMessage], list[int]]:
    out: list[p.ChatMessage] = []
    out_owners: list[int] = []
    for t, owner in zip(turns, owners, strict=True):
        prev = out[-1] if out else None
        if prev is None or prev.role != t.role or t.role not in ("user", "assistant") or prev.tool_calls:
            out.append(t)
            out_owners.append(owner)
            continue
        text = "\n\n".join(x for x in (prev.text(), t.text()) if x)
        out[-1] = p.ChatMessage(role=t.role, content=text, tool_calls=t.tool_calls)
        out_owners[-1] = owner
    return out, out_owners


# -- the response -------------------------------------------------------------------------------------------
def _event(payload: dict) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def message_id(rid: str) -> str:
    return "msg_" + rid.partition("-")[2]


@dataclass
class Content:
    """One answer's content blocks as its text streams in: text blocks, and tool_use blocks split out of
    the text (server.tools.ToolCallStream); add() returns the stream events of each piece."""

    tools: ToolCalling | None
    window_bound: bool = False  # max_tokens is more than the context has room for
    blocks: list[a.TextContent | a.ToolUseContent] = field(default_factory=list)
    text_open: bool = False  # the last block is a text block still growing
    stop_reason: str | None = None
    stop_sequence: str | None = None

    def __post_init__(self) -> None:
        self.calls = ToolCallStream(self.tools) if self.tools is not None else None

    def add(self, d: Delta) -> list[dict]:
        final = d.finish_reason is not None
        text, calls = self.calls.feed(d.text, final) if self.calls is not None else (d.text, [])
        events = self._text(text) if text else []
        for call in calls:
            events += self._close_text() + self._tool_use(call)
        if final:
            events += self._close_text()
            self.stop_reason = _stop_reason(d, bool(self.calls and self.calls.calls), self.window_bound)
            self.stop_sequence = d.stop_string if self.stop_reason == "stop_sequence" else None
        return events

    def _text(self, text: str) -> list[dict]:
        events = []
        if not self.text_open:
            self.blocks.append(a.TextContent(text=""))
            self.text_open = True
            events.append(_block_start(len(self.blocks) - 1, {"type": "text", "text": ""}))
        self.blocks[-1].text += text
        events.append(_block_delta(len(self.blocks) - 1, {"type": "text_delta", "text": text}))
        return events

    def _close_text(self) -> list[dict]:
        if not self.text_open:
            return []
        self.text_open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _tool_use(self, call: dict) -> list[dict]:
        fn = call["function"]
        arguments = json.loads(fn["arguments"])
        if not isinstance(arguments, dict):  # a tool's input is an object: what is not stays the model's text
            text = f"{self.tools.start}{json.dumps({'name': fn['name'], 'arguments': arguments})}{self.tools.end}"
            return self._text(text) + self._close_text()
        block = a.ToolUseContent(
            id="toolu_" + call["id"].removeprefix("call_"), name=fn["name"], input=arguments
        )
        self.blocks.append(block)
        i = len(self.blocks) - 1
        return [
            _block_start(i, {"type": "tool_use", "id": block.id, "name": block.name, "input": {}}),
            _block_delta(i, {"type": "input_json_delta", "partial_json": fn["arguments"]}),
            {"type": "content_block_stop", "index": i},
        ]


def _block_start(index: int, block: dict) -> dict:
    return {"type": "content_block_start", "index": index, "content_block": block}


def _block_delta(index: int, delta: dict) -> dict:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _stop_reason(d: Delta, called: bool, window_bound: bool) -> str:
    if d.finish_reason == "length":
        return "model_context_window_exceeded" if window_bound else "max_tokens"
    if d.stop_string is not None:
        return "stop_sequence"
    return "tool_use" if called else "end_turn"


class MessagesFormat:
    """Anthropic's Message, or its stream of events."""

    id_prefix = "msg"
    logprobs = False
    keepalive_s = KEEPALIVE_S

    def __init__(self, tools: ToolCalling | None, window_bound: bool = False):
        self.tools = tools
        self.window_bound = window_bound
        self.content = self._content()  # the stream's

    def _content(self) -> Content:
        return Content(self.tools, self.window_bound)

    def usage(self, counts: TokenUsage) -> dict:
        return a.Usage(
            input_tokens=counts.prompt - counts.cached - counts.created,
            cache_creation_input_tokens=counts.created,
            cache_read_input_tokens=counts.cached,
            output_tokens=counts.completion,
        ).model_dump()

    def response(self, rid: str, model: str, per_choice: list[list[Delta]], usage: dict) -> a.MessageResponse:
        (deltas,) = per_choice
        content = self._content()
        content.add(replace(deltas[-1], text="".join(d.text for d in deltas)))
        return self._message(rid, model, content, usage)

    def _message(self, rid: str, model: str, content: Content, usage: dict) -> a.MessageResponse:
        return a.MessageResponse(
            id=message_id(rid),
            model=model,
            content=content.blocks,
            stop_reason=content.stop_reason,
            stop_sequence=content.stop_sequence,
            usage=usage,
        )

    # -- the stream ---------------------------------------------------------------------------------------
    def opening(self, rid: str, model: str, usage: dict) -> list[str]:
        message = self._message(rid, model, self._content(), usage).model_dump()
        return [_event({"type": "message_start", "message": message})]

    def chunks(self, rid: str, model: str, d: Delta) -> list[dict]:
        return self.content.add(d)

    def frame(self, chunk: dict) -> str:
        return _event(chunk)

    def closing(self, rid: str, model: str, usage: dict, include_usage: bool) -> list[str]:
        delta = {"stop_reason": self.content.stop_reason, "stop_sequence": self.content.stop_sequence}
        # usage counts here are totals (the SDKs overwrite message_start's with them)
        return [
            _event({"type": "message_delta", "delta": delta, "usage": usage}),
            _event({"type": "message_stop"}),
        ]

    def error_events(self, status: int, message: str, param: str | None = None) -> list[str]:
        return [_event(anthropic_error_body(status, message, param))]

    def ping(self) -> str:
        return _event({"type": "ping"})
