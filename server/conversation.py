"""One typed conversation between the protocols and the engine.

Each protocol module parses its request (OpenAI chat, Responses, Anthropic Messages) into a `Conversation`:
turns with text, thinking, tool calls and tool results; the tools offered and the choice among them; the
answer's format; limits, stops and sampling; what the server accepted without acting on it. The serving core
(server.core) templates, generates and streams from it alone; no protocol's wire types go further.

Field paths (`Conversation.names`, `Conversation.ignored`) are the request's own spelling, so every error and
every `x-minivllm-ignored` entry names the field as the client sent it.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass, field
from enum import Enum


class Role(str, Enum):
    SYSTEM = "system"
    DEVELOPER = "developer"  # rendered as the template's developer role, or its system role
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"  # a tool's result


@dataclass(frozen=True)
class ToolCall:
    """A call the model made (in the output) or made earlier (in the history). namespace: the group a
    Responses `namespace` tool put the function in (the client calls it by namespace and name)."""

    id: str
    name: str
    arguments: str  # a JSON object's text
    namespace: str | None = None

    @property
    def qualified_name(self) -> str:
        """The name the model sees and writes (server.conversation.qualified)."""
        return qualified(self.namespace, self.name)


def qualified(namespace: str | None, name: str) -> str:
    """A namespaced function's name in the prompt: `namespace.name` (one tool list, flat, for the model)."""
    return f"{namespace}.{name}" if namespace else name


@dataclass(frozen=True)
class Turn:
    """One message of the conversation. source: the index of the request message it comes from (-1: the
    instructions or system prompt before the messages), for breakpoints and the prefix-cache report."""

    role: Role
    text: str = ""
    thinking: str | None = None  # an assistant turn's reasoning, sent back by the client
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # a tool result: the call it answers
    name: str | None = None  # the author's name, for templates that render it
    source: int = -1


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call."""

    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of an object; None: no parameters
    strict: bool | None = None
    namespace: str | None = None
    # False: not in the template's tool list (a deferred tool, described where tool search loaded it, so
    # that the prompt before that point, and its cached pages, stay as they were); callable all the same
    listed: bool = True

    @property
    def qualified_name(self) -> str:
        return qualified(self.namespace, self.name)

    def template_dict(self) -> dict:
        """As chat templates take tools (OpenAI's function tool)."""
        fn = {"name": self.qualified_name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


class ChoiceMode(str, Enum):
    AUTO = "auto"
    REQUIRED = "required"  # some call
    NONE = "none"
    NAMED = "named"  # the call of one function


@dataclass(frozen=True)
class ToolChoice:
    mode: ChoiceMode = ChoiceMode.AUTO
    name: str | None = None  # with NAMED: the function's qualified name


@dataclass(frozen=True)
class OutputFormat:
    """The answer is JSON: valid against schema, or any JSON object when schema is None."""

    schema: dict | None = None


class ThinkingMode(str, Enum):
    OFF = "off"
    ON = "on"
    ADAPTIVE = "adaptive"  # the model decides: a model that thinks thinks, one that does not answers


# thinking tokens by effort, OpenAI's (reasoning_effort, reasoning.effort) and Anthropic's
# (output_config.effort) alike, on a model that thinks; a higher effort: no bound
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096}


@dataclass(frozen=True)
class Thinking:
    mode: ThinkingMode = ThinkingMode.ADAPTIVE
    budget_tokens: int | None = None  # thinking closes after this many tokens
    show: bool = True  # False: the answer carries the thinking sealed, not as text (Anthropic's "omitted")


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    output: OutputFormat | None = None
    thinking: Thinking = Thinking()
    max_tokens: int | None = None  # an upper bound: clamped to the room the context leaves
    stops: tuple[str, ...] = ()
    sampling: Sampling = Sampling()
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    hide_special_tokens: bool = True  # special tokens add no output text
    stream: bool = False
    include_usage: bool = False
    cache_salt: str | None = None
    pins: tuple[tuple[int, float], ...] = ()  # (messages before the pin's end, TTL): Anthropic's breakpoints
    # the request's field names by concept, for errors: prompt, max_tokens, structured_output, tools, ...
    names: dict[str, str] = field(default_factory=dict)
    # request fields accepted without effect here (hints, display, telemetry): the x-minivllm-ignored header
    ignored: tuple[str, ...] = ()
    # fields that act only on a model that thinks (effort, budgets): without effect, and so named, on others
    thinking_fields: tuple[str, ...] = ()

    def name(self, concept: str) -> str:
        return self.names.get(concept, concept)


SEAL_PREFIX = "mvl1."
MAX_SEALED_BYTES = 1 << 22  # a seal inflates to at most this (no decompression bomb)


def seal(thinking: str) -> str:
    """Thinking as an opaque string that carries it (Anthropic's signature, the Responses API's
    encrypted_content): a client that shows no thinking still sends it back, and the history then renders
    the prompt it had (the prefix cache restores it). Not a secret: it is the client's own conversation."""
    return SEAL_PREFIX + base64.urlsafe_b64encode(zlib.compress(thinking.encode())).decode()


def unseal(sealed: str | None) -> str | None:
    """The thinking a seal carries; None for anything this server did not seal."""
    if not sealed or not sealed.startswith(SEAL_PREFIX):
        return None
    try:
        data = base64.b64decode(sealed[len(SEAL_PREFIX) :], altchars=b"-_", validate=True)
        inflate = zlib.decompressobj()
        text = inflate.decompress(data, MAX_SEALED_BYTES)
        return (
            text.decode() if inflate.eof and not inflate.unconsumed_tail else None
        )  # whole, within the bound
    except (ValueError, zlib.error, UnicodeDecodeError):
        return None
