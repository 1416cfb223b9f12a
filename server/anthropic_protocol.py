"""Anthropic Messages API request and response models (the subset minivllm serves).

A field that changes what a correct answer is (tools, tool_choice, output_config.format, stop_sequences,
max_tokens, sampling) is honoured or refused with a 400 naming it; a hint, display preference or telemetry
field (thinking on a model that does not think, output_config.effort, metadata, beta headers) is accepted
and named in the x-minivllm-ignored header (server.messages); docs/api-messages.md lists them. Validation is
strict, as server.protocol's is, and, as at Anthropic, a field the API does not know is a 400 ("Extra inputs
are not permitted"), at the top level and in every block: a misspelt or newer field is never dropped
without a word.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from server.protocol import Text
from server.protocol import only as _only

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"
BILLING_HEADER = "x-anthropic-billing-header:"


class AnthropicModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


# -- content blocks -----------------------------------------------------------------------------------------
class CacheControl(AnthropicModel):
    """Accepted on every block: the prefix cache is automatic, every prompt's whole pages are cached."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None
    citations: list | None = None

    _no_citations = _only("citations", (None, []))


class Caller(AnthropicModel):
    type: Literal["direct"]  # a call the model made itself (no programmatic tool calling here)


class ToolUseBlock(AnthropicModel):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict
    cache_control: CacheControl | None = None
    caller: Caller | None = None
    toolset_name: str | None = None

    _no_toolset = _only("toolset_name")


class ToolReferenceBlock(AnthropicModel):
    """Tool search's result: a deferred tool (defer_loading) the model may call from here on."""

    type: Literal["tool_reference"]
    tool_name: Text
    cache_control: CacheControl | None = None


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[Annotated[TextBlock | ToolReferenceBlock, Field(discriminator="type")]] = ""
    is_error: bool = False  # the result is rendered as an error (server.messages)
    cache_control: CacheControl | None = None
    toolset_name: str | None = None

    _no_toolset = _only("toolset_name")

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v):
        _check_block_types(v, ("text", "tool_reference"))
        return v

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class ThinkingBlock(AnthropicModel):
    """The model's earlier thinking, sent back; signature: what this server signed it with (it carries the
    text, so that a history whose thinking was not displayed renders the same prompt)."""

    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(AnthropicModel):
    type: Literal["redacted_thinking"]
    data: Text


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]
BLOCKS_OF_ROLE = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "tool_use", "thinking", "redacted_thinking"),
    "system": ("text",),  # a system message inside messages[] (Claude Code's): rendered in place
}


def _check_block_types(v, allowed: tuple[str, ...]) -> None:
    for block in v if isinstance(v, list) else ():
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind not in allowed:
            raise ValueError(
                f"content blocks of type {kind!r} are not supported here (only {', '.join(allowed)})"
            )


def join_text(blocks: list[TextBlock]) -> str:
    """Text blocks as one text: a blank line between blocks (Claude Code sends reminders as blocks of
    their own)."""
    return "\n\n".join(b.text for b in blocks)


class Message(AnthropicModel):
    role: Literal["user", "assistant", "system"]
    content: Text | list[Block]

    @model_validator(mode="before")
    @classmethod
    def _blocks_of_the_role(cls, v):
        role = v.get("role") if isinstance(v, dict) else None
        if isinstance(role, str) and role in BLOCKS_OF_ROLE:
            _check_block_types(v.get("content"), BLOCKS_OF_ROLE[role])
        return v

    def blocks(self) -> list:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


