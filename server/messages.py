"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, for the anthropic SDKs and
Claude Code.

The request becomes a chat conversation (server.protocol's messages: system, user, assistant with tool
calls, tool results) templated like any chat (server.prompts); tools and tool_choice become the same call
grammar as chat's (server.tools, server.structured); the serving core generates. MessagesFormat writes the
Message, or its stream of events (message_start, content blocks, message_delta, message_stop), with pings
while the prompt is prefilled.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from fastapi import APIRouter, Request

from minivllm.cache.hints import TTL_DEFAULT_S, TTL_MAX_S
from server import anthropic_protocol as a
from server.conversation import (
    EFFORT_BUDGETS,
    ChoiceMode,
    Conversation,
    OutputFormat,
    Role,
    Sampling,
    Thinking,
    ThinkingMode,
    ToolCall,
    ToolChoice,
    ToolSpec,
    Turn,
    seal,
    unseal,
)
from server.core import KEEPALIVE_S, prepare_chat, serve, sse, state_for
from server.errors import APIError, anthropic_error_body
from server.events import Answer, Event, Failed, Finished, StopReason, TextDelta, ThinkingDelta, ToolCallDone
from server.generation import Usage

router = APIRouter()
MAX_BREAKPOINTS = 4  # blocks with cache_control in one request, as at Anthropic
CHOICES = {"any": ChoiceMode.REQUIRED, "auto": ChoiceMode.AUTO, "none": ChoiceMode.NONE}
HINT_HEADERS = (
    "anthropic-beta",
)  # request headers that ask for what the server does by itself or not at all


@router.post("/v1/messages")
async def messages(body: a.MessagesRequest, request: Request):
    st = state_for(request, body.model)
    conv = parse(body, request.headers)
    prepared = await prepare_chat(request, st, conv)
    return await serve(request, st, conv, prepared, MessagesWriter(conv))


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: a.CountTokensRequest, request: Request) -> a.TokenCount:
    """The prompt's tokens, as /v1/messages would template them: what its usage's input_tokens,
    cache_read_input_tokens and cache_creation_input_tokens add up to."""
    st = state_for(request, body.model)
    prepared = await prepare_chat(request, st, parse(body, request.headers))
    return a.TokenCount(input_tokens=len(prepared.prompts[0]))


# -- the request --------------------------------------------------------------------------------------------
def parse(body: a.CountTokensRequest, headers: Mapping[str, str] = {}) -> Conversation:
    """The request as the typed conversation. The system prompt comes first (less Claude Code's billing
    header); a system message inside messages[] stays where it is; a user message's tool_result blocks
    become tool turns and its text blocks user turns, in their order; an assistant message's thinking is
    its turn's thinking, its tool_use blocks its calls. Consecutive messages of one role are one turn, as at
    Anthropic. Deferred tools (defer_loading) join the tools once a tool_reference names them."""
    if body.messages[-1].role == "assistant":
        raise APIError(
            400,
            "a last assistant message (prefill) is not supported: end with a user message",
            param="messages",
        )
    loaded = {
        r.tool_name
        for m in body.messages
        for b in m.blocks()
        if b.type == "tool_result"
        for r in b.blocks()
        if r.type == "tool_reference"
    }
    tools = {t.name: t for t in body.tools or ()}  # by name, for tool_reference blocks
    turns = _turns(body, tools, _thinking_kept(body))
    choice = body.tool_choice or a.ToolChoice(type="auto")
    mode = ChoiceMode.NAMED if choice.type == "tool" else CHOICES[choice.type]
    forced = mode in (ChoiceMode.REQUIRED, ChoiceMode.NAMED)
    if any(t.strict for t in body.tools or ()) and not forced:
        # a call the model makes on its own is read from its text, not held to the schema
        raise APIError(
            400, 'strict tool inputs need a forced call (tool_choice "any" or "tool")', param="tools"
        )
    fmt = body.output_config and body.output_config.format
    max_tokens = getattr(body, "max_tokens", None)
    thinking, thinking_fields = _thinking(body)
    marks = breakpoints(body, turns)  # checked on count_tokens too: what /v1/messages refuses, it refuses
    return Conversation(
        turns=turns,
        tools=tuple(_tool(t) for t in body.tools or () if not t.defer_loading or t.name in loaded),
        tool_choice=ToolChoice(mode, choice.name),
        parallel_tool_calls=not choice.disable_parallel_tool_use,
        output=OutputFormat(fmt.schema_) if fmt else None,
        thinking=thinking,
        max_tokens=max_tokens,
        stops=tuple(getattr(body, "stop_sequences", None) or ()),
        sampling=Sampling(
            temperature=getattr(body, "temperature", 1.0),
            top_p=getattr(body, "top_p", 1.0),
            top_k=getattr(body, "top_k", 0),
        ),
        stream=getattr(body, "stream", False),
        pins=marks if max_tokens is not None else (),
        names={
            "prompt": "messages",
            "max_tokens": "max_tokens",
            "structured_output": "tool_choice" if forced else "output_config.format",
            "output": "output_config.format",
        },
        ignored=_hints(body, headers),
        thinking_fields=thinking_fields,
    )


