"""OpenAI API request and response models (the subset minivllm serves).

Requests are validated strictly, as OpenAI validates them: no coercion (`"stream": "yes"` or `"n": "2"` is
a 400), roles from a fixed set, text that is valid Unicode. Unknown fields are ignored, as OpenAI ignores them
(clients send many).
"""

import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator


def _valid_unicode(text: str) -> str:
    """JSON can carry lone surrogates ("\\ud800"), which neither a tokenizer nor a UTF-8 response accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode; it contains a lone surrogate") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
Role = Literal["system", "user", "assistant", "tool", "developer"]

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
    user: Text | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

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


class ChatMessage(RequestModel):
    role: Role
    content: Text | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(GenerationRequest):
    prompt: Text | list[int] | list[Text] | list[list[int]]  # text may spell special tokens: they count
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Text | None = None


# -- responses ------------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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
