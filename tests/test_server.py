"""The OpenAI-compatible server, end to end: a real uvicorn on 127.0.0.1 with the tiny model, driven by
the official openai client (and httpx for what the client will not send)."""

import argparse
import asyncio
import contextlib

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minivllm.engine.sampling_params import choice_seed
from server.serve import serve_main
from server.settings import (
    Settings,
    SettingsError,
    add_serve_arguments,
    settings_from_args,
    settings_from_mapping,
)
from tests.server_thread import ServerThread, assert_error, tiny_settings

MODEL = "tiny"
CHAT = [{"role": "user", "content": "Paged attention stores keys and values"}]
LONG_PROMPT = "Prefix caching reuses the KV cache of a shared prompt prefix across requests. " * 3


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ServerThread(tiny_settings(tiny_model_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):
    """A second server: API key required, one running and one waiting request at most."""
    with ServerThread(tiny_settings(tiny_model_dir, api_key="sesame", max_num_seqs=1, max_waiting=1)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _stream_text(stream) -> tuple[str, list, object]:
    text, reasons, usage = "", [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            text += piece or ""
            reasons.append(c.finish_reason)
    return text, [r for r in reasons if r], usage


# -- basics ---------------------------------------------------------------------------------------------
def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_non_streaming_and_streaming_agree(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, reasons, usage = _stream_text(stream)
    assert text == choice.message.content and reasons == [choice.finish_reason]
    assert usage.completion_tokens == r.usage.completion_tokens


def test_completions_string_and_token_prompts(server, client):
    r = client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0, logprobs=2
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens - (r.choices[0].finish_reason == "stop")
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    ids = server.engine.tokenizer.encode("The quick brown fox")
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert r2.choices[0].text == r.choices[0].text
    stream = client.completions.create(model=MODEL, prompt=[ids], max_tokens=8, temperature=0, stream=True)
    assert _stream_text(stream)[0] == r.choices[0].text


def test_completion_text_keeps_the_first_tokens_leading_space(server, client):
    """The text is what decoding the generated tokens gives, a first token's leading space included
    (prompt + text must read as one string: "The quick brown" + " fox")."""
    tokenizer = server.engine.tokenizer
    (fox,) = tokenizer.encode(" fox")  # one token whose text starts with a space
    forced = {str(fox): 100}
    r = client.completions.create(
        model=MODEL, prompt="The quick brown", max_tokens=2, temperature=0, logit_bias=forced
    )
    assert r.choices[0].text == " fox fox"
    stream = client.completions.create(
        model=MODEL, prompt="The quick brown", max_tokens=2, temperature=0, stream=True, logit_bias=forced
    )
    assert _stream_text(stream)[0] == " fox fox"


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy picks the top


def test_repeated_prompt_reports_cached_tokens(client):
    first = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 32
    assert again.usage.prompt_tokens_details.cached_tokens > 0


# -- stop strings -----------------------------------------------------------------------------------------
def _stop_across_boundary(client, prompt: str) -> tuple[str, str] | None:
    """A stop string spanning a token boundary of the greedy output, and the text expected before it."""
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=0, extra_body={"ignore_eos": True}
    )
    text, tokens = r.choices[0].text, r.choices[0].logprobs.tokens
    for i in range(len(tokens) - 1):
        left, right = tokens[i], tokens[i + 1]
        if not all(t.isascii() and t.isprintable() and t.strip() for t in (left, right)):
            continue
        prefix = "".join(tokens[: i + 1])
        stop = left[-1] + right[:2]
        if text.startswith(prefix + right) and text.find(stop) == len(prefix) - 1:
            return stop, text[: text.find(stop)]
    return None


def test_stop_string_split_across_tokens(client):
    prompt, (stop, expected) = next(
        (p, found)
        for p in ("The quick", "def reverse(s):", "abc", "0123")
        if (found := _stop_across_boundary(client, p))
    )
    kw = dict(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    r = client.completions.create(**kw)
    assert r.choices[0].text == expected and stop not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    text, reasons, _ = _stream_text(client.completions.create(stream=True, **kw))
    assert text == expected and reasons == ["stop"]


# -- sampling -------------------------------------------------------------------------------------------
def test_n_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=1, seed=3, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    stream = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=6, temperature=1, seed=3, n=2, stream=True
    )
    indices = {c.index for chunk in stream for c in chunk.choices}
    assert indices == {0, 1}


def test_seed_reproducibility(client):
    def choices(seed: int, n: int = 1) -> list[str]:
        r = client.completions.create(
            model=MODEL,
            prompt="The quick brown fox",
            max_tokens=12,
            temperature=1,
            seed=seed,
            n=n,
            extra_body={"ignore_eos": True},
        )
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    assert choices(7) == choices(7)
    assert len({text for s in range(4) for text in choices(s)}) > 1
    # n with a seed: choice i samples with choice_seed(seed, i); consecutive seeds share no choice
    assert choices(7, n=2) == choices(7) + choices(choice_seed(7, 1))
    assert len(set(choices(7, n=2) + choices(8, n=2))) == 4


def test_concurrent_streams_complete(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, list]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=16,
            temperature=0,
            stream=True,
        )
        text, reasons = "", []
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                reasons += [c.finish_reason] if c.finish_reason else []
        return text, reasons

    async def main():
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(main())
    assert len(results) == 16 and all(len(reasons) == 1 for _, reasons in results)
    server.wait_idle()


# -- errors ---------------------------------------------------------------------------------------------
def _post(server, path: str, **kw) -> httpx.Response:
    return httpx.post(server.url + path, timeout=30, **kw)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"model": MODEL}),  # no messages
        ("/v1/chat/completions", {"model": MODEL, "messages": []}),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": "many"}),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "temperature": 3}),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "top_p": 0}),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "top_logprobs": 21, "logprobs": True}),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 0}),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "n": 0}),
        ("/v1/completions", {"model": MODEL, "prompt": ""}),
        ("/v1/completions", {"model": MODEL, "prompt": []}),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 99999]}),
        ("/v1/completions", {"model": MODEL, "prompt": [1] * 5000, "max_tokens": 1}),  # past the context
        ("/v1/completions", {"model": MODEL, "prompt": list(range(1, 300)) * 7}),  # longer than the context
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 50}),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": True}),
        ("/v1/completions", {"model": MODEL, "prompt": ["hi", [1, 2]]}),
        ("/v1/completions", [1, 2]),
    ],
)
def test_bad_requests_are_400(server, path, body):
    for stream in (False, True):
        payload = {**body, "stream": stream} if isinstance(body, dict) else body
        assert_error(_post(server, path, json=payload), 400)


