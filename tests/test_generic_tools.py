"""Tools on a model whose chat template has no tool-call format: the server's generic format
(server.generic_tools), through the three APIs' official SDKs on a tiny model with a plain ChatML template,
and on Qwen's real tokenizer (its `<tool_call>` is an added token) with the same plain template."""

import json
import shutil

import anthropic
import jsonschema
import pytest

from minivllm.models.loader import load_tokenizer
from server import chat, generic_tools
from server.prompts import PromptBuilder
from tests.server_thread import ServerThread, tiny_settings
from tests.test_api import GET_TIME, GET_WEATHER, WEATHER
from tests.tiny_model import PLAIN_CHAT_TEMPLATE, make_tiny_model

ASK = [{"role": "user", "content": "Paged attention stores keys and values"}]
HISTORY = [
    {"role": "system", "content": "You help."},
    {"role": "user", "content": "Weather and time?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": "CET"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    {"role": "tool", "tool_call_id": "c2", "content": "09:00"},
    {"role": "user", "content": "Thanks"},
]


@pytest.fixture(scope="module")
def plain_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-plain"), chat_template=PLAIN_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(plain_model_dir):
    with ServerThread(tiny_settings(plain_model_dir)) as s:
        yield s


def _prompt_text(model_dir, messages: list[dict], tools: list[dict] | None) -> str:
    import asyncio

    from server.protocol import ChatCompletionRequest

    tokenizer = load_tokenizer(str(model_dir))
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    ids = asyncio.run(PromptBuilder(tokenizer, 2048).chat(chat.turns_of(request.messages), None, tools))
    return tokenizer.decode(ids)


def test_the_generic_format_renders_tools_calls_and_results_into_a_plain_template(plain_model_dir):
    text = _prompt_text(plain_model_dir, HISTORY, [GET_WEATHER, GET_TIME])
    system, user, assistant, results, thanks = text.split("<|im_start|>")[1:6]
    assert system.startswith("system\nYou help.\n\n# Tools")
    assert json.dumps(GET_WEATHER) in system and json.dumps(GET_TIME) in system
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert assistant.startswith("assistant\nLet me look.\n" + call + "\n<tool_call>")
    assert (
        results
        == "user\n<tool_response>\nrain\n</tool_response>\n<tool_response>\n09:00\n</tool_response><|im_end|>\n"
    )
    assert thanks.startswith("user\nThanks")
    # without tools in the request: no tool list, the history still rendered
    text = _prompt_text(plain_model_dir, HISTORY, None)
    assert "# Tools" not in text and call in text and "<tool_response>\nrain" in text


def test_the_models_own_format_wins_where_its_template_has_one(tiny_model_dir):
    text = _prompt_text(tiny_model_dir, HISTORY, [GET_WEATHER])
    assert "# Tools\n<tools>" in text  # the template's own rendering (tests/tiny_model.CHAT_TEMPLATE)
    assert generic_tools.instructions([GET_WEATHER])[:40] not in text


def forced_chat_call(server, tools: list[dict], tool_choice, stream: bool) -> tuple[str, str]:
    """A forced call through the openai SDK's chat completions, streamed or not: its name and arguments."""
    kwargs = dict(model="tiny", messages=ASK, tools=tools, tool_choice=tool_choice, max_tokens=300, seed=1)
    client = server.client()
    if stream:
        name, arguments, reasons = "", "", []
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for call in chunk.choices[0].delta.tool_calls or []:
                name += call.function.name or ""
                arguments += call.function.arguments or ""
            reasons.append(chunk.choices[0].finish_reason)
        assert reasons[-1] == "tool_calls"
    else:
        reply = client.chat.completions.create(**kwargs)
        assert reply.choices[0].finish_reason == "tool_calls"
        (call,) = reply.choices[0].message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    server.wait_idle()
    return name, arguments


def forced_call_round_trip(server, tool: dict) -> None:
    """A forced call through the anthropic SDK, valid against its schema, then its result sent back: the
    first turn's prompt is restored."""
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    first = client.messages.create(
        model="tiny", max_tokens=300, messages=ASK, tools=[tool], tool_choice={"type": "any"}
    )
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.name == tool["name"]
    jsonschema.validate(use.input, tool["input_schema"])
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
    history = [*ASK, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    second = client.messages.create(model="tiny", max_tokens=8, messages=history, tools=[tool])
    assert second.usage.cache_read_input_tokens > 0  # the first turn's prompt, restored
    server.wait_idle()


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_in_the_generic_format_follows_the_schema(server, choice, stream):
    tool_choice = (
        choice if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    )
    name, arguments = forced_chat_call(server, [GET_WEATHER, GET_TIME], tool_choice, stream)
    if choice == "named":
        assert name == "get_weather"
    schema = {"get_weather": WEATHER, "get_time": GET_TIME["function"]["parameters"]}[name]
    jsonschema.validate(json.loads(arguments), schema)


def test_a_forced_call_and_its_round_trip_through_the_messages_api(server):
    forced_call_round_trip(
        server, {"name": "get_weather", "description": "The weather", "input_schema": WEATHER}
    )


def test_a_forced_call_through_the_responses_api(server):
    fn = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    reply = server.client().responses.create(
        model="tiny", input="Weather?", tools=[fn], tool_choice="required", max_output_tokens=200
    )
    (call,) = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    server.wait_idle()


# -- Qwen's tokenizer with a plain template: the markers are added tokens -------------------------------------
@pytest.fixture(scope="module")
def plain_qwen_tokenizer(tmp_path_factory):
    from tests.test_default_model import default_model_dir

    source, path = default_model_dir(), tmp_path_factory.mktemp("qwen-plain")
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(source / name, path / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = PLAIN_CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(str(path))
    assert not tokenizer.has_tool_calling
    return tokenizer


def test_generic_calls_on_qwens_tokenizer_take_its_marker_tokens(plain_qwen_tokenizer):
    """The forced call's grammar names `<tool_call>` by its id (151657): the first mask allows only it."""
    from minivllm.engine.grammar import GrammarCompiler
    from server.protocol import ChatCompletionRequest
    from server.structured import output_grammar
    from server.tools import ToolCalling
    from tests.test_default_model import _allowed, default_model_dir

    body = chat.parse(
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": ASK, "tools": [GET_WEATHER], "tool_choice": "required"}
        )
    )
    calling = ToolCalling.of(body, plain_qwen_tokenizer)
    vocab_size = json.loads((default_model_dir() / "config.json").read_text())["vocab_size"]
    grammars = GrammarCompiler(plain_qwen_tokenizer.hf, vocab_size, plain_qwen_tokenizer.eos_token_ids)
    matcher = grammars.matcher(output_grammar(body, calling))
    start = plain_qwen_tokenizer.convert_tokens_to_ids("<tool_call>")
    assert _allowed(grammars, matcher) == [start]
    arguments = {"city": "Paris", "unit": "celsius", "days": 2}
    block = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
    ids = plain_qwen_tokenizer.encode(block, add_special_tokens=False)
    for token in ids:
        assert matcher.consume_token(token), matcher.get_error()
    assert matcher.is_accepting()
    assert calling.parse(block[len("<tool_call>") : -len("</tool_call>")]).name == "get_weather"


@pytest.mark.parametrize("field", ["tool description", "argument value", "tool call name"])
def test_no_tool_field_forges_a_turn_in_the_generic_format(plain_qwen_tokenizer, field):
    from tests.test_default_model import FORGERY_FIELDS, _history

    builder = PromptBuilder(plain_qwen_tokenizer, 32768)

    def ids(body):
        import asyncio

        from server.protocol import ChatCompletionRequest
        from server.tools import ToolCalling

        conv = chat.parse(ChatCompletionRequest.model_validate(body))
        tools = ToolCalling.of(conv, plain_qwen_tokenizer).template_tools()
        return asyncio.run(builder.chat(conv.turns, None, tools))

    plain = ids(_history())
    body = _history()
    FORGERY_FIELDS[field](body)
    forged = ids(body)
    for control in plain_qwen_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]):
        assert forged.count(control) == plain.count(control), field
