"""OpenAI Responses API request and response models (the subset minivllm serves; docs/api-responses.md).

The server is stateless: nothing is stored, so `store: true`, `previous_response_id`, `conversation` and
`background` are refused. A field that changes the answer is honoured or refused with a 400 naming it, as in
server.protocol, whose sampling fields (and their extensions: top_k, seed, stop, ...) this request shares; a
hint (reasoning on a model that does not reason, client_metadata, prompt_cache_key, ...) is accepted and
named in the x-minivllm-ignored header. Function tools and `namespace` groups of them are offered to the
model; built-in tools (web_search, local_shell, custom, ...) are skipped: agents such as Codex CLI always send
some, and the model can only call functions here (forcing one is a 400).
"""

import re
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Field, field_validator, model_validator

from server import protocol as p
from server.protocol import FUNCTION_NAME, GenerationRequest, RequestModel, Text
from server.protocol import only as _only

# the tool types OpenAI runs itself, or whose calls are items other than function_call: left out of the
# prompt (the model cannot call them here); a type not in this list is a 400
BUILT_IN_TOOLS = (
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "computer",
    "computer_use",
    "computer_use_preview",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
    "tool_search",
    "programmatic_tool_calling",
)
INCLUDABLE = ("reasoning.encrypted_content",)  # reasoning items carry their thinking, sealed
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512


def _valid_unicode_json(value):
    """Every string of a JSON value (dict keys too) valid Unicode: what the response echoes must encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text must be valid Unicode; it contains a lone surrogate") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _valid_unicode_json(k)
            _valid_unicode_json(v)
    elif isinstance(value, list):
        for v in value:
            _valid_unicode_json(v)
    return value


EchoedJson = Annotated[dict, AfterValidator(_valid_unicode_json)]


# -- input items --------------------------------------------------------------------------------------------
class ContentPart(RequestModel):
    type: Literal["input_text", "output_text"]
    text: Text


def _text_parts(v):
    """Content as a list of text parts (a string is one), so that an error names the part at fault."""
    if isinstance(v, str):
        return [{"type": "input_text", "text": v}]
    for part in v if isinstance(v, list) else ():
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in ("input_text", "output_text"):
            raise ValueError(f"content parts of type {kind!r} are not supported (input_text, output_text)")
    return v


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[ContentPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v):
        return _text_parts(v)

    def text(self) -> str:
        return "".join(c.text for c in self.content)


class FunctionCallItem(p.FunctionCall):
    """A call the model made (name, arguments: a JSON object), sent back in the next request's input."""

    type: Literal["function_call"]
    call_id: Text
    namespace: Text | None = None  # the call of a function in a namespace tool


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: Text
    output: list[ContentPart]

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, v):
        return _text_parts(v)

    def text(self) -> str:
        return "".join(c.text for c in self.output)


class ReasoningText(RequestModel):
    type: str
    text: Text = ""


class ReasoningItem(RequestModel):
    """Reasoning in a history sent back: this server's (encrypted_content, which carries it) is rendered
    as the next assistant turn's thinking; another model's is left out."""

    type: Literal["reasoning"]
    encrypted_content: Text | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(discriminator="type")
]
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


