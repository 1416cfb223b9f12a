"""Smoke tests of the benchmark harness with the tiny random model (seconds, no real model needed).

Against mlx_lm.server today; the same tests run against minivllm by switching ServerSpec.name.
"""

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest

from benchmarks.harness import client, models, prompts, results, servers

SERVER = "mlx-lm"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return prompts.load_tokenizer(tiny_model_dir)


def test_running_server_and_stream_chat(tiny_model_dir, tokenizer):
    prompt = prompts.make_prompt(tokenizer, 120, seed=1)

    async def go(server: servers.Server) -> list[client.RequestResult]:
        api = client.make_client(server.api_url)
        try:
            first = await client.stream_chat(api, prompt.messages, 8, model=server.model_id)
            again = await client.stream_chat(api, prompt.messages, 8, model=server.model_id)
            return [first, again]
        finally:
            await api.close()

    with servers.running_server(servers.ServerSpec(SERVER, tiny_model_dir, label="smoke")) as server:
        proc_url = server.base_url
        results = asyncio.run(go(server))
    for r in results:
        assert 0 < r.ttft_s <= r.latency_s
        assert r.text and r.completion_tokens > 0
        assert r.prompt_tokens == prompt.n_tokens  # the client's templating matches the server's
    assert results[1].cached_tokens > 0  # the peer reuses an identical prompt
    assert server.log_path.exists()
    with pytest.raises(Exception):  # noqa: B017  the server is gone once the block exits
        httpx.get(proc_url + "/v1/models", timeout=2.0)


def test_minivllm_replicas_start_through_the_serve_command(tiny_model_dir):
    spec = servers.ServerSpec("minivllm", tiny_model_dir, replicas=2, routing="round-robin")
    cmd, env = servers._server_command(spec, tiny_model_dir, 8123)
    assert cmd[1:] == ["-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", "8123",
                       "--replicas", "2", "--routing", "round-robin"]  # fmt: skip
    assert env["MINIVLLM_MODEL"] == str(tiny_model_dir)
    single, _ = servers._server_command(servers.ServerSpec("minivllm", tiny_model_dir), tiny_model_dir, 8123)
    assert single[1:3] == ["-m", "uvicorn"]


def test_running_server_reports_a_dying_server(tiny_model_dir):
    spec = servers.ServerSpec(SERVER, tiny_model_dir, label="smoke-dies", extra_args=["--no-such-flag"])
    with pytest.raises(RuntimeError, match="exited with code") as info:
        with servers.running_server(spec):
            pass
    assert "no-such-flag" in str(info.value)  # the log tail says why


@pytest.mark.parametrize("n_tokens", [64, 300, 900])
def test_make_prompt_hits_its_length(tokenizer, n_tokens):
    prompt = prompts.make_prompt(tokenizer, n_tokens, seed=n_tokens)
    assert n_tokens - 3 <= prompt.n_tokens <= n_tokens
    assert prompt.token_ids == prompts.chat_token_ids(tokenizer, prompt.messages)


def test_make_prompt_shares_a_fraction_of_a_prefix(tokenizer):
    seed = prompts.make_prompt(tokenizer, 600, seed=7)
    other = prompts.make_prompt(tokenizer, 600, seed=8)
    assert prompts._common_prefix(seed.token_ids, other.token_ids) < 16  # distinct seeds: not one whole page
    for fraction in (0.25, 0.5, 0.75):
        probe = prompts.make_prompt(tokenizer, 600, seed=9, share=seed, fraction=fraction)
        assert abs(probe.shared_tokens - fraction * seed.n_tokens) <= 3
        assert probe.token_ids[: probe.shared_tokens] == seed.token_ids[: probe.shared_tokens]
    same = prompts.make_prompt(tokenizer, 600, seed=9, share=seed, fraction=1.0)
    assert same.token_ids == seed.token_ids
    assert prompts.expected_restore(same.shared_tokens, same.n_tokens, 16) == (seed.n_tokens - 1) // 16 * 16


