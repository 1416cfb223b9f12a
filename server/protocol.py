"""OpenAI API request and response models (the subset minivllm serves).

A field that changes the answer is honoured or refused with a 400 naming it; a hint the server cannot act on
is accepted and named in the x-minivllm-ignored header (the field policy: docs/api.md). Requests are
validated strictly, as OpenAI validates them: no coercion (`"stream": "yes"` or `"n": "2"` is a 400), roles
from a fixed set, text that is valid Unicode. Unknown fields are ignored, as OpenAI ignores them (clients
send many).
"""

import json
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_JSON_NESTING = 128  # of JSON text inside a field (tool-call arguments); the body parser bounds the rest


def _nesting(text: str) -> int:
    """The deepest bracket nesting of JSON text, outside strings (a bound checked before parsing)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            escaped, in_string = (not escaped and c == "\\"), in_string and (escaped or c != '"')
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def _valid_unicode(text: str) -> str:
    """JSON can carry lone surrogates ("\\ud800"), which neither a tokenizer nor a UTF-8 response accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode; it contains a lone surrogate") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
Role = Literal["system", "user", "assistant", "tool", "developer"]
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")

# -- requests -------------------------------------------------------------------------------------------


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(RequestModel):
    include_usage: bool = False


class GenerationRequest(RequestModel):
    """Fields chat and completions share."""

    model: Text
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # extension; 0 or -1: off
    seed: int | None = None
    stop: Text | list[Text] | None = Field(None, validate_default=True)  # always a list once validated
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    skip_special_tokens: bool = True  # extension (vLLM's): False keeps special tokens in the output text
    n: int = Field(1, ge=1, le=32)
    user: Text | None = None  # no effect on the output, as at OpenAI
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)  # extension
    min_p: float = Field(0.0, ge=0, le=1)  # extension
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias in [-100, 100]
    cache_salt: Text | None = Field(None, min_length=1, max_length=256)  # extension (vLLM's): cache domain

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v):
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()) or len(key) > 10:  # no vocabulary has 10^10 tokens
                raise ValueError(f"keys must be token ids, got {key[:20]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"bias must be in [-100, 100], got {bias} for token {key}")
        return v

    @property
    def token_bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(RequestModel):
    type: Literal["text"]
    text: Text


class FunctionCall(RequestModel):
    name: Text
    arguments: str  # JSON text, as OpenAI sends it

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        if _nesting(v) > MAX_JSON_NESTING:  # json.loads would recurse past Python's stack
            raise ValueError(f"arguments nest deeper than {MAX_JSON_NESTING} levels")
        try:
            value = json.loads(v)
        except ValueError as e:
            raise ValueError(f"arguments must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("arguments must be a JSON object")
        return v


class ToolCall(RequestModel):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Role
    content: Text | list[TextPart] | None = None
    name: Text | None = None  # passed to the chat template
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: Text | None = None  # tool messages
    reasoning_content: Text | None = (
        None  # an assistant's thinking, sent back (rendered where templates take it)
    )
    audio: Any = None  # refused

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, v):
        if v is not None:
            raise ValueError("audio is not supported")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v):
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported (text only)")
        return v

    @model_validator(mode="after")
    def _roles(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; absent: no parameters
    strict: bool | None = None  # calls forced by tool_choice always follow the schema


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")  # absent: any JSON object
    strict: bool | None = None  # the schema is enforced either way


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema")
        return self


def only(field: str, allowed: tuple = (None,), why: str = "not supported"):
    """A validator that refuses a field unless its value is one of `allowed` (every protocol's models use
    it: the 400 names the field, says why, and lists the values it takes)."""

    def check(cls, v):
        if v not in allowed:
            shown = [a for a in allowed if a is not None]
            raise ValueError(f"{field}: {why}" + (f" (only {', '.join(map(repr, shown))})" if shown else ""))
        return v

    return field_validator(field)(classmethod(check))


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # OpenAI fields without effect on the output here or there: accepted
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache needs no hint
    # refused: 400 naming the field
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: str | None = None  # on a model that thinks: none (off) or a bound on its thinking
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint: accepted, without effect here
    service_tier: str | None = None
    store: bool | None = None  # an opt-in to storage the server does not keep: accepted, without effect

    _no_functions = only("functions")
    _no_function_call = only("function_call")
    _no_audio = only("audio")
    _no_prediction = only("prediction")
    _no_web_search = only("web_search_options")
    _effort = only("reasoning_effort", (None, *REASONING_EFFORTS))
    _tier = only("service_tier", (None, "auto", "default"))

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, v):
        if v is not None and v != ["text"]:
            raise ValueError("only the text modality is supported")
        return v

    @model_validator(mode="after")
    def _one_token_limit(self):
        # both set and different: which one the client meant is unknown (and each must fit the context)
        if (
            None not in (self.max_tokens, self.max_completion_tokens)
            and self.max_tokens != self.max_completion_tokens
        ):
            raise ValueError(
                "max_tokens and max_completion_tokens differ: send one (max_tokens is deprecated)"
            )
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v, info):
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, v):
        named = isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict)
        if v is None or v in ("none", "auto", "required") or named:
            return v
        raise ValueError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class CompletionRequest(GenerationRequest):
    prompt: Text | list[int] | list[Text] | list[list[int]]  # text may spell special tokens: they count
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Text | None = None
    best_of: int | None = None

    _one_best = only("best_of", (None, 1))


# -- responses ------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails = CompletionTokensDetails()


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None  # None only in stream chunks


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minivllm"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
