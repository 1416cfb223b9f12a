"""The OpenAI API honoured on the small random model, through the official openai client: structured
output, tool calls (forced, streamed, and a full round trip), sampling controls, and a 400 naming each
field that is refused."""

import asyncio
import collections
import json

import httpx
import jsonschema
import openai
import pytest

from tests.server_thread import ServerThread, assert_error, assert_refused, tiny_settings

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
MODEL = "tiny"
GET_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
}
GET_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_settings(tiny_model_dir, max_num_seqs=24)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}


# -- structured output ------------------------------------------------------------------------------------
def test_json_schema_output_validates_in_20_of_20_seeded_samples(server, client):
    kw = dict(
        model=MODEL, messages=ASK, response_format=_json_format(WEATHER), temperature=1.0, max_tokens=200
    )

    async def one(aclient: openai.AsyncOpenAI, seed: int) -> tuple[str, str]:
        if seed % 2:  # half streamed
            stream = await aclient.chat.completions.create(seed=seed, stream=True, **kw)
            text, reasons = "", []
            async for chunk in stream:
                text += chunk.choices[0].delta.content or ""
                reasons += [chunk.choices[0].finish_reason] if chunk.choices[0].finish_reason else []
            return text, reasons[-1]
        r = await aclient.chat.completions.create(seed=seed, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason

    async def main():
        async with server.async_client() as aclient:
            return await asyncio.gather(*(one(aclient, seed) for seed in range(18)))

    results = asyncio.run(main())
    sync = [client.chat.completions.create(seed=18, **kw), client.chat.completions.create(seed=19, **kw)]
    results += [(r.choices[0].message.content, r.choices[0].finish_reason) for r in sync]
    assert len(results) == 20
    for text, reason in results:
        jsonschema.validate(json.loads(text), WEATHER)
        assert reason == "stop"
    assert len({text for text, _ in results}) > 10  # sampled, not one forced answer
    server.wait_idle()


def test_json_object_output_is_an_object(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            response_format={"type": "json_object"},
            temperature=0.7,
            seed=seed,
            max_tokens=400,
            presence_penalty=1.0,  # with the penalties, the random model closes its strings sooner
        )
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:
            assert r.choices[0].message.content.startswith("{")


def test_parse_helper_of_the_client(client):
    """The openai client's own structured-output path (a strict json_schema, parsed by the client)."""
    r = client.chat.completions.parse(
        model=MODEL,
        messages=ASK,
        response_format=_json_format(WEATHER),
        temperature=1.0,
        seed=5,
        max_tokens=200,
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)


# -- tool calls -------------------------------------------------------------------------------------------
def _check_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_tool_choice_required_returns_a_valid_call(client):
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[GET_WEATHER],
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        _check_call(call, GET_WEATHER)


def test_named_tool_choice_calls_that_function(client):
    for name, tool in (("get_time", GET_TIME), ("get_weather", GET_WEATHER)):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[GET_WEATHER, GET_TIME],
            tool_choice={"type": "function", "function": {"name": name}},
            temperature=1.0,
            seed=1,
            max_tokens=200,
        )
        (call,) = r.choices[0].message.tool_calls
        _check_call(call, tool)


def test_streamed_tool_calls_sync_and_async(server, client):
    kw = dict(
        model=MODEL,
        messages=ASK,
        tools=[GET_WEATHER, GET_TIME],
        tool_choice="required",
        temperature=1.0,
        seed=3,
        max_tokens=200,
    )
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]

    def collect(chunks) -> tuple[dict, list]:
        calls, reasons = collections.defaultdict(lambda: {"id": None, "name": "", "arguments": ""}), []
        for chunk in chunks:
            choice = chunk.choices[0]
            assert not choice.delta.content
            for part in choice.delta.tool_calls or []:
                call = calls[part.index]
                call["id"] = call["id"] or part.id
                call["name"] += part.function.name or ""
                call["arguments"] += part.function.arguments or ""
            reasons += [choice.finish_reason] if choice.finish_reason else []
        return dict(calls), reasons

    sync_calls, reasons = collect(client.chat.completions.create(stream=True, **kw))
    assert reasons == ["tool_calls"] and list(sync_calls) == [0]
    assert (
        sync_calls[0]["name"] == whole.function.name
        and sync_calls[0]["arguments"] == whole.function.arguments
    )

    async def main():
        async with server.async_client() as aclient:
            stream = await aclient.chat.completions.create(stream=True, **kw)
            return [chunk async for chunk in stream]

    async_calls, reasons = collect(asyncio.run(main()))
    assert reasons == ["tool_calls"]
    assert async_calls[0]["arguments"] == whole.function.arguments
    # the client's own accumulator agrees
    with client.chat.completions.stream(**{k: v for k, v in kw.items()}) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.arguments == whole.function.arguments


