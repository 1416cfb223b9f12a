"""Property-based fuzzing of the server's own OpenAPI schema (schemathesis, on hypothesis): valid and invalid
requests to every endpoint, against a real tiny-model server. Any 5xx fails, and so does an error that is not
OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`), or Anthropic-shaped on Anthropic's routes
(`{"type": "error", "error": {"type", "message"}}`).

Half the generated bodies name the served model, with small max_tokens and n (random names only reach the
404, random lengths mostly the context check), so generation runs too; the context is 128 tokens, which keeps
every generation short (at most 128 tokens, 4 when aimed).
"""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from tests.server_thread import ServerThread, tiny_settings

MODEL = "tiny"


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    with ServerThread(tiny_settings(tiny_model_dir, max_model_len=128)) as server:
        yield server


def flatmap_body(ctx, body):
    """As generated, or (as often) aimed at the served model with short outputs, so generation runs too."""
    if not isinstance(body, dict) or "model" not in body:
        return st.just(body)
    responses = ctx.operation is not None and ctx.operation.path == "/v1/responses"  # its own field names
    limit = {"max_output_tokens" if responses else "max_tokens": 4}
    aimed = limit | {k: _integral(v) for k, v in body.items()} | {"model": MODEL}
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n"):
        if isinstance(aimed.get(key), int) and not isinstance(aimed[key], bool):
            aimed[key] = aimed[key] % 4 + 1
    return st.sampled_from([body, aimed])


def _integral(value):
    """1.0 -> 1: JSON Schema's integers include 1.0, which the server (strict, like OpenAI) refuses."""
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else value


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    api = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    api.hook(flatmap_body)
    return api


schema = schemathesis.pytest.from_fixture("api_schema")


@schemathesis.check
def openai_shaped_error(ctx, response, case):
    """Every 4xx / 5xx body is {"error": {"message": str, "type": str, "param": str|None, "code": str|None}},
    or on /v1/messages... {"type": "error", "error": {"type": str, "message": str}}."""
    if response.status_code < 400:
        return True
    if case.path.startswith("/v1/messages"):
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, response.text
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], response.text
        return True
    error = response.json().get("error")
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, response.text
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")), response.text
    return True


@schema.parametrize()
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_server_error_and_every_error_is_openai_shaped(case):
    case.call_and_validate(checks=[not_a_server_error, openai_shaped_error], timeout=30)


# -- legal requests with extreme values: all must succeed -------------------------------------------------
_text = st.text(st.characters(codec="utf-8"), max_size=8)  # at most 32 bytes: it fits the context
_sampling = st.fixed_dictionaries(
    {"model": st.just(MODEL), "max_tokens": st.integers(1, 6)},
    optional={
        "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0.0, 5e-324, 1e-6, 2.0])),
        "top_p": st.one_of(st.floats(5e-324, 1), st.just(1.0)),
        "top_k": st.integers(-1, 10_000),
        "seed": st.integers(-(2**80), 2**80),
        "stop": st.one_of(_text.filter(bool), st.lists(_text.filter(bool), max_size=4)),
        "stop_token_ids": st.lists(st.integers(-(2**40), 2**40), max_size=3),
        "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "n": st.integers(1, 3),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    },
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]), "content": _text}
)
_chat = st.tuples(_sampling, st.lists(_message, min_size=1, max_size=2)).map(
    lambda t: (CHAT_PATH, t[0] | {"messages": t[1], "logprobs": True, "top_logprobs": 2})
)
_completion = st.tuples(
    _sampling, st.one_of(_text.filter(bool), st.lists(st.integers(0, 383), min_size=1, max_size=12))
).map(lambda t: ("/v1/completions", t[0] | {"prompt": t[1], "logprobs": 1}))
CHAT_PATH = "/v1/chat/completions"
_messages = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "max_tokens": st.integers(1, 6),
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": _text}), min_size=1, max_size=2
        ),
    },
    optional={
        "system": _text,
        "temperature": st.one_of(st.floats(0, 1), st.sampled_from([0.0, 5e-324, 1.0])),
        "top_p": st.one_of(st.floats(5e-324, 1), st.just(1.0)),
        "top_k": st.integers(0, 10_000),
        "stop_sequences": st.lists(_text.filter(bool), max_size=4),
        "stream": st.booleans(),
        "metadata": st.fixed_dictionaries({"user_id": _text}),
    },
).map(lambda body: ("/v1/messages", body))


@given(request=st.one_of(_chat, _completion, _messages))
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_legal_requests_with_extreme_values_succeed(fuzz_server, request):
    path, body = request
    r = httpx.post(fuzz_server.url + path, json=body, timeout=30)
    assert r.status_code == 200, (body, r.text)
    if path == "/v1/messages":
        if body.get("stream"):
            events = [line for line in r.text.splitlines() if line.startswith("event: ")]
            assert events[-1] == "event: message_stop" and "event: error" not in events, r.text
        else:
            assert r.json()["type"] == "message"
    elif body.get("stream"):
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and '"error"' not in r.text, r.text
    else:
        assert len(r.json()["choices"]) == body.get("n", 1)