def test_write_results_writes_json_and_markdown(tiny_model_dir, tmp_path):
    meta = results.metadata(tiny_model_dir, page_size=16, runs=1)
    meta["git"]["dirty"] = False  # as from a clean committed tree
    rows = [
        {"config": "a", "TTFT ms": results.fmt_ms([0.1, 0.2]), "restored": 16.0},
        {"config": "b", "restored": math.nan},
    ]
    json_path, md_path = results.write_results("smoke", rows, meta, out_dir=tmp_path, raw={"r": [client.RequestResult(
        0.1, 0.2, 10, 2, 0, "hi", 0.0, 0.1, 0.2)]})  # fmt: skip
    data = json.loads(json_path.read_text())
    assert data["rows"][0]["config"] == "a" and data["raw"]["r"][0]["ttft_s"] == 0.1
    for key in ("machine", "mlx", "model", "git", "date"):
        assert key in data["metadata"]
    assert data["metadata"]["model"]["dtype"] == "F32"
    md = md_path.read_text()
    assert "| config | TTFT ms | restored |" in md and "150.0 ± 70.7" in md
    assert "mlx_version" in md and "commit=" in md


def test_results_from_a_dirty_tree_are_refused_or_marked(tiny_model_dir, tmp_path):
    meta = results.metadata(tiny_model_dir, page_size=16, runs=1)
    meta["git"]["dirty"] = True
    rows = [{"config": "a", "restored": 16.0}]
    with pytest.raises(results.DirtyTree, match="--allow-dirty"):
        results.write_results("bench", rows, meta, out_dir=tmp_path)
    assert not list(tmp_path.iterdir())
    json_path, md_path = results.write_results("bench", rows, meta, out_dir=tmp_path, allow_dirty=True)
    assert (json_path.name, md_path.name) == ("bench-DIRTY.json", "bench-DIRTY.md")
    assert json.loads(json_path.read_text())["WARNING"].startswith("DIRTY")
    assert md_path.read_text().splitlines()[2].startswith("> **DIRTY")


def test_float32_copy_dequantizes_for_the_peer(tiny_model_dir, tmp_path):
    from mlx_lm.convert import convert

    q4 = tmp_path / "tiny-q4"
    convert(str(tiny_model_dir), str(q4), quantize=True, q_bits=4, q_group_size=64)
    assert models.model_dtype(q4).startswith("4-bit")
    f32 = models.float32_copy(q4)
    assert f32 == tmp_path / "tiny-q4-float32" and models.model_dtype(f32) == "F32"
    assert "quantization" not in json.loads((f32 / "config.json").read_text())
    assert (f32 / "tokenizer_config.json").exists()
    assert models.float32_copy(q4) == f32  # cached
    if models.is_cpu_backend():
        assert servers.served_model_dir(servers.ServerSpec("mlx-lm", q4)) == f32
    assert servers.served_model_dir(servers.ServerSpec("minivllm", q4)) == q4


def test_long_context_quick_compares_engines_in_one_process(tiny_model_dir, tmp_path):
    """The long-context benchmark on the tiny model, with this checkout also imported as the baseline."""
    from benchmarks import long_context

    repo = Path(__file__).resolve().parents[1]
    args = ["--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--baseline", str(repo)]
    long_context.main(args + ["--allow-dirty"])  # a clean tree writes long_context-quick.json, else -DIRTY
    (path,) = tmp_path.glob("long_context-quick*.json")
    data = json.loads(path.read_text())
    assert set(data["raw"]) == {"minivllm", "mlx-lm", f"baseline {data['metadata']['git']['commit']}"}
    metrics = [row["metric"] for row in data["rows"]]
    assert metrics == [
        "prefill 512 (tok/s)", "prefill 64 (tok/s)", "prefill 256 (tok/s)", "decode b1 ctx 128 (tok/s)",
        "decode b8 ctx 128 (tok/s)", "decode b1 ctx 512 (tok/s)", "decode b8 ctx 512 (tok/s)",
    ]  # fmt: skip
    assert all(v > 0 for rates in data["raw"].values() for vs in rates.values() for v in vs)
    assert all(row["minivllm / baseline"].endswith("x") for row in data["rows"])
    assert all(float(row["limit"]) > 0 for row in data["rows"])


