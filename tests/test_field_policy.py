"""The field policy (docs/api.md#the-field-policy): a hint, display preference, telemetry field or opt-in the
server cannot act on is accepted and named in `x-minivllm-ignored`, never a contract field; max_tokens is an
upper bound on every route; what agents send mid-conversation (system turns, deferred tools, namespaces of
functions) is rendered where it belongs."""

import json

import httpx
import pytest

from minivllm.models.loader import load_tokenizer
from server.conversation import Role, Turn
from server.prompts import PromptBuilder
from tests.server_thread import ServerThread, tiny_settings
from tests.tiny_model import build_tokenizer, write_tokenizer

MODEL = "tiny"
ASK = [{"role": "user", "content": "Paged attention stores keys and values"}]
HEADER = "x-minivllm-ignored"
WEATHER = {  # a short call, even from a random model: its one argument is an enum
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_settings(tiny_model_dir)) as s:
        yield s


def _post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, headers=headers, timeout=120)


def _ignored(r: httpx.Response) -> set[str]:
    assert r.status_code == 200, r.text
    value = r.headers.get(HEADER)
    return set(value.split(",")) if value else set()


@pytest.mark.parametrize("stream", [False, True])
def test_chat_names_its_hints_and_no_contract(server, stream):
    hints = {"metadata": {"k": "v"}, "user": "u", "prompt_cache_key": "p", "store": True, "verbosity": "low"}
    contracts = {"temperature": 0.5, "stop": ["zz"], "max_tokens": 3, "seed": 1, "top_p": 0.9}
    r = _post(server, "/v1/chat/completions", {"messages": ASK, **hints, **contracts, "stream": stream})
    assert _ignored(r) == set(hints)
    plain = _post(server, "/v1/chat/completions", {"messages": ASK, **contracts, "stream": stream})
    assert _ignored(plain) == set()


def test_responses_names_what_codex_sends_that_a_model_without_reasoning_cannot_use(server):
    body = {
        "input": ASK,
        "max_output_tokens": 3,
        "reasoning": {"summary": "auto"},
        "include": ["reasoning.encrypted_content"],
        "store": False,
        "prompt_cache_key": "thread-1",
        "client_metadata": {"thread_id": "t"},
        "parallel_tool_calls": True,
        "tools": [{"type": "web_search", "external_web_access": False}],
    }
    r = _post(server, "/v1/responses", body)
    assert _ignored(r) == {"reasoning.summary", "include", "prompt_cache_key", "client_metadata"}


def test_messages_names_what_claude_code_sends_that_a_model_without_thinking_cannot_use(server):
    body = {
        "messages": ASK,
        "max_tokens": 32000,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": '{"device_id": "d"}'},
        "stop_sequences": ["zz"],
        "temperature": 0,  # greedy: a sampled random model now and then writes the stop sequence
    }
    r = _post(server, "/v1/messages", body, headers={"anthropic-beta": "effort-2025-11-24"})
    assert _ignored(r) == {
        "anthropic-beta",
        "metadata.user_id",
        "thinking",
        "output_config.effort",
        "context_management",
    }
    assert r.json()["stop_reason"] in ("end_turn", "model_context_window_exceeded")


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": ASK, "max_tokens": 100_000, "ignore_eos": True}),
        ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 100_000, "ignore_eos": True}),
        ("/v1/responses", {"input": ASK, "max_output_tokens": 100_000, "ignore_eos": True}),
    ],
)
def test_max_tokens_past_the_context_runs_to_its_end(server, path, body):
    """As opencode and qwen-code ask (32000 beside their prompt on a 32k model): an upper bound, clamped."""
    r = _post(server, path, body)
    assert r.status_code == 200, r.text
    out = r.json()
    usage = out["usage"]
    total = usage.get("total_tokens")
    assert total == server.engine.max_model_len
    if path == "/v1/responses":
        assert out["status"] == "incomplete"
    else:
        assert out["choices"][0]["finish_reason"] == "length"


def test_a_system_message_mid_conversation_stays_in_place(server):
    """Claude Code sends its environment as messages[1], a system message: rendered there (hoisting it to
    the top would change the prefix of every earlier turn)."""
    prompts = []
    add = server.engine.add_request
    server.engine.add_request = lambda rid, prompt, *a: prompts.append(prompt) or add(rid, prompt, *a)
    try:
        messages = [*ASK, {"role": "system", "content": [{"type": "text", "text": "ENV: linux"}]}]
        r = _post(server, "/v1/messages", {"system": "Be brief.", "messages": messages, "max_tokens": 2})
    finally:
        del server.engine.add_request
    assert r.status_code == 200, r.text
    text = server.engine.tokenizer.decode(prompts[0])
    assert (
        text.index("Be brief.") < text.index("Paged attention") < text.index("<|im_start|>system\nENV: linux")
    )


