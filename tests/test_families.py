"""Model families: each supported one answers mlx-lm's greedy tokens (tiny random models built with
mlx-lm's own classes), and every config the forward cannot run exactly is refused at load, by name."""

import re

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from minivllm import LLM, SamplingParams
from tests.reference import MlxLmReference
from tests.test_engine import random_prompts
from tests.tiny_model import FAMILY_OPTIONS, make_tiny_family_model

QWEN3_MOE = {k: v for k, v in FAMILY_OPTIONS["qwen3_moe"].items() if k != "num_hidden_layers"}
GLM4_MOE = FAMILY_OPTIONS["glm4_moe"]
GPT_OSS = FAMILY_OPTIONS["gpt_oss"]


@pytest.fixture(scope="module", params=sorted(FAMILY_OPTIONS))
def family(request, tmp_path_factory):
    name = request.param
    path = make_tiny_family_model(tmp_path_factory.mktemp(name), name, **FAMILY_OPTIONS[name])
    return name, path, MlxLmReference(path)


def test_each_family_answers_mlx_lms_tokens_and_restores_its_prefix(family):
    _, path, reference = family
    answers_mlx_lms_tokens(path, reference)


# Gemma 4's other shapes (26B / 31B): routed experts beside the MLP, keys that are the values on global
# layers with their own KV head count, no per-layer inputs, every layer with its own K/V
GEMMA4_MOE = {
    **FAMILY_OPTIONS["gemma4_text"],
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 64,
    "attention_k_eq_v": True,
    "num_global_key_value_heads": 1,
    "hidden_size_per_layer_input": 0,
    "num_kv_shared_layers": 0,
}


def test_gemma4_with_experts_and_keys_as_values_answers_mlx_lms_tokens(tmp_path):
    path = make_tiny_family_model(tmp_path / "m", "gemma4_text", **GEMMA4_MOE)
    answers_mlx_lms_tokens(path, MlxLmReference(path))


def test_a_gemma4_multimodal_checkpoint_runs_its_text_model(tmp_path):
    """model_type gemma4 (text, vision and audio): its language model, token for token."""
    from tests.tiny_model import TINY_FAMILY_CONFIG

    text = {**TINY_FAMILY_CONFIG, **FAMILY_OPTIONS["gemma4_text"], "model_type": "gemma4_text"}
    path = make_tiny_family_model(tmp_path / "m", "gemma4", text_config=text)
    answers_mlx_lms_tokens(path, MlxLmReference(path))


def test_gemma4s_logits_are_soft_capped_as_mlx_lms(tmp_path):
    """Soft-capping changes no greedy token: the log-probabilities show it."""
    path = make_tiny_family_model(tmp_path / "m", "gemma4_text", **FAMILY_OPTIONS["gemma4_text"])
    reference = MlxLmReference(path)
    (prompt,) = random_prompts([40], seed=5, vocab=362)
    (out,) = LLM(str(path), kv_cache_bytes=16 << 20).generate(
        [prompt], SamplingParams(max_tokens=4, logprobs=1)
    )
    steps = generate_step(mx.array(prompt), reference.model, max_tokens=4)
    expected = [(int(token), logprobs[token].item()) for token, logprobs in steps]
    assert [t.token_id for t in out.logprobs] == [t for t, _ in expected]
    assert [t.logprob for t in out.logprobs] == pytest.approx([lp for _, lp in expected], abs=1e-4)


