"""minivllm on Ray Serve, end to end: a local Ray with two applications of 2 tiny-model engine replicas
each (affinity and round-robin routing), driven through Ray Serve's HTTP proxy by the official openai
client. Ray is shut down when the module ends."""

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("ray.serve", reason="needs the ray extra: pip install -e '.[ray]'")

import ray  # noqa: E402
import yaml  # noqa: E402  (a Ray dependency)
from ray import serve  # noqa: E402

from minivllm.cluster.routing import RoutingConfig  # noqa: E402
from server.cluster.app import ENGINE_DEPLOYMENT, app_builder, build_app, cpus_per_replica  # noqa: E402
from server.settings import Settings  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL = "tiny"
APPS = ("affinity", "round-robin")
PAGE = 16


def _settings(model_dir) -> Settings:
    # at_completion: a burst's followers wait for the leader's whole request, so one that arrives a little
    # late through the proxy still joins its flight
    return Settings(
        model=str(model_dir), model_name=MODEL, kv_cache_bytes=8 << 20, single_flight="at_completion"
    )


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    """Both applications on one local Ray (2 CPUs, a quarter CPU per replica); yields app -> base URL."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=128 << 20)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for name in APPS:
            app = build_app(_settings(tiny_model_dir), 2, RoutingConfig(policy=name), cpus_per_replica=0.25)
            serve.run(app, name=name, route_prefix=f"/{name}")
        yield {name: f"http://127.0.0.1:{port}/{name}" for name in APPS}
    finally:
        serve.shutdown()
        ray.shutdown()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def engine_metrics(url: str) -> dict[str, dict[str, float]]:
    """Engine series by name, then by replica label."""
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if "replica" in sample.labels:
                out.setdefault(sample.name, {})[sample.labels["replica"]] = sample.value
    return out


def wait_for(url: str, condition, what: str = "condition", reports: int = 3, stall_s: float = 600.0):
    """Poll until condition() returns something truthy. Replica stats reach the router about every second,
    however loaded the machine: give up once every replica has reported `reports` more times and the
    condition still fails (the stats it needs would be there by then), or when no report arrives at all
    for stall_s (the cluster hangs)."""
    start = seen = stats_reports(url)
    last_progress = time.monotonic()
    while True:
        value = condition()
        if value:
            return value
        now = stats_reports(url)
        if now != seen:
            seen, last_progress = now, time.monotonic()
        fresh = min((now.get(r, 0) - start.get(r, 0) for r in now), default=0)
        assert fresh < reports, f"{what}: not seen in {fresh} stats reports of every replica"
        assert time.monotonic() - last_progress < stall_s, f"{what}: no replica stats for {stall_s:.0f} s"
        time.sleep(0.25)


def stats_reports(url: str) -> dict[str, float]:
    """How often each replica of the app at url has reported its stats so far."""
    return engine_metrics(url).get("minivllm_replica_stats_reports_total", {})


def fresh_metrics(url: str) -> dict[str, dict[str, float]]:
    """The engine series once every replica has reported twice more: stats taken after this call began
    (a report already on its way may predate it)."""
    start = stats_reports(url)
    wait_for(
        url,
        lambda: all(n - start.get(r, 0) >= 2 for r, n in stats_reports(url).items()),
        what="two fresh stats reports",
        reports=4,
    )
    return engine_metrics(url)


def restorable(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // PAGE * PAGE


# -- health and metrics ---------------------------------------------------------------------------------
def test_health_lists_the_replicas_and_metrics_are_labelled_by_replica(cluster):
    url = cluster["affinity"]
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and len(health["replicas"]) == 2
    series = wait_for(url, lambda: engine_metrics(url).get("minivllm_pages_total"), what="replica stats")
    assert sorted(series) == sorted(health["replicas"])
    assert all(v > 0 for v in series.values())  # each replica has its own KV pool
    assert [m.id for m in client(url).models.list().data] == [MODEL]


def test_an_engine_refusal_keeps_its_status_through_the_replica(cluster):
    with pytest.raises(openai.BadRequestError, match="token ids"):
        client(cluster["affinity"]).completions.create(model=MODEL, prompt=[100_000], max_tokens=2)


def test_structured_output_is_enforced_on_the_replica_and_a_bad_schema_is_a_400(cluster):
    c = client(cluster["affinity"])
    # no other keys: the random test model could otherwise spend max_tokens on an extra key's string;
    # seeded, so the run is the same every time
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a number"}],
        max_tokens=400,
        response_format=fmt,
        seed=0,
    )
    assert isinstance(json.loads(r.choices[0].message.content)["n"], int)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError, match="response_format"):
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], response_format=bad
        )


# -- multi-turn sessions --------------------------------------------------------------------------------
def run_sessions(url: str, sessions: int = 3, turns: int = 4) -> list[list[tuple[int, int]]]:
    """Interleaved chats (turn 1 of every session, then turn 2, ...); (prompt, cached) tokens per turn."""
    c = client(url)
    histories = [
        [{"role": "user", "content": f"Session {s}: " + "The quick brown fox jumps over the lazy dog. " * 4}]
        for s in range(sessions)
    ]
    usage: list[list[tuple[int, int]]] = [[] for _ in range(sessions)]
    for turn in range(turns):
        for s, messages in enumerate(histories):
            r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
            usage[s].append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": f"Turn {turn}: tell me more about prefix caching, please."},
            ]
    return usage


def test_affinity_restores_every_later_turn_and_round_robin_fewer(cluster):
    affinity = run_sessions(cluster["affinity"])
    for turns in affinity:
        for (prev_prompt, _), (_, cached) in zip(turns, turns[1:]):
            assert cached >= prev_prompt // PAGE * PAGE  # the whole previous prompt, page-aligned
    round_robin = run_sessions(cluster["round-robin"])
    later = lambda usage: sum(cached for turns in usage for _, cached in turns[1:])  # noqa: E731
    assert later(round_robin) < 0.75 * later(affinity)


# -- single flight across the cluster -------------------------------------------------------------------
def burst(url: str, prompt: str, n: int = 8) -> tuple[list[int], int, dict[str, float], dict[str, float]]:
    """n identical prompts at once; the cached tokens of each, the prompt length, and per replica the flights
    opened and the followers coalesced by the burst (from stats reported before and after it)."""
    before = fresh_metrics(url)

    async def one(c):
        r = await c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=200, temperature=0, extra_body={"ignore_eos": True}
        )
        return r.usage

    async def all_at_once():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(c) for _ in range(n)))
        finally:
            await c.close()

    usages = asyncio.run(all_at_once())
    after = fresh_metrics(url)

    def delta(name: str) -> dict[str, float]:
        return {r: v - before.get(name, {}).get(r, 0.0) for r, v in after.get(name, {}).items()}

    flights = delta("minivllm_single_flight_flights_opened_total")
    followers = delta("minivllm_single_flight_followers_coalesced_total")
    return (
        [u.prompt_tokens_details.cached_tokens for u in usages],
        usages[0].prompt_tokens,
        flights,
        followers,
    )


def test_a_burst_of_identical_prompts_has_one_leader_cluster_wide(cluster):
    prompt = "Prefix caching reuses the KV cache of a shared prompt prefix across requests. " * 12
    cached, prompt_tokens, flights, followers = burst(cluster["affinity"], prompt)
    assert sum(flights.values()) == 1 and sum(followers.values()) == 7
    assert sorted(cached) == [0] + [restorable(prompt_tokens)] * 7  # seven restored the leader's pages
    # round-robin splits the same burst over both replicas: one leader on each
    _, _, flights, _ = burst(cluster["round-robin"], prompt + " Again.")
    assert sorted(flights.values()) == [1, 1]


# -- a replica dies -------------------------------------------------------------------------------------
def kill_replica(app: str, replica: str) -> None:
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].endswith(f"{app}#{ENGINE_DEPLOYMENT}#{replica}"):
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            return
    raise AssertionError(f"no actor for replica {replica} of {app}")


def test_killing_a_replica_ends_its_streams_with_an_error_and_the_service_keeps_answering(cluster):
    url = cluster["affinity"]
    c = client(url)
    messages = [{"role": "user", "content": "A long answer, please: " + "paged attention " * 20}]
    stream = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=1800,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)  # it runs
    running = wait_for(
        url,
        lambda: [
            r for r, n in engine_metrics(url).get("minivllm_num_requests_running", {}).items() if n >= 1
        ],
        what="the stream's replica",
    )
    kill_replica("affinity", running[0])
    with pytest.raises(openai.APIError, match="engine replica"):
        for _ in chunks:
            pass
    # new requests, including the dead replica's conversation, are answered by the survivor
    for i in range(4):
        r = c.chat.completions.create(
            model=MODEL,
            messages=messages if i == 0 else [{"role": "user", "content": f"hello {i}"}],
            max_tokens=4,
        )
        assert r.choices[0].finish_reason in ("stop", "length")
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and running[0] not in health["replicas"]


# -- the Ray Serve config builder -----------------------------------------------------------------------
def test_the_documented_serve_config_is_valid_and_builds(tiny_model_dir):
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((REPO / "server" / "cluster" / "serve_config.yaml").read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    args = app["args"] | {"settings": app["args"]["settings"] | {"model": str(tiny_model_dir)}}
    assert app_builder(args) is not None


def test_app_builder_reads_a_serve_config(tiny_model_dir):
    app = app_builder(
        {
            "replicas": 3,
            "routing": "round-robin",
            "settings": {"model": str(tiny_model_dir), "kv_cache_bytes": "4M"},
        }
    )
    assert app is not None
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        app_builder({"settings": {"kv_cache_bytes": "lots"}})
    with pytest.raises(ValueError, match="unknown settings"):
        app_builder({"settings": {"colour": "blue"}})
    with pytest.raises(ValueError, match="unknown application args"):
        app_builder({"replicaz": 2})


def test_cpu_shares_are_whole_above_one():
    assert cpus_per_replica(16, 4) == 4.0 and cpus_per_replica(10, 4) == 2.0 and cpus_per_replica(2, 4) == 0.5
