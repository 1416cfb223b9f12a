"""Hybrid models (Qwen3.5, Qwen3-Next): linear-attention layers whose recurrent state the engine carries
from step to step and keeps as snapshots at page boundaries beside the prefix cache's pages. Every answer
is mlx-lm's greedy one (its own model class on tiny random models); a restore resumes the state where the
restored pages end, from RAM or from the disk tier across a restart."""

import pytest

from minivllm import LLM, SamplingParams
from tests.reference import MlxLmReference
from tests.test_engine import random_prompts
from tests.tiny_model import FAMILY_OPTIONS, HYBRID_OPTIONS, make_tiny_family_model

PAGE = 16


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = make_tiny_family_model(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5", **FAMILY_OPTIONS["qwen3_5"])
    return str(path), MlxLmReference(path)


def checked(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params)
    llm.engine.check_invariants()
    return outs


# -- held-out shapes: the forward is mlx-lm's for other options of both families ---------------------------
VARIANTS = {
    "qwen3_5-interval-4-tied": (
        "qwen3_5",
        {**HYBRID_OPTIONS, "num_hidden_layers": 4, "full_attention_interval": 4, "tie_word_embeddings": True},
    ),
    "qwen3_5-heads-equal-conv-2": (
        "qwen3_5",
        {**HYBRID_OPTIONS, "num_hidden_layers": 2, "linear_num_value_heads": 2, "linear_conv_kernel_dim": 2},
    ),
    "qwen3_5_moe": (
        "qwen3_5_moe",
        {
            **HYBRID_OPTIONS,
            "num_hidden_layers": 2,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
        },
    ),
    "qwen3_next-dense": (
        "qwen3_next",
        {**FAMILY_OPTIONS["qwen3_next"], "num_experts": 0, "linear_value_head_dim": 16},
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_other_shapes_answer_mlx_lms_tokens(tmp_path, variant):
    model_type, options = VARIANTS[variant]
    path = make_tiny_family_model(tmp_path / variant, model_type, seed=3, **options)
    reference = MlxLmReference(path)
    prompts = random_prompts([5, 150], seed=31, vocab=362)
    llm = LLM(str(path), kv_cache_bytes=8 << 20, max_num_batched_tokens=40)  # chunks across page boundaries
    outs = checked(llm, prompts, greedy(10))
    assert [o.token_ids for o in outs] == [reference.greedy(p, 10) for p in prompts]


# -- the state's prefix cache --------------------------------------------------------------------------------
def test_a_shared_prefix_resumes_at_a_snapshot_with_a_cold_runs_tokens(hybrid):
    path, reference = hybrid
    shared, a, b, c = random_prompts([200, 20, 25, 30], seed=32, vocab=362)
    # by default a snapshot every 48 tokens here (3 pages' KV take as much memory as one): the second
    # prompt resumes at 192, where its pages leave the first's
    llm = LLM(path, kv_cache_bytes=8 << 20, single_flight="off")
    assert llm.engine.kv.snapshot_every == 48
    checked(llm, shared + a, greedy())
    out = checked(llm, shared + b, greedy())[0]
    assert out.num_cached_tokens == 192 and out.token_ids == reference.greedy(shared + b, 8)
    # with snapshots far apart, the pages of 192 shared tokens are cached but no state at their end: the
    # second prompt resumes at token 0, and keeps its state where it leaves the cached prompt
    llm = LLM(path, kv_cache_bytes=8 << 20, single_flight="off", state_snapshot_tokens=1024)
    first = checked(llm, shared + a, greedy())[0]
    second = checked(llm, shared + b, greedy())[0]
    third = checked(llm, shared + c, greedy())[0]
    assert (first.num_cached_tokens, second.num_cached_tokens, third.num_cached_tokens) == (0, 0, 192)
    for prompt, out in ((shared + a, first), (shared + b, second), (shared + c, third)):
        assert out.token_ids == reference.greedy(prompt, 8)


def test_the_next_turn_resumes_after_the_last_turns_answer(hybrid):
    path, reference = hybrid
    prompt, more = random_prompts([150, 30], seed=33, vocab=362)
    llm = LLM(path, kv_cache_bytes=8 << 20)
    answer = checked(llm, prompt, greedy(20))[0].token_ids
    turn = prompt + answer + more
    out = checked(llm, turn, greedy())[0]
    # the state at the last page boundary of what the first turn computed (169 tokens)
    assert out.num_cached_tokens == 160
    assert out.token_ids == reference.greedy(turn, 8)
    again = checked(llm, turn, greedy())[0]  # the second turn's prompt end was kept too
    assert again.num_cached_tokens == (len(turn) - 1) // PAGE * PAGE and again.token_ids == out.token_ids


def test_identical_prompts_and_a_fan_out_compute_their_prefix_once(hybrid):
    path, reference = hybrid
    # 270 shared tokens: their pages end at 256, between two periodic snapshots (every 48 tokens)
    shared, *suffixes = random_prompts([270, 12, 15, 9, 20], seed=34, vocab=362)
    prompt = shared + suffixes[0]
    llm = LLM(path, kv_cache_bytes=16 << 20)
    outs = checked(llm, [prompt] * 4, greedy())
    assert [o.num_cached_tokens for o in outs] == [0] + [(len(prompt) - 1) // PAGE * PAGE] * 3
    assert all(o.token_ids == reference.greedy(prompt, 8) for o in outs)
    # a fan-out: the waiters resume where the shared pages end, the leader kept the state there for them
    llm = LLM(path, kv_cache_bytes=16 << 20)
    assert llm.engine.kv.snapshot_every == 48
    prompts = [shared + s for s in suffixes]
    outs = checked(llm, prompts, greedy())
    assert sorted(o.num_cached_tokens for o in outs) == [0, 256, 256, 256]
    for p, out in zip(prompts, outs):
        assert out.token_ids == reference.greedy(p, 8)
    assert llm.engine.stats().computed_prompt_tokens == len(prompt) + sum(len(p) - 256 for p in prompts[1:])


def test_preempted_requests_resume_their_state_right(hybrid):
    """A pool too small for everyone: requests are preempted mid-decode, lose their state with their pages,
    and resume from a snapshot or from token 0; every answer is the one each gets alone."""
    path, reference = hybrid
    prompts = random_prompts([100, 90, 110], seed=35, vocab=362)
    page_bytes = 2 * 2 * 2 * PAGE * 32 * 4  # 2 attention layers, K and V, 2 KV heads, head_dim 32, float32
    llm = LLM(
        path, kv_cache_bytes=20 * page_bytes * 4 // 3, max_num_batched_tokens=48
    )  # 20 pages: 2 of 3 fit
    outs = checked(llm, prompts, greedy(60))
    assert llm.engine.stats().preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference.greedy(prompt, 60)
    assert llm.engine.kv.state().in_use == 0


def test_snapshots_within_their_budget_and_never_past_their_page(hybrid):
    path, reference = hybrid
    prompts = random_prompts([120, 130, 140, 150], seed=36, vocab=362)
    llm = LLM(path, kv_cache_bytes=600 << 10)  # 28 pages (4 prompts need 38) and 3 snapshots' room
    for prompt in [p for p in prompts for _ in range(2)]:  # each twice: the second restores
        out = checked(llm, prompt, greedy())[0]  # no snapshot outlives its page, none over the budget
        assert out.token_ids == reference.greedy(prompt, 8)
    snapshots, stats = llm.engine.kv.snapshots, llm.engine.stats()
    assert stats.pages_evicted > 0 and snapshots.counters.snapshots_dropped > 0 and 0 < len(snapshots) <= 3
    assert stats.state_snapshots_restored > 0


def test_a_snapshot_goes_with_its_page(hybrid):
    """Snapshots with room to spare and a pool that must evict: the pages given up take their snapshots
    with them (checked's invariants: no snapshot outlives its page), none goes for the budget."""
    path, reference = hybrid
    prompts = random_prompts([120, 130, 140, 150], seed=37, vocab=362)
    llm = LLM(path, kv_cache_bytes=1200 << 10, state_cache_fraction=0.75)
    for prompt in prompts:
        assert checked(llm, prompt, greedy())[0].token_ids == reference.greedy(prompt, 8)
    snapshots, stats = llm.engine.kv.snapshots, llm.engine.stats()
    assert stats.pages_evicted > 0 and snapshots.counters.snapshots_dropped == 0 and len(snapshots) > 0


def test_speculative_decoding_is_off_for_a_hybrid_model(hybrid):
    path, reference = hybrid
    prompt = random_prompts([40], seed=37, vocab=362)[0]
    llm = LLM(path, kv_cache_bytes=4 << 20, speculative="ngram")
    assert llm.engine.config.speculative == "off"
    assert checked(llm, prompt * 3, greedy(16))[0].token_ids == reference.greedy(prompt * 3, 16)


# -- the disk tier ---------------------------------------------------------------------------------------------
def test_the_state_is_restored_from_disk_across_a_restart(hybrid, tmp_path):
    path, reference = hybrid
    prompt, more = random_prompts([180, 25], seed=38, vocab=362)
    disk = dict(kv_cache_bytes=8 << 20, kv_disk_dir=str(tmp_path / "kv"), kv_disk_bytes=64 << 20)
    llm = LLM(path, **disk)
    answer = checked(llm, prompt, greedy(12))[0].token_ids
    llm.engine.close()
    restarted = LLM(path, **disk)
    turn = prompt + answer + more
    out = checked(restarted, turn, greedy())[0]
    assert out.num_cached_tokens == (len(prompt) + len(answer) - 1) // PAGE * PAGE
    assert out.token_ids == reference.greedy(turn, 8)
    stats = restarted.engine.stats()
    assert stats.kv_disk_pages_read > 0
    restarted.engine.close()
    # a damaged snapshot file is deleted, never served: the request computes what it cannot restore
    files = sorted((tmp_path / "kv" / "states" / "pages").iterdir())
    assert files
    for f in files:
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))
    damaged = LLM(path, **disk)
    out = checked(damaged, turn, greedy())[0]
    assert out.token_ids == reference.greedy(turn, 8)
    assert out.num_cached_tokens < (len(prompt) + len(answer) - 1) // PAGE * PAGE
    damaged.engine.close()


def test_an_aborted_request_gives_back_its_pages_and_states(hybrid):
    path, _ = hybrid
    llm = LLM(path, kv_cache_bytes=4 << 20)
    engine = llm.engine
    seq = engine.add_request("a", random_prompts([70], seed=39, vocab=362)[0], greedy(50))
    while len(seq.token_ids) < 75:  # past the prompt and a page boundary of its answer
        engine.step()
    assert seq.recurrent is not None and seq.boundary_state is not None
    engine.abort_request("a")
    engine.step()
    assert (seq.recurrent, seq.boundary_state, seq.kept_states) == (None, None, [])
    assert engine.kv.state().in_use == 0
    engine.check_invariants()