def _hints(body: a.CountTokensRequest, headers: Mapping[str, str]) -> tuple[str, ...]:
    """The fields accepted without effect on any model: telemetry, and what the server does by itself."""
    hints = [h for h in HINT_HEADERS if h in headers]
    metadata = getattr(body, "metadata", None)
    if metadata is not None and metadata.user_id is not None:
        hints.append("metadata.user_id")
    if any(t.eager_input_streaming is not None for t in body.tools or ()):
        hints.append("tools.eager_input_streaming")
    return tuple(hints)


def _thinking(body: a.CountTokensRequest) -> tuple[Thinking, tuple[str, ...]]:
    """Thinking as asked (on a model that thinks), and the fields that only act on such a model."""
    fields = ["context_management"] if body.context_management else []
    effort = body.output_config and body.output_config.effort
    budget = EFFORT_BUDGETS.get(effort) if effort else None
    if effort:
        fields.append("output_config.effort")
    if body.thinking is None:
        return Thinking(ThinkingMode.ADAPTIVE, budget), tuple(fields)
    fields.append("thinking")
    kind, show = body.thinking.type, body.thinking.display != "omitted"
    if kind == "disabled":
        return Thinking(ThinkingMode.OFF), tuple(fields)
    if kind == "enabled":
        budget = min(body.thinking.budget_tokens, budget or body.thinking.budget_tokens)
        return Thinking(ThinkingMode.ON, budget, show), tuple(fields)
    return Thinking(ThinkingMode.ADAPTIVE, budget, show), tuple(fields)


def _thinking_kept(body: a.CountTokensRequest) -> int | None:
    """How many of the last assistant turns with thinking keep it (context management's clear_thinking);
    None: all."""
    edits = body.context_management.edits if body.context_management else []
    if not edits:
        return None
    keep = edits[-1].keep
    return None if keep == "all" else 1 if keep is None else keep.value


def _tool(tool: a.Tool) -> ToolSpec:
    return ToolSpec(
        tool.name, tool.description, tool.input_schema, tool.strict, listed=not tool.defer_loading
    )


def _turns(body: a.CountTokensRequest, tools: dict[str, a.Tool], keep: int | None) -> tuple[Turn, ...]:
    turns: list[Turn] = []
    system = body.system_text()
    if system is not None:
        turns.append(Turn(Role.SYSTEM, system, source=-1))
    for i, m in enumerate(body.messages):
        if m.role == "assistant":
            turns.append(_assistant_turn(m, i))
        elif m.role == "system":
            turns.append(Turn(Role.SYSTEM, a.join_text(m.blocks()), source=i))
        else:
            turns += _user_turns(m, i, tools)
    return tuple(_merged(_clear_thinking(turns, keep)))


def _clear_thinking(turns: list[Turn], keep: int | None) -> list[Turn]:
    if keep is None:
        return turns
    thinking = [k for k, t in enumerate(turns) if t.thinking]
    cleared = set(thinking[: max(0, len(thinking) - keep)])
    return [replace(t, thinking=None) if k in cleared else t for k, t in enumerate(turns)]


def _assistant_turn(m: a.Message, index: int) -> Turn:
    blocks = m.blocks()
    calls = tuple(
        ToolCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False))
        for b in blocks
        if b.type == "tool_use"
    )
    thinking = "".join(unseal(b.signature) or b.thinking for b in blocks if b.type == "thinking")
    text = a.join_text([b for b in blocks if b.type == "text"])
    return Turn(Role.ASSISTANT, text, thinking=thinking or None, tool_calls=calls, source=index)


