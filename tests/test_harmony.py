"""gpt-oss's Harmony on every protocol: a tiny random gpt-oss model with gpt-oss's own vocabulary, its prompt
rendered by openai-harmony, its output read back as reasoning, answer and tool calls, through the official
openai and anthropic SDKs. A forced call reasons first (within the thinking budget), then calls, its
arguments valid against the schema; a tool's result goes back as Harmony's tool message."""

import asyncio
import json
import os
import subprocess
import sys

import anthropic
import jsonschema
import openai
import pytest
from openai_harmony import (
    Author,
    DeveloperContent,
    HarmonyEncodingName,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)
from openai_harmony import Conversation as HarmonyConversation

from server.events import Finished, TextDelta, ThinkingDelta, ToolCallDone
from server.generation import Delta
from server.harmony import HarmonyEvents, HarmonyFormat
from tests.server_thread import ServerThread, tiny_settings
from tests.tiny_model import harmony_vocabulary, make_tiny_harmony_model

MODEL = "tiny"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "A forecast", "parameters": WEATHER},
    }
]
FORCED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris for 2 days?"},
]


@pytest.fixture(scope="module")
def vocabulary(tmp_path_factory):
    return harmony_vocabulary(tmp_path_factory.mktemp("o200k"))


@pytest.fixture(scope="module")
def encoding(vocabulary):
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@pytest.fixture(scope="module")
def server(tmp_path_factory, vocabulary):
    path = make_tiny_harmony_model(tmp_path_factory.mktemp("gpt-oss"), vocabulary)
    with ServerThread(tiny_settings(path, kv_cache_bytes=16 << 20)) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_the_tokenizer_is_gpt_oss_own(server, encoding):
    """The fixture's tokenizer (converted from o200k_base) tokenizes as Harmony's encoding does."""
    tok = server.engine.tokenizer
    for text in ["Hello, world! 12345 héllo\n\n  def f(x):\n\treturn x", "日本語 🙂 <|channel|> Ünïcödé"]:
        assert tok.encode(text, add_special_tokens=False) == encoding.encode(text, allowed_special="all")
    assert tok.added_token_id("<|call|>") == 200012


def test_a_forced_call_reasons_within_its_budget_then_calls_valid_against_its_schema(server, oai):
    r = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=FORCED, reasoning_effort="minimal", max_tokens=600
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning and 0 < r.usage.completion_tokens_details.reasoning_tokens <= 256  # minimal's budget
    server.wait_idle()


def test_a_forced_call_without_reasoning_asked_calls_at_once(server, oai, claude):
    """No effort, no thinking field: the grammar starts with the call (the reasoning gpt-oss would write
    first has no bound the request set), as a forced call does on every model."""
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=FORCED, max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert (
        r.usage.completion_tokens_details.reasoning_tokens == 0 and r.choices[0].finish_reason == "tool_calls"
    )
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    m = claude.messages.create(
        model=MODEL, max_tokens=60, messages=ASK[1:], tools=tools, tool_choice={"type": "any"}
    )
    assert [b.type for b in m.content] == ["tool_use"] and m.stop_reason == "tool_use"
    jsonschema.validate(m.content[0].input, WEATHER)
    server.wait_idle()


def test_the_prompt_is_harmonys_own_rendering_with_the_tool_result(server, oai, encoding):
    """A history with a call and its result renders as openai-harmony renders those messages: the tools
    in the developer message, the call on the commentary channel, the result from functions.get_weather."""
    arguments = '{"city": "Paris", "days": 2}'
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 C"},
    ]
    r, prompts = server.prompts_during(
        lambda: oai.chat.completions.create(
            model=MODEL, messages=history, tools=TOOLS, reasoning_effort="low", max_tokens=3
        ),
    )
    assert r.choices[0].finish_reason == "length"
    developer = DeveloperContent.new().with_instructions("Be brief.")
    developer = developer.with_function_tools(
        [ToolDescription.new("get_weather", "A forecast", parameters=WEATHER)]
    )
    expected = [
        Message.from_role_and_content(
            Role.SYSTEM, SystemContent.new().with_reasoning_effort(ReasoningEffort.LOW)
        ),
        Message.from_role_and_content(Role.DEVELOPER, developer),
        Message.from_role_and_content(Role.USER, ASK[1]["content"]),
        Message.from_role_and_content(Role.ASSISTANT, arguments)
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), "Sunny, 21 C")
        .with_channel("commentary")
        .with_recipient("assistant"),
    ]
    rendered = encoding.render_conversation_for_completion(
        HarmonyConversation.from_messages(expected), Role.ASSISTANT
    )
    assert prompts == [rendered]
    text = encoding.decode(rendered)
    assert (
        "Reasoning: low" in text
        and "<|start|>functions.get_weather to=assistant<|channel|>commentary" in text
    )
    server.wait_idle()


