"""Each protocol's parse (request -> typed conversation) and writer (typed events -> response), and the event
stream between them, without a server or a model."""

import json
import zlib
from types import SimpleNamespace

import pytest

from server import chat, messages, responses
from server.anthropic_protocol import MessagesRequest
from server.conversation import ChoiceMode, Role, ThinkingMode, ToolCall, seal, unseal
from server.events import (
    Answer,
    ChoiceEvents,
    Finished,
    StopReason,
    TextDelta,
    ThinkingDelta,
    ThinkMarkers,
    ToolCallDone,
)
from server.generation import Delta, Usage
from server.protocol import ChatCompletionRequest
from server.responses_protocol import ResponsesRequest

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
USAGE = Usage(prompt=100, cached=64, created=16, completion=7, reasoning=3)


def _delta(text: str, reason: str | None = None, tokens: int = 1, stop: str | None = None) -> Delta:
    return Delta(0, text, [0] * tokens, [], reason, stop_string=stop)


# -- parse ----------------------------------------------------------------------------------------------
def test_chat_parse():
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "hmm",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": WEATHER}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "max_completion_tokens": 9,
            "user": "u",
            "reasoning_effort": "low",
        }
    )
    conv = chat.parse(body)
    assert [t.role for t in conv.turns] == [Role.SYSTEM, Role.USER, Role.ASSISTANT, Role.TOOL]
    assert conv.turns[1].text == "ab" and conv.turns[2].thinking == "hmm"
    assert conv.turns[2].tool_calls == (ToolCall("c1", "f", "{}"),) and conv.turns[3].tool_call_id == "c1"
    assert conv.tool_choice.mode == ChoiceMode.NAMED and conv.tool_choice.name == "f"
    assert conv.max_tokens == 9 and conv.names["max_tokens"] == "max_completion_tokens"
    assert conv.names["structured_output"] == "tool_choice"
    assert conv.ignored == ("user",) and conv.thinking_fields == ("reasoning_effort",)
    assert (conv.thinking.mode, conv.thinking.budget_tokens) == (ThinkingMode.ON, 1024)


def test_messages_parse_keeps_a_late_system_message_in_place_and_defers_tools():
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 32000,
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                {"type": "text", "text": "S"},
            ],
            "messages": [
                {"role": "user", "content": "go"},
                {"role": "system", "content": [{"type": "text", "text": "ENV"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "", "signature": seal("secret plan")},
                        {"type": "tool_use", "id": "t1", "name": "search", "input": {"q": "w"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "tool_reference", "tool_name": "weather"}],
                        }
                    ],
                },
            ],
            "tools": [
                {"name": "search", "input_schema": WEATHER},
                {"name": "weather", "input_schema": WEATHER, "defer_loading": True},
                {"name": "never", "input_schema": WEATHER, "defer_loading": True},
            ],
            "thinking": {"type": "enabled", "budget_tokens": 500},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        }
    )
    conv = messages.parse(body, {"anthropic-beta": "x"})
    assert [(t.role, t.source) for t in conv.turns] == [
        (Role.SYSTEM, -1),
        (Role.USER, 0),
        (Role.SYSTEM, 1),
        (Role.ASSISTANT, 2),
        (Role.TOOL, 3),
    ]
    assert conv.turns[0].text == "S" and conv.turns[3].thinking == "secret plan"
    assert conv.turns[4].text.startswith("Tool loaded: ") and '"weather"' in conv.turns[4].text
    assert [(t.name, t.listed) for t in conv.tools] == [("search", True), ("weather", False)]
    assert (conv.thinking.mode, conv.thinking.budget_tokens) == (ThinkingMode.ON, 500)
    assert conv.ignored == ("anthropic-beta",) and "thinking" in conv.thinking_fields


def test_messages_clear_thinking_keeps_the_last_turns_thinking():
    def assistant(thought):
        return {
            "role": "assistant",
            "content": [{"type": "thinking", "thinking": thought}, {"type": "text", "text": "ok"}],
        }

    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 1,
            "messages": [
                {"role": "user", "content": "1"},
                assistant("first"),
                {"role": "user", "content": "2"},
                assistant("second"),
                {"role": "user", "content": "3"},
            ],
            "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
        }
    )
    assert [t.thinking for t in messages.parse(body).turns if t.role == Role.ASSISTANT] == [None, "second"]


def test_responses_parse_flattens_namespaces_and_reads_its_own_reasoning():
    body = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "I",
            "input": [
                {"role": "developer", "content": "D"},
                {"role": "user", "content": "go"},
                {"type": "reasoning", "id": "rs", "summary": [], "encrypted_content": seal("plan")},
                {
                    "type": "function_call",
                    "call_id": "c",
                    "name": "spawn",
                    "namespace": "agents",
                    "arguments": "{}",
                },
                {"type": "function_call_output", "call_id": "c", "output": "done"},
                {"type": "reasoning", "id": "rs2", "summary": [], "encrypted_content": "gAAAA-foreign"},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
            ],
            "tools": [
                {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "spawn"}]},
                {"type": "function", "name": "f", "parameters": WEATHER},
                {"type": "web_search"},
            ],
            "reasoning": {"summary": "auto"},
            "prompt_cache_key": "k",
        }
    )
    conv = responses.parse(body)
    assert [t.role for t in conv.turns] == [
        Role.SYSTEM,
        Role.DEVELOPER,
        Role.USER,
        Role.ASSISTANT,
        Role.TOOL,
        Role.ASSISTANT,
    ]
    call_turn = conv.turns[3]
    assert call_turn.thinking == "plan" and call_turn.tool_calls[0].qualified_name == "agents.spawn"
    assert conv.turns[5].thinking is None  # another server's reasoning is left out
    assert [t.qualified_name for t in conv.tools] == ["agents.spawn", "f"]
    assert conv.ignored == ("prompt_cache_key",) and conv.thinking_fields == ("reasoning.summary",)


