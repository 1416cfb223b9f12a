"""The prefix cache through HTTP: every protocol's x-minivllm-prefix-cache report (where and why a restore
stopped: the message and token of a change, evicted or new), GET /v1/cache/explain, POST /v1/cache/pin,
and Anthropic cache_control breakpoints pinning the right prefixes."""

import json
import logging

import httpx
import pytest

from server.prefix_report import EXPLAINED, HEADER
from server.prompts import TextOffsets
from tests.server_thread import ServerThread, assert_error, tiny_settings
from tests.test_prefix_cache import PAGE_BYTES

KEY = "sesame"
AUTH = {"authorization": f"Bearer {KEY}"}
WORDS = "paged attention stores keys and values in blocks of sixteen tokens while prefix caching reuses them "


def text(seed: int, words: int = 40) -> str:
    """A distinct text: the words in an order of its own."""
    w = WORDS.split()
    return " ".join(w[(seed * 7 + i * (seed % 5 + 1)) % len(w)] + str(seed) for i in range(words))


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # 64 pages: a few long prompts evict everything unpinned
    settings = tiny_settings(tiny_model_dir, api_key=KEY, kv_cache_bytes=64 * PAGE_BYTES, single_flight="off")
    with ServerThread(settings) as s:
        yield s


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120, **kw)


def report(header: str) -> dict:
    return dict(part.split("=") for part in header.split("; "))


def chat(server, messages: list[dict], **kw) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0, **kw}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    return report(r.headers[HEADER])


def conversation(seed: int, n: int = 4) -> list[dict]:
    roles = ["system", "user", "assistant", "user", "assistant", "user"]
    return [{"role": roles[i], "content": text(seed * 10 + i, 20)} for i in range(n)]


def prompt_ids(server, messages: list[dict]) -> list[int]:
    tok = server.engine.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def flood(server, seed: int, count: int = 6) -> None:
    for i in range(count):
        chat(server, [{"role": "user", "content": text(1000 + seed * 100 + i, 50)}])


