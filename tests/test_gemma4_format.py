"""Gemma 4's chat format. Tools on a model whose template writes calls in Gemma 4's form
(`call:NAME{key:value,...}` between `<|tool_call>` and `<tool_call|>`, strings between `<|"|>` delimiters:
mlx-lm's gemma4 parser): a forced call's grammar follows the function's schema in that form, and the call is
parsed back, through the openai and anthropic SDKs. Thinking between `<|channel>thought` and `<channel|>`
(markers of several tokens): a thinking block, closed at the budget."""

import json

import anthropic
import jsonschema
import pytest

from minivllm.models.loader import load_tokenizer
from tests.server_thread import ServerThread, tiny_settings
from tests.test_api import GET_TIME
from tests.test_generic_tools import forced_call_round_trip, forced_chat_call
from tests.test_tagged_tools import FORECAST, GET_FORECAST, SHORT_FORECAST, accepts, calling_of
from tests.tiny_model import (
    GEMMA4_CHAT_TEMPLATE,
    GEMMA4_THINK_TOKENS,
    GEMMA4_THINKING_TEMPLATE,
    GEMMA4_TOKENS,
    GEMMA4_TOOL_TOKENS,
    make_tiny_model,
)


@pytest.fixture(scope="module")
def gemma_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma4-format")
    return make_tiny_model(
        path,
        chat_template=GEMMA4_CHAT_TEMPLATE,
        special_tokens=GEMMA4_TOKENS,
        added_tokens=GEMMA4_TOOL_TOKENS,
        eos_token="<end_of_turn>",
    )


@pytest.fixture(scope="module")
def server(gemma_model_dir):
    with ServerThread(tiny_settings(gemma_model_dir)) as s:
        yield s


def test_the_grammar_of_a_forced_call_follows_the_schema_in_gemma4s_form(gemma_model_dir):
    tokenizer = load_tokenizer(str(gemma_model_dir))
    calling = calling_of(tokenizer, [GET_FORECAST, GET_TIME], "get_forecast")
    assert calling.gemma_quote is not None  # mlx-lm read the template as Gemma 4's
    grammar = calling.call_grammar()
    q = '<|"|>'
    call = "<|tool_call>call:get_forecast{{city:{q}{city}{q},unit:{q}celsius{q},days:3{rest}}}<tool_call|>"
    assert accepts(tokenizer, grammar, call.format(q=q, city="São Paulo, if a < b {x}", rest=""))
    assert accepts(tokenizer, grammar, call.format(q=q, city="Oslo", rest=",hours:[9, 12]"))
    for wrong in [
        call.format(q=q, city="Oslo", rest="").replace("celsius", "kelvin"),  # not in the enum
        call.format(q=q, city="Oslo", rest="").replace("days:3", "days:9"),  # past the maximum
        call.format(q=q, city="Oslo", rest="").replace("days:3", f"days:{q}3{q}"),  # a string for an integer
        call.format(q=q, city="Oslo", rest="").replace(",days:3", ""),  # a required argument left out
        call.format(q=q, city="Oslo", rest=",wind:1"),  # not in the schema
        '<|tool_call>{"name": "get_forecast", "arguments": {"city": "Oslo"}}<tool_call|>',  # JSON
        f"<|tool_call>call:get_time{{zone:{q}UTC{q}}}<tool_call|>",  # not the forced function
    ]:
        assert not accepts(tokenizer, grammar, wrong), wrong
    # the delimiters and markers are the tokenizer's added tokens, not their text spelled out
    assert "<[" in grammar and '"<|tool_call>"' not in grammar
    parsed = calling.parse(
        call.format(q=q, city="Oslo {x}", rest=",hours:[9]")[len("<|tool_call>") : -len("<tool_call|>")]
    )
    assert parsed.name == "get_forecast"
    assert json.loads(parsed.arguments) == {"city": "Oslo {x}", "unit": "celsius", "days": 3, "hours": [9]}
    jsonschema.validate(json.loads(parsed.arguments), FORECAST)


def test_optional_arguments_alone_and_none(gemma_model_dir):
    tokenizer = load_tokenizer(str(gemma_model_dir))
    optional = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": optional}}]
    grammar = calling_of(tokenizer, tools, "f").call_grammar()
    for text in ["{}", "{a:1}", "{b:true}", "{a:1,b:false}"]:
        assert accepts(tokenizer, grammar, f"<|tool_call>call:f{text}<tool_call|>"), text
    for text in ["{b:true,a:1}", "{,a:1}", "{a:1,}"]:
        assert not accepts(tokenizer, grammar, f"<|tool_call>call:f{text}<tool_call|>"), text


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_a_forced_call_in_gemma4s_form_comes_back_valid_against_its_schema(server, stream):
    tool_choice = {"type": "function", "function": {"name": "get_forecast"}}
    forecast = {"type": "function", "function": {"name": "get_forecast", "parameters": SHORT_FORECAST}}
    name, arguments = forced_chat_call(server, [forecast, GET_TIME], tool_choice, stream)
    assert name == "get_forecast"
    jsonschema.validate(json.loads(arguments), SHORT_FORECAST)


def test_a_forced_call_in_gemma4s_form_and_its_round_trip_through_the_messages_api(server):
    forced_call_round_trip(server, {"name": "get_forecast", "input_schema": SHORT_FORECAST})


def test_thinking_between_markers_of_several_tokens_is_a_thinking_block_closed_at_the_budget(tmp_path):
    path = make_tiny_model(
        tmp_path / "m",
        chat_template=GEMMA4_THINKING_TEMPLATE,
        special_tokens=GEMMA4_TOKENS + GEMMA4_THINK_TOKENS,
        eos_token="<end_of_turn>",
    )
    budget = 5
    with ServerThread(tiny_settings(path)) as server:
        claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        r, prompts = server.prompts_during(
            lambda: claude.messages.create(
                model="tiny",
                max_tokens=30,
                messages=[{"role": "user", "content": "Hi"}],
                thinking={"type": "enabled", "budget_tokens": budget},
                # greedy: sampled, the random model can close the thought itself (a flake seen in CI)
                extra_body={"temperature": 0},
            )
        )
        tok = server.engine.tokenizer
        first, second = prompts
        assert tok.decode(first).endswith("<start_of_turn>model\n<|channel>thought\n")
        assert second[: len(first)] == first and second[-1] == tok.added_token_id("<channel|>")
        assert len(second) - len(first) == budget + 1
        assert r.content[0].type == "thinking" and r.content[0].thinking
        assert all(b.type != "thinking" for b in r.content[1:])
