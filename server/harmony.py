"""gpt-oss's chat format, Harmony, through OpenAI's own `openai-harmony`: the conversation rendered into
Harmony's messages, and the model's output read back as reasoning, answer and tool calls.

The model answers in messages on channels: `analysis` (its reasoning: thinking blocks, reasoning items,
`reasoning_content`), `commentary` (a call when the message has a recipient `functions.NAME`, the
arguments as JSON; a preamble to the user when it has none) and `final` (the answer). A call ends the
output with `<|call|>`, an answer with `<|return|>`. The tool list is the developer message's `functions`
namespace; a tool result is a message from `functions.NAME` to the assistant. Past reasoning is rendered
where Harmony keeps it (before the calls of an unfinished turn) and dropped where it drops it.

Reasoning cannot be switched off: gpt-oss always reasons. The request's effort (or thinking budget) sets
the system message's `Reasoning:` level; thinking off hides the reasoning from the answer. A forced call
(and a JSON answer) is a grammar over the whole output: the reasoning where the request asks for it
(bounded by its thinking budget), then the call on the commentary channel, its arguments held to the
schema.

openai-harmony loads OpenAI's o200k vocabulary from the network on first use (cached), or from the folder
`TIKTOKEN_ENCODINGS_BASE` names (a file `o200k_base.tiktoken`). Offline, the server rebuilds that file
from the model's own tokenizer, and uses it if it is OpenAI's byte for byte.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from openai_harmony import (
    Author,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    HarmonyError,
    Message,
    ReasoningEffort,
    Role,
    StreamableParser,
    StreamState,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)
from openai_harmony import Conversation as HarmonyConversation

from minivllm.engine.validation import RequestError
from minivllm.models.loader import cache_dir
from server.conversation import Role as TurnRole
from server.conversation import Thinking, ThinkingMode, ToolCall, ToolSpec, Turn
from server.events import Event, Failed, Finished, StopReason, TextDelta, ThinkingDelta, ToolCallDone
from server.generation import Delta
from server.tools import json_value

logger = logging.getLogger(__name__)

MARKER = "<|channel|>"  # in a chat template: the model writes Harmony
FUNCTIONS = "functions."  # the recipient prefix of a call to one of the request's tools
O200K_SIZE = 199_998  # tokens in o200k_base; Harmony's special tokens follow
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # tiktoken's check
# the tokens the grammars name, which the model's tokenizer must have at Harmony's ids
# a message header (`<|channel|>commentary to=functions.NAME <|constrain|>json`) is a few tokens; past this,
# the model is not writing Harmony (a random or untrained one) and its tokens are passed on as text
MAX_HEADER_TOKENS = 64
TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>")


def writes_harmony(chat_template: object) -> bool:
    return MARKER in str(chat_template or "")


def effort(thinking: Thinking) -> ReasoningEffort:
    """The `Reasoning:` level for a request's thinking: its budget (server.conversation.EFFORT_BUDGETS: low
    up to 1,024 tokens, medium up to 4,096), high without one when asked, medium (gpt-oss's own default)
    when not."""
    budget = thinking.budget_tokens
    if budget is None:
        return ReasoningEffort.HIGH if thinking.mode == ThinkingMode.ON else ReasoningEffort.MEDIUM
    if budget <= 1024:
        return ReasoningEffort.LOW
    return ReasoningEffort.MEDIUM if budget <= 4096 else ReasoningEffort.HIGH


class HarmonyFormat:
    """The Harmony encoding, checked against the model's tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.encoding = _load_encoding(tokenizer)
        self.ids = {t: self.encoding.encode(t, allowed_special="all")[0] for t in TOKENS}
        self.lark = {t: f"<[{i}]>" for t, i in self.ids.items()}  # as lark token literals, by id
        differ = [t for t, i in self.ids.items() if tokenizer.added_token_id(t) != i]
        if differ:
            raise ValueError(
                f"this model's template writes Harmony, but its tokenizer does not have {', '.join(differ)} "
                "at Harmony's ids: not gpt-oss's vocabulary"
            )
        # <|return|>, <|call|> (openai-harmony gives a set: in no fixed order)
        self.stop_tokens = tuple(sorted(self.encoding.stop_tokens_for_assistant_actions()))
        # after a message's <|end|>: the header of the assistant's next one
        self.next_message = tuple(self.encoding.encode("<|start|>assistant", allowed_special="all"))

    # -- the prompt -------------------------------------------------------------------------------------
    def prompt(self, turns: Sequence[Turn], tools: list[dict] | None, thinking: Thinking) -> list[int]:
        """The conversation's tokens, ending where the assistant's next message starts. tools: as chat
        templates take them (ToolSpec.template_dict), the listed ones."""
        try:
            messages = [
                Message.from_role_and_content(
                    Role.SYSTEM, SystemContent.new().with_reasoning_effort(effort(thinking))
                )
            ]
            messages += self._messages(turns, tools)
            conversation = HarmonyConversation.from_messages(messages)
            return self.encoding.render_conversation_for_completion(conversation, Role.ASSISTANT)
        except HarmonyError as e:
            raise RequestError(f"cannot render the conversation in Harmony: {e}", param="prompt") from None

    def message_ends(
        self,
        turns: Sequence[Turn],
        tools: list[dict] | None,
        thinking: Thinking,
        ids: list[int],
        ends: list[int],
    ) -> list[int]:
        """For each k in ends, the tokens of prompt `ids` before turn k (0 where they differ: Harmony renders
        each message on its own, but drops past reasoning once a turn has its answer)."""
        out = []
        for k in ends:
            part = self.prompt(turns[:k], tools, thinking)[: -len(self.next_message)]  # less the next message
            out.append(len(part) if ids[: len(part)] == part else 0)
        return out

    def _messages(self, turns: Sequence[Turn], tools: list[dict] | None) -> list[Message]:
        lead = 0  # the system and developer turns before the conversation: the developer's instructions
        while lead < len(turns) and turns[lead].role in (TurnRole.SYSTEM, TurnRole.DEVELOPER):
            lead += 1
        instructions = "\n\n".join(t.text for t in turns[:lead] if t.text)
        out = []
        if instructions or tools:
            developer = DeveloperContent.new()
            if instructions:
                developer = developer.with_instructions(instructions)
            if tools:
                developer = developer.with_function_tools([_description(t["function"]) for t in tools])
            out.append(Message.from_role_and_content(Role.DEVELOPER, developer))
        names = {c.id: c.qualified_name for t in turns for c in t.tool_calls}
        for turn in turns[lead:]:
            out += _turn_messages(turn, names)
        return out

    # -- the grammar of a forced output -----------------------------------------------------------------
    def output_grammar(self, bodies: list[str], thinking_tokens: int | None) -> str:
        """Lark (llguidance's): the reasoning first unless thinking_tokens is 0 (at most that many tokens,
        when set), then one of bodies: a message after its `<|channel|>` (call_alternatives,
        answer_alternative)."""
        t = self.lark
        body = "body: " + " | ".join(f"({b})" for b in bodies) + "\n"
        if thinking_tokens == 0:
            return f"start: {t['<|channel|>']} body\n{body}"
        bound = f"[max_tokens={thinking_tokens}]" if thinking_tokens is not None else ""
        return (
            f'start: {t["<|channel|>"]} "analysis" {t["<|message|>"]} reasoning {t["<|end|>"]} '
            f'{t["<|start|>"]} "assistant" {t["<|channel|>"]} body\n'
            f"reasoning{bound}: /(.|\\n)*/\n{body}"
        )

    def call_alternatives(self, tools: Sequence[ToolSpec]) -> list[str]:
        """A call of one of tools on the commentary channel, its arguments valid against its schema."""
        t = self.lark
        out = []
        for tool in tools:
            arguments = json_value(tool.parameters or {"type": "object", "properties": {}})
            head = json.dumps(f"commentary to={FUNCTIONS}{tool.qualified_name} ")
            out.append(f'{head} {t["<|constrain|>"]} "json" {t["<|message|>"]} {arguments} {t["<|call|>"]}')
        return out

    def answer_alternative(self, schema: dict | None) -> str:
        """A final answer that is JSON (valid against schema, or any object)."""
        t = self.lark
        return f'"final" {t["<|message|>"]} {json_value(schema or {"type": "object"})} {t["<|return|>"]}'


def _load_encoding(tokenizer) -> HarmonyEncoding:
    """openai-harmony's encoding. Offline, without the vocabulary in its cache or where
    TIKTOKEN_ENCODINGS_BASE points, the vocabulary is rebuilt from the model's own tokenizer (gpt-oss's
    holds o200k_base below id 199,998), used only if it is OpenAI's file byte for byte."""
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as e:
        folder = _vocabulary_of(tokenizer)
        if folder is None:
            raise RuntimeError(
                f"this model writes Harmony (gpt-oss), and openai-harmony cannot load its vocabulary ({e}), "
                "nor is it the model's own: connect once to the network, or set TIKTOKEN_ENCODINGS_BASE to a "
                "folder with o200k_base.tiktoken"
            ) from None
    logger.info("Harmony's vocabulary rebuilt from the model's tokenizer, in %s", folder)
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)  # where openai-harmony reads it
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def _vocabulary_of(tokenizer) -> Path | None:
    """A folder with o200k_base.tiktoken (each token's bytes in base64 and its rank, a line each) written
    from the tokenizer's first O200K_SIZE tokens, if that is OpenAI's file (tiktoken's own SHA-256)."""
    if len(tokenizer.get_vocab()) < O200K_SIZE:
        return None
    data = b"".join(base64.b64encode(tokenizer.token_bytes(i)) + b" %d\n" % i for i in range(O200K_SIZE))
    if hashlib.sha256(data).hexdigest() != O200K_SHA256:
        return None
    folder = cache_dir() / "o200k"
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f"o200k_base.tiktoken.{os.getpid()}.part"
    part.write_bytes(data)
    part.replace(folder / "o200k_base.tiktoken")  # whole or not at all, for another server starting too
    return folder


