"""A real uvicorn server on 127.0.0.1 in a background thread, and helpers, for the server tests."""

import json
import socket
import threading
import time

import httpx
import openai
import uvicorn

from server.app import create_app
from server.connections import uvicorn_config
from server.errors import error_body
from server.settings import Settings


class ServerThread:
    """uvicorn.Server in a background thread, on a free port."""

    def __init__(self, settings: Settings):
        self.app = create_app(settings)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = uvicorn_config(self.app, settings, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def engine(self):
        return self.app.state.server.engine.engine  # the LLMEngine

    def prompts_during(self, call):
        """call()'s result, and the token ids of the prompts the engine was given meanwhile."""
        prompts = []
        add = self.engine.add_request
        self.engine.add_request = lambda rid, prompt, *a: prompts.append(prompt) or add(rid, prompt, *a)
        try:
            return call(), prompts
        finally:
            del self.engine.add_request

    def client(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, **kw)

    def async_client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Poll until no request holds pages, then check the pool's invariants."""
        deadline = time.monotonic() + timeout
        eng = self.engine
        while eng.requests or eng.kv.pool.num_in_use:
            assert time.monotonic() < deadline, f"engine not idle: {len(eng.requests)} requests"
            time.sleep(0.02)
        time.sleep(0.05)  # let the stepping thread finish its bookkeeping
        assert eng.kv.pool.num_in_use == 0
        eng.check_invariants()


def tiny_settings(model_dir, **overrides) -> Settings:
    """A server of the tiny model at model_dir, served as "tiny", with a 4 MiB KV pool unless overridden."""
    return Settings(**{"model": str(model_dir), "model_name": "tiny", "kv_cache_bytes": 4 << 20, **overrides})


def assert_error(r: httpx.Response, status: int) -> dict:
    """r is an OpenAI-shaped error with this status; returns its `error` object."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def assert_refused(r: httpx.Response, status: int) -> dict:
    """r is an OpenAI-shaped error with this status, or a stream refused after its headers went out: a
    keep-alive comment, then that error as the stream's one event, then [DONE]. Returns the `error` object."""
    if r.status_code != 200 or not r.headers["content-type"].startswith("text/event-stream"):
        return assert_error(r, status)
    blocks = r.text.strip().split("\n\n")
    assert blocks[0] == ": ping" and blocks[-1] == "data: [DONE]" and len(blocks) == 3, r.text
    error = json.loads(blocks[1].removeprefix("data: "))["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == error_body(status, "")["error"]["type"]
    return error
