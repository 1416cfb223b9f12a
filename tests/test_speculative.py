"""Speculative decoding (prompt lookup, minivllm.engine.ngram_draft) on the tiny models: it must change
nothing a request sees. Greedy tokens are mlx-lm's and those of decoding without drafts, whether drafts
hit (a looping model, repetitive prompts, a drafter that knows the answer) or miss (random prompts);
seeded samples are the same tokens too, and their distribution is the target's (a chi-square test);
stop tokens and max_tokens cut where they would; the pool's invariants hold after every step and no page
holding a rejected token's KV is ever published."""

import random

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chi2

from minivllm import SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine import scheduler as scheduler_module
from minivllm.engine.llm_engine import LLMEngine, new_sequence
from minivllm.engine.ngram_draft import MAX_PAUSE, DraftState, accepted_tokens, propose
from minivllm.engine.sampling_params import StructuredOutput
from tests.reference import MlxLmReference
from tests.test_engine import greedy, random_prompts
from tests.tiny_model import BYTES_PER_PAGE, make_tiny_model

VOCAB = 512  # the tiny models' (the tokenizer has 384 tokens; the model samples all 512)


@pytest.fixture(scope="module")
def looping_model_dir(tmp_path_factory):
    """A tiny model at the default init's weight scale: its greedy outputs fall into loops, so prompt
    lookup drafts hit often (30-90% of tokens), and they still depend on the whole context."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-looping"), weight_scale=1.0)


@pytest.fixture(scope="module")
def looping_reference(looping_model_dir):
    return MlxLmReference(looping_model_dir)


def make_engine(model_dir, **kw) -> LLMEngine:
    settings = dict(kv_cache_bytes=8 << 20, max_num_seqs=8, single_flight="off", speculative="ngram") | kw
    return LLMEngine(EngineConfig(model=str(model_dir), **settings))


def run(engine: LLMEngine, requests: dict, arrivals: dict | None = None, after_step=None) -> dict:
    """Every request to its end: request id -> (tokens, finish reason). arrivals: request id -> the step
    it is added before (default 0). After every step: the pool's invariants, and no request holds a page
    past its tokens."""
    arrivals = arrivals or {}
    seen = {rid: ([], None) for rid in requests}
    step = 0
    while engine.has_unfinished_requests() or any(arrivals.get(r, 0) >= step for r in requests):
        assert step < 2000, "requests that never finish"
        for rid, (prompt, params) in requests.items():
            if arrivals.get(rid, 0) == step:
                engine.add_request(rid, prompt, params)
        step += 1
        for out in engine.step():
            seen[out.request_id] = (seen[out.request_id][0] + out.new_token_ids, out.finish_reason)
        engine.check_invariants()
        for seq in engine.scheduler.running:
            assert len(seq.cache.page_table) <= engine.kv.pages_for(len(seq.token_ids)), seq.request_id
            assert not seq.draft_token_ids
        if after_step:
            after_step(engine)
    assert engine.kv.pool.num_in_use == 0
    return seen


def published_kv(engine: LLMEngine) -> dict[bytes, np.ndarray]:
    """Every published page's keys and values (all layers), by page hash."""
    pool, kv, size = engine.kv.pool, engine.runner.kv, engine.kv.page_size
    out = {}
    for h, page in pool.index.items():
        slots = slice(page * size, (page + 1) * size)
        out[h] = np.stack([np.array(a[:, slots]) for a in kv.keys + kv.values])
    return out


def only_true_pages(truths: list[list[int]], page_size: int):
    """An after_step check: every published page is a page of one of the true token sequences."""
    valid = set()
    for truth in truths:
        valid.update(new_sequence("t", truth, SamplingParams()).cache.full_page_hashes(page_size))

    def check(engine: LLMEngine) -> None:
        assert set(engine.kv.pool.index) <= valid, "a page of tokens no request has was published"

    return check


def oracle_drafter(truths: list[list[int]], seed: int = 0, wrong: float = 0.5):
    """A drafter that knows each request's true continuation and drafts it with one wrong token (at a
    random place) half the time: drafts are accepted whole, in part or not at all."""
    rng = random.Random(seed)

    def draft(token_ids: list[int], max_tokens: int) -> list[int]:
        (truth,) = [t for t in truths if t[: len(token_ids)] == token_ids]
        out = truth[len(token_ids) : len(token_ids) + max_tokens]
        if out and rng.random() < wrong:
            j = rng.randrange(len(out))
            out[j] = (out[j] + 1) % VOCAB
        return out

    return draft


