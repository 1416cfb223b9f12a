"""Anthropic's Messages API on the small random model, through the official anthropic SDK (unchanged, as
Claude Code's users run it) and httpx for the raw events: messages, streams and their accumulation, token
counts and Anthropic's usage accounting, forced tool calls and their round trip, stop reasons, the billing
header kept out of the prefix, and errors in Anthropic's shape."""

import asyncio
import json

import anthropic
import httpx
import jsonschema
import pytest

from server import messages as m
from server.anthropic_protocol import MessagesRequest
from tests.server_thread import ServerThread, tiny_settings

MODEL = "tiny"
KEY = "sesame"
ASK = [{"role": "user", "content": "Paged attention stores keys and values"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
GET_WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}
GET_TIME = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}
GREEDY = {"extra_body": {"temperature": 0}}  # this SDK sends sampling fields in the body only this way


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    settings = tiny_settings(tiny_model_dir, api_key=KEY, max_request_bytes=1 << 20)
    with ServerThread(settings) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"x-api-key": KEY}, timeout=60, **kw)


def _events(server, body: dict) -> list[tuple[str, dict]]:
    """The raw SSE events of a streamed request: (event name, data)."""
    with httpx.stream(
        "POST", server.url + "/v1/messages", json={**body, "stream": True}, headers={"x-api-key": KEY}
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = []
    for frame in text.split("\n\n"):
        if frame:
            if frame.startswith(":"):  # an SSE comment (the prefix-cache report)
                continue
            event, data = frame.split("\n")
            assert event.startswith("event: ") and data.startswith("data: ")
            payload = json.loads(data[len("data: ") :])
            assert payload["type"] == event[len("event: ") :]
            events.append((payload["type"], payload))
    return events


def _assert_usage_adds_up(usage, prompt_tokens: int) -> None:
    parts = (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens)
    assert min(parts) >= 0 and sum(parts) == prompt_tokens


# -- messages and streams --------------------------------------------------------------------------------
def test_create_returns_a_message_whose_usage_adds_up_to_count_tokens(client):
    r = client.messages.create(model=MODEL, max_tokens=6, messages=ASK, **GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL and r.id.startswith("msg_")
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert [b.type for b in r.content] in ([], ["text"])
    assert 0 < r.usage.output_tokens <= 6
    count = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    _assert_usage_adds_up(r.usage, count)


def test_stream_accumulates_to_the_same_message(client):
    whole = client.messages.create(model=MODEL, max_tokens=8, messages=ASK, system="Be brief.", **GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=8, messages=ASK, system="Be brief.", **GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    count = client.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.").input_tokens
    _assert_usage_adds_up(final.usage, count)


def test_stream_events_come_in_anthropics_order(server):
    events = _events(server, {"model": MODEL, "max_tokens": 5, "messages": ASK, "temperature": 0})
    kinds = [k for k, _ in events]
    assert kinds[0] == "ping"  # sent with the headers, before the prompt is prefilled
    assert kinds[1] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[2:-2] == ["content_block_start"] + ["content_block_delta"] * (len(kinds) - 6) + [
        "content_block_stop"
    ]
    start = events[1][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] >= 0
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5


def test_pings_keep_a_slow_prefill_alive(server, monkeypatch):
    step = server.engine.step

    def slow_step():
        import time

        time.sleep(0.15)
        return step()

    monkeypatch.setattr(m.MessagesWriter, "keepalive_s", 0.03)
    monkeypatch.setattr(server.engine, "step", slow_step)
    events = _events(server, {"model": MODEL, "max_tokens": 2, "messages": ASK})
    monkeypatch.undo()
    kinds = [k for k, _ in events]
    first = kinds.index("message_start")
    assert first >= 3 and set(kinds[:first]) == {"ping"}
    assert "ping" not in kinds[first:]


def test_stop_sequence_is_reported(client):
    free = client.messages.create(model=MODEL, max_tokens=12, messages=ASK, **GREEDY).content[0].text
    # a stop sequence the greedy answer first holds at i > 0
    i = next(
        i for i in range(1, len(free) - 1) if free[i : i + 2].strip() and free.find(free[i : i + 2]) == i
    )
    stop = free[i : i + 2]
    r = client.messages.create(model=MODEL, max_tokens=12, messages=ASK, stop_sequences=[stop], **GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == free[:i]
    with client.messages.stream(
        model=MODEL, max_tokens=12, messages=ASK, stop_sequences=["\x00never", stop], **GREEDY
    ) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_max_tokens_is_the_stop_reason_when_reached(client):
    r = client.messages.create(model=MODEL, max_tokens=3, messages=ASK, **GREEDY)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3


def test_an_answer_that_reaches_the_end_of_the_context_stops_there(client):
    """max_tokens caps the answer; more than the context has room for is no refusal (Claude Code asks for
    32000 tokens whatever the context): the answer stops at the context's end, as at Anthropic."""
    base = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": ""}]).input_tokens
    long = [{"role": "user", "content": "界" * ((2048 - 6 - base) // 3)}]  # a byte-level BPE: 3 tokens each
    count = client.messages.count_tokens(model=MODEL, messages=long).input_tokens
    assert 2048 - 8 <= count < 2048
    r = client.messages.create(model=MODEL, max_tokens=4096, messages=long, **GREEDY)
    assert r.stop_reason == "model_context_window_exceeded" and r.usage.output_tokens == 2048 - count
    with client.messages.stream(model=MODEL, max_tokens=4096, messages=long, **GREEDY) as s:
        assert s.get_final_message().stop_reason == "model_context_window_exceeded"


def test_sampling_fields_from_the_body_are_honoured(client):
    greedy = client.messages.create(model=MODEL, max_tokens=8, messages=ASK, **GREEDY)
    top_1 = client.messages.create(
        model=MODEL, max_tokens=8, messages=ASK, extra_body={"temperature": 1, "top_k": 1}
    )
    assert top_1.content[0].text == greedy.content[0].text  # top_k 1: the most likely token, always
    narrow = client.messages.create(
        model=MODEL, max_tokens=8, messages=ASK, extra_body={"temperature": 1, "top_p": 1e-6}
    )
    assert narrow.content[0].text == greedy.content[0].text


def test_json_output_format_follows_its_schema(client):
    r = client.messages.create(
        model=MODEL,
        max_tokens=200,
        messages=ASK,
        output_config={"format": {"type": "json_schema", "schema": WEATHER}},
    )
    assert r.stop_reason == "end_turn"
    jsonschema.validate(json.loads(r.content[0].text), WEATHER)


# -- the billing header and the prefix cache ---------------------------------------------------------------
def _claude_code_request(cch: str) -> dict:
    billing = f"x-anthropic-billing-header: cc_version=2.1.90.3fa; cc_entrypoint=cli; cch={cch};"
    system = "You are an interactive agent that helps users with software engineering tasks. " * 3
    return {
        "system": [
            {"type": "text", "text": billing},
            {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Prefix caching reuses pages."}]}],
        "tools": [GET_WEATHER],
    }


def test_billing_header_is_kept_out_of_the_prefix(server, client):
    """Two turns of Claude Code differ in the billing header's cch only: the second restores (nearly)
    its whole prompt from the cache, and its usage adds up to its token count."""
    first = client.messages.create(
        model=MODEL, max_tokens=4, metadata={"user_id": "user_1"}, **_claude_code_request("a41f0")
    )
    request = _claude_code_request("0b7c3")
    count = client.messages.count_tokens(model=MODEL, **request).input_tokens
    assert count == client.messages.count_tokens(model=MODEL, **_claude_code_request("a41f0")).input_tokens
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens >= 0.9 * count
    _assert_usage_adds_up(first.usage, count)
    prompts = []
    add_request = server.engine.add_request
    server.engine.add_request = lambda rid, prompt, *a: prompts.append(prompt) or add_request(rid, prompt, *a)
    try:
        second = client.messages.create(model=MODEL, max_tokens=4, **request)
    finally:
        del server.engine.add_request
    assert second.usage.cache_read_input_tokens >= 0.9 * count
    assert second.usage.cache_creation_input_tokens == 0
    _assert_usage_adds_up(second.usage, count)
    text = server.engine.tokenizer.decode(prompts[0])
    assert "billing-header" not in text and "cch=" not in text and "interactive agent" in text


def test_a_billing_header_elsewhere_is_text():
    body = _claude_code_request("a41f0")
    body["system"].reverse()
    request = MessagesRequest.model_validate({"model": MODEL, "max_tokens": 1, **body})
    assert "cch=a41f0" in request.system_text()
    assert (
        MessagesRequest.model_validate(
            {"model": MODEL, "max_tokens": 1, **body, "system": body["system"][1]["text"]}
        )
        .system_text()
        .startswith("x-anthropic-billing-header:")
    )


# -- tools -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "choice, name",
    [({"type": "any"}, None), ({"type": "tool", "name": "get_time"}, "get_time")],
    ids=["any", "named"],
)
def test_forced_tool_call_is_a_schema_valid_tool_use(client, choice, name):
    kw = dict(model=MODEL, max_tokens=200, messages=ASK, tools=[GET_WEATHER, GET_TIME], tool_choice=choice)
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    for r in (whole, streamed):
        assert r.stop_reason == "tool_use"
        (block,) = [b for b in r.content if b.type == "tool_use"]
        assert block.id.startswith("toolu_") and (name is None or block.name == name)
        schema = {"get_weather": WEATHER, "get_time": GET_TIME["input_schema"]}[block.name]
        jsonschema.validate(block.input, schema)


def test_streamed_tool_use_is_one_input_json_delta(server):
    body = {"model": MODEL, "max_tokens": 200, "messages": ASK, "tools": [GET_WEATHER]}
    events = _events(server, {**body, "tool_choice": {"type": "any"}})
    starts = [e for k, e in events if k == "content_block_start"]
    (tool,) = [s for s in starts if s["content_block"]["type"] == "tool_use"]
    assert tool["content_block"]["input"] == {} and tool["content_block"]["name"] == "get_weather"
    deltas = [e["delta"] for k, e in events if k == "content_block_delta" and e["index"] == tool["index"]]
    assert [d["type"] for d in deltas] == ["input_json_delta"]
    jsonschema.validate(json.loads(deltas[0]["partial_json"]), WEATHER)
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_round_trip_renders_the_result_into_the_prompt(server, client):
    first = client.messages.create(
        model=MODEL, max_tokens=200, messages=ASK, tools=[GET_WEATHER], tool_choice={"type": "any"}
    )
    (call,) = first.content
    history = ASK + [
        {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": '{"temperature": 21}'},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
        {"role": "user", "content": "In Paris."},
    ]
    prompts = []
    add_request = server.engine.add_request
    server.engine.add_request = lambda rid, prompt, *a: prompts.append(prompt) or add_request(rid, prompt, *a)
    try:
        final = client.messages.create(model=MODEL, max_tokens=4, messages=history, tools=[GET_WEATHER])
    finally:
        del server.engine.add_request
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    text = server.engine.tokenizer.decode(prompts[0])
    arguments = json.dumps(call.input, ensure_ascii=False)
    assert f'{{"name": "get_weather", "arguments": {arguments}}}' in text  # the call, as made
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    assert "<|im_start|>user\nAnd tomorrow?\n\nIn Paris.<|im_end|>" in text  # consecutive turns: one
    count = client.messages.count_tokens(model=MODEL, messages=history, tools=[GET_WEATHER]).input_tokens
    assert count == len(prompts[0])


def test_a_failed_tool_result_says_so_in_the_prompt():
    body = MessagesRequest.model_validate(
        {
            "model": MODEL,
            "max_tokens": 1,
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "is_error": True,
                            "content": [{"type": "text", "text": "no such city"}],
                        }
                    ],
                },
            ],
        }
    )
    turns = m.parse(body).turns
    assert [t.role for t in turns] == ["user", "assistant", "tool"]
    assert turns[2].text == "Error: no such city" and turns[2].tool_call_id == "t1"
    assert turns[1].tool_calls[0].arguments == "{}"


def test_tool_choice_none_leaves_the_tools_out(client):
    plain = client.messages.create(model=MODEL, max_tokens=6, messages=ASK, **GREEDY)
    none = client.messages.create(
        model=MODEL, max_tokens=6, messages=ASK, tools=[GET_WEATHER], tool_choice={"type": "none"}, **GREEDY
    )
    assert none.content == plain.content and none.usage.output_tokens == plain.usage.output_tokens


def test_parallel_calls_can_be_disabled(client):
    choice = {"type": "any", "disable_parallel_tool_use": True}
    r = client.messages.create(
        model=MODEL, max_tokens=200, messages=ASK, tools=[GET_WEATHER], tool_choice=choice
    )
    assert [b.type for b in r.content] == ["tool_use"]


# -- errors ------------------------------------------------------------------------------------------------
def _block(kind: str) -> dict:
    return {"role": "user", "content": [{"type": kind, "source": {"type": "base64", "data": ""}}]}


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"messages": [_block("image")]}, "image"),
        ({"messages": [_block("document")]}, "document"),
        ({"thinking": {"type": "enabled"}}, "budget_tokens"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"container": "c_1"}, "container"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"speed": "fast"}, "speed"),
        ({"inference_geo": "us"}, "inference_geo"),
        ({"output_config": {"effort": "extreme"}}, "effort"),
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "context_management"),
        ({"metadata": {"user_id": "u", "session": "s"}}, "metadata.session"),
        ({"frequency_penalty": 1}, "frequency_penalty: Extra inputs are not permitted"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "bash_20250124"),
        ({"tools": [{**GET_WEATHER, "strict": True}]}, "strict"),
        ({"tools": [GET_WEATHER, GET_WEATHER]}, "unique"),
        ({"tools": [GET_WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"tools": [GET_WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
        ({"tool_choice": {"type": "any"}}, "tool_choice needs tools"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"temperature": 1.5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "界" * 3000}]}, "maximum context length is 2048 tokens"),
        ({"messages": ASK + [{"role": "assistant", "content": "The answer is"}]}, "prefill"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
                ]
            },
            "tool_use",
        ),
        (
            {
                "tools": [GET_WEATHER],
                "output_config": {"format": {"type": "json_schema", "schema": WEATHER}},
                "tool_choice": {"type": "any"},
            },
            "output_config.format",
        ),
    ],
)
def test_refusals_are_400s_in_anthropics_shape_naming_the_field(server, client, extra, named):
    body = {"model": MODEL, "max_tokens": 4, "messages": ASK, **extra}
    required = {k: body.pop(k) for k in ("model", "max_tokens", "messages")}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(**required, extra_body=body)  # every other field as the request's own JSON
    body |= required
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert named in e.value.body["error"]["message"], e.value.body
    streamed = _post(server, "/v1/messages", {**body, "stream": True})  # refused before the stream starts
    assert streamed.status_code == 400 and streamed.json() == e.value.body