def test_a_seal_round_trips_and_nothing_else_unseals():
    assert unseal(seal("thinking, with ünicode")) == "thinking, with ünicode"
    assert unseal("gAAAAB-openai") is None and unseal(None) is None and unseal("mvl1.!!!") is None
    import base64

    bomb = "mvl1." + base64.urlsafe_b64encode(zlib.compress(b"a" * (8 << 20))).decode()
    assert unseal(bomb) is None  # inflates past the bound


# -- the event stream -----------------------------------------------------------------------------------
def test_thinking_split_across_deltas_with_markers_cut_anywhere():
    events = ChoiceEvents(0, think=ThinkMarkers("<think>", "</think>"))
    out = []
    for piece in [" <thi", "nk>plan", " A</th", "ink>\n\nAns", "wer"]:
        out += events.feed(_delta(piece))
    out += events.feed(_delta("", "stop"))
    thinking = "".join(e.text for e in out if isinstance(e, ThinkingDelta))
    text = "".join(e.text for e in out if isinstance(e, TextDelta))
    assert (thinking, text) == ("plan A", "Answer")
    assert out[-1] == Finished(0, StopReason.END)
    assert events.thinking_tokens == 2  # the tokens of the deltas that began while thinking


def test_an_answer_without_thinking_passes_through_and_think_is_then_text():
    events = ChoiceEvents(0, think=ThinkMarkers("<think>", "</think>"))
    out = events.feed(_delta("Hi <think>"))
    assert [e.text for e in out if isinstance(e, TextDelta)] == ["Hi <think>"]


@pytest.mark.parametrize(
    "reason, stop, window_bound, expected",
    [
        ("stop", None, False, StopReason.END),
        ("stop", "##", False, StopReason.STOP_STRING),
        ("length", None, False, StopReason.LENGTH),
        ("length", None, True, StopReason.CONTEXT),
    ],
)
def test_stop_reasons(reason, stop, window_bound, expected):
    events = ChoiceEvents(0, window_bound=window_bound)
    assert events.feed(_delta("x", reason, stop=stop))[-1] == Finished(0, expected, stop)


# -- writers ----------------------------------------------------------------------------------------------
def _answer(*events) -> Answer:
    answer = Answer(0)
    for e in events:
        answer.add(e)
    return answer


CALL = ToolCall("call_abc", "get_weather", '{"city": "Paris"}', namespace="tools")
EVENTS = [
    ThinkingDelta(0, "plan"),
    TextDelta(0, "Checking."),
    ToolCallDone(0, CALL),
    Finished(0, StopReason.TOOL_CALLS),
]


def test_chat_writer():
    state = SimpleNamespace(token_text=str, token_bytes=lambda t: b"")
    conv = chat.parse(
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    )
    body = chat.ChatWriter(state, conv).response("chatcmpl-1", "m", [_answer(*EVENTS)], USAGE)
    message = body["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ("Checking.", "plan")
    assert message["tool_calls"][0]["function"] == {"name": "tools.get_weather", "arguments": CALL.arguments}
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3
    chunks = [
        json.loads(c.removeprefix("data: "))
        for e in EVENTS
        for c in chat.ChatWriter(state, conv).event("r", "m", e)
    ]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "reasoning_content": "plan"}


def test_messages_writer_streams_thinking_with_its_signature():
    conv = messages.parse(
        MessagesRequest.model_validate(
            {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
        )
    )
    writer = messages.MessagesWriter(conv)
    frames = [f for e in EVENTS for f in writer.event("msg-1", "m", e)]
    kinds = [json.loads(f.split("data: ", 1)[1])["type"] for f in frames]
    assert kinds[:4] == [
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
    ]
    signature = json.loads(frames[2].split("data: ", 1)[1])["delta"]
    assert signature["type"] == "signature_delta" and unseal(signature["signature"]) == "plan"
    whole = messages.MessagesWriter(conv).response("msg-1", "m", [_answer(*EVENTS)], USAGE)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use"]
    assert whole["stop_reason"] == "tool_use" and whole["content"][2]["name"] == "get_weather"
    assert whole["usage"] == {
        "input_tokens": 20,
        "cache_creation_input_tokens": 16,
        "cache_read_input_tokens": 64,
        "output_tokens": 7,
        "service_tier": "standard",
    }


def test_responses_writer_orders_reasoning_message_and_calls():
    body = ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": "x",
            "include": ["reasoning.encrypted_content"],
            "reasoning": {"summary": "auto"},
        }
    )
    out = responses.ResponsesWriter(body).response("resp-1", "m", [_answer(*EVENTS)], USAGE)
    kinds = [item["type"] for item in out["output"]]
    assert kinds == ["reasoning", "message", "function_call"]
    reasoning, _, call = out["output"]
    assert unseal(reasoning["encrypted_content"]) == "plan" and reasoning["summary"][0]["text"] == "plan"
    assert (call["namespace"], call["name"], call["call_id"]) == ("tools", "get_weather", "call_abc")
    assert out["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
