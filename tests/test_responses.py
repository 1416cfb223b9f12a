"""POST /v1/responses on the tiny model, through the official openai client unchanged (and httpx for the raw
events): the response object and its events as the SDK's own models define them, tools forced and round
tripped, text.format, cached tokens, and a 400 naming each refused field."""

import json
from typing import get_args

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.server_thread import ServerThread, assert_error, tiny_settings

MODEL = "tiny"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
GET_WEATHER = {"type": "function", "name": "get_weather", "description": "The weather", "parameters": WEATHER}
GET_TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
    "strict": True,
}
ASK = "What is the weather in Paris?"
JSON_FORMAT = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}}
# the SDK's typed event models, by their `type`
EVENT_MODELS = {
    get_args(m.model_fields["type"].annotation)[0]: m for m in get_args(get_args(ResponseStreamEvent)[0])
}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_settings(tiny_model_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _post(server, body: dict) -> httpx.Response:
    content = json.dumps({"model": MODEL, **body})  # ASCII, lone surrogates escaped as JSON allows
    return httpx.post(
        server.url + "/v1/responses",
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )


def _events(server, body: dict) -> list[dict]:
    """The raw SSE events of a streamed request, each checked against the SDK's model of its type."""
    r = _post(server, {**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    blocks = r.text.strip().split("\n\n")
    assert blocks[0] == ": ping"  # an SSE comment with the headers, before the prompt is prefilled
    events = []
    for block in blocks[1:]:
        if block.startswith(":"):
            continue  # a keep-alive (more come until the first output) or the prefix-cache report
        (kind, data) = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        EVENT_MODELS[event["type"]].model_validate(event)
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _without_ids(output) -> list[dict]:
    """Output items as the server writes them, ids left out (parsed_arguments: the SDK's own, for strict tools)."""
    items = [item if isinstance(item, dict) else item.model_dump(exclude_none=True) for item in output]
    return [
        {k: v for k, v in item.items() if k not in ("id", "call_id", "parsed_arguments")} for item in items
    ]


def _counts(usage) -> tuple[int, int, int]:
    """The token counts of a usage (its cached tokens depend on what ran before)."""
    return usage.input_tokens, usage.output_tokens, usage.total_tokens


def _prompts_sent(server, monkeypatch, call) -> list[list[int]]:
    prompts = []
    add_request = server.engine.add_request
    monkeypatch.setattr(
        server.engine,
        "add_request",
        lambda rid, prompt, *a: prompts.append(prompt) or add_request(rid, prompt, *a),
    )
    call()
    monkeypatch.undo()
    return prompts


# -- the response object --------------------------------------------------------------------------------------
def test_a_response_is_the_sdks_response_and_answers_as_chat_does(server, client):
    r = _post(server, {"input": ASK, "max_output_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    Response.model_validate(body)  # every field as the SDK's model defines it
    assert body["id"].startswith("resp_") and body["object"] == "response" and body["store"] is False
    assert (body["status"], body["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    (message,) = body["output"]
    assert (
        message["type"] == "message" and message["id"].startswith("msg_") and message["role"] == "assistant"
    )
    assert message["status"] == "incomplete"
    (part,) = message["content"]
    assert part["type"] == "output_text" and part["annotations"] == []
    usage = body["usage"]
    assert usage["output_tokens"] == 6 and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=6, temperature=0
    )
    assert part["text"] == chat.choices[0].message.content  # the same prompt, the same greedy answer
    assert usage["input_tokens"] == chat.usage.prompt_tokens
    sdk = client.responses.create(model=MODEL, input=ASK, max_output_tokens=6, temperature=0)
    assert sdk.output_text == part["text"]


def test_instructions_and_input_items_render_as_the_chat_messages(server, client, monkeypatch):
    """instructions are the system message; typed messages (text parts, the developer role), the model's
    function calls and their outputs are the chat turns a chat request would send; reasoning is left out."""
    call = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer briefly."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}],
        },
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 21}'},
        {"role": "user", "content": "Thanks"},
    ]
    messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        {"role": "user", "content": "Thanks"},
    ]
    chat_tool = {"type": "function", "function": {k: v for k, v in GET_WEATHER.items() if k != "type"}}
    prompts = _prompts_sent(
        server,
        monkeypatch,
        lambda: (
            client.responses.create(
                model=MODEL, instructions="Be kind.", input=items, tools=[GET_WEATHER], max_output_tokens=1
            ),
            client.chat.completions.create(model=MODEL, messages=messages, tools=[chat_tool], max_tokens=1),
        ),
    )
    assert len(prompts) == 2 and prompts[0] == prompts[1]
    text = server.engine.tokenizer.decode(prompts[0])
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text and "opaque" not in text


# -- streaming -------------------------------------------------------------------------------------------------
def test_streamed_events_build_the_whole_response(server, client):
    """Every event validates as the SDK's model of its type, in OpenAI's order; the SDK's accumulator ends
    with the output of the same request unstreamed."""
    kw = dict(model=MODEL, input=ASK, text=JSON_FORMAT, temperature=0, max_output_tokens=60)
    whole = client.responses.create(**kw)
    assert whole.status == "completed" and whole.completed_at is not None
    events = _events(server, {k: v for k, v in kw.items() if k != "model"})
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole.output_text and json.loads(text).keys() == {"city", "days"}
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text and final["usage"]["output_tokens"] > 0
    assert len({e["response"]["id"] for e in events if "response" in e}) == 1
    with client.responses.stream(**kw) as stream:
        for event in stream:
            assert event.type in EVENT_MODELS
        accumulated = stream.get_final_response()
    assert _without_ids(accumulated.output) == _without_ids(whole.output)
    assert accumulated.output_text == whole.output_text
    assert _counts(accumulated.usage) == _counts(whole.usage)


def test_a_streamed_response_cut_by_max_output_tokens_is_incomplete(server, client):
    whole = client.responses.create(model=MODEL, input=ASK, max_output_tokens=5, temperature=0)
    events = _events(server, {"input": ASK, "max_output_tokens": 5, "temperature": 0})
    last = events[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert _without_ids(last["response"]["output"]) == _without_ids(whole.output)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == whole.output_text
    with client.responses.create(
        model=MODEL, input=ASK, max_output_tokens=5, temperature=0, stream=True
    ) as s:
        assert [e.type for e in s][-1] == "response.incomplete"


def test_an_engine_fault_fails_the_response(server, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated step failure")

    monkeypatch.setattr(server.engine.runner, "launch", broken)
    assert "simulated step failure" in assert_error(_post(server, {"input": "hi"}), 500)["message"]
    events = _events(server, {"input": "hi"})
    monkeypatch.undo()
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "simulated step failure" in failed["error"]["message"]
    server.wait_idle()


def test_a_request_the_server_aborts_ends_with_an_error_event(server, monkeypatch):
    """An abort (the server shutting down) is no fault of the response: an `error` event, or a 503."""
    from minivllm.outputs import FinishReason, RequestOutput

    engine = server.app.state.server.engine
    generate = engine.generate

    async def aborted_after_one_output(rid, prompt, params, cache=None):
        async for out in generate(rid, prompt, params, cache):
            yield out
            break  # closing the engine's stream aborts the request there
        yield RequestOutput(
            rid, [], finished=True, finish_reason=FinishReason.ABORT, error="server shutting down"
        )

    monkeypatch.setattr(engine, "generate", aborted_after_one_output)
    assert assert_error(_post(server, {"input": ASK}), 503)["message"] == "server shutting down"
    events = _events(server, {"input": ASK})
    monkeypatch.undo()
    assert events[-1] == {
        "type": "error",
        "code": "server_unavailable",
        "message": "server shutting down",
        "param": None,
        "sequence_number": len(events) - 1,
    }
    server.wait_idle()


# -- tools -----------------------------------------------------------------------------------------------------
def _check_call(item, tool: dict) -> dict:
    assert item.type == "function_call" and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id.startswith("call_") and item.name == tool["name"]
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, tool["parameters"])
    return arguments


@pytest.mark.parametrize(
    "choice, tool",
    [("required", None), ({"type": "function", "name": "get_time"}, GET_TIME)],
    ids=["required", "named"],
)
def test_a_forced_call_is_one_valid_function_call_whole_or_streamed(server, client, choice, tool):
    kw = dict(
        model=MODEL,
        input=ASK,
        tools=[GET_WEATHER, GET_TIME, {"type": "web_search"}],
        tool_choice=choice,
        temperature=1.0,
        max_output_tokens=200,
        extra_body={"seed": 3},
    )
    whole = client.responses.create(**kw)
    assert whole.status == "completed" and whole.output_text == ""
    (item,) = whole.output
    _check_call(item, tool or {"get_weather": GET_WEATHER, "get_time": GET_TIME}[item.name])
    assert [t.name for t in whole.tools] == ["get_weather", "get_time"]  # the tools the model was offered
    with client.responses.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert _without_ids(streamed.output) == _without_ids(whole.output)  # seeded: the same call
    events = _events(server, {k: v for k, v in kw.items() if k not in ("model", "extra_body")} | {"seed": 3})
    added = next(e for e in events if e["type"] == "response.output_item.added")["item"]
    assert (added["arguments"], added["status"]) == ("", "in_progress")


def test_a_call_round_trips_with_its_output(server, client, monkeypatch):
    """The call, as the SDK returns it, and its output go back in the next input: the model sees both, as
    chat renders an assistant tool call and its tool result."""
    first = client.responses.create(
        model=MODEL,
        input=ASK,
        tools=[GET_WEATHER],
        tool_choice="required",
        temperature=0,
        max_output_tokens=200,
    )
    (call,) = first.output
    history = [
        {"role": "user", "content": ASK},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'},
    ]
    prompts = _prompts_sent(
        server,
        monkeypatch,
        lambda: client.responses.create(model=MODEL, input=history, tools=[GET_WEATHER], max_output_tokens=4),
    )
    text = server.engine.tokenizer.decode(prompts[0])
    assert f'{{"name": "get_weather", "arguments": {call.arguments}}}' in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text


def test_built_in_tools_are_left_out(server, client):
    """Codex CLI sends web_search, local_shell or custom tools along with its functions: they are not in the
    prompt (the model cannot call them here), nor in the response's tools; naming one in tool_choice is a 400."""
    built_in = [{"type": "web_search"}, {"type": "local_shell"}, {"type": "custom", "name": "apply_patch"}]
    kw = dict(model=MODEL, input=ASK, max_output_tokens=1)
    plain = client.responses.create(**kw)
    skipped = client.responses.create(tools=built_in, **kw)
    assert skipped.usage.input_tokens == plain.usage.input_tokens and skipped.tools == []
    one = client.responses.create(tools=[GET_WEATHER], **kw)
    mixed = client.responses.create(tools=[*built_in, GET_WEATHER], **kw)
    assert mixed.usage.input_tokens == one.usage.input_tokens > plain.usage.input_tokens
    assert [t.name for t in mixed.tools] == ["get_weather"]


# -- text.format, usage, the request's settings -------------------------------------------------------------
def test_json_schema_and_json_object_formats(client):
    for seed in range(3):
        r = client.responses.create(
            model=MODEL,
            input=ASK,
            text=JSON_FORMAT,
            temperature=1.0,
            max_output_tokens=200,
            extra_body={"seed": seed},
        )
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), WEATHER)
        assert r.text.format.type == "json_schema" and r.text.format.schema_ == WEATHER
    r = client.responses.create(
        model=MODEL,
        input=ASK,
        text={"format": {"type": "json_object"}},
        temperature=0.7,
        max_output_tokens=400,
        extra_body={"seed": 0, "presence_penalty": 1.0},
    )
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)
    else:
        assert r.output_text.startswith("{")