def test_a_repeated_conversation_restores_all_it_can_and_says_so(server):
    messages = conversation(1)
    first = chat(server, messages)
    assert first["restored"] == "0" and first["miss"] == "new" and first["message"] == "0"
    again = chat(server, messages)
    n = len(prompt_ids(server, messages))
    assert again == {"restored": str((n - 1) // 16 * 16), "prompt": str(n)}


def test_the_report_goes_to_the_log_at_info(server, caplog):
    with caplog.at_level(logging.INFO, logger="server.prefix_report"):
        header = post(server, "/v1/completions", {"model": "tiny", "prompt": text(45, 10), "max_tokens": 1})
    line = next(r.getMessage() for r in caplog.records if r.name == "server.prefix_report")
    assert line.startswith("prefix cache /v1/completions cmpl-") and line.endswith(header.headers[HEADER])


@pytest.mark.parametrize("k, byte", [(1, 5), (2, 40), (3, 100)])
def test_a_change_in_message_k_is_reported_at_its_message_and_page(server, k, byte):
    messages = conversation(2 + k)
    chat(server, messages)
    changed = [dict(m) for m in messages]
    content = changed[k]["content"]
    changed[k]["content"] = content[:byte] + "X" + content[byte + 1 :]
    got = chat(server, changed)
    before, after = prompt_ids(server, messages), prompt_ids(server, changed)
    diverge = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
    assert got["miss"] == "new" and got["message"] == str(k)
    assert int(got["token"]) == diverge and int(got["restored"]) == diverge // 16 * 16


def test_an_evicted_prefix_is_reported_as_evicted(server):
    messages = conversation(30)
    chat(server, messages)
    flood(server, seed=1)
    got = chat(server, messages)
    assert got["miss"] == "evicted" and got["token"] == "0" and got["message"] == "0"


def _streamed_report(r) -> dict:
    """A stream's headers leave before admission: its report comes as an SSE comment before the first
    output event (after the keep-alives: OpenAI's comments, Anthropic's ping events)."""
    frames = r.text.split("\n\n")
    comment = next(i for i, f in enumerate(frames) if f.startswith(f": {HEADER}: "))
    first = next(i for i, f in enumerate(frames) if f and not f.startswith((":", "event: ping")))
    assert comment < first
    return report(frames[comment].removeprefix(f": {HEADER}: "))


def test_every_protocol_carries_the_report(server):
    prompt = text(40, 60)
    chat_body = {"model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 2}
    bodies = {
        "/v1/completions": {"model": "tiny", "prompt": prompt, "max_tokens": 2},
        "/v1/responses": {"model": "tiny", "input": prompt, "max_output_tokens": 2},
        "/v1/chat/completions": chat_body,
    }
    for path, body in bodies.items():
        r = post(server, path, body)
        assert r.status_code == 200 and report(r.headers[HEADER])["prompt"]
        r = post(server, path, {**body, "stream": True})
        assert r.status_code == 200 and HEADER not in r.headers and _streamed_report(r)["prompt"]
    anthropic = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": prompt}]}
    r = post(server, "/v1/messages", anthropic)
    assert report(r.headers[HEADER])["restored"] != "0"  # the chat request above cached it
    assert _streamed_report(post(server, "/v1/messages", {**anthropic, "stream": True}))["prompt"]


def test_explain_returns_the_last_reports_bounded(server):
    messages = conversation(50)
    chat(server, messages)
    r = httpx.get(server.url + "/v1/cache/explain", headers=AUTH)
    last = r.json()["data"][-1]
    assert last["endpoint"] == "/v1/chat/completions" and last["prompt_tokens"] == len(
        prompt_ids(server, messages)
    )
    for i in range(EXPLAINED + 2):
        post(server, "/v1/completions", {"model": "tiny", "prompt": f"short {i}", "max_tokens": 1})
    data = httpx.get(server.url + "/v1/cache/explain", headers=AUTH).json()["data"]
    assert len(data) == EXPLAINED and data[-1]["endpoint"] == "/v1/completions"
    assert httpx.get(server.url + "/v1/cache/explain").status_code == 401


def test_a_pinned_prompt_survives_a_flood(server):
    prompt = text(60, 80)
    r = post(server, "/v1/cache/pin", {"prompt": prompt, "ttl": "1h"})
    assert r.status_code == 200, r.text
    pinned = r.json()
    assert pinned["pages"] == pinned["prompt_tokens"] // 16 and pinned["tokens"] == 16 * pinned["pages"]
    assert 3590 < pinned["ttl_s"] <= 3600
    flood(server, seed=2)
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    n = pinned["prompt_tokens"]
    assert report(r.headers[HEADER]) == {"restored": str((n - 1) // 16 * 16), "prompt": str(n)}


def test_a_pinned_conversation_serves_a_chat_request_after_a_flood(server):
    messages = conversation(65, n=2)
    r = post(server, "/v1/cache/pin", {"messages": messages, "ttl": 600})
    assert r.status_code == 200 and r.json()["prompt_tokens"] == len(prompt_ids(server, messages))
    flood(server, seed=3)
    n = len(prompt_ids(server, messages))
    assert chat(server, messages) == {"restored": str((n - 1) // 16 * 16), "prompt": str(n)}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, None),
        ({"prompt": ""}, None),
        ({"prompt": "a", "ttl": 0}, "ttl"),
        ({"prompt": "a", "ttl": "2h"}, "ttl"),
        ({"prompt": "a", "keep": True}, "keep"),
    ],
)
def test_a_bad_pin_request_is_a_400(server, body, param):
    error = assert_error(post(server, "/v1/cache/pin", body), 400)
    assert param is None or error["param"].startswith(param)


def test_a_pin_of_another_model_is_a_404(server):
    assert (
        assert_error(post(server, "/v1/cache/pin", {"prompt": "a", "model": "other"}), 404)["param"]
        == "model"
    )
    assert post(server, "/v1/cache/pin", {"prompt": "a", "model": "tiny"}).status_code == 200


def test_the_pin_endpoint_needs_the_key(server):
    assert httpx.post(server.url + "/v1/cache/pin", json={"prompt": "a"}).status_code == 401


def anthropic_request(seed: int, **kw) -> dict:
    return {
        "model": "tiny",
        "max_tokens": 1,
        "system": [{"type": "text", "text": text(seed, 15)}],
        "messages": [
            {"role": "user", "content": text(seed + 1, 8)},
            {"role": "assistant", "content": text(seed + 2, 8)},
            {"role": "user", "content": [{"type": "text", "text": text(seed + 3, 8)}]},
        ],
        **kw,
    }


def turn_tokens(server, turns: list[dict], tools=None) -> int:
    """Tokens of the first turns as templated (no generation prompt)."""
    tok = server.engine.tokenizer
    return len(
        tok.encode(tok.apply_chat_template(turns, tools=tools, add_generation_prompt=False, tokenize=False))
    )


def pins_after(server, body: dict) -> list[tuple[int, float]]:
    """The pins the request added: (pages, TTL) each."""
    kv = server.engine.kv
    before = {pin.hashes for pin in kv.pins.held()}
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120)
    assert r.status_code == 200, r.text
    server.wait_idle()
    return [(len(pin.hashes), pin.ttl_s) for pin in kv.pins.held() if pin.hashes not in before]


def chat_turns(body: dict) -> list[dict]:
    turns = [{"role": "system", "content": body["system"][0]["text"]}]
    for m in body["messages"]:
        content = m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]
        turns.append({"role": m["role"], "content": content})
    return turns


def test_cache_control_on_system_and_messages_pins_through_their_turns(server):
    body = anthropic_request(70)
    body["system"][0]["cache_control"] = {"type": "ephemeral"}
    body["messages"][2]["content"][0]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    turns = chat_turns(body)
    pins = pins_after(server, body)
    assert pins == [(turn_tokens(server, turns[:1]) // 16, 300.0), (turn_tokens(server, turns) // 16, 3600.0)]


def test_cache_control_on_a_tool_pins_the_system_prompt_and_the_tools(server):
    tool = {"name": "lookup", "description": text(80, 10), "input_schema": {"type": "object"}}
    body = anthropic_request(80, tools=[{**tool, "cache_control": {"type": "ephemeral"}}])
    template_tool = {
        "type": "function",
        "function": {"name": "lookup", "description": tool["description"], "parameters": {"type": "object"}},
    }
    pins = pins_after(server, body)
    assert pins == [(turn_tokens(server, chat_turns(body)[:1], [template_tool]) // 16, 300.0)]


def test_top_level_cache_control_pins_the_whole_conversation(server):
    body = anthropic_request(90, cache_control={"type": "ephemeral"})
    assert pins_after(server, body) == [(turn_tokens(server, chat_turns(body)) // 16, 300.0)]


def test_more_than_four_breakpoints_are_refused(server):
    body = anthropic_request(95, cache_control={"type": "ephemeral"})
    body["system"] = [
        {"type": "text", "text": f"part {i}", "cache_control": {"type": "ephemeral"}} for i in range(2)
    ]
    for m in body["messages"]:
        m["content"] = [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400 and "cache_control" in json.dumps(r.json())


def test_text_offsets_agree_with_decoding_every_prefix(server):
    tok = server.engine.tokenizer
    ids = tok.encode("déjà vu — naïve café, 中文 and plain text " * 20, add_special_tokens=False)
    for offsets in (
        TextOffsets(tok.decode, ids),
        TextOffsets(tok.decode, ids, chunk=7),
    ):  # cuts in characters
        for p in range(len(ids) + 1):
            exact = len(tok.decode(ids[:p]))
            assert offsets.char_of(p) == exact
            before = offsets.tokens_before(exact)
            assert len(tok.decode(ids[:before])) <= exact and before >= p


def test_a_pin_of_text_that_is_not_unicode_is_a_400(server):
    """JSON can carry a lone surrogate, which no tokenizer takes: refused by name, never a 500."""
    for field, body in (
        ("prompt", '{"prompt": "a\\ud800b"}'),
        ("cache_salt", '{"prompt": "a", "cache_salt": "\\ud800"}'),
    ):
        r = httpx.post(
            server.url + "/v1/cache/pin", content=body, headers={**AUTH, "content-type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