def test_long_context_peers_stop_at_their_context_cap(tiny_model_dir, tmp_path):
    """--peer-max-context: mlx-lm and the MLX-attention engine prefill the context's first part only and
    decode at the contexts within it; minivllm goes on to the whole context, its first part restored."""
    from benchmarks import long_context

    args = ["--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--batch", "1"]
    args += ["--mlx-attention", "--peer-max-context", "128", "--prefill", "64", "--allow-dirty"]
    long_context.main(args)
    (path,) = tmp_path.glob("long_context-quick-b1*.json")
    data = json.loads(path.read_text())
    rows = {row["metric"]: row for row in data["rows"]}
    assert list(rows) == [
        "prefill 128 (tok/s)", "prefill 128..512 (tok/s)", "prefill 64 (tok/s)",
        "decode b1 ctx 128 (tok/s)", "decode b1 ctx 512 (tok/s)",
    ]  # fmt: skip
    for peer in ("mlx-lm", long_context.MLX_ATTENTION):
        assert set(data["raw"][peer]) == {"prefill 128", "prefill 64", "decode b1 ctx 128"}
    assert rows["decode b1 ctx 512 (tok/s)"]["minivllm / mlx-lm"] == "—"
    assert rows["decode b1 ctx 128 (tok/s)"]["minivllm / MLX attention"].endswith("x")
    # the limit falls with the context: more attention FLOPs a token, more K/V read a step
    limits = [float(rows[m]["limit"]) for m in ("prefill 128 (tok/s)", "prefill 128..512 (tok/s)")]
    assert limits[0] > limits[1] > 0


def test_long_context_batch_subset_gets_its_own_file(tiny_model_dir, tmp_path):
    from benchmarks import long_context

    args = ["--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--skip-mlx-lm"]
    long_context.main(args + ["--batch", "1", "--contexts", "128", "--prefill", "64", "--allow-dirty"])
    (path,) = tmp_path.glob("long_context-quick-b1*.json")
    metrics = [row["metric"] for row in json.loads(path.read_text())["rows"]]
    assert metrics == ["prefill 128 (tok/s)", "prefill 64 (tok/s)", "decode b1 ctx 128 (tok/s)"]


def test_cpu_settings_quick_measures_every_setting(tiny_model_dir, tmp_path):
    from benchmarks import cpu_settings

    if not cpu_settings.OPENBLAS_PATH:
        pytest.skip("OpenBLAS is not loaded (not the CPU backend)")
    before = cpu_settings.blas_threads()
    args = ["--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--chunks", "64,128"]
    cpu_settings.main(args + ["--allow-dirty"])
    (path,) = tmp_path.glob("cpu_settings-quick*.json")
    data = json.loads(path.read_text())
    settings = [(row["OpenBLAS threads"], row["max_num_batched_tokens"]) for row in data["rows"]]
    assert settings == [(1, 64), (1, 128), (2, 64), (2, 128)]
    assert {"decode b1 tok/s", "decode b1 tok/s, no overlap", "decode b8 tok/s, no overlap"} <= set(
        data["rows"][0]
    )
    assert all(v > 0 for vs in data["raw"].values() for v in vs)
    assert cpu_settings.blas_threads() == before  # restored


def test_quality_benchmark_on_a_tiny_gguf(tmp_path):
    """The reference scores itself perfectly; the transcode stays near it; 4-bit drifts further."""
    from benchmarks import quality
    from tests.test_gguf_import import write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf")
    args = ["--gguf", str(tmp_path / "tiny.gguf"), "--quick", "--plot", "--out", str(tmp_path)]
    quality.main(args + ["--allow-dirty"])  # a clean tree writes quality-quick.json, else -DIRTY
    (path,) = tmp_path.glob("quality-quick*.json")
    data = json.loads(path.read_text())
    reference, transcode, q4 = data["rows"]
    assert reference["KL (code / prose)"] == "0 / 0"
    assert reference["top-1 agreement (code / prose)"] == "100.0% / 100.0%"
    for text in ("code", "prose"):
        assert 0 <= data["raw"]["transcode (default)"][text]["kl"] < data["raw"]["4-bit g64"][text]["kl"]
    assert int(transcode["model MB"]) > int(q4["model MB"])
    assert data["metadata"]["tokens_per_text"] == {"code": 64, "prose": 64}
    assert list(tmp_path.glob("quality-quick*.png"))