def test_a_repeated_input_reports_cached_tokens(client):
    long_input = "Prefix caching reuses the KV cache of a shared prompt prefix across requests. " * 3
    first = client.responses.create(model=MODEL, input=long_input, max_output_tokens=2, temperature=0)
    again = client.responses.create(model=MODEL, input=long_input, max_output_tokens=2, temperature=0)
    assert first.usage.input_tokens == again.usage.input_tokens > 32
    assert 16 <= again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens  # whole pages


def test_settings_are_echoed_and_codex_requests_are_served(server):
    """A request as Codex CLI sends it (instructions, developer and user messages, function and built-in
    tools, reasoning null, store false, include [], a prompt_cache_key) streams to its end."""
    shell = {
        "type": "function",
        "name": "shell",
        "description": "Runs a shell command",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "array", "items": {"type": "string"}}},
            "required": ["command"],
            "additionalProperties": False,
        },
    }
    body = {
        "instructions": "You are a coding agent.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "sandbox: none"}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "List the files"}],
            },
        ],
        "tools": [shell, {"type": "web_search"}],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": None,
        "store": False,
        "include": [],
        "prompt_cache_key": "c0ffee",
        "max_output_tokens": 4,
        "metadata": {"session": "s1"},
    }
    last = _events(server, body)[-1]["response"]
    assert last["status"] in ("completed", "incomplete") and last["prompt_cache_key"] == "c0ffee"
    assert last["parallel_tool_calls"] is False and last["metadata"] == {"session": "s1"}
    assert last["instructions"] == "You are a coding agent." and [t["name"] for t in last["tools"]] == [
        "shell"
    ]
    r = _post(
        server,
        {
            "input": "hi",
            "max_output_tokens": 1,
            "reasoning": {"effort": "none"},
            "include": ["reasoning.encrypted_content"],
        },
    )
    assert r.status_code == 200 and r.json()["reasoning"]["effort"] == "none", r.text