def _description(function: dict) -> ToolDescription:
    return ToolDescription.new(
        function["name"], function.get("description") or "", parameters=function.get("parameters")
    )


def _turn_messages(turn: Turn, names: dict[str, str]) -> list[Message]:
    role = turn.role
    if role in (TurnRole.SYSTEM, TurnRole.DEVELOPER):  # a later instruction stays where it is
        return [
            Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions(turn.text))
        ]
    if role == TurnRole.USER:
        return [Message.from_role_and_content(Role.USER, turn.text)]
    if role == TurnRole.TOOL:
        name = names.get(turn.tool_call_id or "", turn.name or "tool")
        author = Author.new(Role.TOOL, FUNCTIONS + name)
        return [
            Message.from_author_and_content(author, turn.text)
            .with_channel("commentary")
            .with_recipient("assistant")
        ]
    out = []
    if turn.thinking:
        out.append(Message.from_role_and_content(Role.ASSISTANT, turn.thinking).with_channel("analysis"))
    if turn.text:  # before calls: their preamble, on the commentary channel; alone: the answer
        channel = "commentary" if turn.tool_calls else "final"
        out.append(Message.from_role_and_content(Role.ASSISTANT, turn.text).with_channel(channel))
    for call in turn.tool_calls:
        message = Message.from_role_and_content(Role.ASSISTANT, call.arguments).with_channel("commentary")
        out.append(
            message.with_recipient(FUNCTIONS + call.qualified_name).with_content_type("<|constrain|>json")
        )
    return out