# -- tools ---------------------------------------------------------------------------------------------------
class Tool(AnthropicModel):
    """A client tool. Server tools (bash_..., web_search_..., text_editor_...) are refused."""

    name: str = Field(pattern=TOOL_NAME)
    description: Text | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # checked against tool_choice by the request
    # the input streams as one input_json_delta once the call is complete, eager or not: the hint changes
    # neither the events' kinds nor what they add up to
    eager_input_streaming: bool | None = None
    # left out of the prompt until a tool_reference block (tool search's result) names it (server.messages)
    defer_loading: bool | None = None
    input_examples: list | None = None
    allowed_callers: list[str] | None = None

    _no_examples = _only("input_examples", (None, []))
    _direct_callers = _only("allowed_callers", (None, ["direct"]))

    @field_validator("input_schema")
    @classmethod
    def _an_object_schema(cls, v):
        if v.get("type") != "object":
            raise ValueError('input_schema must be a JSON schema of "type": "object"')
        return v


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_with_tool(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name is required with type "tool", and only there')
        return self


# -- other request fields -------------------------------------------------------------------------------------
class Thinking(AnthropicModel):
    """On a model that thinks: enabled (budget_tokens bounds it), adaptive (it thinks), disabled. On one
    that does not, every type answers without thinking (as adaptive does at Anthropic when the model
    decides not to think)."""

    type: Literal["disabled", "enabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking blocks carry no text

    @model_validator(mode="after")
    def _budget_with_enabled(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError('budget_tokens is required with type "enabled"')
        return self


class KeepThinking(AnthropicModel):
    type: Literal["thinking_turns"]
    value: int = Field(ge=0)


class ClearThinking(AnthropicModel):
    """Context editing that clears the thinking of all but the last `keep` assistant turns that have some
    (default 1), before the prompt is templated."""

    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | KeepThinking | None = None


class ContextManagement(AnthropicModel):
    edits: list[ClearThinking] = []

    @field_validator("edits", mode="before")
    @classmethod
    def _known_edits(cls, v):
        for edit in v if isinstance(v, list) else ():
            kind = edit.get("type") if isinstance(edit, dict) else None
            if kind != "clear_thinking_20251015":
                raise ValueError(f"context edits of type {kind!r} are not supported (clear_thinking only)")
        return v


class JsonOutputFormat(AnthropicModel):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(AnthropicModel):
    format: JsonOutputFormat | None = None  # the answer follows the schema (a grammar)
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = (
        None  # bounds thinking, where there is any
    )


class Metadata(AnthropicModel):
    user_id: Text | None = None  # no effect on the output, as at Anthropic


class CountTokensRequest(AnthropicModel):
    """POST /v1/messages/count_tokens: what makes the prompt."""

    model: Text
    messages: list[Message] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None
    cache_control: CacheControl | None = None  # automatic prefix caching
    speed: str | None = None
    mcp_servers: list | None = None

    _standard_speed = _only("speed", (None, "standard"))
    _no_mcp = _only("mcp_servers", (None, []))

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools(cls, v):
        for tool in v if isinstance(v, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise ValueError(f"server tools ({kind}) are not supported: only client tools")
        return v

    def system_text(self) -> str | None:
        """The system prompt, less a leading billing-header block: Claude Code's first system block
        (`x-anthropic-billing-header: cc_version=...; cch=...;`) changes every request, and in the
        prompt it would end the shared prefix at its first token."""
        if self.system is None or isinstance(self.system, str):
            return self.system
        blocks = self.system
        if blocks and blocks[0].text.startswith(BILLING_HEADER):
            blocks = blocks[1:]
        return join_text(blocks) if blocks else None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stream: bool = False
    stop_sequences: list[Text] | None = Field(None, max_length=64)
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0: no limit
    metadata: Metadata | None = None
    service_tier: str | None = None
    # refused: 400 naming the field
    container: Any = None
    inference_geo: str | None = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    _one_tier = _only("service_tier", (None, "auto", "standard_only"))
    _no_container = _only("container")
    _no_geo = _only("inference_geo")
    _no_diagnostics = _only("diagnostics")
    _no_user_profile = _only("user_profile_id")
    _no_workspace = _only("workspace_id")

    @field_validator("stop_sequences")
    @classmethod
    def _non_empty(cls, v):
        if any(not s for s in v or ()):
            raise ValueError("stop sequences must be non-empty")
        return v


# -- responses ---------------------------------------------------------------------------------------------
class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict


class Usage(BaseModel):
    """input_tokens + cache_read_input_tokens + cache_creation_input_tokens = the prompt's tokens."""

    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int
    service_tier: Literal["standard"] = "standard"


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextContent | ToolUseContent]
    stop_reason: (
        Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"] | None
    )
    stop_sequence: str | None
    usage: Usage


class TokenCount(BaseModel):
    input_tokens: int