# -- the drafter and the acceptance rule, alone ------------------------------------------------------------
def test_propose_drafts_what_followed_the_most_recent_match_of_the_longest_tail():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 6, 7]
    assert propose(tokens, 3) == [3, 4, 6]  # the tail "6 7" last occurred at 6-7 (not 1-2)
    assert propose(tokens + [9], 2) == []  # 9 never occurred before
    assert propose([1, 2, 3, 9, 1, 2, 3, 8, 2, 3], 4) == [8, 2, 3]  # "2 3" at 6-7 is more recent than "1 2 3"
    assert propose([1, 2, 3, 4, 9, 2, 3, 4], 2) == [9, 2]  # the 3-gram "2 3 4" wins over shorter tails
    assert propose([4, 4, 4], 8) == [4]  # "4 4" at 0-1: only one token follows it
    assert propose([1, 2, 3], 0) == [] and propose([], 3) == [] and propose([7], 3) == []


def test_accepted_tokens_are_the_confirmed_draft_and_one_draw_more():
    assert accepted_tokens([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]  # all accepted, and the bonus
    assert accepted_tokens([1, 2, 3], [1, 9, 3, 4]) == [1, 9]  # the first mismatch: the target's draw
    assert accepted_tokens([1, 2, 3], [8, 2, 3, 4]) == [8]
    assert accepted_tokens([], [5]) == [5]


def test_a_request_drafts_less_and_pauses_after_misses_and_recovers_on_a_hit():
    state = DraftState(limit=8)
    state.record(8, 8)
    assert (state.limit, state.pause) == (16, 0)  # doubled; the engine caps it at speculative_tokens
    state.limit = 8
    state.record(8, 3)
    assert (state.limit, state.pause) == (8, 0)  # accepted in part: kept
    pauses, limits = [], []
    for _ in range(7):
        state.record(state.limit, 0)  # nothing accepted: half the draft, and a longer pause
        pauses.append(state.pause)
        limits.append(state.limit)
    assert pauses == [0, 1, 3, 7, MAX_PAUSE, MAX_PAUSE, MAX_PAUSE] and limits == [4, 2, 1, 1, 1, 1, 1]
    for _ in range(MAX_PAUSE):
        state.decoded_without_draft()
    assert state.pause == 0
    state.record(1, 1)
    assert (state.misses, state.limit, state.drafted, state.accepted) == (0, 2, 8 + 8 + 8 + 4 + 2 + 4 + 1, 12)


# -- greedy: the same tokens --------------------------------------------------------------------------------
def mixed_prompts(seed: int) -> list[list[int]]:
    """Random prompts (drafts mostly miss) and repetitive ones (the prompt itself predicts the output
    for a while), some long enough to be prefilled in several chunks while others decode."""
    rng = random.Random(seed)
    base = [rng.randrange(384) for _ in range(9)]
    return random_prompts([3, 24, 150], seed=seed) + [base * 7, base * 3 + [1, 2, 3] * 12, [5] * 40]


@pytest.mark.parametrize("model", ["random", "looping"])
def test_greedy_outputs_are_the_same_with_and_without_speculation(
    model, tiny_model_dir, reference, looping_model_dir, looping_reference
):
    model_dir, ref = (
        (tiny_model_dir, reference) if model == "random" else (looping_model_dir, looping_reference)
    )
    prompts = mixed_prompts(seed=51)
    requests = {f"r{i}": (p, greedy(48)) for i, p in enumerate(prompts)}
    arrivals = {"r2": 3, "r4": 9, "r5": 20}  # long prefills start while others decode
    budget = dict(max_num_batched_tokens=64, max_num_seqs=4)  # chunked prefills; at most 4 decode
    plain = make_engine(model_dir, speculative="off", **budget)
    spec = make_engine(model_dir, **budget)
    expected = run(plain, requests, arrivals)
    got = run(spec, requests, arrivals)
    assert got == expected
    assert [expected[f"r{i}"][0] for i in range(len(prompts))] == [ref.greedy(p, 48) for p in prompts]
    stats = spec.stats()
    assert stats.spec_draft_tokens > 10
    if model == "looping":  # drafts hit: several tokens per step
        assert stats.spec_accepted_tokens > 0.3 * stats.spec_draft_tokens
        assert spec.num_steps < 0.8 * plain.num_steps


def test_drafts_accepted_in_part_keep_greedy_exact_and_publish_only_true_kv(
    tiny_model_dir, reference, monkeypatch
):
    """A drafter that knows the answer but errs half the time, 4-token pages (a draft spans pages) and
    a small budget (prefill chunks share steps with verifications): the tokens are mlx-lm's, every step
    fits the budget, and every published page holds the KV decoding without drafts computes for it."""
    prompts = random_prompts([5, 20, 37, 90, 130], seed=52)
    n = 40
    truths = [p + reference.greedy(p, n) for p in prompts]
    requests = {f"r{i}": (p, greedy(n)) for i, p in enumerate(prompts)}
    arrivals = {"r3": 4, "r4": 12}
    config = dict(page_size=4, max_num_batched_tokens=48, max_num_seqs=4)
    plain = make_engine(tiny_model_dir, speculative="off", **config)
    expected = run(plain, requests, arrivals)
    spec = make_engine(tiny_model_dir, **config)
    steps = []
    real_launch = spec.runner.launch

    def launch(seqs, num_tokens, after=None):
        steps.append((sum(num_tokens), sum(len(s.draft_token_ids) for s in seqs)))
        return real_launch(seqs, num_tokens, after)

    spec.runner.launch = launch
    monkeypatch.setattr(scheduler_module, "propose", oracle_drafter(truths, seed=1))
    got = run(spec, requests, arrivals, after_step=only_true_pages(truths, 4))
    assert got == expected
    assert [got[f"r{i}"][0] for i in range(len(prompts))] == [t[len(p) :] for t, p in zip(truths, prompts)]
    assert all(total <= 48 for total, _ in steps)  # drafted tokens count in the step's budget
    stats = spec.stats()
    accepted, drafted = stats.spec_accepted_tokens, stats.spec_draft_tokens
    assert 0.2 * drafted < accepted < 0.9 * drafted  # whole, partial and failed verifications
    theirs, ours = published_kv(plain), published_kv(spec)
    common = set(theirs) & set(ours)
    assert len(common) > 0.8 * len(ours) and len(ours) > 40
    for h in common:
        np.testing.assert_allclose(ours[h], theirs[h], rtol=1e-4, atol=1e-4)


def test_stop_tokens_and_length_limits_cut_where_they_would_without_drafts(
    tiny_model_dir, reference, monkeypatch
):
    """The drafter offers tokens past a stop token, past max_tokens and past the context's end: they are
    never delivered, and each request ends as it would without speculation."""
    prompts = random_prompts([12, 30, 18], seed=53)
    full = [reference.greedy(p, 40) for p in prompts]
    stop = full[0][9]
    requests = {
        "stop": (prompts[0], SamplingParams(max_tokens=30, stop_token_ids=[stop], ignore_eos=True)),
        "length": (prompts[1], greedy(13)),
        # no max_tokens: up to the context's end, 18 + 32 = 50 tokens
        "context": (prompts[2], SamplingParams(max_tokens=None, ignore_eos=True)),
    }
    truths = [p + f for p, f in zip(prompts, full)]
    monkeypatch.setattr(scheduler_module, "propose", oracle_drafter(truths, wrong=0.0))
    engine = make_engine(tiny_model_dir, max_model_len=50)
    got = run(engine, requests)
    assert got["stop"] == (full[0][: full[0].index(stop) + 1], "stop")
    assert got["length"] == (full[1][:13], "length")
    assert got["context"] == (full[2][: 50 - 18], "length")
    assert engine.stats().spec_accepted_tokens > 20


def test_drafts_take_only_free_pages_and_never_preempt(tiny_model_dir, reference, monkeypatch):
    """A pool too small for its requests, 4-token pages and drafts of 8: decodes preempt each other as
    without speculation, and a draft only ever takes pages nobody needs (it never evicts nor preempts;
    a full pool just drafts less)."""
    prompts = random_prompts([20, 25, 30], seed=57)
    truths = [p + reference.greedy(p, 50) for p in prompts]
    monkeypatch.setattr(scheduler_module, "propose", oracle_drafter(truths, seed=3, wrong=0.3))
    requests = {f"r{i}": (p, greedy(50)) for i, p in enumerate(prompts)}
    pages = 40  # of 4 tokens: the three requests grow to 20 pages each
    engine = make_engine(
        tiny_model_dir,
        page_size=4,
        kv_cache_bytes=pages * BYTES_PER_PAGE // 4,
        max_num_seqs=3,
        enable_prefix_caching=False,
    )
    got = run(engine, requests)
    assert [got[f"r{i}"][0] for i in range(len(prompts))] == [t[len(p) :] for t, p in zip(truths, prompts)]
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.spec_accepted_tokens > 40


# -- sampling: the same draws, the target's distribution -----------------------------------------------
def test_seeded_samples_are_the_same_with_and_without_speculation(tiny_model_dir, monkeypatch):
    """A verification draws each drafted position with the draw decoding without a draft makes there:
    a drafter that knows the samples (and errs half the time) changes no token."""
    prompts = mixed_prompts(seed=54)
    params = [
        SamplingParams(max_tokens=40, temperature=t, top_p=tp, top_k=k, seed=i, ignore_eos=True)
        for i, (t, tp, k) in enumerate([(0.7, 1.0, 0), (1.0, 0.9, 0), (0.5, 1.0, 20), (1.5, 0.95, 0)] * 2)
    ]
    requests = {f"r{i}": (p, sp) for i, (p, sp) in enumerate(zip(prompts, params))}
    config = dict(max_num_seqs=4, max_num_batched_tokens=64)
    expected = run(make_engine(tiny_model_dir, speculative="off", **config), requests)
    truths = [p + expected[f"r{i}"][0] for i, p in enumerate(prompts)]
    monkeypatch.setattr(scheduler_module, "propose", oracle_drafter(truths, seed=2))
    spec = make_engine(tiny_model_dir, **config)
    assert run(spec, requests, arrivals={"r5": 6}) == expected
    assert spec.stats().spec_accepted_tokens > 40


def next_token_logits(ref: MlxLmReference, prompt: list[int], tokens: list[int], rows: int = 64) -> mx.array:
    """mlx-lm's logits of the token after prompt + [t], for each t in tokens: [len(tokens), vocab]. At
    most `rows` batch rows a call: mlx-lm's rope of the tiny model's 16 dims fails on MLX's CUDA backend
    from 128 rows of 4 heads (docs/how-it-works.md#on-a-gpu)."""
    if len(tokens) > rows:
        parts = [
            next_token_logits(ref, prompt, tokens[i : i + rows], rows) for i in range(0, len(tokens), rows)
        ]
        return mx.concatenate(parts)
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(ref.model)
    ref.model(mx.array(prompt)[None], cache=cache)
    for c in cache:  # the same context for every t: one batch row each
        c.keys, c.values = (mx.repeat(a[..., : c.offset, :], len(tokens), axis=0) for a in (c.keys, c.values))
    return ref.model(mx.array(tokens)[:, None], cache=cache)[:, -1].astype(mx.float32)


def test_sampled_tokens_keep_the_target_distribution(tiny_model_dir, reference, monkeypatch):
    """Thousands of seeded requests, each verifying one drafted token after its first sampled one, t0:
    their second tokens, pooled, against the sum of the target's distributions after prompt + [t0]
    (temperature 1), a chi-square test. The draft is the target's most likely token after prompt + [t0]
    (the drafter knows it), so that about a sixth of the drafts are accepted: the rule is the same for
    any deterministic draft, and a prompt-lookup draft on a random model is rarely likely. Deterministic:
    the seeds are fixed. Breaking the acceptance rule (tests/mutations.py: spec-accepts-every-draft)
    fails it."""
    n = 2000
    prompt = random_prompts([24], seed=56)[0]
    after = mx.softmax(next_token_logits(reference, prompt, list(range(VOCAB))), axis=-1)
    likeliest = mx.argmax(after, axis=-1).tolist()
    probs = np.array(after)

    def draft(token_ids: list[int], max_tokens: int) -> list[int]:
        return [likeliest[token_ids[-1]]] if len(token_ids) == len(prompt) + 1 else []

    monkeypatch.setattr(scheduler_module, "propose", draft)
    monkeypatch.setattr(scheduler_module, "SPEC_MAX_DECODES", 64)  # all of a big batch draft
    engine = make_engine(tiny_model_dir, max_num_seqs=64, max_waiting=n, speculative_tokens=64)
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True) for i in range(n)]
    seqs = [engine.add_request(f"s{i}", prompt, p) for i, p in enumerate(params)]
    while engine.has_unfinished_requests():
        engine.step()
    firsts = np.array([s.output_token_ids[0] for s in seqs])
    seconds = np.array([s.output_token_ids[1] for s in seqs])
    expected = probs[firsts].sum(axis=0)
    observed = np.bincount(seconds, minlength=VOCAB).astype(float)
    big = expected >= 5  # the rare tokens pooled into one bin
    exp_bins = np.append(expected[big], expected[~big].sum())
    obs_bins = np.append(observed[big], observed[~big].sum())
    statistic = ((obs_bins - exp_bins) ** 2 / exp_bins).sum()
    p_value = chi2.sf(statistic, len(exp_bins) - 1)
    assert len(exp_bins) > 20
    assert p_value > 1e-3, f"chi-square {statistic:.0f} over {len(exp_bins)} bins: p = {p_value:.2g}"
    stats = engine.stats()
    assert stats.spec_draft_tokens == n  # every request verified one drafted token
    assert 0.1 * n < stats.spec_accepted_tokens < 0.9 * n  # accepted and rejected drafts alike