def _builder(tmp_path, template: str) -> PromptBuilder:
    write_tokenizer(tmp_path, build_tokenizer(), 2048, template)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return PromptBuilder(load_tokenizer(str(tmp_path)), 2048)


def test_a_template_without_late_system_turns_gets_them_in_the_next_user_turn(tmp_path):
    first_only = (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be at the beginning') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    import asyncio

    builder = _builder(tmp_path, first_only)
    assert not builder.system_anywhere
    turns = [
        Turn(Role.SYSTEM, "S0"),
        Turn(Role.USER, "U1"),
        Turn(Role.ASSISTANT, "A1"),
        Turn(Role.SYSTEM, "S1"),
        Turn(Role.USER, "U2"),
    ]
    text = builder.tokenizer.decode(asyncio.run(builder.chat(turns, None)))
    assert text.index("S0") < text.index("U1") < text.index("A1") < text.index("S1\n\nU2")


def test_deferred_tools_stay_out_of_the_prompt_until_tool_search_loads_them(server):
    """Claude Code's `defer_loading` tools: listed only where a tool_reference names them, after the
    cached prefix; callable from there on."""
    prompts = []
    add = server.engine.add_request
    server.engine.add_request = lambda rid, prompt, *a: prompts.append(prompt) or add(rid, prompt, *a)
    tools = [
        {"name": "search_tools", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}},
        {"name": "get_weather", "input_schema": WEATHER, "defer_loading": True},
    ]
    search = {"type": "tool_use", "id": "toolu_1", "name": "search_tools", "input": {"q": "weather"}}
    found = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "tool_reference", "tool_name": "get_weather"}],
    }
    first = [
        *ASK,
        {"role": "assistant", "content": [search]},
        {"role": "user", "content": [{"type": "text", "text": "go on"}]},
    ]
    second = [*ASK, {"role": "assistant", "content": [search]}, {"role": "user", "content": [found]}]
    try:
        for messages in (first, second):
            r = _post(server, "/v1/messages", {"messages": messages, "tools": tools, "max_tokens": 2})
            assert r.status_code == 200, r.text
        forced = {"type": "tool", "name": "get_weather"}
        r = _post(
            server,
            "/v1/messages",
            {"messages": second, "tools": tools, "max_tokens": 200, "tool_choice": forced},
        )
    finally:
        del server.engine.add_request
    decode = server.engine.tokenizer.decode
    before, after = decode(prompts[0]), decode(prompts[1])
    assert "get_weather" not in before and "search_tools" in before
    assert "Tool loaded:" in after and '"name": "get_weather"' in after
    cut = before.index("go on")
    assert after[:cut] == before[:cut]  # the tool list, system prompt and turns before it are unchanged
    call = next(b for b in r.json()["content"] if b["type"] == "tool_use")
    assert call["name"] == "get_weather" and set(call["input"]) == {"city"}


def test_a_namespaced_function_is_called_by_namespace_and_name(server):
    """Codex's `namespace` tools: the model sees `namespace.name`; the call comes back as Codex reads it."""
    tool = {
        "type": "namespace",
        "name": "weather_v1",
        "description": "Weather tools.",
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}],
    }
    body = {"input": ASK, "tools": [tool], "tool_choice": "required", "max_output_tokens": 200}
    r = _post(server, "/v1/responses", body)
    assert r.status_code == 200, r.text
    (call,) = [item for item in r.json()["output"] if item["type"] == "function_call"]
    assert (call["namespace"], call["name"]) == ("weather_v1", "get_weather")
    history = [*ASK, {k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")}]
    history.append({"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"})
    assert (
        _post(
            server, "/v1/responses", {"input": history, "tools": [tool], "max_output_tokens": 2}
        ).status_code
        == 200
    )


def test_the_root_answers_a_probe(server):
    """Clients check that a base URL is alive with HEAD / (llama.cpp's and Ollama's servers answer it)."""
    assert httpx.head(server.url + "/").status_code == 200


def test_count_tokens_refuses_the_breakpoints_messages_refuses(server):
    block = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    messages = [{"role": "user", "content": [block] * 5}]
    for path, extra in (("/v1/messages", {"max_tokens": 1}), ("/v1/messages/count_tokens", {})):
        r = _post(server, path, {"messages": messages, **extra})
        assert r.status_code == 400 and "cache_control" in r.json()["error"]["message"], (path, r.text)


def test_the_page_loads_nothing_from_elsewhere_and_is_never_framed(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["x-frame-options"] == "DENY"
    policy = r.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
