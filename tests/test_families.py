"""Model families: each supported one answers mlx-lm's greedy tokens (tiny random models built with
mlx-lm's own classes), and every config the forward cannot run exactly is refused at load, by name."""

import pytest

from minivllm import LLM, SamplingParams
from tests.reference import MlxLmReference
from tests.test_engine import random_prompts
from tests.tiny_model import LLAMA3_ROPE_SCALING, make_tiny_family_model

SUPPORTED = {
    "qwen2": {},
    "qwen3": {},  # q/k RMSNorms come with the class
    "llama": {"rope_scaling": LLAMA3_ROPE_SCALING, "attention_bias": True},
    "mistral": {"sliding_window": None},
}


@pytest.fixture(scope="module", params=sorted(SUPPORTED))
def family(request, tmp_path_factory):
    name = request.param
    path = make_tiny_family_model(tmp_path_factory.mktemp(name), name, **SUPPORTED[name])
    return name, path, MlxLmReference(path)


def test_each_family_answers_mlx_lms_tokens_and_restores_its_prefix(family):
    _, path, reference = family
    short, long = random_prompts([11, 300], seed=27, vocab=362)  # 300 tokens: many pages
    llm = LLM(str(path), kv_cache_bytes=16 << 20)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = llm.generate([short, long], greedy)
    assert [o.token_ids for o in outs] == [reference.greedy(short, 12), reference.greedy(long, 12)]
    again = llm.generate(long, greedy)[0]
    assert again.num_cached_tokens == (len(long) - 1) // 16 * 16
    assert again.token_ids == outs[1].token_ids


REFUSED = [
    (
        "qwen3_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
        },
        "unsupported architecture 'qwen3_moe'",
    ),  # fmt: skip
    ("gemma3_text", {}, "unsupported architecture 'gemma3_text'"),
    ("phi3", {}, "unsupported architecture 'phi3'"),
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
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(str(path), kv_cache_bytes=4 << 20)
