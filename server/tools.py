"""Tool calling: the conversation (with tool calls and tool results) into the chat template, the model's
tool calls out of its text, and the grammar that makes a forced call follow its function's schema.

The call format is the model's own, as mlx-lm infers it from the chat template (`tool_call_start`,
`tool_call_end` and `tool_parser` on its tokenizer wrapper): Qwen2.5 and Hermes write
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. mlx-lm's parser reads each block. A
template without a call format gets the generic one of server.generic_tools (the same blocks, rendered by
the server). A
marker that is an added token (Qwen's two are) is that token in a forced call's grammar, not its text.

GLM-4.5 / 4.6 / 4.7 write a call's arguments as tags instead of JSON (mlx-lm's glm47 parser):
`<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>`, a string value as
its raw text and any other as JSON, with or without a newline between the pieces (4.5's template writes
them, 4.7's does not). A forced call is held to the function's schema in that form too; a schema the
tags cannot express (a string with a pattern, a format or a length, `$defs`) gets the JSON form inside the
same markers, which that parser also reads.

Gemma 4 writes `<|tool_call>call:NAME{key:value,...}<tool_call|>` (mlx-lm's gemma4 parser): keys bare,
strings between `<|"|>` delimiters, other values as JSON. A forced call is held to the function's schema in
that form.
"""

import json
import logging
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from minivllm.engine.grammar import JSON_OPTIONS
from server import generic_tools
from server.conversation import ChoiceMode, Conversation, ToolCall, ToolSpec, Turn
from server.errors import APIError

logger = logging.getLogger(__name__)


# -- the prompt ---------------------------------------------------------------------------------------------
def template_turns(turns: Sequence[Turn]) -> list[dict]:
    """Turns as chat templates expect them: tool-call arguments as objects (Qwen2.5's template writes
    them with `tojson`), tool results with the id of the call they answer, past reasoning as
    `reasoning_content` (where Qwen3's and similar templates look for it)."""
    out = []
    for t in turns:
        message = {"role": t.role.value, "content": t.text}
        if t.name is not None:
            message["name"] = t.name
        if t.thinking:
            message["reasoning_content"] = t.thinking
        if t.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.qualified_name, "arguments": json.loads(c.arguments)},
                }
                for c in t.tool_calls
            ]
        if t.tool_call_id is not None:
            message["tool_call_id"] = t.tool_call_id
        out.append(message)
    return out


