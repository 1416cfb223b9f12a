"""OpenAI streams (chat, completions, responses) send their headers and an SSE comment at once, then a comment
every keep-alive period until the first output: a client or proxy with an idle timeout waits out a long
prefill. The engine is held (its step blocks) until the server has sent some comments, so no token can come
before them; the openai SDK parses the streams unchanged (it skips SSE comments)."""

import contextlib
import json
import threading

import httpx
import pytest

from server.core import OpenAIEvents
from tests.server_thread import ServerThread, tiny_settings

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Paged attention stores keys and values"}]
HELD_PINGS = 3  # the engine steps only once this many comments went out
BODIES = {
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 4},
    "/v1/completions": {"prompt": "The quick brown fox", "max_tokens": 4},
    "/v1/responses": {"input": "The quick brown fox", "max_output_tokens": 4},
}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_settings(tiny_model_dir)) as s:
        yield s


@contextlib.contextmanager
def held_until_pinged(server, monkeypatch):
    """While inside: the engine's steps wait until the server has sent HELD_PINGS keep-alive comments (or
    30 s: the test then fails on `released`). Yields the event that the pings set."""
    released = threading.Event()
    sent = 0
    ping, step = OpenAIEvents.ping, server.engine.step

    def counted_ping(self) -> str:
        nonlocal sent
        sent += 1
        if sent >= HELD_PINGS:
            released.set()
        return ping(self)

    def held_step():
        released.wait(30)
        return step()

    monkeypatch.setattr(OpenAIEvents, "keepalive_s", 0.01)
    monkeypatch.setattr(OpenAIEvents, "ping", counted_ping)
    monkeypatch.setattr(server.engine, "step", held_step)
    try:
        yield released
    finally:
        monkeypatch.undo()
    server.wait_idle()


@pytest.mark.parametrize("path", BODIES)
def test_headers_and_comments_come_before_the_first_token(server, monkeypatch, path):
    body = {"model": MODEL, "temperature": 0, "stream": True, **BODIES[path]}
    with held_until_pinged(server, monkeypatch) as released:
        with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            blocks = r.read().decode().strip().split("\n\n")
        assert released.is_set()  # the comments came while the engine could not step
    first_data = next(i for i, b in enumerate(blocks) if not b.startswith(":"))
    pings = [b for b in blocks[:first_data] if b == ": ping"]
    assert len(pings) >= HELD_PINGS and blocks[0] == ": ping"
    # besides the pings only the prefix-cache report (server.prefix_report), once, after them
    assert [b for b in blocks[:first_data] if b != ": ping"] == [blocks[first_data - 1]]
    assert blocks[first_data - 1].startswith(": x-minivllm-prefix-cache: ")
    assert not any(b.startswith(":") for b in blocks[first_data:])  # none once the output flows
    lines = [line for b in blocks[first_data:] for line in b.split("\n") if line.startswith("data: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line != "data: [DONE]"]
    assert data  # every block after the comments holds data events, and they parse
    assert not any("error" in d for d in data)


def test_the_openai_sdk_parses_streams_with_comments(server, monkeypatch):
    client = server.client()
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
    with held_until_pinged(server, monkeypatch) as released:
        stream = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=4, temperature=0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert released.is_set()
    assert text == plain.choices[0].message.content
    whole = client.responses.create(
        model=MODEL, input="The quick brown fox", max_output_tokens=4, temperature=0
    )
    with held_until_pinged(server, monkeypatch) as released:
        with client.responses.create(
            model=MODEL, input="The quick brown fox", max_output_tokens=4, temperature=0, stream=True
        ) as s:
            kinds = [e.type for e in s]
        assert released.is_set()
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert whole.status == "incomplete"


def test_a_refusal_after_the_first_comment_is_an_error_event(server):
    """A stream's headers are out before the engine accepts it: a refusal is then the stream's error event,
    in its protocol's shape (here a grammar the engine cannot build)."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4, "stream": True, "response_format": fmt}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        text = r.read().decode()
    blocks = text.strip().split("\n\n")
    assert blocks[0] == ": ping" and blocks[-1] == "data: [DONE]"
    error = json.loads(blocks[-2].removeprefix("data: "))["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert "invalid grammar" in error["message"] and "<state>" not in error["message"]