# -- who drafts -------------------------------------------------------------------------------------------------
def test_requests_that_need_each_token_on_the_host_and_large_batches_never_draft(looping_model_dir):
    grammar = StructuredOutput(lark='start: "a" ("b" | "c")* "d"')
    base = [3, 1, 4, 1, 5, 9, 2, 6]
    special = {
        "logprobs": SamplingParams(max_tokens=24, logprobs=2, ignore_eos=True),
        "penalties": SamplingParams(max_tokens=24, repetition_penalty=1.2, ignore_eos=True),
        "grammar": SamplingParams(max_tokens=24, temperature=1.0, seed=1, structured_output=grammar),
    }
    engine = make_engine(looping_model_dir)
    run(engine, {k: (base * 4, p) for k, p in special.items()})
    assert engine.stats().spec_draft_tokens == 0
    many = {f"r{i}": (base * 4 + [i], greedy(24)) for i in range(scheduler_module.SPEC_MAX_DECODES + 1)}
    engine = make_engine(looping_model_dir)
    run(engine, many)
    assert engine.stats().spec_draft_tokens == 0
    engine = make_engine(looping_model_dir)
    run(engine, dict(list(many.items())[: scheduler_module.SPEC_MAX_DECODES]))
    assert engine.stats().spec_draft_tokens > 0