def _user_turns(m: a.Message, index: int, tools: dict[str, a.Tool]) -> list[Turn]:
    turns, texts = [], []
    for b in [*m.blocks(), None]:  # None: the end, which closes the last run of text blocks
        if b is not None and b.type == "text":
            texts.append(b)
            continue
        if texts:
            turns.append(Turn(Role.USER, a.join_text(texts), source=index))
            texts = []
        if b is not None:
            result = _result_text(b, tools)
            if b.is_error:  # the template has no place for it: the result says so itself
                result = f"Error: {result}" if result else "Error"
            turns.append(Turn(Role.TOOL, result, tool_call_id=b.tool_use_id, source=index))
    return turns


def _result_text(b: a.ToolResultBlock, tools: dict[str, a.Tool]) -> str:
    """A tool result's text; a tool_reference (tool search found a deferred tool) is the tool's definition,
    here rather than in the tool list, so that the prompt before it stays as it was (and cached)."""
    parts = []
    for part in b.blocks():
        if part.type == "text":
            parts.append(part.text)
        elif (tool := tools.get(part.tool_name)) is not None:
            parts.append("Tool loaded: " + json.dumps(_tool(tool).template_dict(), ensure_ascii=False))
        else:
            parts.append(f"Tool loaded: {part.tool_name}")
    return "\n\n".join(parts)


def _merged(turns: list[Turn]) -> list[Turn]:
    out: list[Turn] = []
    for t in turns:
        prev = out[-1] if out else None
        if (
            prev is None
            or prev.role != t.role
            or t.role not in (Role.USER, Role.ASSISTANT)
            or prev.tool_calls
        ):
            out.append(t)
            continue
        text = "\n\n".join(x for x in (prev.text, t.text) if x)
        thinking = "".join(x for x in (prev.thinking, t.thinking) if x) or None
        out[-1] = replace(t, text=text, thinking=thinking)
    return out


def breakpoints(body: a.CountTokensRequest, turns: tuple[Turn, ...]) -> tuple[tuple[int, float], ...]:
    """The request's cache_control breakpoints as (k, TTL): each pins the prompt up to the start of turn k.
    A block of the system prompt pins the system prompt; a tool, the system prompt and the tools (chat
    templates render tools there, before the first message); a block of a message, through the end of the
    turn that holds it; the request's own cache_control, the whole conversation."""
    system = 1 if turns and turns[0].source == -1 else 0
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
                turn = next(t for t, turn in enumerate(turns) if turn.source >= i)  # merged into a later one
                marks.append((turn + 1, _ttl(b.cache_control)))
    if body.cache_control is not None:
        marks.append((len(turns), _ttl(body.cache_control)))
    if len(marks) > MAX_BREAKPOINTS:
        raise APIError(
            400,
            f"cache_control: at most {MAX_BREAKPOINTS} blocks may have cache_control, found {len(marks)}",
            param="cache_control",
        )
    return tuple(marks)


def _ttl(control: a.CacheControl) -> float:
    return TTL_MAX_S if control.ttl == "1h" else TTL_DEFAULT_S


# -- the response -------------------------------------------------------------------------------------------
STOP_REASONS = {
    StopReason.END: "end_turn",
    StopReason.STOP_STRING: "stop_sequence",
    StopReason.TOOL_CALLS: "tool_use",
    StopReason.LENGTH: "max_tokens",
    StopReason.CONTEXT: "model_context_window_exceeded",  # as at Anthropic (its newer models)
}


def _event(payload: dict) -> str:
    return sse(payload, payload["type"])


def message_id(rid: str) -> str:
    return "msg_" + rid.partition("-")[2]


