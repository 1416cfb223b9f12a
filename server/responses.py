"""POST /v1/responses: OpenAI's Responses API, stateless (what Codex CLI speaks with wire_api = "responses").

The input items become chat messages for the model's template (server.prompts); function tools and
`text.format` become the grammar the output must match, as on chat (server.tools, server.structured); the
serving core generates; ResponsesFormat writes the response object, or its stream of typed events.

The output is at most one message, its text streamed as it is released, then the function calls, added
when the generation ends (a call's arguments come whole, once its end marker is read). Streamed and whole
responses are built by the same OutputItems from the same deltas, so they end with the same output.
"""

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import APIRouter, Request

from server import protocol as p
from server.core import OpenAIEvents, generate, protocol_names, state_for, until_disconnect
from server.errors import APIError, error_body
from server.generation import Delta, Generation
from server.responses_protocol import (
    FunctionChoice,
    IncompleteDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from server.structured import format_grammar
from server.tools import ToolCalling, ToolCallStream

router = APIRouter()


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request):
    st = state_for(request, body.model)
    calling = tool_calling(body, st.engine.tokenizer)
    text_format = body.text_format
    structured = format_grammar(text_format and text_format.response_format(), calling, "text.format")
    names = {
        "prompt": "input",
        "max_tokens": "max_output_tokens",
        "structured_output": "tool_choice" if calling and calling.forced else "text.format",
    }
    with protocol_names(names):
        messages = chat_messages(body)
        tools = calling and calling.template_tools()
        try:
            prompt = await until_disconnect(
                request, lambda: st.prompts.chat(messages, body.max_output_tokens, tools)
            )
        except APIError as e:  # the prompt builder speaks chat's names
            e.param = "input" if e.param == "messages" else e.param
            raise
        fmt = ResponsesFormat(body, calling)

        def locate(token: int):
            return st.prompts.message_at(messages, tools, prompt, token)

        max_tokens = body.max_output_tokens
        return await generate(request, st, fmt, body, [prompt], max_tokens, None, structured, locate, names)


def tool_calling(body: ResponsesRequest, tokenizer) -> ToolCalling | None:
    """The request's function tools and what it asks of them; None when it uses none. Built-in tools are
    not among them (server.responses_protocol.BUILT_IN_TOOLS)."""
    functions = body.function_tools
    names = [t.name for t in functions]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        if choice.name not in names:
            raise APIError(400, f"tool_choice: no function tool named {choice.name!r}", param="tool_choice")
        choice = choice.name
    elif choice == "required" and not functions:
        raise APIError(400, "tool_choice: required needs function tools", param="tool_choice")
    if not functions or choice == "none":
        return None
    plain = body.text_format is None or body.text_format.type == "text"
    return ToolCalling.of_functions(
        [t.chat_tool() for t in functions],
        choice or "auto",
        body.parallel_tool_calls,
        bare_calls=choice in (None, "auto") and plain,
        tokenizer=tokenizer,
    )