def test_with_overlap_a_verification_is_never_run_ahead(looping_model_dir, looping_reference):
    prompts = mixed_prompts(seed=55)[:4]
    requests = {f"r{i}": (p, greedy(40)) for i, p in enumerate(prompts)}
    engine = make_engine(looping_model_dir, overlap=True)
    got = run(engine, requests)  # the runner refuses to build a step after a verification
    assert [got[f"r{i}"][0] for i in range(4)] == [looping_reference.greedy(p, 40) for p in prompts]
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.steps_ahead > 0  # backed-off requests overlap


def test_the_settings_and_the_metrics():
    from minivllm.outputs import EngineStats
    from server.metrics import Metrics
    from server.settings import Settings, SettingsError

    env = {"MINIVLLM_SPECULATIVE": "ngram", "MINIVLLM_SPECULATIVE_TOKENS": "4"}
    config = Settings.from_env(env).engine_config()
    assert (config.speculative, config.speculative_tokens) == ("ngram", 4)
    assert Settings.from_env({}).engine_config().speculative == "off"
    with pytest.raises(SettingsError, match="MINIVLLM_SPECULATIVE: expected one of off, ngram"):
        Settings.from_env({"MINIVLLM_SPECULATIVE": "eagle"})
    with pytest.raises(SettingsError, match="MINIVLLM_SPECULATIVE_TOKENS"):
        Settings.from_env({"MINIVLLM_SPECULATIVE_TOKENS": "0"})

    class Engine:
        def replica_stats(self):
            return {None: EngineStats(spec_draft_tokens=7, spec_accepted_tokens=5)}

    metrics = Metrics()
    metrics.bind_engines({"tiny": Engine()})
    text = metrics.render().decode()
    assert "minivllm_spec_draft_tokens_total 7.0" in text
    assert "minivllm_spec_accepted_tokens_total 5.0" in text


