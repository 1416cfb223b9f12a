"""POST /v1/chat/completions: OpenAI's chat API, with tools and structured output.

Messages are templated into prompt ids (server.prompts), tools and response_format become the grammar the
output must match (server.tools, server.structured); the serving core generates; ChatFormat writes the
OpenAI chat response or its chunks, splitting tool calls out of the text as they stream.
"""

from fastapi import APIRouter, Request

from minivllm.outputs import TokenLogprob
from server import protocol as p
from server.core import OpenAIEvents, ServerState, generate, protocol_names, state_for, until_disconnect
from server.generation import Delta
from server.structured import chat_output
from server.tools import ToolCalling, ToolCallStream, call_deltas

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: p.ChatCompletionRequest, request: Request):
    st = state_for(request, body.model)
    max_tokens = body.max_completion_tokens or body.max_tokens
    tools = ToolCalling.of(body, st.engine.tokenizer)
    structured = chat_output(body, tools)
    names = {
        "prompt": "messages",
        "max_tokens": "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
        "structured_output": "tool_choice" if tools and tools.forced else "response_format",
    }
    with protocol_names(names):
        template_tools = tools and tools.template_tools()
        prompt = await until_disconnect(
            request, lambda: st.prompts.chat(body.messages, max_tokens, template_tools)
        )
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        fmt = ChatFormat(st, body.logprobs, tools)

        def locate(token: int):
            return st.prompts.message_at(body.messages, template_tools, prompt, token)

        return await generate(
            request, st, fmt, body, [prompt], max_tokens, logprobs, structured, locate, names
        )


class ChatFormat(OpenAIEvents):
    id_prefix = "chatcmpl"

    def __init__(self, state: "ServerState", logprobs: bool, tools: ToolCalling | None = None):
        self.token_text = state.token_text
        self.token_bytes = state.token_bytes
        self.logprobs = logprobs
        self.tools = tools
        self._role_sent: set[int] = set()
        self._tool_streams: dict[int, ToolCallStream] = {}

    def response(
        self, rid: str, model: str, per_choice: list[list[Delta]], usage: dict
    ) -> p.ChatCompletionResponse:
        choices = []
        for i, deltas in enumerate(per_choice):
            text, reason = "".join(d.text for d in deltas), deltas[-1].finish_reason
            calls = None
            if self.tools is not None:
                stream = ToolCallStream(self.tools)
                text, calls = stream.feed(text, final=True)
                reason = _tool_finish(reason, calls)
            message = p.ChatResponseMessage(content=text or (None if calls else ""), tool_calls=calls or None)
            logprobs = self._logprobs([lp for d in deltas for lp in d.logprobs])
            choices.append(p.ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=reason))
        return p.ChatCompletionResponse(id=rid, model=model, choices=choices, usage=usage)

    def chunks(self, rid: str, model: str, d: Delta) -> list[p.ChatCompletionChunk]:
        role = None if d.index in self._role_sent else "assistant"
        self._role_sent.add(d.index)
        text, calls, reason, first_call = d.text, [], d.finish_reason, 0
        if self.tools is not None:
            stream = self._tool_streams.setdefault(d.index, ToolCallStream(self.tools))
            text, calls = stream.feed(d.text, final=reason is not None)
            reason = _tool_finish(reason, stream.calls)
            first_call = len(stream.calls) - len(calls)
        deltas = [p.ChatDelta(role=role, content=text)] if text or role else []
        deltas += call_deltas(calls, first_call)
        if not deltas and (reason is not None or d.logprobs):
            deltas.append(p.ChatDelta())
        choices = [p.ChatChunkChoice(index=d.index, delta=delta) for delta in deltas]
        if choices:  # the finish reason and the logprobs ride on the last chunk
            choices[-1].finish_reason = reason
            choices[-1].logprobs = self._logprobs(d.logprobs)
        return [p.ChatCompletionChunk(id=rid, model=model, choices=[c]) for c in choices]

    def usage_chunk(self, rid: str, model: str, usage: dict) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(id=rid, model=model, choices=[], usage=usage)

    def _logprobs(self, lps: list[TokenLogprob]) -> p.ChatLogprobs | None:
        if not self.logprobs:
            return None
        return p.ChatLogprobs(
            content=[
                p.ChatTokenLogprob(
                    **self._top(lp.token_id, lp.logprob),
                    top_logprobs=[p.TopLogprob(**self._top(t, v)) for t, v in lp.top],
                )
                for lp in lps
            ]
        )

    def _top(self, token_id: int, logprob: float) -> dict:
        return {
            "token": self.token_text(token_id),
            "logprob": logprob,
            "bytes": list(self.token_bytes(token_id)),
        }


def _tool_finish(reason: str | None, calls: list) -> str | None:
    """A choice that ended by itself ("stop") after calling tools ends with "tool_calls"."""
    return "tool_calls" if reason == "stop" and calls else reason