def answers_mlx_lms_tokens(path, reference) -> None:
    """Greedy tokens equal mlx-lm's for a short prompt and a 300-token one, in one batch and in 48-token
    chunks; the long one again, restored from the prefix cache."""
    short, long = random_prompts([11, 300], seed=27, vocab=362)  # 300 tokens: many pages
    llm = LLM(str(path), kv_cache_bytes=16 << 20)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = llm.generate([short, long], greedy)
    expected = [reference.greedy(short, 12), reference.greedy(long, 12)]
    assert len(set(expected[1])) > 3  # not a degenerate model: equal tokens mean equal computations
    assert [o.token_ids for o in outs] == expected
    again = llm.generate(long, greedy)[0]
    assert again.num_cached_tokens == (len(long) - 1) // 16 * 16
    assert again.token_ids == outs[1].token_ids
    # prefill in chunks of 48 tokens next to the short prompt's decode: chunks start mid-window
    chunked = LLM(str(path), kv_cache_bytes=16 << 20, max_num_batched_tokens=48)
    assert [o.token_ids for o in chunked.generate([short, long], greedy)] == expected


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
REFUSED = [
    ("gemma2", {}, "unsupported architecture 'gemma2'"),
    ("qwen3_moe", {**QWEN3_MOE, "rope_scaling": YARN}, "rope scaling ({"),  # mlx-lm's module ignores it
    ("glm4_moe", {**GLM4_MOE, "rope_scaling": YARN}, "rope scaling ({"),  # so does GLM's
    (
        "gpt_oss",
        {**GPT_OSS, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
        "rope scaling type 'dynamic'",
    ),
    ("phi3", {"sliding_window": 64}, "window 64 < context 4096"),  # mlx-lm's module ignores it
    ("gemma3_text", {"final_logit_softcapping": 30.0}, "logit soft-capping"),
    (
        "gemma3_text",
        {"sliding_window_pattern": 2, "layer_types": ["full_attention", "sliding_attention"]},
        "layer_types ['full_attention', 'sliding_attention']",
    ),
    ("gemma3_text", {"hidden_activation": "relu"}, "activation 'relu'"),
    (
        "gemma4_text",
        {**FAMILY_OPTIONS["gemma4_text"], "attn_logit_softcapping": 50.0},
        "attention logit soft",
    ),
    (
        "gemma4_text",
        {
            **FAMILY_OPTIONS["gemma4_text"],
            "rope_parameters": {
                "full_attention": {
                    "rope_type": "yarn",
                    "factor": 2.0,
                    "original_max_position_embeddings": 1024,
                }
            },
        },
        "rope type 'yarn' on full_attention layers",
    ),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64}, "sliding-window attention"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64}, "sliding-window attention"),
    ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope scaling type 'dynamic'"),
    ("llama", {"hidden_act": "gelu"}, "activation 'gelu'"),
    (
        "llama",
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64},
        "sliding-window",
    ),
    ("mistral", {"sliding_window": 64}, "window 64 < context 4096"),
]


@pytest.mark.parametrize(
    ("model_type", "config", "message"), REFUSED, ids=[f"{r[0]}-{r[2][:24]}" for r in REFUSED]
)
def test_a_config_the_forward_cannot_run_is_refused_by_name(tmp_path, model_type, config, message):
    path = make_tiny_family_model(tmp_path / model_type, model_type, **config)
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(str(path), kv_cache_bytes=4 << 20)


def test_a_module_the_forward_would_skip_is_refused(tmp_path):
    """The layout check: every block's submodules exactly the family's, so an extra norm or projection
    (which the forward would silently skip) stops the load."""
    import mlx.nn as nn
    import mlx_lm

    from minivllm.models.families import check_supported

    path = make_tiny_family_model(tmp_path / "qwen3", "qwen3")
    model, _, config = mlx_lm.load(str(path), return_config=True)
    check_supported(config, model)
    model.model.layers[1].pre_feedforward_layernorm = nn.RMSNorm(128)
    with pytest.raises(ValueError, match="a block with pre_feedforward_layernorm"):
        check_supported(config, model)
    del model.model.layers[1].pre_feedforward_layernorm
    model.model.layers[0].mlp.gate_up_proj = nn.Linear(128, 512)
    with pytest.raises(ValueError, match="an MLP of down_proj, gate_proj, gate_up_proj, up_proj"):
        check_supported(config, model)
    del model.model.layers[0].mlp.gate_up_proj
    model.model.layers[0].self_attn.q_norm = None
    with pytest.raises(ValueError, match="an attention module without q_norm"):
        check_supported(config, model)


def test_a_harmony_template_on_another_vocabulary_is_refused_by_name(tmp_path):
    """A template that writes Harmony is rendered by openai-harmony, whose token ids are gpt-oss's: a
    tokenizer without Harmony's tokens at those ids is refused at start-up, naming them."""
    from minivllm.models.loader import load_tokenizer
    from server.prompts import PromptBuilder
    from tests.tiny_model import HARMONY_STAND_IN_TEMPLATE, harmony_vocabulary

    harmony_vocabulary(tmp_path / "vocab")
    path = make_tiny_family_model(
        tmp_path / "m", "gpt_oss", chat_template=HARMONY_STAND_IN_TEMPLATE, **GPT_OSS
    )
    with pytest.raises(ValueError, match="<\\|start\\|>.*at Harmony's ids"):
        PromptBuilder(load_tokenizer(str(path)), 2048)