def test_invalid_json_is_400(server):
    error = assert_error(
        _post(
            server, "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
        ),
        400,
    )
    assert "JSON" in error["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=CHAT)
    assert e.value.body["code"] == "model_not_found"


def test_context_overflow_is_400_through_client(client):
    """A prompt past the context is refused; a max_tokens past it is an upper bound (tests/test_field_policy)."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[1] * 10_000, max_tokens=1)
    assert "context length" in e.value.message


def test_api_key_required(guarded):
    with pytest.raises(openai.AuthenticationError):
        guarded.client(api_key="wrong").models.list()
    r = httpx.post(guarded.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert_error(r, 401)
    assert_error(httpx.get(guarded.url + "/v1/nowhere"), 401)
    assert httpx.get(guarded.url + "/health").status_code == 200
    r = guarded.client(api_key="sesame").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert r.choices[0].text is not None


def test_full_waiting_queue_is_429(guarded):
    async def one(client: httpx.AsyncClient) -> int:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 200, "ignore_eos": True}
        r = await client.post("/v1/completions", json=body)
        if r.status_code == 429:
            assert r.json()["error"]["type"] == "rate_limit_error"
        return r.status_code

    async def main():
        headers = {"Authorization": "Bearer sesame"}
        async with httpx.AsyncClient(base_url=guarded.url, headers=headers, timeout=60) as client:
            return await asyncio.gather(*(one(client) for _ in range(8)))

    statuses = asyncio.run(main())
    assert 200 in statuses and 429 in statuses and set(statuses) <= {200, 429}
    guarded.wait_idle()


def test_engine_error_is_500_and_server_survives(server, client, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated step failure")

    monkeypatch.setattr(server.engine.runner, "launch", broken)
    r = _post(server, "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
    assert "simulated step failure" in assert_error(r, 500)["message"]
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True}
    ) as r:
        assert r.status_code == 200
        body = r.read().decode()
    assert "simulated step failure" in body and '"error"' in body
    monkeypatch.undo()
    server.wait_idle()
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices


# -- disconnects ------------------------------------------------------------------------------------------
def test_disconnect_mid_stream_releases_pages(server):
    server.wait_idle()
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    steps = server.engine.num_steps
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.engine.requests  # still generating
    server.wait_idle()
    assert server.engine.num_steps - steps < 1000  # aborted, not run to its 1500 tokens


def test_disconnect_mid_request_aborts_non_streaming(server):
    server.wait_idle()
    body = {"model": MODEL, "prompt": LONG_PROMPT * 4, "max_tokens": 1500, "ignore_eos": True}
    steps = server.engine.num_steps
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    server.wait_idle()
    assert server.engine.num_steps - steps < 1000  # aborted, not run to its 1500 tokens


# -- metrics ----------------------------------------------------------------------------------------------
def _scrape(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def test_metrics_move(server, client):
    before = _scrape(server)
    client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=3, temperature=0)
    after = _scrape(server)
    ok = "minivllm_http_requests_total{endpoint=/v1/completions,status=200}"
    assert after[ok] == before.get(ok, 0) + 1
    for name in (
        "minivllm_prompt_tokens_total",
        "minivllm_generation_tokens_total",
        "minivllm_prefix_cache_queries_total",
        "minivllm_time_to_first_token_seconds_count",
        "minivllm_e2e_request_latency_seconds_count",
    ):
        assert after[name] > before.get(name, 0), name
    # its 3 tokens: 2 gaps of one step each in the engine's inter-token histogram
    for name in ("bucket{le=1.0}", "bucket{le=+Inf}", "count", "sum"):
        name = f"minivllm_inter_token_steps_{name}"
        assert after[name] - before.get(name, 0) == 2, name
    assert after["minivllm_prefix_cache_hits_total{tier=ram}"] > 0  # LONG_PROMPT ran before
    assert after["minivllm_prefix_cache_hits_total{tier=disk}"] == 0  # no disk tier
    assert after["minivllm_pages_total"] == server.engine.kv.pool.num_pages
    for name in (
        "minivllm_pages_free",
        "minivllm_pages_cached",
        "minivllm_pages_in_use",
        "minivllm_num_requests_running",
        "minivllm_num_requests_waiting",
        "minivllm_pages_published_total",
        "minivllm_pages_evicted_total",
        "minivllm_pages_unreachable_total",
        "minivllm_kv_disk_reads_total",
        "minivllm_kv_disk_bytes",
        "minivllm_single_flight_flights_opened_total",
        "minivllm_single_flight_followers_coalesced_total",
        "minivllm_single_flight_follower_wait_seconds_total",
    ):
        assert name in after, name


# -- settings ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env, named",
    [
        ({"MINIVLLM_PAGE_SIZE": "abc"}, "MINIVLLM_PAGE_SIZE"),
        ({"MINIVLLM_EVICTION": "nope"}, "MINIVLLM_EVICTION"),
        ({"MINIVLLM_PREFIX_CACHE": "maybe"}, "MINIVLLM_PREFIX_CACHE"),
        ({"MINIVLLM_KV_CACHE_BYTES": "lots"}, "MINIVLLM_KV_CACHE_BYTES"),
        ({"MINIVLLM_PAGE_SIZE": "0"}, "MINIVLLM_PAGE_SIZE"),  # EngineConfig's own check
        ({"MINIVLLM_PREFIX_CACHE": "0", "MINIVLLM_SINGLE_FLIGHT": "after_prefill"}, "MINIVLLM_SINGLE_FLIGHT"),
    ],
)
def test_bad_env_value_names_the_variable(env, named):
    with pytest.raises(SettingsError, match=named):
        Settings.from_env(env)


def test_settings_from_env_and_flags():
    s = Settings.from_env(
        {"MINIVLLM_KV_CACHE_BYTES": "4M", "MINIVLLM_PREFIX_CACHE": "false", "MINIVLLM_MODEL": "/m/tiny/"}
    )
    assert s.kv_cache_bytes == 4 << 20 and s.served_model_name == "tiny"
    assert s.engine_config().single_flight == "off"  # follows the prefix cache unless set
    assert Settings.from_env({}).served_model_name == "qwen2.5-coder-0.5b-instruct"
    parser = add_serve_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--page-size", "32", "--eviction", "lru"])
    s = settings_from_args(args, {"MINIVLLM_PAGE_SIZE": "8", "MINIVLLM_MAX_WAITING": "3"})
    assert (s.page_size, s.eviction, s.max_waiting) == (32, "lru", 3)
    with pytest.raises(SettingsError, match="--max-num-seqs"):
        settings_from_args(parser.parse_args(["--max-num-seqs", "x"]), {})
    assert serve_main(["--eviction", "nope"]) == 2


def test_settings_from_a_mapping_name_the_setting():
    s = settings_from_mapping({"kv_cache_bytes": "4M", "max_num_seqs": 4, "prefix_cache": False}, {})
    assert (s.kv_cache_bytes, s.max_num_seqs, s.prefix_cache) == (4 << 20, 4, False)
    with pytest.raises(SettingsError, match="^max_waiting: "):
        settings_from_mapping({"max_waiting": "x"}, {})
    with pytest.raises(SettingsError, match="unknown settings"):
        settings_from_mapping({"colour": "blue"}, {})


@pytest.mark.parametrize(
    "flags",
    [
        ["--routing", "affinity"],
        ["--replicas", "0"],
        ["--replicas", "2", "--routing", "x"],
        ["--replicas", "2", "--max-connections", "64"],  # Ray Serve's proxy takes the connections
        ["--replicas", "2", "--header-timeout", "3"],
    ],
)
def test_serve_refuses_bad_replica_flags(flags, capsys):
    with pytest.raises(SystemExit) if "x" in flags else contextlib.nullcontext():
        assert serve_main(flags) == 2
    assert "error" in capsys.readouterr().err
