"""POST /v1/responses: OpenAI's Responses API, stateless (what Codex CLI speaks with wire_api = "responses").

`parse` turns the input items into the typed conversation (server.conversation): instructions and
developer messages, messages, function calls joined to the assistant turn they follow, their outputs as
tool turns, this server's reasoning items as that turn's thinking. Function tools and namespaces of them are
offered to the model (a namespaced function as `namespace.name`); built-in tools are not. ResponsesWriter
writes the response object, or its stream of typed events: a reasoning item (where the model thought), at
most one message, its text streamed as it is released, then the function calls (a call's arguments come
whole, once its end marker is read). Streamed and whole responses are built by the same OutputItems from
the same events, so they end with the same output.
"""

import time
import uuid
from dataclasses import dataclass, field

from fastapi import APIRouter, Request

from server.chat import sampling_of, thinking_of_effort
from server.conversation import (
    ChoiceMode,
    Conversation,
    OutputFormat,
    Role,
    Thinking,
    ToolCall,
    ToolChoice,
    ToolSpec,
    Turn,
    seal,
    unseal,
)
from server.core import OpenAIEvents, prepare_chat, serve, sse, state_for
from server.errors import error_body
from server.events import Answer, Event, Failed, Finished, StopReason, TextDelta, ThinkingDelta, ToolCallDone
from server.generation import Usage
from server.responses_protocol import (
    FunctionChoice,
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    OutputText,
    OutputTokensDetails,
    ReasoningPart,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponsesTool,
    ResponseUsage,
    SummaryText,
)

router = APIRouter()
HINTS = ("prompt_cache_key", "client_metadata", "safety_identifier", "user", "text.verbosity")


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    st = state_for(request, body.model)
    conv = parse(body)
    prepared = await prepare_chat(request, st, conv)
    return await serve(request, st, conv, prepared, ResponsesWriter(body))


def parse(body: ResponsesRequest) -> Conversation:
    forced = body.tool_choice not in (None, "auto", "none")
    text_format = body.text_format
    output = None
    if text_format is not None and text_format.type != "text":
        output = OutputFormat(text_format.schema_ if text_format.type == "json_schema" else None)
    reasoning = body.reasoning
    effort = reasoning and reasoning.effort
    return Conversation(
        turns=turns_of(body),
        tools=tuple(t for tool in body.function_tools for t in _specs(tool)),
        tool_choice=_choice(body),
        parallel_tool_calls=body.parallel_tool_calls,
        output=output,
        thinking=thinking_of_effort(effort) if effort else Thinking(),
        max_tokens=body.max_output_tokens,
        stops=tuple(body.stop),
        sampling=sampling_of(body),
        stream=body.stream,
        include_usage=True,
        cache_salt=body.cache_salt,
        names={
            "prompt": "input",
            "max_tokens": "max_output_tokens",
            "structured_output": "tool_choice" if forced else "text.format",
            "output": "text.format",
        },
        ignored=tuple(h for h in HINTS if _given(body, h)),
        thinking_fields=_thinking_fields(body),
    )


def _thinking_fields(body: ResponsesRequest) -> tuple[str, ...]:
    """The fields that act only where the model thinks: reasoning's, and asking for its sealed content."""
    reasoning = body.reasoning
    fields = [
        f"reasoning.{k}" for k in ("effort", "summary", "generate_summary") if getattr(reasoning, k, None)
    ]
    return (*fields, *(["include"] if body.include else []))


def _given(body: ResponsesRequest, path: str):
    head, _, rest = path.partition(".")
    value = getattr(body, head)
    return value if not rest or value is None else getattr(value, rest)


def _specs(tool: ResponsesTool) -> list[ToolSpec]:
    if tool.type == "namespace":
        return [ToolSpec(t.name, t.description, t.parameters, t.strict, tool.name) for t in tool.tools or ()]
    return [ToolSpec(tool.name, tool.description, tool.parameters, tool.strict)]


def _choice(body: ResponsesRequest) -> ToolChoice:
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        return ToolChoice(ChoiceMode.NAMED, choice.name)
    return ToolChoice(ChoiceMode(choice or "auto"))


def turns_of(body: ResponsesRequest) -> tuple[Turn, ...]:
    """The input as turns: the instructions first, as the system turn; function calls join the assistant
    turn they follow (a chat template renders a turn's text and calls together), their outputs are tool
    turns; a reasoning item this server sealed is the next assistant turn's thinking."""
    turns = [Turn(Role.SYSTEM, body.instructions, source=-1)] if body.instructions else []
    thinking = None  # from a reasoning item, for the assistant turn that follows it
    for i, item in enumerate(body.input):
        if item.type == "reasoning":
            thinking = unseal(item.encrypted_content) or thinking
        elif item.type == "message":
            if item.role == "assistant" and thinking:
                turns.append(Turn(Role.ASSISTANT, item.text(), thinking=thinking, source=i))
                thinking = None
            else:
                turns.append(Turn(Role(item.role), item.text(), source=i))
        elif item.type == "function_call":
            call = ToolCall(item.call_id, item.name, item.arguments, item.namespace)
            last = turns[-1] if turns else None
            if last is not None and last.role == Role.ASSISTANT and thinking is None:
                turns[-1] = Turn(Role.ASSISTANT, last.text, last.thinking, (*last.tool_calls, call), source=i)
            else:
                turns.append(Turn(Role.ASSISTANT, "", thinking, (call,), source=i))
                thinking = None
        elif item.type == "function_call_output":
            turns.append(Turn(Role.TOOL, item.text(), tool_call_id=item.call_id, source=i))
    return tuple(turns)