@dataclass
class ToolCalling:
    """A request's tools and what it asked of them, with the model's call format."""

    tools: tuple[ToolSpec, ...]
    choice: str  # "auto", "required", or the qualified name of the function that must be called
    parallel: bool
    start: str
    end: str
    parser: object  # mlx-lm's parse_tool_call(text, tools) -> {"name", "arguments"}
    bare_calls: bool  # also read an answer that is nothing but a call's JSON (see parse_bare)
    start_token: int | None = None  # the marker's id where it is one added token (Qwen's <tool_call>)
    end_token: int | None = None
    # GLM's argument tags (ARG_TAGS), as lark snippets (a tag that is an added token by its id); None:
    # the arguments are a JSON object
    arg_tags: tuple[str, ...] | None = None
    # Gemma 4's string delimiter (GEMMA4_QUOTE) as a lark snippet: its calls are `call:NAME{key:value,...}`
    gemma_quote: str | None = None

    @classmethod
    def of(cls, conv: Conversation, tokenizer) -> "ToolCalling | None":
        """The conversation's tools and tool choice, checked (the one place for every protocol); None when
        no tool is used (none given, or the choice is none)."""
        tools, choice = conv.tools, conv.tool_choice
        names = [t.qualified_name for t in tools]
        if len(set(names)) != len(names):
            raise APIError(400, "tool names must be unique", param=conv.name("tools"))
        if choice.mode in (ChoiceMode.REQUIRED, ChoiceMode.NAMED) and not names:
            raise APIError(400, "tool_choice needs tools", param=conv.name("tool_choice"))
        if choice.mode == ChoiceMode.NAMED and choice.name not in names:
            raise APIError(400, f"no tool named {choice.name!r} in tools", param=conv.name("tool_choice"))
        if not tools or choice.mode == ChoiceMode.NONE:
            return None
        named = choice.name if choice.mode == ChoiceMode.NAMED else choice.mode.value
        bare = choice.mode == ChoiceMode.AUTO and conv.output is None
        return cls.of_functions(tools, named, conv.parallel_tool_calls, bare, tokenizer)

    @classmethod
    def of_functions(
        cls, tools: Sequence[ToolSpec], choice: str, parallel: bool, bare_calls: bool, tokenizer
    ) -> "ToolCalling":
        """Tools in the model's call format, or the generic one (server.generic_tools) for a template without
        one: choice is "auto", "required" or the qualified name of one of them."""
        own = tokenizer.has_tool_calling
        start = tokenizer.tool_call_start if own else generic_tools.START
        end = tokenizer.tool_call_end if own else generic_tools.END
        parser = getattr(tokenizer.tool_parser, "__module__", "") if own else ""
        tags = None
        if parser.endswith(".glm47"):
            tags = tuple(_lark_marker(t, tokenizer.added_token_id(t)) for t in ARG_TAGS)
        quote = None
        if parser.endswith(".gemma4"):
            quote = _lark_marker(GEMMA4_QUOTE, tokenizer.added_token_id(GEMMA4_QUOTE))
        return cls(
            tools=tuple(tools),
            choice=choice,
            parallel=parallel,
            start=start,
            end=end,
            parser=tokenizer.tool_parser if own else generic_tools.parse_tool_call,
            bare_calls=bare_calls,
            start_token=tokenizer.added_token_id(start),
            end_token=tokenizer.added_token_id(end),
            arg_tags=tags,
            gemma_quote=quote,
        )

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def template_tools(self) -> list[dict]:
        """The tools the template lists (deferred ones are described where they were loaded)."""
        return [t.template_dict() for t in self.tools if t.listed]

    # -- the grammar of a call ------------------------------------------------------------------------
    def call_grammar(self) -> str:
        """Lark rules (llguidance's dialect) for one call block whose JSON follows a function's schema:
        the forced one, or any of the tools'. `call` is the rule to use."""
        tools = self.grammar_tools()
        start, end = _lark_marker(self.start, self.start_token), _lark_marker(self.end, self.end_token)
        if self.arg_tags is not None and all(_taggable(t.parameters) for t in tools):
            return _tagged_call_grammar(tools, start, end, self.arg_tags)
        if self.gemma_quote is not None and all(_flat(t.parameters) for t in tools):
            return _gemma4_call_grammar(tools, start, end, self.gemma_quote)
        schemas = [_call_schema(t) for t in tools]
        body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        body["x-guidance"] = JSON_OPTIONS
        return f'call: {start} "\\n" %json {json.dumps(body)} "\\n" {end}\n'

    def grammar_tools(self) -> list[ToolSpec]:
        """The functions a call's grammar allows: the named one, or any."""
        named = self.forced and self.choice != "required"
        return [t for t in self.tools if not named or t.qualified_name == self.choice]

    # -- the output -----------------------------------------------------------------------------------
    def parse(self, block: str) -> ToolCall | None:
        """One call block's text -> a tool call, or None if it does not parse."""
        try:
            call = self.parser(block, [t.template_dict() for t in self.tools])
        except Exception as e:  # the model's text is whatever it wrote
            logger.info("unparsable tool call %r: %s", block[:200], e)
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        spec = next((t for t in self.tools if t.qualified_name == call["name"]), None)
        namespace, name = (spec.namespace, spec.name) if spec else (None, call["name"])
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments, namespace)

    def parse_bare(self, text: str) -> ToolCall | None:
        """A whole answer that is one call's JSON without the markers, bare or in a ```json fence, as
        small models (Qwen2.5-Coder-0.5B among them) often answer a tool request: a call if it names one
        of the request's tools."""
        body = text.strip()
        if body.startswith(FENCE):
            if not body.endswith("```"):
                return None
            body = body[len(FENCE) : -3]
        call = self.parse(body)
        names = {t.qualified_name for t in self.tools}
        return call if call is not None and call.qualified_name in names else None


FENCE = "```json"


def _may_be_bare_call(head: str) -> bool:
    return head.startswith(("{", FENCE)) or FENCE.startswith(head)


def _lark_marker(marker: str, token: int | None) -> str:
    """A call marker in llguidance's lark: llguidance holds every added token as special-token bytes, which a
    text literal never matches (its first mask allows the token, then consuming it fails), so an added token
    is named by its id."""
    return json.dumps(marker) if token is None else f"<[{token}]>"


ARG_TAGS = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
# what a string's raw text in a tag may be, its schema apart from these keys being plain
_PLAIN_STRING_KEYS = {"type", "description", "title", "enum", "const", "default", "examples"}
# a raw string value: any text but a closing tag's "</" (the closing tag is a token, where it is one)
_RAW_TEXT = r"/([^<]|<[^\/])*/"


def _taggable(parameters: dict | None) -> bool:
    """Whether every argument of a function fits GLM's tags: self-contained schemas, strings plain."""
    parameters = parameters or {}
    if "$defs" in parameters or "definitions" in parameters:
        return False
    return all(
        s.get("type") != "string" or set(s) <= _PLAIN_STRING_KEYS
        for s in parameters.get("properties", {}).values()
    )


