"""Tools on a model whose template writes calls in GLM-4.5's form (arguments as <arg_key>/<arg_value> tags,
mlx-lm's glm47 parser): a forced call's grammar follows the function's schema in that form, the answer's
call is parsed back, through the openai and anthropic SDKs."""

import json

import jsonschema
import llguidance
import llguidance.hf
import pytest

from minivllm.models.loader import load_tokenizer
from server.conversation import ToolSpec
from server.tools import ToolCalling
from tests.server_thread import ServerThread, tiny_settings
from tests.test_api import GET_TIME, WEATHER
from tests.test_generic_tools import forced_call_round_trip, forced_chat_call
from tests.tiny_model import GLM_CHAT_TEMPLATE, GLM_TOKENS, GLM_TOOL_TOKENS, make_tiny_model

# plain strings, an enum, an integer and an optional array: what the tags carry as raw text or JSON
FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "where"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "hours": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
GET_FORECAST = {"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST}}
# for a random model's answers: a raw string runs as long as the model writes, a closing tag being one token
# of hundreds (the grammar test above takes the raw text)
SHORT_FORECAST = FORECAST | {
    "properties": FORECAST["properties"] | {"city": {"type": "string", "enum": ["Oslo", "Lima"]}}
}


@pytest.fixture(scope="module")
def glm_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-glm-format")
    return make_tiny_model(
        path,
        chat_template=GLM_CHAT_TEMPLATE,
        special_tokens=GLM_TOKENS,
        added_tokens=GLM_TOOL_TOKENS,
        eos_token="<|user|>",
    )


@pytest.fixture(scope="module")
def server(glm_model_dir):
    with ServerThread(tiny_settings(glm_model_dir)) as s:
        yield s


def accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar's matcher takes the text's tokens to an accepting state."""
    ll = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=512)
    matcher = llguidance.LLMatcher(ll, f"start: call\n{grammar}", log_level=0)
    return matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()


def calling_of(tokenizer, tools, choice: str) -> ToolCalling:
    specs = [ToolSpec(t["function"]["name"], parameters=t["function"].get("parameters")) for t in tools]
    return ToolCalling.of_functions(specs, choice, True, False, tokenizer)


def test_the_grammar_of_a_forced_call_follows_the_schema_in_tags(glm_model_dir):
    tokenizer = load_tokenizer(str(glm_model_dir))
    calling = calling_of(tokenizer, [GET_FORECAST, GET_TIME], "get_forecast")
    assert calling.arg_tags is not None  # mlx-lm read the template as GLM's
    grammar = calling.call_grammar()
    call = "<tool_call>get_forecast\n<arg_key>city</arg_key>\n<arg_value>{}</arg_value>\n{}</tool_call>"
    rest = "<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
    assert accepts(tokenizer, grammar, call.format("São Paulo, if a < b", rest))
    compact = rest.replace("\n", "") + "<arg_key>hours</arg_key><arg_value>[9, 12]</arg_value>"
    assert accepts(tokenizer, grammar, call.format("Oslo", compact).replace("\n", ""))  # GLM-4.7's form
    for wrong in [
        call.format("Oslo", rest.replace("celsius", "kelvin")),  # not in the enum
        call.format("Oslo", rest.replace(">3<", ">9<")),  # past the maximum
        call.format("Oslo", rest.replace(">3<", '>"3"<')),  # an integer given as a string
        call.format("Oslo", rest.split("<arg_key>days")[0]),  # a required argument left out
        call.format(
            "Oslo", rest + "<arg_key>wind</arg_key>\n<arg_value>1</arg_value>\n"
        ),  # not in the schema
        '<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Oslo"}}\n</tool_call>',  # JSON
        "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>",  # not forced
    ]:
        assert not accepts(tokenizer, grammar, wrong), wrong
    # the tags are the tokenizer's added tokens, not their text spelled out
    assert "<[" in grammar and '"<arg_key>"' not in grammar


def test_a_schema_the_tags_cannot_hold_keeps_the_json_form(glm_model_dir):
    """WEATHER's city has a maxLength: raw text in a tag cannot be bounded, so its call is JSON, which
    mlx-lm's glm47 parser reads too."""
    tokenizer = load_tokenizer(str(glm_model_dir))
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
    grammar = calling_of(tokenizer, [weather], "required").call_grammar()
    arguments = {"city": "Oslo", "unit": "celsius", "days": 2}
    text = f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': arguments})}\n</tool_call>"
    assert accepts(tokenizer, grammar, text)
    call = calling_of(tokenizer, [weather], "required").parse(
        text.removeprefix("<tool_call>").removesuffix("</tool_call>")
    )
    assert call.name == "get_weather" and json.loads(call.arguments) == arguments


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_a_forced_call_in_tags_comes_back_as_a_call_valid_against_its_schema(server, stream):
    tool_choice = {"type": "function", "function": {"name": "get_forecast"}}
    forecast = {"type": "function", "function": {"name": "get_forecast", "parameters": SHORT_FORECAST}}
    name, arguments = forced_chat_call(server, [forecast, GET_TIME], tool_choice, stream)
    assert name == "get_forecast"
    jsonschema.validate(json.loads(arguments), SHORT_FORECAST)


def test_a_forced_call_in_tags_and_its_round_trip_through_the_messages_api(server):
    forced_call_round_trip(server, {"name": "get_forecast", "input_schema": SHORT_FORECAST})