def test_through_the_server_stop_strings_cut_as_without_speculation(looping_model_dir):
    """The server matches stop strings on the text, with several tokens arriving in one step."""
    import httpx

    from tests.server_thread import ServerThread, tiny_settings

    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    kw = dict(model="tiny", prompt=prompt, max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
    seen = {}
    for mode in ("off", "ngram"):
        with ServerThread(tiny_settings(looping_model_dir, speculative=mode)) as server:
            client = server.client()
            full = client.completions.create(**kw).choices[0].text
            # a stop string first found well into the text
            stop = next(full[i : i + 3] for i in range(12, len(full) - 3) if full.find(full[i : i + 3]) == i)
            r = client.completions.create(stop=[stop], **kw)
            stream = "".join(
                c.choices[0].text for c in client.completions.create(stream=True, stop=[stop], **kw)
            )
            seen[mode] = (full, stop, r.choices[0].text, r.choices[0].finish_reason, stream)
            metrics = httpx.get(server.url + "/metrics").text
    assert seen["ngram"] == seen["off"]
    full, stop, cut, reason, stream = seen["ngram"]
    assert cut == stream == full[: full.index(stop)] and reason == "stop"
    (accepted,) = [
        line for line in metrics.splitlines() if line.startswith("minivllm_spec_accepted_tokens_total")
    ]
    assert float(accepted.split()[-1]) > 0