def _tagged_call_grammar(tools: list[ToolSpec], start: str, end: str, tags: tuple[str, ...]) -> str:
    """Lark rules for one call in GLM's form: the function's name, then its arguments in the schema's
    order (the required ones always), each a key tag and a value tag."""
    key_open, key_close, value_open, value_close = tags
    rules, alternatives = [], []
    for i, tool in enumerate(tools):
        parameters = tool.parameters or {}
        required = set(parameters.get("required", []))
        arguments = []
        for j, (key, schema) in enumerate(parameters.get("properties", {}).items()):
            rule = f"arg_{i}_{j}"
            rules.append(
                f'{rule}: "\\n"? {key_open} {json.dumps(key)} {key_close} "\\n"? {value_open} '
                f"{_tag_value(schema)} {value_close}"
            )
            arguments.append(rule if key in required else f"{rule}?")
        rules.append(f'tool_{i}: {json.dumps(tool.qualified_name)} {" ".join(arguments)} "\\n"?')
        alternatives.append(f"tool_{i}")
    return f"call: {start} ({' | '.join(alternatives)}) {end}\n" + "\n".join(rules) + "\n"


def _tag_value(schema: dict, raw: str = _RAW_TEXT) -> str:
    """An argument's value in a call form that writes strings as raw text (GLM's tags, Gemma 4's
    delimiters): a plain string's text (one of its enum or const, if it has them; else `raw`), any other
    value as JSON following its schema."""
    if schema.get("type") != "string":
        return json_value(schema)
    if "const" in schema:
        return json.dumps(schema["const"])
    if "enum" in schema:
        return "(" + " | ".join(json.dumps(v) for v in schema["enum"]) + ")"
    return raw


def json_value(schema: dict) -> str:
    """A lark snippet for compact JSON valid against the schema."""
    return f"%json {json.dumps(schema | {'x-guidance': JSON_OPTIONS})}"


GEMMA4_QUOTE = '<|"|>'  # Gemma 4's string delimiter in calls (mlx-lm's gemma4 parser)
_KEY = re.compile(r"\w+")  # a key Gemma 4 writes bare (the parser quotes these alone)


def _flat(parameters: dict | None) -> bool:
    """A self-contained schema (no $defs to follow), whose call Gemma 4's form can hold."""
    parameters = parameters or {}
    return "$defs" not in parameters and "definitions" not in parameters


def _gemma4_call_grammar(tools: list[ToolSpec], start: str, end: str, quote: str) -> str:
    """Lark rules for one call in Gemma 4's form, `call:NAME{key:value,...}` between the call markers: the
    required arguments in the schema's order, then any of the others in theirs; a plain string between
    quote delimiters as raw text, any other value as JSON following its schema (which the parser reads:
    it quotes bare keys and turns delimited strings into JSON strings)."""
    rules, alternatives = [], []
    raw = "/(.|\\n)*/" if quote.startswith("<[") else r"/([^<]|<[^|])*/"  # a token delimiter ends it
    for i, tool in enumerate(tools):
        parameters = tool.parameters or {}
        required = set(parameters.get("required", []))
        names = []
        for j, (key, schema) in enumerate(parameters.get("properties", {}).items()):
            spelled = f"{key}:" if _KEY.fullmatch(key) else f"{json.dumps(key)}:"
            if schema.get("type") == "string" and set(schema) <= _PLAIN_STRING_KEYS:
                value = f"{quote} {_tag_value(schema, raw)} {quote}"
            else:  # other values, and strings whose bounds raw text cannot keep
                value = json_value(schema)
            rules.append(f"arg_{i}_{j}: {json.dumps(spelled)} {value}")
            names.append((f"arg_{i}_{j}", key in required))
        rules.append(f'tool_{i}: "call:" {json.dumps(tool.qualified_name)} "{{" {_argument_list(names)} "}}"')
        alternatives.append(f"tool_{i}")
    return f"call: {start} ({' | '.join(alternatives)}) {end}\n" + "\n".join(rules) + "\n"


def _argument_list(names: list[tuple[str, bool]]) -> str:
    """The arguments comma-separated: the required ones in order, then any subset of the others in order."""
    required = [rule for rule, needed in names if needed]
    optional = [rule for rule, needed in names if not needed]
    if required:
        return " ".join(
            [required[0], *(f'"," {r}' for r in required[1:]), *(f'("," {o})?' for o in optional)]
        )
    if not optional:
        return ""
    runs = [
        " ".join([first, *(f'("," {o})?' for o in optional[k + 1 :])]) for k, first in enumerate(optional)
    ]
    return "(" + " | ".join(f"({run})" for run in runs) + ")?"


def _call_schema(tool: ToolSpec) -> dict:
    parameters = tool.parameters or {"type": "object", "properties": {}, "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.qualified_name}, "arguments": parameters},
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
    calls: list[ToolCall] = field(default_factory=list)
    held: str = ""  # content that may be a bare call
    undecided: bool = True  # whether the answer may still be a bare call

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """New text in; the content to release and the calls completed by it out."""
        self.buffer += text
        content, calls = [], []
        start, end = self.calling.start, self.calling.end
        while True:
            if not self.in_call:
                i = self.buffer.find(start)
                if i < 0:
                    keep = 0 if final else partial_suffix(self.buffer, start)
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

    def _hold_bare_call(self, text: str, final: bool) -> tuple[str, ToolCall | None]:
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


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