def chat_messages(body: ResponsesRequest) -> list[p.ChatMessage]:
    """The input as chat messages: the instructions first, as the system message; function calls join the
    assistant message they follow (a chat template renders a turn's text and calls together), their
    outputs are tool messages; reasoning items are left out (this model does not reason)."""
    messages = [p.ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    for item in body.input:
        if item.type == "message":
            messages.append(p.ChatMessage(role=item.role, content=item.text()))
        elif item.type == "function_call":
            call = p.ToolCall(
                id=item.call_id, function=p.FunctionCall(name=item.name, arguments=item.arguments)
            )
            if messages and messages[-1].role == "assistant":
                messages[-1].tool_calls = [*(messages[-1].tool_calls or ()), call]
            else:
                messages.append(p.ChatMessage(role="assistant", tool_calls=[call]))
        elif item.type == "function_call_output":
            messages.append(p.ChatMessage(role="tool", tool_call_id=item.call_id, content=item.text()))
    return messages


# -- the output ---------------------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class OutputItems:
    """One response's output, built delta by delta; each step returns the events that stream it."""

    calling: ToolCalling | None
    message: OutputMessage | None = None
    calls: list[OutputFunctionCall] = field(default_factory=list)
    finish_reason: str | None = None
    tool_stream: ToolCallStream | None = None

    def __post_init__(self):
        if self.calling is not None:
            self.tool_stream = ToolCallStream(self.calling)

    @property
    def items(self) -> list[OutputMessage | OutputFunctionCall]:
        return ([self.message] if self.message else []) + self.calls

    @property
    def incomplete(self) -> bool:
        return self.finish_reason == "length"

    def add(self, d: Delta) -> list[dict]:
        final = d.finish_reason is not None
        text = d.text
        if self.tool_stream is not None:  # calls are held in the stream until finish
            text, _ = self.tool_stream.feed(d.text, final=final)
        if final:
            self.finish_reason = d.finish_reason
        if not text:
            return []
        events = [] if self.message else self._open_message()
        self.message.content[0].text += text
        where = {"item_id": self.message.id, "output_index": 0, "content_index": 0}
        return [*events, {"type": "response.output_text.delta", **where, "delta": text, "logprobs": []}]

    def finish(self) -> list[dict]:
        """The closing events: the message's, then each call's. No text and no call is an empty message."""
        calls = self.tool_stream.calls if self.tool_stream else []
        events = self._open_message() if self.message is None and not calls else []
        if self.message is not None:
            self.message.status = "incomplete" if self.incomplete else "completed"
            part = self.message.content[0]
            where = {"item_id": self.message.id, "output_index": 0, "content_index": 0}
            events += [
                {"type": "response.output_text.done", **where, "text": part.text, "logprobs": []},
                {"type": "response.content_part.done", **where, "part": part.model_dump()},
                {"type": "response.output_item.done", "output_index": 0, "item": self.message.model_dump()},
            ]
        for call in calls:
            fn = call["function"]
            item = OutputFunctionCall(
                id=_id("fc"),
                call_id=call["id"],
                name=fn["name"],
                arguments=fn["arguments"],
                status="completed",
            )
            index, where = len(self.items), {"item_id": item.id, "output_index": len(self.items)}
            self.calls.append(item)
            added = item.model_copy(update={"arguments": "", "status": "in_progress"})
            events += [
                {"type": "response.output_item.added", "output_index": index, "item": added.model_dump()},
                {"type": "response.function_call_arguments.delta", **where, "delta": item.arguments},
                {"type": "response.function_call_arguments.done", **where, "arguments": item.arguments},
                {"type": "response.output_item.done", "output_index": index, "item": item.model_dump()},
            ]
        return events

    def _open_message(self) -> list[dict]:
        self.message = OutputMessage(id=_id("msg"), status="in_progress", content=[OutputText(text="")])
        added = self.message.model_copy(update={"content": []})
        where = {"item_id": self.message.id, "output_index": 0, "content_index": 0}
        return [
            {"type": "response.output_item.added", "output_index": 0, "item": added.model_dump()},
            {"type": "response.content_part.added", **where, "part": OutputText(text="").model_dump()},
        ]


class ResponsesFormat(OpenAIEvents):
    """Writes the response object, or the stream of its events, each numbered (sequence_number)."""

    id_prefix = "resp"
    logprobs = False

    def __init__(self, body: ResponsesRequest, calling: ToolCalling | None):
        self.body = body
        self.calling = calling
        self.created_at = int(time.time())
        self.sequence_number = 0

    def response(self, rid: str, model: str, per_choice: list[list[Delta]], usage: dict) -> ResponseObject:
        (deltas,) = per_choice
        out = OutputItems(self.calling)
        for d in deltas:
            out.add(d)
        out.finish()
        return self._response(rid, model, out, usage)

    async def events(self, gen: Generation, rid: str, model: str) -> AsyncIterator[str]:
        """The SSE body; if the client goes away, the generation is closed and this ends."""
        out = OutputItems(self.calling)
        try:
            for kind in ("response.created", "response.in_progress"):
                yield self._sse({"type": kind, "response": self._response(rid, model).model_dump()})
            async for d in gen.deltas():
                if d.error:
                    yield self._sse(self._failure(rid, model, out, gen, d))
                    return
                for event in out.add(d):
                    yield self._sse(event)
            if gen.closed:
                return  # the client is gone
            for event in out.finish():
                yield self._sse(event)
            final = self._response(rid, model, out, gen.usage())
            kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
            yield self._sse({"type": kind, "response": final.model_dump()})
        finally:
            gen.close()

    def error_events(self, status: int, message: str, param: str | None = None) -> list[str]:
        """A refusal that comes after the stream's first ping: an `error` event."""
        error = error_body(status, message, param=param)["error"]
        event = {"type": "error", "code": error["type"], "message": error["message"], "param": error["param"]}
        return [self._sse(event)]

    def _failure(self, rid: str, model: str, out: OutputItems, gen: Generation, d: Delta) -> dict:
        """An engine fault fails the response; an abort (the server shutting down) or a grammar past the
        engine's limits (the request's fault) is an error event."""
        if d.finish_reason == "abort":
            return {"type": "error", "code": "server_unavailable", "message": d.error, "param": None}
        if d.error_param:
            return {
                "type": "error",
                "code": "invalid_request_error",
                "message": d.error,
                "param": d.error_param,
            }
        failed = self._response(rid, model, out, gen.usage(), error=d.error)
        return {"type": "response.failed", "response": failed.model_dump()}

    def _sse(self, event: dict) -> str:
        event["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def _response(
        self,
        rid: str,
        model: str,
        out: OutputItems | None = None,
        usage: dict | None = None,
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
        return ResponseObject(
            id=f"resp_{rid.removeprefix(self.id_prefix + '-')}",
            created_at=self.created_at,
            status=status,
            completed_at=int(time.time()) if status == "completed" else None,
            error=ResponseError(message=error) if error is not None else None,
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            model=model,
            output=out.items if out else [],
            usage=ResponseUsage.of(usage) if usage else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            max_tool_calls=body.max_tool_calls,
            parallel_tool_calls=body.parallel_tool_calls,
            reasoning={"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
            temperature=body.temperature,
            top_p=body.top_p,
            text={"format": text_format.echo() if text_format else {"type": "text"}, "verbosity": None},
            tool_choice=_tool_choice(body),
            tools=[t.echo() for t in body.function_tools],
            user=body.user,
            safety_identifier=body.safety_identifier,
            prompt_cache_key=body.prompt_cache_key,
            metadata=body.metadata or {},
        )


def _tool_choice(body: ResponsesRequest) -> str | dict:
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "name": choice.name}
    return choice or "auto"
