"""Tool calling: the conversation (with tool calls and tool results) into the chat template, the model's
tool calls out of its text, and the grammar that makes a forced call follow its function's schema.

The call format is the model's own, as mlx-lm infers it from the chat template (`tool_call_start`,
`tool_call_end` and `tool_parser` on its tokenizer wrapper): Qwen2.5 and Hermes write
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. mlx-lm's parser reads each block. A
template without a call format gets the generic one of server.generic_tools (the same blocks, rendered by
the server). A
marker that is an added token (Qwen's two are) is that token in a forced call's grammar, not its text.
"""

import json
import logging
import uuid
from dataclasses import dataclass, field

from minivllm.engine.grammar import JSON_OPTIONS
from server import generic_tools
from server import protocol as p
from server.errors import APIError

logger = logging.getLogger(__name__)


# -- the prompt ---------------------------------------------------------------------------------------------
def conversation(messages: list[p.ChatMessage]) -> list[dict]:
    """Messages as chat templates expect them: tool-call arguments as objects (Qwen2.5's template writes
    them with `tojson`), tool results with the id of the call they answer."""
    out = []
    for m in messages:
        message = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


@dataclass
class ToolCalling:
    """A chat request's tools and what it asked of them, with the model's call format."""

    tools: list[p.Tool]
    choice: str  # "auto", "required", or the name of the function that must be called
    parallel: bool
    start: str
    end: str
    parser: object  # mlx-lm's parse_tool_call(text, tools) -> {"name", "arguments"}
    bare_calls: bool  # also read an answer that is nothing but a call's JSON (see parse_bare)
    start_token: int | None = None  # the marker's id where it is one added token (Qwen's <tool_call>)
    end_token: int | None = None

    @classmethod
    def of(cls, body: p.ChatCompletionRequest, tokenizer) -> "ToolCalling | None":
        """A chat request's tools; None when it uses none (none given, or tool_choice "none")."""
        choice = body.tool_choice
        if isinstance(choice, p.NamedToolChoice):
            choice = choice.function
        text_answer = body.response_format is None or body.response_format.type == "text"
        calling = cls.build(body.tools or [], choice, body.parallel_tool_calls, tokenizer, text_answer)
        if calling is not None and body.logprobs:
            raise APIError(400, "logprobs are not supported together with tools", param="logprobs")
        return calling

    @classmethod
    def build(
        cls,
        tools: list[p.Tool],
        choice: str | p.NamedFunction | None,
        parallel: bool,
        tokenizer,
        text_answer: bool = True,
    ) -> "ToolCalling | None":
        """Any protocol's tools (as function tools: name, description, parameters) and its choice: None or
        "auto", "none", "required" (some call), or the function to call. None when no tool is used.
        text_answer: no JSON answer format competes with a bare call (see parse_bare)."""
        names = [t.function.name for t in tools]
        if len(set(names)) != len(names):
            raise APIError(400, "tool names must be unique", param="tools")
        if choice not in (None, "none", "auto") and not names:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        used = bool(tools) and choice != "none"
        if isinstance(choice, p.NamedFunction):
            if choice.name not in names:
                raise APIError(400, f"no tool named {choice.name!r} in tools", param="tool_choice")
            choice = choice.name
        if not used:
            return None
        return cls.of_functions(
            tools, choice or "auto", parallel, choice in (None, "auto") and text_answer, tokenizer
        )

    @classmethod
    def of_functions(
        cls, tools: list[p.Tool], choice: str, parallel: bool, bare_calls: bool, tokenizer
    ) -> "ToolCalling":
        """Checked tools in the model's call format, or the generic one (server.generic_tools) for a
        template without one: choice is "auto", "required" or the name of one of them (build checks a chat
        request's; server.responses checks its own)."""
        own = tokenizer.has_tool_calling
        start = tokenizer.tool_call_start if own else generic_tools.START
        end = tokenizer.tool_call_end if own else generic_tools.END
        return cls(
            tools=tools,
            choice=choice,
            parallel=parallel,
            start=start,
            end=end,
            parser=tokenizer.tool_parser if own else generic_tools.parse_tool_call,
            bare_calls=bare_calls,
            start_token=tokenizer.added_token_id(start),
            end_token=tokenizer.added_token_id(end),
        )

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def template_tools(self) -> list[dict]:
        return [t.model_dump(exclude_none=True) for t in self.tools]

    # -- the grammar of a call ------------------------------------------------------------------------
    def call_grammar(self) -> str:
        """Lark rules (llguidance's dialect) for one call block whose JSON follows a function's schema:
        the forced one, or any of the tools'. `call` is the rule to use."""
        names = [self.choice] if self.forced and self.choice != "required" else None
        schemas = [_call_schema(t.function) for t in self.tools if names is None or t.function.name in names]
        body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        body["x-guidance"] = JSON_OPTIONS
        start, end = _lark_marker(self.start, self.start_token), _lark_marker(self.end, self.end_token)
        return f'call: {start} "\\n" %json {json.dumps(body)} "\\n" {end}\n'

    # -- the output -----------------------------------------------------------------------------------
    def parse(self, block: str) -> dict | None:
        """One call block's text -> an OpenAI tool call, or None if it does not parse."""
        try:
            call = self.parser(block, [t.model_dump() for t in self.tools])
        except Exception as e:  # the model's text is whatever it wrote
            logger.info("unparsable tool call %r: %s", block[:200], e)
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call["name"], "arguments": arguments},
        }

    def parse_bare(self, text: str) -> dict | None:
        """A whole answer that is one call's JSON without the markers, bare or in a ```json fence, as
        small models (Qwen2.5-Coder-0.5B among them) often answer a tool request: a call if it names one
        of the request's tools."""
        body = text.strip()
        if body.startswith(FENCE):
            if not body.endswith("```"):
                return None
            body = body[len(FENCE) : -3]
        call = self.parse(body)
        names = {t.function.name for t in self.tools}
        return call if call is not None and call["function"]["name"] in names else None


