"""POST /v1/chat/completions: OpenAI's chat API, with tools, structured output and reasoning.

`parse` turns the request into the typed conversation (server.conversation); the serving core templates and
generates it; ChatWriter writes the chat completion, or its chunks, from the typed events: text as
`content`, thinking as `reasoning_content` (as vLLM and llama.cpp return it), calls as `tool_calls`.
"""

from fastapi import APIRouter, Request

from minivllm.outputs import TokenLogprob
from server import protocol as p
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
)
from server.core import OpenAIEvents, ServerState, prepare_chat, serve, sse, state_for
from server.errors import APIError
from server.events import Answer, Event, Finished, StopReason, TextDelta, ThinkingDelta, ToolCallDone
from server.generation import Usage

router = APIRouter()
FINISH = {
    StopReason.END: "stop",
    StopReason.STOP_STRING: "stop",
    StopReason.TOOL_CALLS: "tool_calls",
    StopReason.LENGTH: "length",
    StopReason.CONTEXT: "length",
}
EFFORT_OFF = "none"


@router.post("/v1/chat/completions")
async def chat_completions(body: p.ChatCompletionRequest, request: Request):
    st = state_for(request, body.model)
    conv = parse(body)
    prepared = await prepare_chat(request, st, conv)
    return await serve(request, st, conv, prepared, ChatWriter(st, conv))


def parse(body: p.ChatCompletionRequest) -> Conversation:
    if body.uses_tools and body.logprobs:
        raise APIError(400, "logprobs are not supported together with tools", param="logprobs")
    max_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    tools = tuple(_tool(t) for t in body.tools or ())
    forced = body.uses_tools and body.tool_choice not in (None, "auto")
    hints = ("metadata", "safety_identifier", "prompt_cache_key", "user", "verbosity", "store")
    ignored = [f for f in hints if getattr(body, f)]
    thinking = Thinking()
    if body.reasoning_effort is not None:
        thinking = thinking_of_effort(body.reasoning_effort)
    return Conversation(
        turns=turns_of(body.messages),
        tools=tools,
        tool_choice=_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        output=_format(body.response_format),
        thinking=thinking,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        stops=tuple(body.stop),
        sampling=sampling_of(body),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        hide_special_tokens=body.skip_special_tokens,
        stream=body.stream,
        include_usage=body.include_usage,
        cache_salt=body.cache_salt,
        names={
            "prompt": "messages",
            "max_tokens": max_name,
            "structured_output": "tool_choice" if forced else "response_format",
            "output": "response_format",
        },
        ignored=tuple(ignored),
        thinking_fields=("reasoning_effort",) if body.reasoning_effort is not None else (),
    )


def thinking_of_effort(effort: str) -> Thinking:
    """OpenAI's reasoning effort on a model that thinks: "none" is no thinking; the others bound it."""
    if effort == EFFORT_OFF:
        return Thinking(ThinkingMode.OFF)
    return Thinking(ThinkingMode.ON, EFFORT_BUDGETS.get(effort))


def sampling_of(body: p.GenerationRequest) -> Sampling:
    """OpenAI's sampling fields (and their extensions), which chat, completions and Responses share."""
    return Sampling(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=body.token_bias,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        n=body.n,
    )


def turns_of(messages: list[p.ChatMessage]) -> tuple[Turn, ...]:
    return tuple(_turn(m, i) for i, m in enumerate(messages))


def _turn(m: p.ChatMessage, index: int) -> Turn:
    calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or ())
    return Turn(
        Role(m.role),
        m.text(),
        thinking=m.reasoning_content or None,
        tool_calls=calls,
        tool_call_id=m.tool_call_id,
        name=m.name,
        source=index,
    )


def _tool(t: p.Tool) -> ToolSpec:
    fn = t.function
    return ToolSpec(fn.name, fn.description, fn.parameters, fn.strict)


def _choice(choice) -> ToolChoice:
    if isinstance(choice, p.NamedToolChoice):
        return ToolChoice(ChoiceMode.NAMED, choice.function.name)
    return ToolChoice(ChoiceMode(choice or "auto"))


def _format(fmt: p.ResponseFormat | None) -> OutputFormat | None:
    """An OpenAI response format (chat's response_format, or the Responses API's text.format)."""
    if fmt is None or fmt.type == "text":
        return None
    return OutputFormat(fmt.json_schema.schema_ if fmt.type == "json_schema" else None)


class ChatWriter(OpenAIEvents):
    id_prefix = "chatcmpl"

    def __init__(self, state: ServerState, conv: Conversation):
        super().__init__(conv.include_usage)
        self.token_text = state.token_text
        self.token_bytes = state.token_bytes
        self.logprobs = conv.logprobs is not None
        self._role_sent: set[int] = set()
        self._calls: dict[int, int] = {}  # calls streamed so far, by choice

    def response(self, rid: str, model: str, answers: list[Answer], usage: Usage) -> dict:
        choices = []
        for a in answers:
            calls = [_tool_call(c) for c in a.calls]
            message = p.ChatResponseMessage(
                content=a.text or (None if calls else ""),
                reasoning_content=a.thinking or None,
                tool_calls=calls or None,
            )
            logprobs = self._logprobs(a.logprobs)
            choices.append(
                p.ChatChoice(
                    index=a.index, message=message, logprobs=logprobs, finish_reason=FINISH[a.reason]
                )
            )
        return p.ChatCompletionResponse(
            id=rid, model=model, choices=choices, usage=usage.openai()
        ).model_dump()

    def event(self, rid: str, model: str, event: Event) -> list[str]:
        i = event.index
        choice = p.ChatChunkChoice(index=i, delta=p.ChatDelta())
        if isinstance(event, TextDelta):
            choice.delta.content = event.text
            choice.logprobs = self._logprobs(list(event.logprobs))
        elif isinstance(event, ThinkingDelta):
            choice.delta.reasoning_content = event.text
        elif isinstance(event, ToolCallDone):
            k = self._calls[i] = self._calls.get(i, -1) + 1
            return [self._chunk(rid, model, d) for d in _call_deltas(i, event.call, k, self._role(i))]
        elif isinstance(event, Finished):
            choice.finish_reason = FINISH[event.reason]
        choice.delta.role = self._role(i)
        return [self._chunk(rid, model, choice)]

    def _role(self, index: int) -> str | None:
        """The role rides on a choice's first chunk."""
        if index in self._role_sent:
            return None
        self._role_sent.add(index)
        return "assistant"

    def _chunk(self, rid: str, model: str, choice: p.ChatChunkChoice) -> str:
        return sse(p.ChatCompletionChunk(id=rid, model=model, choices=[choice]))

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


def _tool_call(call: ToolCall) -> p.ResponseToolCall:
    return p.ResponseToolCall(
        id=call.id, function=p.ResponseFunctionCall(name=call.qualified_name, arguments=call.arguments)
    )


def _call_deltas(index: int, call: ToolCall, k: int, role: str | None) -> list[p.ChatChunkChoice]:
    """A call as OpenAI streams it: its id and name (arguments empty), then its arguments."""
    header = p.DeltaFunctionCall(name=call.qualified_name, arguments="")
    arguments = p.DeltaFunctionCall(arguments=call.arguments)
    first = p.DeltaToolCall(index=k, id=call.id, type="function", function=header)
    return [
        p.ChatChunkChoice(index=index, delta=p.ChatDelta(role=role, tool_calls=[first])),
        p.ChatChunkChoice(
            index=index, delta=p.ChatDelta(tool_calls=[p.DeltaToolCall(index=k, function=arguments)])
        ),
    ]