# -- tools, text format, reasoning --------------------------------------------------------------------------
class ResponsesTool(RequestModel):
    """A function tool (honoured), a namespace of function tools (honoured: the model sees them as
    `namespace.name`), or a built-in one (skipped)."""

    type: str
    name: str | None = None
    description: Text | None = None
    parameters: EchoedJson | None = None  # a JSON schema; absent: no parameters
    strict: bool | None = None  # calls forced by tool_choice always follow the schema
    defer_loading: bool | None = None  # a tool loaded on demand, through tool search: refused
    tools: list["ResponsesTool"] | None = None  # a namespace's functions

    @field_validator("type")
    @classmethod
    def _a_known_type(cls, v):
        if v not in ("function", "namespace", *BUILT_IN_TOOLS):
            raise ValueError(f"tools of type {v!r} are not supported (function, or a built-in tool: skipped)")
        return v

    @model_validator(mode="after")
    def _a_named_function(self):
        if self.type in ("function", "namespace"):
            if self.name is None or not re.fullmatch(FUNCTION_NAME, self.name):
                raise ValueError(f"a {self.type} tool needs a name matching {FUNCTION_NAME}")
            if self.defer_loading:
                raise ValueError("defer_loading is not supported (no tool search)")
        if self.type == "namespace" and any(t.type != "function" for t in self.tools or ()):
            raise ValueError("a namespace holds function tools only")
        return self

    def echo(self) -> dict:
        if self.type == "namespace":
            return {
                "type": "namespace",
                "name": self.name,
                "description": self.description,
                "tools": [t.echo() for t in self.tools or ()],
            }
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        }


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    description: Text | None = None
    schema_: EchoedJson | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is enforced either way

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("type json_schema needs name and schema")
        return self

    def echo(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        return {
            "type": "json_schema",
            "name": self.name,
            "schema": self.schema_,
            "description": self.description,
            "strict": self.strict,
        }


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # a hint: accepted, without effect here


class ReasoningConfig(RequestModel):
    """On a model that thinks: effort "none" turns thinking off, the others bound it; summary asks for
    the reasoning in summary parts. On one that does not: accepted, without effect."""

    effort: Literal[p.REASONING_EFFORTS] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # summary's old name


class ResponsesStreamOptions(RequestModel):
    include_obfuscation: bool | None = None

    _plain = _only("include_obfuscation", (None, False), "obfuscation padding is not supported")


# -- the request --------------------------------------------------------------------------------------------
STATELESS = "the server is stateless: nothing is stored"


class ResponsesRequest(GenerationRequest):
    input: list[InputItem]  # a string is one user message
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    stream_options: ResponsesStreamOptions | None = None
    metadata: dict[Text, Text] | None = None  # echoed in the response
    client_metadata: dict | None = None  # telemetry (Codex's): accepted, without effect
    safety_identifier: Text | None = None  # no effect on the output, as at OpenAI
    prompt_cache_key: Text | None = None  # a cache-affinity hint: the prefix cache needs no key
    prompt_cache_retention: str | None = None
    max_tool_calls: int | None = Field(None, ge=1)  # bounds built-in tool calls: none are made here
    top_logprobs: int | None = None
    service_tier: str | None = None
    truncation: str | None = None
    store: bool | None = None
    # refused: state the server does not keep, and what it does not offer
    previous_response_id: Any = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    prompt_cache_options: Any = None
    context_management: Any = None
    moderation: Any = None
    access_programs: Any = None
    background_options: Any = None
    image: Any = None
    # chat and completions fields that the Responses API names otherwise or has not
    max_tokens: Any = None
    n: int = 1

    _no_store = _only("store", (None, False), STATELESS + " (store: false only)")
    _no_previous = _only("previous_response_id", (None,), STATELESS + "; send the whole conversation")
    _no_conversation = _only("conversation", (None,), STATELESS + "; send the whole conversation")
    _no_background = _only("background", (None, False), "background responses are not supported")
    _no_prompt = _only("prompt", (None,), "stored prompt templates are not supported")
    _no_cache_options = _only("prompt_cache_options", (None,), "the prefix cache is implicit: no options")
    _retention = _only("prompt_cache_retention", (None, "in_memory"), "pages stay in memory")
    _no_context_management = _only("context_management", (None,), "context management is not supported")
    _no_moderation = _only("moderation", (None,), "moderation is not supported")
    _no_access_programs = _only("access_programs", (None,), "access programs are not supported")
    _no_background_options = _only("background_options", (None,), "background responses are not supported")
    _no_image = _only("image", (None,), "images are not supported")
    _tier = _only("service_tier", (None, "auto", "default"), "one tier")
    _truncation = _only("truncation", (None, "disabled"), "an input too long is a 400")
    _no_logprobs = _only("top_logprobs", (None, 0), "logprobs are not supported on /v1/responses")
    _no_max_tokens = _only("max_tokens", (None,), "not a Responses field: use max_output_tokens")
    _one = _only("n", (1,), "one response per request")

    @field_validator("input", mode="before")
    @classmethod
    def _item_types(cls, v):
        """A string is one user message; items without a type are messages (OpenAI's easy input); an
        unsupported type is named."""
        if isinstance(v, str):
            return [{"type": "message", "role": "user", "content": v}]
        if not isinstance(v, list):
            return v
        if not v:
            raise ValueError("input must not be empty")
        for i, item in enumerate(v):
            if not isinstance(item, dict):
                continue
            kind = item.setdefault("type", "message")
            if kind == "item_reference":
                raise ValueError(f"input[{i}]: item references need stored items; the server is stateless")
            if kind not in ITEM_TYPES:
                raise ValueError(
                    f"input[{i}]: items of type {kind!r} are not supported ({', '.join(ITEM_TYPES)})"
                )
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, v):
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(
                f"tool_choice of type {v.get('type')!r} is not supported: built-in tools are not offered "
                '(tool_choice "none", "auto", "required" or {"type": "function", "name": ...})'
            )
        return v

    @field_validator("include")
    @classmethod
    def _includable(cls, v):
        for item in v or ():
            if item not in INCLUDABLE:
                raise ValueError(f"include: {item!r} is not supported (only {', '.join(INCLUDABLE)})")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v):
        if v is not None and len(v) > METADATA_PAIRS:
            raise ValueError(f"at most {METADATA_PAIRS} pairs")
        for key, value in (v or {}).items():
            if len(key) > METADATA_KEY or len(value) > METADATA_VALUE:
                raise ValueError(
                    f"keys of at most {METADATA_KEY} characters, values of at most {METADATA_VALUE}"
                )
        return v

    @property
    def include_usage(self) -> bool:
        return True  # the usage is always in the finished response

    @property
    def function_tools(self) -> list[ResponsesTool]:
        """The tools offered to the model: functions and namespaces of them (built-in tools are not)."""
        return [t for t in self.tools or () if t.type in ("function", "namespace")]

    @property
    def text_format(self) -> TextFormat | None:
        return self.text.format if self.text else None


# -- the response -------------------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]
    namespace: str | None = None


class SummaryText(BaseModel):
    type: Literal["summary_text"] = "summary_text"
    text: str


class ReasoningPart(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[SummaryText] = []
    content: list[ReasoningPart] = []
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int = 0  # writes of explicit prompt caching (prompt_cache_options): none here


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class ResponseError(BaseModel):
    code: str = "server_error"
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputReasoning | OutputMessage | OutputFunctionCall] = []
    usage: ResponseUsage | None = None
    # the request's settings, echoed as OpenAI does
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict = {"effort": None, "summary": None}
    service_tier: str = "default"
    store: bool = False
    background: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    text: dict = {"format": {"type": "text"}, "verbosity": None}
    tool_choice: str | dict = "auto"
    tools: list[dict] = []
    truncation: str = "disabled"
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] = {}