FENCE = "```json"


def _may_be_bare_call(head: str) -> bool:
    return head.startswith(("{", FENCE)) or FENCE.startswith(head)


def _lark_marker(marker: str, token: int | None) -> str:
    """A call marker in llguidance's lark: llguidance holds every added token as special-token bytes, which a
    text literal never matches (its first mask allows the token, then consuming it fails), so an added token
    is named by its id."""
    return json.dumps(marker) if token is None else f"<[{token}]>"


def _call_schema(fn: p.FunctionDefinition) -> dict:
    parameters = fn.parameters or {"type": "object", "properties": {}, "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"name": {"const": fn.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


@dataclass
class ToolCallStream:
    """Splits one choice's text, as it streams, into content and tool calls. Text that may be the start of
    a call marker is held back; a call is released once its end marker arrives (its arguments in one
    fragment). Content is trimmed of surrounding whitespace, as in the non-streaming answer. A block that
    does not parse stays content, as the model wrote it. An answer that starts like a bare call's JSON is
    held to its end, to be read as a call or released as content."""

    calling: ToolCalling
    buffer: str = ""
    in_call: bool = False
    pending_space: str = ""  # whitespace held until more content follows it
    content_started: bool = False
    calls: list[dict] = field(default_factory=list)
    held: str = ""  # content that may be a bare call
    undecided: bool = True  # whether the answer may still be a bare call

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """New text in; the content to release and the calls completed by it out."""
        self.buffer += text
        content, calls = [], []
        start, end = self.calling.start, self.calling.end
        while True:
            if not self.in_call:
                i = self.buffer.find(start)
                if i < 0:
                    keep = 0 if final else _partial_suffix(self.buffer, start)
                    content.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                content.append(self.buffer[:i])
                self.buffer = self.buffer[i + len(start) :]
                self.in_call = True
            else:
                j = self.buffer.find(end)
                if j < 0:
                    if final:  # cut off (max_tokens): what there is stays text
                        content.append(start + self.buffer)
                        self.buffer = ""
                    break
                block, self.buffer = self.buffer[:j], self.buffer[j + len(end) :]
                self.in_call = False
                call = self.calling.parse(block)
                if call is None:
                    content.append(start + block + end)
                elif self.calling.parallel or not self.calls:  # parallel_tool_calls false: the first only
                    self.calls.append(call)
                    calls.append(call)
        text = "".join(content)
        if self.undecided and self.calling.bare_calls:
            text, bare = self._hold_bare_call(text, final)
            if bare is not None:
                self.calls.append(bare)
                calls.append(bare)
        return self._trim(text, final), calls

    def _hold_bare_call(self, text: str, final: bool) -> tuple[str, dict | None]:
        self.held += text
        head = self.held.lstrip()
        if self.calls or (head and not _may_be_bare_call(head)):
            self.undecided = False
            text, self.held = self.held, ""
            return text, None
        if not final:
            return "", None
        self.undecided = False
        call = self.calling.parse_bare(self.held)
        text, self.held = ("" if call else self.held), ""
        return text, call

    def _trim(self, text: str, final: bool) -> str:
        if not self.content_started:
            text = text.lstrip()
            self.content_started = bool(text)
        text = self.pending_space + text
        stripped = text.rstrip()
        self.pending_space = "" if final else text[len(stripped) :]
        return stripped


def call_deltas(calls: list[dict], first_index: int) -> list[p.ChatDelta]:
    """Calls as OpenAI streams them: per call, its id and name (arguments empty), then its arguments."""
    deltas = []
    for index, call in enumerate(calls, first_index):
        fn = call["function"]
        header = p.DeltaFunctionCall(name=fn["name"], arguments="")
        arguments = p.DeltaFunctionCall(arguments=fn["arguments"])
        deltas.append(
            p.ChatDelta(
                tool_calls=[p.DeltaToolCall(index=index, id=call["id"], type="function", function=header)]
            )
        )
        deltas.append(p.ChatDelta(tool_calls=[p.DeltaToolCall(index=index, function=arguments)]))
    return deltas


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