def test_single_flight_quick_bursts_and_churn(tiny_model_dir, tmp_path):
    """Both scenarios end to end on the tiny model: the summaries read every run (they once crashed there)."""
    from benchmarks import single_flight

    args = ["--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--allow-dirty"]
    single_flight.main(args)
    (path,) = tmp_path.glob("single_flight-quick*.json")
    rows = {row["strategy"]: row for row in json.loads(path.read_text())["rows"]}
    assert set(rows) == set(single_flight.CONFIGS)
    assert rows["independent"]["restored per follower"] == 0  # both computed: publication at completion
    assert rows["after_prefill"]["restored per follower"] > 0  # the follower waited for the leader's pages

    single_flight.main(args + ["--scenario", "churn", "--evictions", "adaptive,lru"])
    (path,) = tmp_path.glob("single_flight_churn-quick*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [row["eviction"] for row in rows] == ["adaptive", "lru"]
    for row in rows:
        assert row["errors"] == 0 and row["restored (distinct, expected 0)"] == 0
        assert row["pages evicted"] > 0  # the distinct prompts overflowed the pool


def test_fairness_measures_shorts_and_the_stream_during_a_long_prefill(tmp_path):
    """benchmarks.fairness on a small long prefill: short requests answered while it runs, and the stream
    served in every step of it by the engine's own count (the time bounds are the benchmark's to report,
    not this test's)."""
    import argparse

    from benchmarks import fairness
    from benchmarks.hardening import tiny_long_context_model

    model = tiny_long_context_model(tmp_path)
    # 24,000 tokens: on a loaded machine a 6,000-token prefill of the tiny model could end before the first
    # short request was sent (no short measured: 1 run in 4 beside another job)
    args = argparse.Namespace(prompt_tokens=24000, shorts=3, short_timeout=60.0)
    m = fairness.run(results.REPO_ROOT, model, args, "smoke")
    row = fairness.row("minivllm", "HEAD", m, args.prompt_tokens)
    assert row["short requests"] >= 1 and row["short TTFT p99 ms"] < 60_000
    assert m["prefill_steps"] > 0 and m["gaps"]
    assert row["stream tokens per step (engine)"] == 1.0 and row["stream gap p99 steps"] == 1.0


def test_agent_session_quick_on_the_tiny_model(tiny_model_dir, tmp_path):
    """benchmarks.agent_session end to end on the tiny model: both protocols, every turn and subagent
    measured, later turns restored from the prefix cache."""
    from benchmarks import agent_session

    argv = ["--model", str(tiny_model_dir), "--system-tokens", "200", "--turns", "3", "--fan-out-turn", "1"]
    argv += ["--out", str(tmp_path)]
    agent_session.main(argv + ["--result-tokens", "40", "--allow-dirty", "--quick"])
    (path,) = tmp_path.glob("agent_session-quick*.json")  # -DIRTY when run from a changed tree
    record = json.loads(path.read_text())
    turns = record["raw"]
    assert {t["protocol"] for t in turns} == {"messages", "responses"}
    assert sum(t["kind"] == "subagent" for t in turns) == 6
    later = [t for t in turns if t["turn"] > 0 or t["kind"] == "subagent"]
    assert all(t["restored_tokens"] > 0 and t["ttft_s"] > 0 for t in later)


def test_speculative_quick_measures_both_workloads_at_both_batch_sizes(tiny_model_dir, tmp_path):
    from benchmarks import speculative

    args = ["--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--allow-dirty"]
    speculative.main(args)
    (path,) = tmp_path.glob("speculative-quick*.json")
    data = json.loads(path.read_text())
    assert [(r["workload"], r["batch"]) for r in data["rows"]] == [
        ("edit", 1),
        ("edit", 4),
        ("free", 1),
        ("free", 4),
    ]
    assert all(r["same tokens"] == "yes" for r in data["rows"])  # greedy: speculation changes no token
    rates = [v for by_batch in data["raw"].values() for cells in by_batch.values()
             for name, cell in cells.items() if name != "same" for v in cell["rate"]]  # fmt: skip
    assert len(rates) == 12 and all(v > 0 for v in rates)


def test_kv_tier_quick_restores_the_prompt_from_disk(tiny_model_dir, tmp_path):
    """benchmarks.kv_tier on the tiny model: the warm-from-disk runs restore every restorable page from disk."""
    from benchmarks import kv_tier

    kv_tier.main(["--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--allow-dirty"])
    (path,) = tmp_path.glob("kv_tier-quick*.json")
    data = json.loads(path.read_text())
    rows = {row["measurement"]: row for row in data["rows"]}
    restorable = data["metadata"]["restorable_tokens"]
    assert rows["TTFT, cold"]["detail"].startswith("0 tokens cached")
    assert rows["TTFT, warm in RAM"]["detail"].startswith(f"{restorable} tokens cached, 0 from disk")
    for label in ("TTFT, warm from disk (RAM cache dropped)", "TTFT, warm from disk after a restart"):
        assert rows[label]["detail"].startswith(f"{restorable} tokens cached, {restorable} from disk")
    assert rows["index rebuild at start"]["detail"] == f"{restorable // 16} pages"
    assert float(rows["disk tier read, OS page cache warm"]["value"].split()[0]) > 0
    assert {"decode, no disk tier", "page files written, one page per file"} <= set(rows)


def test_connection_attack_probes_both_servers_through_an_attack(tiny_model_dir, tmp_path):
    """benchmarks.connection_attack, small: both servers answer every probe and exit on SIGTERM."""
    from benchmarks import connection_attack

    args = [
        "--idle",
        "60",
        "--stalled",
        "20",
        "--big-stalled",
        "2",
        "--seconds",
        "2",
        "--model",
        str(tiny_model_dir),
    ]
    connection_attack.main([*args, "--out", str(tmp_path), "--allow-dirty"])
    (path,) = tmp_path.glob("connection_attack*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [row["mode"] for row in rows] == ["serve", "uvicorn"]
    for row in rows:
        assert row["health"].endswith(f"failed 0 of {row['health'].rsplit(' ', 1)[1]}")
        assert not row["SIGTERM to exit s"].startswith(">")


def test_replay_tiers_writes_both_tables(tmp_path):
    from benchmarks import replay_tiers
    from tests.test_replay import random_prefix_trace

    for i, name in enumerate(replay_tiers.TRACES):
        lines = [
            json.dumps({"input_length": r.input_length, "hash_ids": r.hash_ids})
            for r in random_prefix_trace(i)
        ]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    assert (
        replay_tiers.main(["--traces-dir", str(tmp_path), "--out-dir", str(tmp_path), "--allow-dirty"]) == 0
    )
    (tiers_path,) = [p for p in tmp_path.glob("replay_tiers*.json") if "design" not in p.name]
    tiers = json.loads(tiers_path.read_text())
    design = json.loads(next(tmp_path.glob("replay_tiers_design*.json")).read_text())
    assert len(tiers["rows"]) == 2 * 6 and len(design["rows"]) == 2 * 4 * 4
    no_disk = [row for row in tiers["rows"] if row["disk blocks"] == 0]
    assert all(row["from disk"] == "0.0000" and row["blocks written"] == 0 for row in no_disk)


def test_replay_diff_lists_the_requests_that_decide_two_policies(tmp_path):
    from benchmarks import replay_diff

    # two blocks of cache: LRU keeps A when C comes (A was used after B), FIFO gives A up (A came first)
    lines = [json.dumps({"input_length": 512, "hash_ids": [h]}) for h in (1, 2, 1, 3, 1)]
    trace = tmp_path / "abaca.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    args = [str(trace), "--capacity", "2", "--policies", "lru,fifo", "--out-dir", str(tmp_path)]
    assert replay_diff.main(args) == 0
    md = (tmp_path / "replay_diff-abaca-2.md").read_text()
    assert "1 of 5 requests differ" in md and "net `lru` - `fifo`: +1 blocks, out of 1" in md
    assert md.rstrip().splitlines()[-1] == "| 4 | 1 | 1 | 0 | 2 | 2 |"


def test_replay_diff_gives_the_net_in_standard_deviations_of_the_differences():
    from benchmarks.replay_diff import Difference, markdown

    # +1 and -3 blocks: net -2 over a noise of sqrt(1 + 9) = 3.16 blocks, -0.63 deviations
    diffs = [Difference(3, 4, (2, 1), 1, 2), Difference(7, 4, (0, 3), 1, 4)]
    md = markdown("t.jsonl", 4, ["adaptive", "lru"], 10, diffs, {"adaptive": [], "lru": []})
    assert "net `adaptive` - `lru`: -2 blocks, out of 4 blocks of differences" in md
    assert "the net is -0.63 standard deviations of its noise (3 blocks," in md


@pytest.mark.parametrize("family", ["forest", "conversations", "agent"])
def test_wide_draws_reach_past_the_tuned_ranges_and_draw_the_same_trace_again(family, tmp_path):
    from benchmarks.trace_families import WIDE_PARAMS, draw, main
    from minivllm.replay import load_trace

    assert family in WIDE_PARAMS
    narrow = [draw(family, seed).params for seed in range(40)]
    wide = [draw(family, seed, wide=True).params for seed in range(40)]
    beyond = {k for p in wide for k, v in p.items() if all(q.get(k) != v for q in narrow)}
    assert len(beyond) >= 3  # values the tuned draw never takes, in several parameters
    main([family, "3", str(tmp_path / "t.jsonl"), "--wide"])  # the generator takes every drawn parameter
    again = draw(family, 3, wide=True).requests()
    assert [r.hash_ids for r in load_trace(tmp_path / "t.jsonl")] == [r.hash_ids for r in again]


def test_family_robustness_counts_the_misses_under_the_bar_that_the_trace_tells_apart_from_chance():
    from benchmarks.family_robustness import markdown, summary

    def row(trace, ratio, **noise):
        rates = {"infinite": 0.5, "lru": 0.2, "s3fifo": 0.1, "adaptive": 0.2 * ratio}
        return {
            "trace": trace,
            "family": "scan",
            "capacity": 1000,
            "in_scope": True,
            "unreachable": 0,
            "ratio": ratio,
            "to_infinite": 0.4 * ratio,
            "lru_holds": False,
            **rates,
            **noise,
        }

    rows = [  # under the bar by more than the noise (a rule could have avoided it), by a coin flip, above it
        row("scan#1", 0.95, baseline="lru", net_blocks=-40, net_deviations=-2.5),
        row("scan#2", 0.965, baseline="lru", net_blocks=-12, net_deviations=-0.08),
        row("scan#3", 0.99),
    ]
    s = summary(rows)
    assert (s["below_bar"], s["below_bar_beyond_noise"]) == (2, 1)
    record = {
        "summary": s,
        "policy": "adaptive",
        "git_commit": "c",
        "date": "d",
        "seeds": 1,
        "first_seed": 0,
        "mooncake_seeds": 0,
        "capacities": (1000,),
        "rows": rows,
    }
    md = markdown(record)
    assert "below 0.97: 2 of 3, of which 1 by more than 2 deviations" in md
    assert "| 0.950 | -40 (-2.50) |" in md and "| 0.965 | -12 (-0.08) |" in md and "| 0.990 |  |" in md


def test_replay_diff_records_each_switch_of_the_configuration_the_default_follows():
    from types import SimpleNamespace

    from benchmarks.replay_diff import Switch, recording_switches
    from minivllm.cache.eviction import CONFIGURATION_NAMES, CONFIGURATIONS

    assert len(CONFIGURATION_NAMES) == len(CONFIGURATIONS)
    cache = SimpleNamespace(mode=0)
    modes = iter([0, 3, 3, 4, 0])  # the configuration once each request is done

    def hits():
        for hit in range(5):
            cache.mode = next(modes)
            yield hit

    switches: list = []
    assert list(recording_switches(cache, hits(), switches)) == [0, 1, 2, 3, 4]
    names = CONFIGURATION_NAMES
    assert switches == [
        Switch(1, names[0], names[3]),
        Switch(3, names[3], names[4]),
        Switch(4, names[4], names[0]),
    ]
    lru: list = []
    assert list(recording_switches(SimpleNamespace(), iter([5, 6]), lru)) == [5, 6] and lru == []


def test_replay_alone_replays_each_configuration_beside_the_baselines(tmp_path):
    from benchmarks import replay_alone
    from minivllm.cache.eviction import CONFIGURATION_NAMES

    # two blocks of cache: LRU hits A on requests 3 and 5 (0.4 of the tokens); the seed's S3FIFO sends A to
    # its ghost when B comes (a small queue of one block) and hits it on request 5 only (0.2)
    lines = [json.dumps({"input_length": 512, "hash_ids": [h]}) for h in (1, 2, 1, 3, 1)]
    trace = tmp_path / "abaca.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    assert replay_alone.main([str(trace), "--capacity", "2", "--out-dir", str(tmp_path)]) == 0
    md = (tmp_path / "replay_alone-abaca-2.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| policy")]
    assert [r.split(" | ")[0][2:] for r in rows] == [
        "lru",
        "s3fifo",
        *(f"{name}, alone" for name in CONFIGURATION_NAMES[:-1]),
        replay_alone.FOLLOWED,
        "default",
    ]
    assert rows[0] == "| lru | 0.4000 | 1.000 |" and rows[1] == "| s3fifo | 0.2000 | 0.500 |"
    assert "Block hits per" not in md and "The default at capacities" not in md  # only where asked


def test_replay_alone_gives_each_policys_block_hits_per_span_of_requests(tmp_path):
    from benchmarks import replay_alone

    # the trace of the test above: LRU hits A on requests 3 and 5, the seed's S3FIFO on request 5 only
    lines = [json.dumps({"input_length": 512, "hash_ids": [h]}) for h in (1, 2, 1, 3, 1)]
    trace = tmp_path / "abaca.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    assert replay_alone.main([str(trace), "--capacity", "2", "--span", "3", "--out-dir", str(tmp_path)]) == 0
    md = (tmp_path / "replay_alone-abaca-2.md").read_text()
    header, _, *rows = md.split("Block hits per 3 requests")[1].strip().splitlines()[2:]
    assert header.startswith("| requests | lru | s3fifo | ") and header.endswith(
        f" | {replay_alone.FOLLOWED} | default |"
    )
    cells = [row.strip("| ").split(" | ") for row in rows]
    assert [c[:3] for c in cells] == [["0", "1", "0"], ["3", "1", "1"], ["all", "2", "1"]]
    with pytest.raises(SystemExit):
        replay_alone.main([str(trace), "--capacity", "2", "--span", "-1", "--out-dir", str(tmp_path)])


def test_replay_alone_replays_the_default_and_the_baselines_around_the_capacity(tmp_path):
    from benchmarks import replay_alone

    # three passes over 100 one-block prompts: LRU thrashes in a pool of 96 or 98 blocks and holds them all
    # from 100 up (hits on the last two passes, 2/3 of the tokens)
    lines = [json.dumps({"input_length": 512, "hash_ids": [h]}) for _ in range(3) for h in range(100)]
    trace = tmp_path / "loop.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    assert replay_alone.main([str(trace), "--capacity", "100", "--around", "--out-dir", str(tmp_path)]) == 0
    md = (tmp_path / "replay_alone-loop-100.md").read_text()
    intro, _, _, _, *rows = md.split("The default at capacities ")[1].strip().splitlines()
    assert intro.startswith(
        "96-104 (x0.96 to x1.04): 1.000x to 1.000x max(LRU, S3FIFO), 0 of 5 below the bar"
    )
    cells = [row.strip("| ").split(" | ") for row in rows]
    assert [c[0] for c in cells] == ["96", "98", "100", "102", "104"]
    assert [c[1] for c in cells] == ["0.0000", "0.0000", "0.6667", "0.6667", "0.6667"]
    # where neither baseline hits there is no bar, whatever the default hits
    assert [c[4] for c in cells] == ["-", "-", "1.000", "1.000", "1.000"]


def test_replay_alone_says_whether_any_configuration_reaches_the_bar():
    from benchmarks.replay_alone import FOLLOWED, markdown
    from benchmarks.replay_diff import Switch

    rates = {"lru": 0.1, "s3fifo": 0.2, "a, alone": 0.19, "b, alone": 0.15, FOLLOWED: 0.18, "default": 0.17}
    md = markdown("t", 10, rates, [])
    assert "the default: 0.850x" in md and "the best configuration alone, a: 0.950x; none reaches" in md
    assert "- the default never switched configuration" in md
    md = markdown("t", 10, {**rates, "b, alone": 0.195}, [Switch(3, "a", "b"), Switch(8, "b", "a")])
    assert "the best configuration alone, b: 0.975x; it reaches" in md
    assert "- the default switched configuration after request 3 (a -> b), 8 (b -> a)" in md
    # the followed S3FIFO is the last configuration's expert
    md = markdown("t", 10, {**rates, FOLLOWED: 0.199}, [])
    assert f"the best configuration alone, {FOLLOWED}: 0.995x; it reaches" in md


def test_families_quick_measures_both_engines_in_every_phase(tmp_path):
    from benchmarks import families

    args = ["--quick", "--families", "phi3,gemma3_text", "--out", str(tmp_path), "--allow-dirty"]
    families.main(args)
    (path,) = tmp_path.glob("families-quick*.json")
    data = json.loads(path.read_text())
    assert [r["family"] for r in data["rows"]] == ["phi3", "gemma3_text"]
    rates = [v for phases in data["raw"].values() for cells in phases.values() for v in cells.values()]
    assert len(rates) == 2 * 4 * 2 and all(len(r) == 1 and r[0] > 0 for r in rates)
    nodes = data["raw"]["phi3"]["graph nodes"]
    assert 50 < nodes["minivllm"][0] < 1000 and 50 < nodes["mlx-lm"][0] < 1000


def test_random_model_is_quantized_in_the_shape_asked_and_the_engine_runs_it(tmp_path):
    """The GPU check's model: Qwen2.5-0.5B's shape (overridden here to stay small), 4-bit, group 64."""
    from benchmarks.random_model import QWEN25_05B, make_random_model
    from minivllm import LLM, SamplingParams

    shape = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=2)
    path = make_random_model(tmp_path / "m", **shape)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert config | shape == config and config["vocab_size"] == QWEN25_05B["vocab_size"]
    llm = LLM(str(path), kv_cache_bytes=8 << 20)
    (out,) = llm.generate(["alpha beta"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4


def test_throughput_reports_no_limit_where_the_model_keeps_no_float_matrices():
    """GPU backends keep quantized layers: no weight-streaming limit there, and no division by it."""
    import mlx.nn as nn

    from benchmarks.throughput import limit_ms, report_rows

    quantized = nn.QuantizedLinear(64, 64)
    assert all(math.isnan(ms) for ms in limit_ms(quantized))
    rates = {
        name: {k: [10.0] for k in ("prefill", "decode1", "decode8")}
        for name in ("minivllm", "minivllm-native", "mlx-lm")
    }
    memory = {"parameters": 0.1, "active": 0.2, "peak": 0.3}
    metrics = [
        r["metric"] for r in report_rows(rates, {"native": [math.nan], "transposed": [math.nan]}, memory, 8)
    ]
    assert len(metrics) == 4 and not any("limit" in m for m in metrics) and "memory" in metrics[-1]
    float_limits = {"native": [2.0], "transposed": [1.0]}
    assert sum("limit" in r["metric"] for r in report_rows(rates, float_limits, memory, 8)) == 4
    assert limit_ms(nn.Linear(64, 64))[0] > 0


def test_step_nodes_quick_counts_both_engines_at_each_batch(tiny_model_dir, tmp_path):
    from benchmarks import step_nodes

    step_nodes.main(["--model", str(tiny_model_dir), "--quick", "--out", str(tmp_path), "--allow-dirty"])
    (path,) = tmp_path.glob("step_nodes-quick*.json")
    raw = json.loads(path.read_text())["raw"]
    assert set(raw) == {"minivllm", "mlx-lm"} and all(set(v) == {"1", "2"} for v in raw.values())
    assert 50 < raw["minivllm"]["1"] < raw["minivllm"]["2"]  # attention per sequence: a request adds nodes
    assert raw["mlx-lm"]["1"] > 50


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "__init__"))
def test_every_benchmark_script_imports(script):
    """A script that no longer imports (an engine function it used was moved) fails here, not on a rerun."""
    import importlib

    importlib.import_module(f"benchmarks.{script}")