@dataclass
class Content:
    """One answer's content blocks as its events come: thinking, text and tool_use blocks; add() returns
    the stream events of each. show_thinking False (display "omitted"): thinking blocks carry only their
    signature."""

    show_thinking: bool = True
    blocks: list[dict] = field(default_factory=list)
    open_kind: str | None = None  # the kind of the last block, while it still grows
    stop_reason: str | None = None
    stop_sequence: str | None = None
    thinking: str = ""

    def add(self, event: Event) -> list[dict]:
        if isinstance(event, ThinkingDelta):
            self.thinking += event.text
            shown = event.text if self.show_thinking else ""
            return self._grow("thinking", {"type": "thinking", "thinking": "", "signature": ""}, shown)
        if isinstance(event, TextDelta):
            return self._grow("text", {"type": "text", "text": ""}, event.text) if event.text else []
        if isinstance(event, ToolCallDone):
            return self._close() + self._tool_use(event.call)
        if isinstance(event, Finished):
            self.stop_reason = STOP_REASONS[event.reason]
            self.stop_sequence = event.stop_string if event.reason == StopReason.STOP_STRING else None
            return self._close()
        return []

    def _grow(self, kind: str, empty: dict, text: str) -> list[dict]:
        events = []
        if self.open_kind != kind:
            events += self._close()
            self.blocks.append(dict(empty))
            self.open_kind = kind
            events.append(_block_start(len(self.blocks) - 1, empty))
        i = len(self.blocks) - 1
        if text:
            self.blocks[i][kind] += text
            events.append(_block_delta(i, {"type": f"{kind}_delta", kind: text}))
        return events

    def _close(self) -> list[dict]:
        if self.open_kind is None:
            return []
        i, events = len(self.blocks) - 1, []
        if self.open_kind == "thinking":
            signature = seal(self.thinking)
            self.blocks[i]["signature"] = signature
            events.append(_block_delta(i, {"type": "signature_delta", "signature": signature}))
            self.thinking = ""
        self.open_kind = None
        return [*events, {"type": "content_block_stop", "index": i}]

    def _tool_use(self, call: ToolCall) -> list[dict]:
        arguments = json.loads(call.arguments)
        if not isinstance(arguments, dict):  # a tool's input is an object: what is not stays the model's text
            text = json.dumps({"name": call.name, "arguments": arguments})
            return self._grow("text", {"type": "text", "text": ""}, text) + self._close()
        block = {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name}
        self.blocks.append({**block, "input": arguments})
        i = len(self.blocks) - 1
        return [
            _block_start(i, {**block, "input": {}}),
            _block_delta(i, {"type": "input_json_delta", "partial_json": call.arguments}),
            {"type": "content_block_stop", "index": i},
        ]


def _block_start(index: int, block: dict) -> dict:
    return {"type": "content_block_start", "index": index, "content_block": block}


def _block_delta(index: int, delta: dict) -> dict:
    return {"type": "content_block_delta", "index": index, "delta": delta}


class MessagesWriter:
    """Anthropic's Message, or its stream of events (message_start, content blocks, message_delta,
    message_stop), with ping events while the prompt is prefilled."""

    id_prefix = "msg"
    keepalive_s = KEEPALIVE_S

    def __init__(self, conv: Conversation):
        self.show_thinking = conv.thinking.show
        self.content = Content(self.show_thinking)  # the stream's

    def usage(self, counts: Usage) -> dict:
        return a.Usage(
            input_tokens=counts.prompt - counts.cached - counts.created,
            cache_creation_input_tokens=counts.created,
            cache_read_input_tokens=counts.cached,
            output_tokens=counts.completion,
        ).model_dump()

    def response(self, rid: str, model: str, answers: list[Answer], usage: Usage) -> dict:
        (answer,) = answers
        content = Content(self.show_thinking)
        for event in answer.events:
            content.add(event)
        return self._message(rid, model, content, usage)

    def _message(self, rid: str, model: str, content: Content, usage: Usage) -> dict:
        return {
            "id": message_id(rid),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content.blocks,
            "stop_reason": content.stop_reason,
            "stop_sequence": content.stop_sequence,
            "usage": self.usage(usage),
        }

    # -- the stream ---------------------------------------------------------------------------------------
    def opening(self, rid: str, model: str, usage: Usage) -> list[str]:
        message = self._message(rid, model, Content(), usage)
        return [_event({"type": "message_start", "message": message})]

    def event(self, rid: str, model: str, event: Event) -> list[str]:
        return [_event(e) for e in self.content.add(event)]

    def closing(self, rid: str, model: str, usage: Usage) -> list[str]:
        delta = {"stop_reason": self.content.stop_reason, "stop_sequence": self.content.stop_sequence}
        # usage counts here are totals (the SDKs overwrite message_start's with them)
        return [
            _event({"type": "message_delta", "delta": delta, "usage": self.usage(usage)}),
            _event({"type": "message_stop"}),
        ]

    def failure(self, rid: str, model: str, failed: Failed, usage: Usage) -> list[str]:
        return [_event(anthropic_error_body(failed.status, failed.message, failed.param))]

    def ping(self) -> str:
        return _event({"type": "ping"})