# -- refusals --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"tools": [{"type": "banana"}]}, "tools.0.type"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools.0"),
        ({"tools": [GET_WEATHER, GET_WEATHER]}, "tools"),
        ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tools": [GET_WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        (
            {
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "strin"}}],
                "tool_choice": "required",
            },
            "tool_choice",
        ),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}},
            "text.format",
        ),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"text": {"verbosity": "loud"}}, "text.verbosity"),
        ({"tools": [GET_WEATHER], "tool_choice": "required", "text": JSON_FORMAT}, "text.format"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "\ud800"}}, "metadata.k"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"\ud800": {}}}]}, "tools.0.parameters"),
        ({"max_tokens": 4}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x" * 20_000}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.message.content",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.message.role"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
            "input.0.function_call.arguments",
        ),
    ],
)
def test_refused_fields_are_400_naming_the_field(server, extra, param):
    body = {"input": ASK, "max_output_tokens": 2, **extra}
    error = assert_error(_post(server, body), 400)
    assert error["param"] == param, error
    r = _post(server, {**body, "stream": True})
    if r.status_code == 200:  # refused by the engine (the grammar), after the headers: the error event
        blocks = r.text.strip().split("\n\n")
        event = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))
        assert blocks[0] == ": ping" and event["type"] == "error" and event["code"] == "invalid_request_error"
        assert event["message"] == error["message"] and event["param"] == param
    else:
        assert assert_error(r, 400) == error


def test_refusals_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=ASK, previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id" and "stateless" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=ASK, store=True)
    assert e.value.body["param"] == "store"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-17", input=ASK)