def test_accepted_fields(client):
    r = client.messages.create(
        model=MODEL,
        max_tokens=2,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
                ],
            }
        ],
        system=[{"type": "text", "text": "Be brief."}],
        metadata={"user_id": "u"},
        service_tier="standard_only",
        thinking={"type": "disabled"},
        extra_body={"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}},
        extra_headers={"anthropic-beta": "context-management-2025-06-27"},
    )
    assert r.usage.output_tokens == 2


def test_claude_codes_query_and_headers_and_the_key_on_every_route(server):
    body = {"model": MODEL, "max_tokens": 2, "messages": ASK}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", "anthropic-beta": "prompt-caching-scope"}
    r = httpx.post(server.url + "/v1/messages?beta=true", json=body, headers=headers)
    assert r.status_code == 200 and r.json()["type"] == "message"
    r = httpx.post(
        server.url + "/v1/messages/count_tokens?beta=true", json=body | {"max_tokens": None}, headers=headers
    )
    assert r.status_code == 400  # max_tokens is not a count_tokens field, even null
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    missing = httpx.post(server.url + "/v1/messages/batches", json={}, headers=headers)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_count_tokens_refuses_generation_fields(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model=MODEL, messages=ASK, extra_body={"max_tokens": 4})
    assert "max_tokens" in e.value.body["error"]["message"]