# -- the output ---------------------------------------------------------------------------------------------
@dataclass
class HarmonyEvents:
    """One choice's deltas -> its events, read from the tokens by Harmony's streaming parser. tools: the
    request's, to name a call's namespace (None: no tools; a call is then the model's text). show_thinking
    False: the reasoning is read and dropped. window_bound: as server.events.ChoiceEvents. Output the
    parser cannot read (a model that does not write Harmony) is passed on as the answer's text."""

    index: int
    harmony: HarmonyFormat
    tools: Sequence[ToolSpec] | None = None
    show_thinking: bool = True
    window_bound: bool = False
    thinking_tokens: int = 0
    calls: list[ToolCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.parser = StreamableParser(self.harmony.encoding, role=Role.ASSISTANT)
        self.broken = False  # past output the parser could not read: text from here on
        self.read = 0  # messages of the parser already turned into events
        self.header: list[int] = []  # the tokens of the message header under way

    def feed(self, d: Delta) -> list[Event]:
        if d.error:
            return [Failed(self.index, d.error_status, d.error, d.error_param)]
        events: list[Event] = []
        if self.broken:
            if d.text:
                events.append(TextDelta(self.index, d.text, tuple(d.logprobs)))
        else:
            events += self._tokens(d)
        if d.finish_reason is not None:
            if not self.broken:
                try:
                    self.parser.process_eos()  # a message cut short (max_tokens): what it holds counts
                except HarmonyError:
                    pass
                events += self._messages_done()
            events.append(Finished(self.index, self._reason(d), d.stop_string))
        return events

    def _tokens(self, d: Delta) -> list[Event]:
        events: list[Event] = []
        logprobs = tuple(d.logprobs)
        for k, token in enumerate(d.token_ids):
            try:
                self.parser.process(token)
            except HarmonyError as e:
                logger.info("output not in Harmony (%s): passed on as text", e)
                return events + self._break(list(d.token_ids[k:]), logprobs)
            self.header = self.header + [token] if self.parser.state == StreamState.HEADER else []
            if len(self.header) > MAX_HEADER_TOKENS:  # no header is this long: the output is not Harmony
                logger.info(
                    "output not in Harmony (a header of %d tokens): passed on as text", len(self.header)
                )
                return events + self._break(self.header + list(d.token_ids[k + 1 :]), logprobs)
            events += self._messages_done()
            analysis = self.parser.current_channel == "analysis"
            self.thinking_tokens += analysis and token != self.harmony.ids["<|message|>"]  # its content
            delta = self.parser.last_content_delta
            if not delta or self.parser.current_recipient:  # a call's arguments come whole, at its end
                continue
            if analysis:
                if self.show_thinking:
                    events.append(ThinkingDelta(self.index, delta))
            else:
                events.append(TextDelta(self.index, delta, logprobs))
                logprobs = ()
        if logprobs:
            events.append(TextDelta(self.index, "", logprobs))
        return events

    def _break(self, tokens: list[int], logprobs: tuple) -> list[Event]:
        """From here on the output is text: these tokens' text first."""
        self.broken = True
        return [TextDelta(self.index, self.harmony.encoding.decode(tokens), logprobs)]

    def _messages_done(self) -> list[Event]:
        """Calls among the messages the parser finished since the last look."""
        events: list[Event] = []
        for message in self.parser.messages[self.read :]:
            recipient = message.recipient or ""
            if message.author.role == Role.ASSISTANT and recipient.startswith(FUNCTIONS):
                arguments = "".join(c.text for c in message.content if hasattr(c, "text"))
                call = self._call(recipient[len(FUNCTIONS) :], arguments)
                self.calls.append(call)
                events.append(ToolCallDone(self.index, call))
        self.read = len(self.parser.messages)
        return events

    def _call(self, qualified: str, arguments: str) -> ToolCall:
        spec = next((t for t in self.tools or () if t.qualified_name == qualified), None)
        namespace, name = (spec.namespace, spec.name) if spec else (None, qualified)
        try:
            arguments = json.dumps(json.loads(arguments), ensure_ascii=False)
        except ValueError:
            pass  # passed on as the model wrote them
        return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments, namespace)

    def _reason(self, d: Delta) -> StopReason:
        if d.finish_reason == "length":
            return StopReason.CONTEXT if self.window_bound else StopReason.LENGTH
        if d.stop_string is not None:
            return StopReason.STOP_STRING
        return StopReason.TOOL_CALLS if self.calls else StopReason.END