# -- the output ---------------------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class OutputItems:
    """One response's output, built event by event; each step returns the events that stream it."""

    summarize: bool = False  # reasoning as summary parts too (reasoning.summary)
    sealed: bool = False  # reasoning items carry their thinking sealed (include reasoning.encrypted_content)
    reasoning: OutputReasoning | None = None
    message: OutputMessage | None = None
    calls: list[OutputFunctionCall] = field(default_factory=list)
    pending_calls: list[ToolCall] = field(default_factory=list)
    reason: StopReason | None = None

    @property
    def items(self) -> list:
        return [x for x in (self.reasoning, self.message) if x is not None] + self.calls

    @property
    def incomplete(self) -> bool:
        return self.reason in (StopReason.LENGTH, StopReason.CONTEXT)

    def add(self, event: Event) -> list[dict]:
        if isinstance(event, ThinkingDelta):
            return self._think(event.text)
        if isinstance(event, TextDelta) and event.text:
            return self._close_reasoning() + self._text(event.text)
        if isinstance(event, ToolCallDone):  # calls are written once the message is done
            self.pending_calls.append(event.call)
        elif isinstance(event, Finished):
            self.reason = event.reason
        return []

    def _think(self, text: str) -> list[dict]:
        events = []
        if self.reasoning is None:
            self.reasoning = OutputReasoning(
                id=_id("rs"), content=[ReasoningPart(text="")], status="in_progress"
            )
            events.append(self._added(self.reasoning.model_copy(update={"content": []})))
        self.reasoning.content[0].text += text
        where = {"item_id": self.reasoning.id, "output_index": 0, "content_index": 0}
        return [*events, {"type": "response.reasoning_text.delta", **where, "delta": text}]

    def _close_reasoning(self) -> list[dict]:
        r = self.reasoning
        if r is None or r.status != "in_progress":
            return []
        r.status = "completed"
        text = r.content[0].text
        if self.sealed:
            r.encrypted_content = seal(text)
        where = {"item_id": r.id, "output_index": 0}
        events = [{"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text}]
        if self.summarize:
            r.summary = [SummaryText(text=text)]
            part = {**where, "summary_index": 0}
            events += [
                {
                    "type": "response.reasoning_summary_part.added",
                    **part,
                    "part": {"type": "summary_text", "text": ""},
                },
                {"type": "response.reasoning_summary_text.delta", **part, "delta": text},
                {"type": "response.reasoning_summary_text.done", **part, "text": text},
                {"type": "response.reasoning_summary_part.done", **part, "part": r.summary[0].model_dump()},
            ]
        return [*events, {"type": "response.output_item.done", "output_index": 0, "item": r.model_dump()}]

    def _text(self, text: str) -> list[dict]:
        events = [] if self.message else self._open_message()
        self.message.content[0].text += text
        where = {"item_id": self.message.id, "output_index": self._index(self.message), "content_index": 0}
        return [*events, {"type": "response.output_text.delta", **where, "delta": text, "logprobs": []}]

    def _index(self, item) -> int:
        return self.items.index(item)

    def _added(self, item) -> dict:
        return {
            "type": "response.output_item.added",
            "output_index": len(self.items) - 1,
            "item": item.model_dump(),
        }

    def finish(self) -> list[dict]:
        """The closing events: the reasoning's, the message's, then each call's. No text and no call is an
        empty message."""
        events = self._close_reasoning()
        if self.message is None and not self.pending_calls:
            events += self._open_message()
        if self.message is not None:
            self.message.status = "incomplete" if self.incomplete else "completed"
            part = self.message.content[0]
            index = self._index(self.message)
            where = {"item_id": self.message.id, "output_index": index, "content_index": 0}
            events += [
                {"type": "response.output_text.done", **where, "text": part.text, "logprobs": []},
                {"type": "response.content_part.done", **where, "part": part.model_dump()},
                {
                    "type": "response.output_item.done",
                    "output_index": index,
                    "item": self.message.model_dump(),
                },
            ]
        for call in self.pending_calls:
            item = OutputFunctionCall(
                id=_id("fc"),
                call_id=call.id,
                name=call.name,
                arguments=call.arguments,
                status="completed",
                namespace=call.namespace,
            )
            self.calls.append(item)
            index, where = len(self.items) - 1, {"item_id": item.id, "output_index": len(self.items) - 1}
            added = item.model_copy(update={"arguments": "", "status": "in_progress"})
            events += [
                {"type": "response.output_item.added", "output_index": index, "item": _dump(added)},
                {"type": "response.function_call_arguments.delta", **where, "delta": item.arguments},
                {"type": "response.function_call_arguments.done", **where, "arguments": item.arguments},
                {"type": "response.output_item.done", "output_index": index, "item": _dump(item)},
            ]
        self.pending_calls = []
        return events

    def _open_message(self) -> list[dict]:
        self.message = OutputMessage(id=_id("msg"), status="in_progress", content=[OutputText(text="")])
        added = self.message.model_copy(update={"content": []})
        where = {"item_id": self.message.id, "output_index": self._index(self.message), "content_index": 0}
        return [
            self._added(added),
            {"type": "response.content_part.added", **where, "part": OutputText(text="").model_dump()},
        ]


def _dump(item: OutputFunctionCall) -> dict:
    return item.model_dump(exclude_none=True)


class ResponsesWriter(OpenAIEvents):
    """Writes the response object, or the stream of its events, each numbered (sequence_number)."""

    id_prefix = "resp"

    def __init__(self, body: ResponsesRequest):
        super().__init__(True)
        self.body = body
        self.created_at = int(time.time())
        self.sequence_number = 0
        self.out = self._output()  # the stream's
        self.opened = False

    def _output(self) -> OutputItems:
        reasoning = self.body.reasoning
        summarize = reasoning is not None and (reasoning.summary or reasoning.generate_summary) is not None
        sealed = "reasoning.encrypted_content" in (self.body.include or ())
        return OutputItems(summarize, sealed)

    def response(self, rid: str, model: str, answers: list[Answer], usage: Usage) -> dict:
        (answer,) = answers
        out = self._output()
        for event in answer.events:
            out.add(event)
        out.finish()
        return self._response(rid, model, out, usage).model_dump()

    def opening(self, rid: str, model: str, usage: Usage) -> list[str]:
        self.opened = True
        response = self._response(rid, model).model_dump()
        return [
            self._sse({"type": kind, "response": response})
            for kind in ("response.created", "response.in_progress")
        ]

    def event(self, rid: str, model: str, event: Event) -> list[str]:
        return [self._sse(e) for e in self.out.add(event)]

    def closing(self, rid: str, model: str, usage: Usage) -> list[str]:
        events = [self._sse(e) for e in self.out.finish()]
        final = self._response(rid, model, self.out, usage)
        kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
        return [*events, self._sse({"type": kind, "response": final.model_dump()})]

    def failure(self, rid: str, model: str, failed: Failed, usage: Usage) -> list[str]:
        """A refusal before the stream's output (after its first ping), an abort (the server shutting down)
        or a grammar past the engine's limits (the request's fault) is an `error` event; an engine fault
        fails the response."""
        error = error_body(failed.status, failed.message, param=failed.param)["error"]
        if not self.opened or failed.param:
            code = error["type"]
        elif failed.status == 503:
            code = "server_unavailable"
        else:
            response = self._response(rid, model, self.out, usage, error=failed.message)
            return [self._sse({"type": "response.failed", "response": response.model_dump()})]
        return [
            self._sse({"type": "error", "code": code, "message": error["message"], "param": error["param"]})
        ]

    def _sse(self, event: dict) -> str:
        event["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        return sse(event, event["type"])

    def _response(
        self,
        rid: str,
        model: str,
        out: OutputItems | None = None,
        usage: Usage | None = None,
        error: str | None = None,
    ) -> ResponseObject:
        """The response so far: in progress (no output yet), failed, or done."""
        if out is None:
            status = "in_progress"
        elif error is not None:
            status = "failed"
        else:
            status = "incomplete" if out.incomplete else "completed"
        body, text_format = self.body, self.body.text_format
        reasoning = body.reasoning
        return ResponseObject(
            id=f"resp_{rid.removeprefix(self.id_prefix + '-')}",
            created_at=self.created_at,
            status=status,
            completed_at=int(time.time()) if status == "completed" else None,
            error=ResponseError(message=error) if error is not None else None,
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            model=model,
            output=out.items if out else [],
            usage=_usage(usage) if usage else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            max_tool_calls=body.max_tool_calls,
            parallel_tool_calls=body.parallel_tool_calls,
            reasoning={
                "effort": reasoning.effort if reasoning else None,
                "summary": reasoning.summary if reasoning else None,
            },
            temperature=body.temperature,
            top_p=body.top_p,
            text={
                "format": text_format.echo() if text_format else {"type": "text"},
                "verbosity": body.text.verbosity if body.text else None,
            },
            tool_choice=_tool_choice(body),
            tools=[t.echo() for t in body.function_tools],
            user=body.user,
            safety_identifier=body.safety_identifier,
            prompt_cache_key=body.prompt_cache_key,
            metadata=body.metadata or {},
        )


def _usage(usage: Usage) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=usage.prompt,
        input_tokens_details=InputTokensDetails(cached_tokens=usage.cached),
        output_tokens=usage.completion,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=usage.reasoning),
        total_tokens=usage.prompt + usage.completion,
    )


def _tool_choice(body: ResponsesRequest) -> str | dict:
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "name": choice.name}
    return choice or "auto"