def test_where_each_turn_ends_in_the_prompt(server, encoding):
    """Breakpoints (pins) and the prefix-cache report find turns by the prompt's tokens before each: each
    turn a run of Harmony's messages, at any reasoning level."""
    from server.conversation import Role as TurnRole
    from server.conversation import Thinking, ThinkingMode, Turn

    prompts = server.app.state.server.prompts
    turns = (
        Turn(TurnRole.SYSTEM, "Be brief."),
        Turn(TurnRole.USER, "Hi"),
        Turn(TurnRole.ASSISTANT, "Hello"),
        Turn(TurnRole.USER, "Bye"),
    )
    low = Thinking(ThinkingMode.ON, 256)  # "Reasoning: low" in the system message
    ids = asyncio.run(prompts.chat(turns, None, None, None, low))
    ends = asyncio.run(prompts.message_ends(turns, None, ids, [1, 2, 3, 4], low))
    assert encoding.decode(ids[ends[0] : ends[1]]) == "<|start|>user<|message|>Hi<|end|>"
    assert (
        encoding.decode(ids[ends[1] : ends[2]]) == "<|start|>assistant<|channel|>final<|message|>Hello<|end|>"
    )
    assert encoding.decode(ids[ends[3] :]) == "<|start|>assistant"
    assert asyncio.run(prompts.message_at(turns, None, ids, ends[2], low)) == 3
    assert asyncio.run(prompts.message_at(turns, None, ids, ends[2] - 1, low)) == 2


def test_anthropic_streams_a_thinking_block_then_a_tool_use_block_and_sends_the_result_back(server, claude):
    tools = [{"name": "get_weather", "description": "A forecast", "input_schema": WEATHER}]
    with claude.messages.stream(
        model=MODEL,
        max_tokens=400,
        messages=[{"role": "user", "content": "Weather in Paris for 2 days?"}],
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
        thinking={"type": "enabled", "budget_tokens": 64},
    ) as stream:
        r = stream.get_final_message()
    assert [b.type for b in r.content] == ["thinking", "tool_use"] and r.stop_reason == "tool_use"
    assert r.content[0].thinking and r.content[0].signature
    use = r.content[1]
    jsonschema.validate(use.input, WEATHER)
    history = [
        {"role": "user", "content": "Weather in Paris for 2 days?"},
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]},
    ]
    (again, prompts) = server.prompts_during(
        lambda: claude.messages.create(model=MODEL, max_tokens=3, messages=history, tools=tools)
    )
    text = server.engine.tokenizer.decode(prompts[0])
    # the reasoning before the call stays (the turn is not over), then the call, then its result
    call = f"<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{json.dumps(use.input)}<|call|>"
    assert f"<|channel|>analysis<|message|>{r.content[0].thinking}<|end|>" + call in text
    assert text.endswith(
        f"{call}<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>Sunny<|end|><|start|>assistant"
    )
    assert again.stop_reason == "max_tokens"
    server.wait_idle()


def test_responses_streams_a_reasoning_item_and_a_function_call(server, oai):
    tools = [{"type": "function", "name": "get_weather", "description": "A forecast", "parameters": WEATHER}]
    with oai.responses.stream(
        model=MODEL,
        input="Weather in Rome for 3 days?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        reasoning={"effort": "minimal"},
        max_output_tokens=600,
    ) as stream:
        final = stream.get_final_response()
    kinds = [item.type for item in final.output]
    assert kinds == ["reasoning", "function_call"]
    assert final.output[0].content or final.output[0].summary or final.output[0].encrypted_content
    jsonschema.validate(json.loads(final.output[1].arguments), WEATHER)
    server.wait_idle()


def test_a_thinking_budget_closes_the_reasoning_message_and_opens_the_next(server, claude, encoding):
    """A free answer's reasoning stops at the budget: the engine's second request continues from the
    prompt, the reasoning, `<|end|>` and the next message's header."""
    budget = 8
    r, prompts = server.prompts_during(
        lambda: claude.messages.create(
            model=MODEL,
            max_tokens=30,
            messages=[{"role": "user", "content": "Hi"}],
            thinking={"type": "enabled", "budget_tokens": budget},
            extra_body={"temperature": 0},  # greedy: a sampled model could close it itself
        ),
    )
    first, second = prompts
    closing = encoding.encode("<|end|><|start|>assistant", allowed_special="all")
    assert second[: len(first)] == first and second[-len(closing) :] == closing
    assert len(second) - len(first) - len(closing) == budget  # the random model never closes it itself
    assert r.usage.output_tokens <= 30
    server.wait_idle()


