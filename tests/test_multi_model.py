"""Several models in one server: an engine and KV pool each, `model` in each request picks one (every
protocol), /v1/models lists them all, and each answers with its own weights and its own prefix cache."""

import argparse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.serve import serve_main
from server.settings import Settings, SettingsError, add_serve_arguments, settings_from_args
from tests.reference import MlxLmReference
from tests.server_thread import ServerThread, assert_error
from tests.test_engine import random_prompts
from tests.tiny_model import make_tiny_model

NAMES = ("alpha", "beta")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two tiny models of one tokenizer and different weights."""
    return [make_tiny_model(tmp_path_factory.mktemp(name), seed=seed) for seed, name in enumerate(NAMES)]


@pytest.fixture(scope="module")
def server(model_dirs):
    settings = Settings(
        model=",".join(str(d) for d in model_dirs), model_name=",".join(NAMES), kv_cache_bytes=8 << 20
    )
    with ServerThread(settings) as s:
        yield s


@pytest.fixture(scope="module")
def references(model_dirs):
    return dict(zip(NAMES, (MlxLmReference(d) for d in model_dirs)))


def complete(server, model: str, prompt: list[int], max_tokens: int = 10) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_each_model_answers_its_own_requests_concurrently(server, references):
    prompts = random_prompts([9, 23, 14, 31], seed=5, vocab=300)
    jobs = [(model, prompt) for prompt in prompts for model in NAMES]  # all at once
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: complete(server, *job), jobs))
    decode = server.engine.tokenizer.decode
    for (model, prompt), answer in zip(jobs, answers):
        assert answer["model"] == model
        assert answer["choices"][0]["text"] == decode(references[model].greedy(prompt, 10))
    # different weights: the same prompt gets a different answer from each model
    assert references["alpha"].greedy(prompts[0], 10) != references["beta"].greedy(prompts[0], 10)


def test_each_model_has_its_own_prefix_cache(server, references):
    (long,) = random_prompts([100], seed=11, vocab=300)
    cached = lambda answer: answer["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    first = {model: complete(server, model, long) for model in NAMES}
    assert [cached(first[m]) for m in NAMES] == [0, 0]  # beta does not see alpha's pages
    again = {model: complete(server, model, long) for model in NAMES}
    assert [cached(again[m]) for m in NAMES] == [96, 96]
    decode = server.engine.tokenizer.decode
    for model in NAMES:
        assert again[model]["choices"][0]["text"] == decode(references[model].greedy(long, 10))
    engines = {name: st.engine.engine for name, st in server.app.state.models.items()}
    assert all(engines[m].stats().prefix_hit_tokens >= 96 for m in NAMES)
    assert engines["alpha"].kv is not engines["beta"].kv


def test_models_listed_unknown_404_and_every_protocol_routes(server):
    listed = httpx.get(server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in listed] == list(NAMES)
    assert httpx.get(server.url + "/v1/models/beta").json()["id"] == "beta"
    error = assert_error(httpx.get(server.url + "/v1/models/gamma"), 404)
    assert "`alpha`, `beta`" in error["message"] and error["code"] == "model_not_found"
    engines = {name: st.engine.engine for name, st in server.app.state.models.items()}
    chat = {"messages": [{"role": "user", "content": "Paged attention"}], "max_tokens": 3}
    bodies = {
        "/v1/chat/completions": chat,
        "/v1/completions": {"prompt": "Paged attention", "max_tokens": 3},
        "/v1/messages": chat,
        "/v1/responses": {"input": "Paged attention", "max_output_tokens": 3},
    }
    for path, body in bodies.items():
        for model in NAMES:
            before = {m: engines[m].stats().prefix_lookups for m in NAMES}
            r = httpx.post(server.url + path, json={"model": model, **body}, timeout=60)
            assert r.status_code == 200, (path, r.text)
            after = {m: engines[m].stats().prefix_lookups for m in NAMES}
            other = NAMES[1 - NAMES.index(model)]
            assert after[model] > before[model] and after[other] == before[other], path
        assert httpx.post(server.url + path, json={"model": "gamma", **body}).status_code == 404, path


def test_metrics_are_labelled_by_model(server):
    complete(server, "beta", [5, 6, 7])
    text = httpx.get(server.url + "/metrics").text
    (steps,) = [f for f in text_string_to_metric_families(text) if f.name == "minivllm_engine_steps"]
    by_model = {s.labels["model"]: s.value for s in steps.samples if s.name.endswith("_total")}
    assert set(by_model) == set(NAMES) and by_model["beta"] > 0


def test_the_kv_budget_is_split_and_the_settings_name_the_models():
    settings = Settings(model="/m/a, /m/b", kv_cache_bytes=8 << 20, kv_disk_dir="/d", kv_disk_bytes=1 << 30)
    assert settings.served_model_names == ("a", "b")
    configs = settings.engine_configs()
    assert [(c.model, c.kv_cache_bytes, c.kv_disk_dir) for c in configs] == [
        ("/m/a", 4 << 20, "/d/a"),
        ("/m/b", 4 << 20, "/d/b"),
    ]
    assert all(c.kv_disk_bytes == 1 << 29 for c in configs)
    assert Settings(model="/m/a").engine_configs()[0].kv_cache_bytes is None  # one model: as before
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(["--model", "/m/a", "--model", "/m/b"])
    assert settings_from_args(args, {}).models == ("/m/a", "/m/b")


@pytest.mark.parametrize("names", ["../up,a/../../b", "..,.", "org/model,org_model", "/abs,~user"])
def test_every_models_disk_tier_stays_inside_the_disk_directory(names, tmp_path):
    settings = Settings(model="/m/a, /m/b", model_name=names, kv_disk_dir=str(tmp_path))
    dirs = [Path(c.kv_disk_dir) for c in settings.engine_configs()]
    assert all(d.resolve().parent == tmp_path.resolve() and d.name not in (".", "..") for d in dirs)
    assert len(set(dirs)) == 2
    with pytest.raises(SettingsError, match="MINIVLLM_MODEL_NAME: 1 names for 2 models"):
        Settings(model="/m/a,/m/b", model_name="x").validated()
    with pytest.raises(SettingsError, match="must be distinct"):
        Settings(model="/m/a,/n/a").validated()
    with pytest.raises(SettingsError, match="MINIVLLM_MODEL: an empty entry"):
        Settings(model="/m/a,").validated()
    assert serve_main(["--model", "/m/a", "--model", "/m/b", "--replicas", "2"]) == 2
