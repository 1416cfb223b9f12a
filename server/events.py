"""One typed event stream from the engine's output to every protocol's writer.

A choice's text deltas (server.generation) become events here, once for every protocol: thinking split off
where the model writes its think markers, tool calls split out of the text (server.tools.ToolCallStream), the
finish as a StopReason. A writer (server.chat, server.messages, server.responses, server.completions) only
renders events; `Answer` collects them for a whole, non-streamed response.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from minivllm.outputs import TokenLogprob
from server.conversation import ToolCall
from server.generation import Delta
from server.tools import ToolCalling, ToolCallStream, partial_suffix


class StopReason(str, Enum):
    END = "end"  # the model ended its answer
    STOP_STRING = "stop_string"  # one of the request's stop strings
    TOOL_CALLS = "tool_calls"  # the model ended its answer after calling tools
    LENGTH = "length"  # max_tokens
    CONTEXT = "context"  # the end of the context, before the max_tokens the request asked for


@dataclass(frozen=True)
class TextDelta:
    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ThinkingDelta:
    index: int
    text: str


@dataclass(frozen=True)
class ToolCallDone:
    """A complete call (calls are read once their end marker is out: they come whole)."""

    index: int
    call: ToolCall


@dataclass(frozen=True)
class Finished:
    index: int
    reason: StopReason
    stop_string: str | None = None


@dataclass(frozen=True)
class Failed:
    """The choice ended in an error: the request's own input (param set, a 400), the server stopping it
    (503) or an engine fault (500)."""

    index: int
    status: int
    message: str
    param: str | None = None


Event = TextDelta | ThinkingDelta | ToolCallDone | Finished | Failed


@dataclass(frozen=True)
class ThinkMarkers:
    """The model's thinking markers, and whether the prompt already opened thinking (templates that end
    the generation prompt with `<think>`)."""

    start: str
    end: str
    open_at_start: bool = False


@dataclass
class ChoiceEvents:
    """One choice's deltas -> its events. window_bound: the request asked more tokens than the context
    has room for, so a length finish is the context's end."""

    index: int
    tools: ToolCalling | None = None
    think: ThinkMarkers | None = None
    window_bound: bool = False
    in_thinking: bool = False
    answer_started: bool = False  # past the point where thinking may start
    held: str = ""  # text that may be the start of a marker
    thinking_tokens: int = 0

    def __post_init__(self) -> None:
        self.calls = ToolCallStream(self.tools) if self.tools is not None else None
        self.in_thinking = bool(self.think and self.think.open_at_start)

    def feed(self, d: Delta) -> list[Event]:
        if d.error:
            return [Failed(self.index, d.error_status, d.error, d.error_param)]
        final = d.finish_reason is not None
        if self.in_thinking:
            self.thinking_tokens += len(d.token_ids)
        events: list[Event] = []
        answer = ""
        for kind, text in self._split_thinking(d.text, final):
            if kind == "thinking":
                events.append(ThinkingDelta(self.index, text))
            else:
                answer += text
        if self.calls is not None:
            answer, calls = self.calls.feed(answer, final)
        else:
            calls = []
        if answer or d.logprobs:
            events.append(TextDelta(self.index, answer, tuple(d.logprobs)))
        events += [ToolCallDone(self.index, c) for c in calls]
        if final:
            events.append(Finished(self.index, self._reason(d), d.stop_string))
        return events

    def _reason(self, d: Delta) -> StopReason:
        if d.finish_reason == "length":
            return StopReason.CONTEXT if self.window_bound else StopReason.LENGTH
        if d.stop_string is not None:
            return StopReason.STOP_STRING
        return StopReason.TOOL_CALLS if self.calls and self.calls.calls else StopReason.END

    def _split_thinking(self, text: str, final: bool) -> list[tuple[str, str]]:
        """The text as (thinking | answer, piece) runs. Thinking starts only at the start of the answer
        (after whitespace) and ends at the end marker; a marker split across deltas is held back."""
        if self.think is None or (self.answer_started and not self.in_thinking):
            return [("answer", text)]
        buf, self.held, out = self.held + text, "", []
        while buf:
            if self.in_thinking:
                i = buf.find(self.think.end)
                if i < 0:
                    keep = 0 if final else partial_suffix(buf, self.think.end)
                    out.append(("thinking", buf[: len(buf) - keep]))
                    self.held = buf[len(buf) - keep :]
                    break
                out.append(("thinking", buf[:i]))
                buf = buf[i + len(self.think.end) :].lstrip()
                self.in_thinking, self.answer_started = False, True
                out.append(("answer", buf))
                break
            head = buf.lstrip()
            if head.startswith(self.think.start):
                buf = head[len(self.think.start) :]
                self.in_thinking = True
                continue
            if not final and (not head or self.think.start.startswith(head)):
                self.held = buf  # may still become the start marker
                break
            self.answer_started = True
            out.append(("answer", buf))
            break
        return [(kind, piece) for kind, piece in out if piece]


@dataclass
class Answer:
    """A whole choice, collected from its events (non-streamed responses)."""

    index: int
    text: str = ""
    thinking: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: Finished | None = None
    events: list[Event] = field(default_factory=list)  # all of them, in order

    def add(self, event: Event) -> None:
        self.events.append(event)
        if isinstance(event, TextDelta):
            self.text += event.text
            self.logprobs += event.logprobs
        elif isinstance(event, ThinkingDelta):
            self.thinking += event.text
        elif isinstance(event, ToolCallDone):
            self.calls.append(event.call)
        elif isinstance(event, Finished):
            self.finish = event

    @property
    def reason(self) -> StopReason:
        return self.finish.reason if self.finish else StopReason.END