@pytest.mark.parametrize("model", ["tiny qwen2 dir", "gemma3_text"])
def test_decode_profile_quick_times_every_probe(model, tiny_model_dir, tmp_path):
    """On a model directory, and on a family's tiny model (Gemma's sliding layers: mlx-lm's rotating cache)."""
    from benchmarks import decode_profile

    which = ["--model", str(tiny_model_dir)] if model.endswith("dir") else ["--family", model]
    decode_profile.main(["--quick", "--runs", "1", *which, "--out", str(tmp_path), "--allow-dirty"])
    (path,) = tmp_path.glob("decode_profile*.json")
    assert path.name.startswith("decode_profile-gemma3_text") == (model == "gemma3_text")
    rows = {r["probe"]: r for r in json.loads(path.read_text())["rows"]}
    assert {
        "step",
        "graph build (Python)",
        "forward + argmax",
        "mlx-lm forward + argmax",
        "100 tiny nodes",
    } <= set(rows)
    assert all(float(r["ms"].split()[0]) > 0 for r in rows.values())


def test_long_context_profile_splits_each_step_for_both_attention_paths(tiny_model_dir, tmp_path):
    from benchmarks import long_context_profile

    args = ["--quick", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--allow-dirty"]
    long_context_profile.main(args)
    (path,) = tmp_path.glob("long_context_profile-*.json")
    rows = json.loads(path.read_text())["rows"]
    parts = {(r["what"], r["part"]) for r in rows}
    for label in ("compiled kernel", "MLX ops"):
        for kind in ("prefill chunk", "decode step"):
            # the wrappers saw the step's linear layers and attention
            for part in ("step", "wrapped step", "linear layers", "attention", "the rest"):
                assert (kind, f"{label}: {part}") in parts
        assert ("one layer's attention, prefill chunk", f"{label}: the call") in parts
    assert all(float(r["limit ms"]) > 0 for r in rows if r["part"].endswith(": step"))