def test_thinking_off_hides_the_reasoning_and_a_json_answer_follows_its_schema(server, oai):
    r = oai.chat.completions.create(
        model=MODEL,
        messages=ASK,
        reasoning_effort="none",
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}},
        max_tokens=200,
    )
    message = r.choices[0].message
    assert not (message.model_extra or {}).get("reasoning_content") and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), WEATHER)
    server.wait_idle()


def test_offline_the_vocabulary_is_rebuilt_from_the_models_own_tokenizer(server, vocabulary, tmp_path):
    """Where openai-harmony finds no vocabulary (none where TIKTOKEN_ENCODINGS_BASE points, no network), the
    server writes it from the model's tokenizer, checked against OpenAI's file, and serves."""
    (tmp_path / "empty").mkdir()
    env = {
        **os.environ,
        "TIKTOKEN_ENCODINGS_BASE": str(tmp_path / "empty"),
        "MINIVLLM_CACHE_DIR": str(tmp_path),
    }
    env["TIKTOKEN_RS_CACHE_DIR"] = str(tmp_path / "empty")
    script = (
        "import sys; from minivllm.models.loader import load_tokenizer; from server.prompts import PromptBuilder\n"
        "p = PromptBuilder(load_tokenizer(sys.argv[1]), 4096); print(p.harmony.stop_tokens)"
    )
    model = server.app.state.server.settings.model
    done = subprocess.run(
        [sys.executable, "-c", script, model], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(200002, 200012)"  # <|return|>, <|call|>
    assert (tmp_path / "o200k" / "o200k_base.tiktoken").read_bytes() == vocabulary.read_bytes()


# -- the output parser on Harmony's own tokens ------------------------------------------------------------
def _deltas(tokens: list[int], pieces: int = 3) -> list[Delta]:
    """The tokens as a stream of deltas (the last finished, its stop token cut, as the generation does)."""
    size = max(1, len(tokens) // pieces)
    chunks = [tokens[i : i + size] for i in range(0, len(tokens), size)]
    return [Delta(0, "", c, [], "stop" if k == len(chunks) - 1 else None) for k, c in enumerate(chunks)]


def test_the_parser_reads_reasoning_a_preamble_the_answer_and_calls(vocabulary, encoding):
    harmony = HarmonyFormat(_TokenizerOfEncoding(encoding))
    text = (
        "<|channel|>analysis<|message|>Paris, two days.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city":"Paris","days":2}'
    )
    events = []
    parser = HarmonyEvents(0, harmony)
    for d in _deltas(encoding.encode(text, allowed_special="all")):
        events += parser.feed(d)
    assert "".join(e.text for e in events if isinstance(e, ThinkingDelta)) == "Paris, two days."
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Checking."
    (call,) = [e.call for e in events if isinstance(e, ToolCallDone)]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert events[-1] == Finished(0, "tool_calls")
    hidden = HarmonyEvents(0, harmony, show_thinking=False)
    answer = "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Sunny."
    out = [e for d in _deltas(encoding.encode(answer, allowed_special="all")) for e in hidden.feed(d)]
    assert [type(e) for e in out if not isinstance(e, TextDelta)] == [Finished]
    assert "".join(e.text for e in out if isinstance(e, TextDelta)) == "Sunny." and out[-1].reason == "end"


def test_output_that_is_not_harmony_is_passed_on_as_text(vocabulary, encoding):
    harmony = HarmonyFormat(_TokenizerOfEncoding(encoding))
    parser = HarmonyEvents(0, harmony)
    tokens = encoding.encode("<|channel|>final<|message|>Hi<|end|>oops", allowed_special="all")
    events = parser.feed(Delta(0, "", tokens, [], None)) + parser.feed(Delta(0, "more", [], [], "stop"))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text.startswith("Hi") and "oops" in text and text.endswith("more")
    # a model that never writes a message header's end (an untrained one): its text, once the header is
    # longer than any real one
    rambling = HarmonyEvents(0, harmony)
    words = encoding.encode(" the quick brown fox" * 40)
    first, rest = words[:100], words[100:]  # each delta with its text, as the generation gives it
    events = rambling.feed(Delta(0, encoding.decode(first), first, [], None))
    events += rambling.feed(Delta(0, encoding.decode(rest), rest, [], "length"))
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == " the quick brown fox" * 40


class _TokenizerOfEncoding:
    """The one tokenizer method HarmonyFormat asks: an added token's id."""

    def __init__(self, encoding):
        self.encoding = encoding

    def added_token_id(self, text: str) -> int:
        return self.encoding.encode(text, allowed_special="all")[0]
