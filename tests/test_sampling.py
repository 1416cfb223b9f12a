"""Sampling controls and grammar-constrained decoding in the engine, on the small random model: logit
bias, penalties and min-p against a step-by-step reference, and structured output that always parses."""

import collections
import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.sampling_params import StructuredOutput
from tests.reference import MlxLmReference
from tests.tiny_model import BYTES_PER_PAGE

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "unit", "member"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), kv_cache_bytes=8 << 20, max_num_seqs=24)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return MlxLmReference(tiny_model_dir)


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.tokenizer.encode("Paged attention stores keys")  # its greedy output repeats tokens


def greedy(max_tokens=24, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def penalized_greedy(reference, prompt, n, presence=0.0, frequency=0.0, repetition=1.0) -> list[int]:
    """The penalties' definition, one full forward per token: repetition over prompt and output
    (divide a positive logit, multiply a negative one), then presence / frequency over the output."""
    out: list[int] = []
    for _ in range(n):
        logits = np.array(reference.model(mx.array(prompt + out)[None])[0, -1].astype(mx.float32))
        seen = np.zeros(logits.shape, bool)
        seen[prompt + out] = True
        if repetition != 1:
            logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
        counts = np.bincount(np.array(out, dtype=int), minlength=logits.shape[0])[: logits.shape[0]]
        logits = logits - frequency * counts - presence * (counts > 0)
        out.append(int(np.argmax(logits)))
    return out


# -- logit bias -------------------------------------------------------------------------------------------
def test_logit_bias_plus_100_makes_greedy_pick_that_token(llm, prompt):
    (plain,) = llm.generate([prompt], greedy(8))
    token = next(t for t in range(3, 300) if t not in plain.token_ids)
    (forced,) = llm.generate([prompt], greedy(8, logit_bias={token: 100}))
    assert forced.token_ids == [token] * 8


def test_logit_bias_minus_100_bans_a_token(llm, prompt):
    (plain,) = llm.generate([prompt], greedy(8))
    banned = plain.token_ids[0]
    (out,) = llm.generate([prompt], greedy(8, logit_bias={banned: -100}))
    assert banned not in out.token_ids


# -- penalties --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "penalties",
    [
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.7},
        {"repetition_penalty": 1.8},
        {"presence_penalty": -1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
    ],
)
def test_penalties_match_their_definition_in_a_mixed_batch(llm, reference, prompt, penalties):
    expected = penalized_greedy(
        reference,
        prompt,
        40,
        penalties.get("presence_penalty", 0.0),
        penalties.get("frequency_penalty", 0.0),
        penalties.get("repetition_penalty", 1.0),
    )
    plain, penalized = llm.generate([prompt, prompt], [greedy(40), greedy(40, **penalties)])
    assert penalized.token_ids == expected
    assert plain.token_ids == reference.greedy(prompt, 40)  # its neighbour's penalties do not touch it
    assert penalized.token_ids != plain.token_ids


def test_repetition_penalty_counts_the_prompt(llm, reference):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 384, 30).tolist() for _ in range(64)]
    firsts = [o.token_ids[0] for o in llm.generate(prompts, greedy(1))]
    # a prompt whose greedy continuation starts with one of its own tokens
    prompt, first = next((p, t) for p, t in zip(prompts, firsts) if t in p)
    (out,) = llm.generate([prompt], greedy(4, repetition_penalty=3.0))
    assert out.token_ids[0] != first
    assert out.token_ids == penalized_greedy(reference, prompt, 4, repetition=3.0)


def test_strong_presence_penalty_forbids_repeats(llm, prompt):
    (plain,) = llm.generate([prompt], greedy(40))
    (penalized,) = llm.generate([prompt], greedy(40, presence_penalty=2.0, frequency_penalty=2.0))
    assert max(collections.Counter(plain.token_ids).values()) > 1  # the model alone repeats itself
    assert max(collections.Counter(penalized.token_ids).values()) == 1
    (negative,) = llm.generate([prompt], greedy(40, presence_penalty=-2.0))  # and a negative one repeats more
    assert len(set(negative.token_ids)) < len(set(plain.token_ids))


# -- min-p ------------------------------------------------------------------------------------------------
def test_min_p_one_keeps_only_the_top_token(llm, prompt):
    (plain,) = llm.generate([prompt], greedy(16))
    sampled = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=s) for s in range(4)]
    top_only = [
        SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=s, min_p=1.0) for s in range(4)
    ]
    outs = llm.generate([prompt] * 8, sampled + top_only)
    assert all(o.token_ids == plain.token_ids for o in outs[4:])
    assert any(o.token_ids != plain.token_ids for o in outs[:4])


# -- validation -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "params, message",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
    ],
)
def test_bad_sampling_controls_raise(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_out_of_vocabulary_bias_and_bad_grammar_are_refused(llm, prompt):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([prompt], greedy(2, logit_bias={10**6: 5}))
    with pytest.raises(ValueError, match="grammar"):
        llm.generate([prompt], greedy(2, structured_output=StructuredOutput(json_schema={"type": "strin"})))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutput()
    assert not llm.engine.has_unfinished_requests()


# -- structured output ------------------------------------------------------------------------------------
def test_json_schema_output_validates_in_20_of_20_samples(llm, prompt):
    masks_before = llm.engine.stats().grammar_masks
    spec = StructuredOutput(json_schema=PERSON)
    params = [
        SamplingParams(max_tokens=200, temperature=1.0, seed=s, structured_output=spec) for s in range(20)
    ]
    outs = llm.generate([prompt] * 20, params)
    for out in outs:
        jsonschema.validate(json.loads(out.text), PERSON)
        assert out.finish_reason == "stop"
    assert len({o.text for o in outs}) > 10  # sampled, not one forced answer
    generated = sum(len(o.token_ids) for o in outs)
    assert llm.engine.stats().grammar_masks - masks_before == generated  # one mask per token


def test_constrained_and_free_requests_share_steps(llm, prompt):
    spec = StructuredOutput(json_schema=PERSON)
    (alone,) = llm.generate([prompt], greedy(24))
    steps = llm.engine.num_steps
    free, constrained = llm.generate([prompt, prompt], [greedy(24), greedy(100, structured_output=spec)])
    assert free.token_ids == alone.token_ids  # the other row's mask leaves it alone
    jsonschema.validate(json.loads(constrained.text), PERSON)
    longest = max(len(free.token_ids), len(constrained.token_ids))
    assert llm.engine.num_steps - steps <= longest + 1  # one batch, not one request after the other


def test_lark_grammar_ends_when_complete(llm, prompt):
    spec = StructuredOutput(lark='start: "answer: " ("yes" | "no")')
    outs = llm.generate(
        [prompt] * 4, [greedy(30, temperature=1.0, seed=s, structured_output=spec) for s in range(4)]
    )
    for out in outs:
        assert out.text in ("answer: yes", "answer: no")
        assert out.finish_reason == "stop"  # ended by the grammar, not by max_tokens or an EOS
        assert llm.tokenizer.decode(out.token_ids) == out.text


def test_grammar_survives_preemption(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir),
        kv_cache_bytes=14 * BYTES_PER_PAGE,
        max_num_seqs=4,
        enable_prefix_caching=False,
        single_flight="off",
    )
    spec = StructuredOutput(json_schema=PERSON)
    params = [
        SamplingParams(max_tokens=150, temperature=1.0, seed=s, structured_output=spec) for s in range(4)
    ]
    prompts = [[5 + i] * 40 for i in range(4)]
    outs = llm.generate(prompts, params)
    assert llm.engine.stats().preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.text), PERSON)
