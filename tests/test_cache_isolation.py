"""Prefix-cache isolation: a prompt cached in one domain (an API key, a cache_salt) is never restored in
another, so cached_tokens cannot reveal another client's prompt; within a domain the cache works as ever."""

import httpx
import pytest

from minivllm import LLM, CacheHints, SamplingParams
from minivllm.cache.page_hash import ROOT, extend_page_hashes, root_hash
from tests.server_thread import ServerThread
from tests.test_server import MODEL, tiny_settings

SECRET = "The vault PIN is 4719. Never tell it to anyone. " * 8


def cached(client, prompt: str, **extra) -> int:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra or None)
    return r.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    with ServerThread(tiny_settings(tiny_model_dir, api_keys=("alice-key", "bob-key"))) as s:
        yield s


def test_a_prompt_cached_for_one_key_is_not_restored_for_another(keyed):
    alice, bob = keyed.client(api_key="alice-key"), keyed.client(api_key="bob-key")
    assert cached(alice, SECRET) == 0
    assert cached(bob, SECRET) == 0  # bob's guess of alice's prompt: no hit
    assert cached(alice, SECRET) > 0  # alice's own cache still works
    assert cached(bob, SECRET) > 0  # and bob now has his own copy
    keyed.wait_idle()


def test_anthropic_messages_are_isolated_by_key_too(keyed):
    def cached_message(key: str) -> int:
        body = {
            "model": MODEL,
            "max_tokens": 1,
            "messages": [{"role": "user", "content": SECRET + "(messages)"}],
        }
        r = httpx.post(keyed.url + "/v1/messages", json=body, headers={"x-api-key": key}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["cache_read_input_tokens"]

    assert cached_message("alice-key") == 0
    assert cached_message("bob-key") == 0
    assert cached_message("alice-key") > 0
    keyed.wait_idle()


def test_a_cache_salt_splits_a_domain(keyed):
    alice = keyed.client(api_key="alice-key")
    prompt = "Salted prompts share pages only with the same salt. " * 8
    assert cached(alice, prompt, cache_salt="tenant-1") == 0
    assert cached(alice, prompt, cache_salt="tenant-2") == 0
    assert cached(alice, prompt) == 0  # no salt: a third domain
    assert cached(alice, prompt, cache_salt="tenant-1") > 0


def test_every_key_is_accepted_and_others_refused(keyed):
    import openai

    with pytest.raises(openai.AuthenticationError):
        keyed.client(api_key="mallory").models.list()
    assert keyed.client(api_key="bob-key").models.list().data[0].id == MODEL


def test_salted_hashes_differ_from_page_zero_on():
    tokens = list(range(64))
    plain, salted, other = [], [], []
    extend_page_hashes(plain, tokens, 16)
    extend_page_hashes(salted, tokens, 16, root_hash("a"))
    extend_page_hashes(other, tokens, 16, root_hash("b"))
    assert root_hash(None) == ROOT
    assert not set(plain) & set(salted) and not set(salted) & set(other)


def test_single_flight_never_makes_a_follower_of_another_domain(tiny_model_dir):
    llm = LLM(tiny_model_dir, kv_cache_bytes=8 << 20, single_flight="at_completion")
    prompt = list(range(5, 70))
    hints = [CacheHints(salt=s) for s in ("x", "y", "x")]
    outs = llm.generate([prompt] * 3, SamplingParams(max_tokens=2), cache=hints)
    restorable = (len(prompt) - 1) // 16 * 16
    assert [o.num_cached_tokens for o in outs] == [0, 0, restorable]  # only x's second restores x's pages
    flights = llm.engine.stats()
    assert flights.flights_opened == 2 and flights.followers_coalesced == 1


def test_why_a_prompt_missed_is_told_only_to_its_own_key(keyed):
    """GET /v1/cache/explain: a key sees its own requests' reports, never another key's."""
    alice, bob = keyed.client(api_key="alice-key"), keyed.client(api_key="bob-key")
    r = alice.completions.with_raw_response.create(model=MODEL, prompt=SECRET + "(explain)", max_tokens=1)
    alice_id = r.parse().id
    bob.completions.create(model=MODEL, prompt="bob's own prompt", max_tokens=1)

    def seen(key: str) -> set[str]:
        reply = httpx.get(keyed.url + "/v1/cache/explain", headers={"Authorization": f"Bearer {key}"})
        assert reply.status_code == 200, reply.text
        return {report["request_id"].rsplit("-", 1)[0] for report in reply.json()["data"]}

    assert alice_id in seen("alice-key") and alice_id not in seen("bob-key")
    assert seen("bob-key") and not seen("bob-key") & seen("alice-key")
    keyed.wait_idle()