def test_tool_round_trip_renders_the_history_into_the_prompt(server, client, monkeypatch):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[GET_WEATHER], tool_choice="required", temperature=0, max_tokens=200
    )
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    prompts = []
    add_request = server.engine.add_request
    monkeypatch.setattr(
        server.engine,
        "add_request",
        lambda rid, prompt, *a: prompts.append(prompt) or add_request(rid, prompt, *a),
    )
    final = client.chat.completions.create(model=MODEL, messages=history, tools=[GET_WEATHER], max_tokens=8)
    monkeypatch.undo()
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    tokenizer = server.engine.tokenizer
    expected_history = ASK + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.loads(call.function.arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    expected = tokenizer.apply_chat_template(
        expected_history, tools=[GET_WEATHER], add_generation_prompt=True
    )
    assert prompts == [expected]
    text = tokenizer.decode(prompts[0])
    assert f'{{"name": "get_weather", "arguments": {call.function.arguments}}}' in text  # the call, as made
    assert '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>' in text
    assert '"name": "get_weather"' in text.split("<tools>")[1]  # the tool's definition


def test_tool_choice_none_and_auto(server, client):
    none = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[GET_WEATHER], tool_choice="none", max_tokens=6, temperature=0
    )
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
    assert none.choices[0].message.content == plain.choices[0].message.content  # the tools stay out
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    auto = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[GET_WEATHER], max_tokens=6, temperature=0
    )
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are in the prompt
    assert auto.choices[0].message.tool_calls is None  # the random model writes no <tool_call> block


def test_auto_with_a_json_format_answers_json_or_a_call(client):
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=[GET_TIME],
            response_format=_json_format(WEATHER),
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        message = r.choices[0].message
        if message.tool_calls:
            _check_call(message.tool_calls[0], GET_TIME)
        else:
            jsonschema.validate(json.loads(message.content), WEATHER)


# -- sampling controls -------------------------------------------------------------------------------------
def test_logit_bias_plus_100_makes_greedy_output_that_token(server, client):
    token = server.engine.tokenizer.encode(" fox")[0]
    r = client.completions.create(
        model=MODEL,
        prompt="The quick brown",
        max_tokens=6,
        temperature=0,
        logit_bias={str(token): 100},
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].logprobs.tokens == [" fox"] * 6


def test_penalties_change_greedy_output_in_their_direction(client):
    def tokens(**extra) -> list[bytes]:
        r = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Paged attention stores keys"}],  # answered with repeats
            max_tokens=40,
            temperature=0,
            logprobs=True,
            extra_body={"ignore_eos": True, **extra.pop("extra_body", {})},
            **extra,
        )
        # a token's bytes name it (ids past the tokenizer's vocabulary have none: left out)
        return [bytes(t.bytes) for t in r.choices[0].logprobs.content if t.bytes]

    plain = tokens()
    assert max(collections.Counter(plain).values()) > 1
    assert max(collections.Counter(tokens(presence_penalty=2.0, frequency_penalty=2.0)).values()) == 1
    assert len(set(tokens(presence_penalty=-2.0))) < len(set(plain))
    repeated = {t for t, n in collections.Counter(plain).items() if n > 1}
    discouraged = tokens(extra_body={"repetition_penalty": 3.0})
    assert sum(discouraged.count(t) for t in repeated) < sum(plain.count(t) for t in repeated)


def test_logprobs_bytes_are_the_tokens_own(server, client):
    tokenizer = server.engine.tokenizer
    partial = next(  # a token holding one byte of a multi-byte UTF-8 character
        t for t in range(len(tokenizer.get_vocab())) if tokenizer.convert_ids_to_tokens(t) == "ä"
    )
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=2,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        logit_bias={str(partial): 100},
        extra_body={"ignore_eos": True},
    )
    first = r.choices[0].logprobs.content[0]
    assert first.bytes == [0xE4] and first.token == "\ufffd"
    for top in first.top_logprobs:  # the model's own alternatives (before the bias), bytes of their own
        assert bytes(top.bytes).decode(errors="replace") == top.token


def _partial_byte_token(tokenizer) -> int:
    """A token holding the first byte (0xE4) of a 3-byte UTF-8 character: alone, never a whole character."""
    return next(t for t in range(len(tokenizer.get_vocab())) if tokenizer.convert_ids_to_tokens(t) == "ä")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_output_ending_inside_a_character_is_the_decode_of_its_tokens(server, client, stream):
    """max_tokens cuts the output in the middle of multi-byte characters: the text is what decoding the
    generated tokens gives (U+FFFD for the incomplete bytes), not the characters completed so far."""
    tokenizer = server.engine.tokenizer
    partial = _partial_byte_token(tokenizer)
    kw = dict(
        model=MODEL,
        max_tokens=4,
        temperature=0,
        logit_bias={str(partial): 100},
        extra_body={"ignore_eos": True},
        stream=stream,
    )
    expected = tokenizer.decode([partial] * 4)
    assert expected and "\ufffd" in expected
    completion = client.completions.create(prompt="The quick brown", **kw)
    chat = client.chat.completions.create(messages=ASK, **kw)
    if stream:
        texts = ["".join(c.choices[0].text for c in completion if c.choices)]
        texts.append("".join(c.choices[0].delta.content or "" for c in chat if c.choices))
    else:
        texts = [completion.choices[0].text, chat.choices[0].message.content]
        assert completion.usage.completion_tokens == chat.usage.completion_tokens == 4
    assert texts == [expected, expected]