def test_wrong_key_is_401_and_unknown_model_404(server, client):
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model=MODEL, messages=ASK)
    bearer = httpx.post(
        server.url + "/v1/messages",
        json={"model": MODEL, "max_tokens": 2, "messages": ASK},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert bearer.status_code == 200
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-sonnet-4-5" in str(e.value.body)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-sonnet-4-5", messages=ASK)


def test_too_large_is_413_in_anthropics_shape(server):
    big = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    r = _post(server, "/v1/messages", big)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    openai_shaped = _post(server, "/v1/chat/completions", big)
    assert (
        openai_shaped.status_code == 413 and openai_shaped.json()["error"]["type"] == "invalid_request_error"
    )


def test_engine_failure_is_an_error_event_and_a_500(server, client, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated step failure")

    monkeypatch.setattr(server.engine.runner, "launch", broken)
    with pytest.raises(anthropic.InternalServerError) as e:
        client.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "api_error"
    events = _events(server, {"model": MODEL, "max_tokens": 2, "messages": ASK})
    assert [k for k, _ in events] == ["ping", "message_start", "error"]  # the failure is the first output
    error = events[-1][1]["error"]
    assert error["type"] == "api_error" and "simulated" in error["message"]
    with pytest.raises(anthropic.APIStatusError, match="simulated"):
        with client.messages.stream(model=MODEL, max_tokens=2, messages=ASK) as s:
            s.get_final_message()
    monkeypatch.undo()
    server.wait_idle()


def test_full_queue_is_429_rate_limit_error(tiny_model_dir):
    """Whole: a 429. Streamed: the headers went out before the engine took the request, so the refusal
    is the stream's error event."""

    async def one(client: httpx.AsyncClient, stream: bool) -> str:
        body = {
            "model": MODEL,
            "max_tokens": 200,
            "messages": ASK,
            "stop_sequences": ["\x00"],
            "stream": stream,
        }
        r = await client.post("/v1/messages", json=body)
        if r.status_code == 429:
            assert r.json()["error"]["type"] == "rate_limit_error"
            return "429"
        assert r.status_code == 200
        if stream and "event: error" in r.text:
            error = json.loads(r.text.split("event: error\ndata: ")[1])
            assert error["error"]["type"] == "rate_limit_error" and "busy" in error["error"]["message"]
            return "error event"
        return "ok"

    async def main(url: str):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(one(client, stream=i % 2 == 1) for i in range(8)))

    with ServerThread(tiny_settings(tiny_model_dir, max_num_seqs=1, max_waiting=1)) as s:
        outcomes = asyncio.run(main(s.url))
    assert {"ok", "429", "error event"} <= set(outcomes), outcomes