# -- refusals ---------------------------------------------------------------------------------------------
TEXT_PARTS = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"messages": [{"role": "user", "content": TEXT_PARTS}]}, "messages.0.content"),
        ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages.0.role"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
            "tool_choice",
        ),
        (
            {"tools": [GET_WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [GET_WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0.type"),
        ({"tools": [GET_WEATHER, GET_WEATHER]}, "tools"),
        ({"tools": [GET_WEATHER], "logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        (
            {
                "tools": [GET_WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": _json_format({"type": "strin"})}, "response_format"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}],
                "tool_choice": "required",
            },
            "tool_choice",
        ),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 2}, "min_p"),
        ({"logit_bias": {"5": 150}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        (
            {
                "messages": ASK
                + [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
                        ],
                    }
                ]
            },
            "messages.1.tool_calls.0.function.arguments",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                        ],
                    }
                ]
            },
            "messages.0",
        ),
    ],
)
def test_refused_chat_fields_are_400_naming_the_field(server, extra, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, **extra}
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=30)
        error = assert_refused(r, 400)  # a stream: an HTTP error, or (a grammar) its error event
        assert error["param"] == param, error


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"best_of": 2}, "best_of"),
        ({"presence_penalty": 9}, "presence_penalty"),
        ({"logit_bias": {"3": -101}}, "logit_bias"),
    ],
)
def test_refused_completion_fields_are_400_naming_the_field(server, extra, param):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}
    error = assert_error(httpx.post(server.url + "/v1/completions", json=body, timeout=30), 400)
    assert error["param"] == param, error


def test_refusals_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", best_of=3, n=1, max_tokens=2)
    assert e.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=ASK, functions=[{"name": "f", "parameters": {}}], max_tokens=2
        )
    assert e.value.body["param"] == "functions"


# -- models -----------------------------------------------------------------------------------------------
def test_model_by_id(server, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")


# -- tool-call parsing, piece by piece ------------------------------------------------------------------------
def _calling(choice: str = "auto"):
    from mlx_lm.tool_parsers import json_tools

    from server.chat import _tool
    from server.protocol import Tool
    from server.tools import ToolCalling

    return ToolCalling(
        tools=(_tool(Tool.model_validate(GET_WEATHER)), _tool(Tool.model_validate(GET_TIME))),
        choice=choice,
        parallel=True,
        start=json_tools.tool_call_start,
        end=json_tools.tool_call_end,
        parser=json_tools.parse_tool_call,
        bare_calls=choice == "auto",
    )


def _feed_in_pieces(text: str, size: int = 3, choice: str = "auto") -> tuple[list[str], list[dict]]:
    from server.tools import ToolCallStream

    stream = ToolCallStream(_calling(choice))
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    released, calls = [], []
    for k, piece in enumerate(pieces):
        content, new = stream.feed(piece, final=k == len(pieces) - 1)
        released.append(content)
        calls += new
    return released, calls


CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 2}}'


@pytest.mark.parametrize(
    "text",
    [
        f"<tool_call>\n{CALL_JSON}\n</tool_call>",
        f"\n```json\n{CALL_JSON}\n```\n",  # bare, fenced: how the small default model answers
        CALL_JSON,
    ],
)
def test_tool_calls_are_read_from_the_text_piece_by_piece(text):
    released, calls = _feed_in_pieces(text)
    assert "".join(released) == ""
    (call,) = calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius", "days": 2}


def test_text_around_and_between_calls_is_content():
    other = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
    text = f"Let me check.\n<tool_call>\n{CALL_JSON}\n</tool_call>\n<tool_call>\n{other}\n</tool_call>"
    released, calls = _feed_in_pieces(text)
    assert "".join(released) == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]


def test_what_is_not_a_call_stays_content_and_streams_early():
    code = "```python\nprint('hi')\n```"
    released, calls = _feed_in_pieces(code)
    assert "".join(released) == code and not calls
    assert any(released[:-1])  # released as it came, not held to the end
    broken = "<tool_call>\n{not json}\n</tool_call> after"
    released, calls = _feed_in_pieces(broken)
    assert "".join(released) == broken and not calls
    unknown = '{"name": "launch_rocket", "arguments": {}}'  # a bare JSON naming no tool is an answer
    released, calls = _feed_in_pieces(unknown)
    assert "".join(released) == unknown and not calls
    cut = '<tool_call>\n{"name": "get_wea'  # max_tokens in the middle of a call
    released, calls = _feed_in_pieces(cut)
    assert released[-1] == cut and not any(released[:-1]) and not calls
