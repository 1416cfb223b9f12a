"""Build small random Qwen2 and Llama models in mlx-lm layout, offline, for tests and benchmark smoke runs."""

import json
import math
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen2
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FIM_TOKENS = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"]  # Qwen2.5-Coder's fill-in-the-middle
# ChatML like Qwen2.5's, tools in its format too: tools listed in a system turn, assistant calls as
# <tool_call> blocks (mlx-lm infers its json_tools parser from them), tool results in <tool_response>.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{{ '\n\n' }}{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools>\n"
    'Call one as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{% if message['content'] %}{{ '\n' }}{{ message['content'] }}{% endif %}"
    "{% for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}"
    '{{ \'\n\' }}<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}"
    "\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The same ChatML without any tool format: a model whose tools take the server's generic format
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# ChatML with Qwen3's thinking: <think> blocks, a history's reasoning_content rendered back, and the
# enable_thinking switch; the generation prompt opens the thinking (as Qwen3's 2507 thinking models' do)
THINK_TOKENS = ["<think>", "</think>"]
THINKING_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' and message.reasoning_content %}"
    "<think>\n{{ message.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
# GLM-4.5's roles and tool-call form (written here from its documented format): tools listed in a system
# turn, a call as <tool_call>NAME, then <arg_key>/<arg_value> pairs (strings raw, other values as JSON),
# results after <|observation|>; mlx-lm infers its glm47 parser from the <arg_key> tag
GLM_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
GLM_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
GLM_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\n</tools>\nCall one as <tool_call>{function-name}\n<arg_key>{arg-key}</arg_key>\n"
    "<arg_value>{arg-value}</arg_value>\n</tool_call>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|assistant|>\n{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}{% set tc = tc.function %}\n<tool_call>{{ tc.name }}"
    "{% for k, v in tc.arguments.items() %}\n<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v | tojson if v is not string else v }}</arg_value>{% endfor %}\n</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<|observation|>\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# A template in Gemma 4's call format (what mlx-lm infers its gemma4 parser from: the two call markers)
GEMMA4_TOKENS = ["<|endoftext|>", "<start_of_turn>", "<end_of_turn>"]
GEMMA4_TOOL_TOKENS = ["<|tool_call>", "<tool_call|>", '<|"|>']
GEMMA4_CHAT_TEMPLATE = (
    "{% if tools %}<start_of_turn>system\nTools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\nCall one as <|tool_call>call:NAME{key:value}<tool_call|><end_of_turn>\n{% endif %}"
    "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}<|tool_call>call:{{ tc.function.name }}{{ tc.function.arguments | tojson }}"
    "<tool_call|>{% endfor %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Gemma 4's thinking (mlx-lm infers its markers from the vocabulary: `<|channel>thought` ... `<channel|>`), a
# template that opens it at the generation prompt when asked
GEMMA4_THINK_TOKENS = ["<|channel>", "<channel|>"]
GEMMA4_THINKING_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content %}<|channel>thought\n{{ m.reasoning_content }}"
    "<channel|>{% endif %}{{ m.content }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n"
    "{% if enable_thinking is defined and enable_thinking %}<|channel>thought\n{% endif %}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Paged attention stores keys and values in fixed-size blocks of sixteen tokens.",
    "def reverse(s):\n    return s[::-1]\n",
    "Prefix caching reuses the KV cache of a shared prompt prefix across requests.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ !?.,;:'\"()[]{}<>/\\-_=+*&^%$#@~`|",
]


def build_tokenizer(
    vocab_size: int = 384, special_tokens: list[str] = SPECIAL_TOKENS, added_tokens: list[str] = ()
) -> Tokenizer:
    """added_tokens: tokens of their own that decode as their text (not special: Qwen's and GLM's
    tool-call markers)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    return tok


# KV bytes of one 16-token page of the default tiny model: K+V, layers, kv heads, head dim, page size, float32
BYTES_PER_PAGE = 2 * 2 * 2 * 16 * 16 * 4


def make_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    num_layers: int = 2,
    tie_embeddings: bool = False,
    max_position_embeddings: int = 2048,
    fim: bool = False,
    weight_scale: float = 4.0,
    chat_template: str = CHAT_TEMPLATE,
    special_tokens: list[str] = SPECIAL_TOKENS,
    added_tokens: list[str] = (),
    eos_token: str = "<|im_end|>",
) -> Path:
    """Write config.json, model.safetensors and tokenizer files for a random Qwen2 model. fim: with
    Qwen2.5-Coder's fill-in-the-middle tokens among the special tokens. weight_scale: see
    save_random_weights (1.0, the default init's: a model whose greedy outputs repeat themselves)."""
    path = Path(path)
    specials = special_tokens + FIM_TOKENS if fim else special_tokens
    tokenizer = build_tokenizer(special_tokens=specials, added_tokens=added_tokens)
    tok = write_tokenizer(path, tokenizer, 2048, chat_template, eos_token)
    vocab_size = 512  # >= tokenizer vocabulary, like real models' padded vocabularies
    config = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": num_layers,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_embeddings,
        "eos_token_id": tok.token_to_id(eos_token),
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(seed)
    save_random_weights(qwen2.Model(qwen2.ModelArgs.from_dict(config)), path, weight_scale)
    return path


# Llama 3.1's rope scaling: mlx-lm builds a Llama3RoPE, whose frequencies are an array of the module
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def make_tiny_llama_model(
    path: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    head_dim: int = 32,
    intermediate_size: int = 1024,
    vocab_size: int = 362,
    rope_scaling: dict | None = LLAMA3_ROPE_SCALING,
    max_position_embeddings: int = 131072,  # Llama 3.1's; the engine clamps it to what the KV pool holds
) -> Path:
    """A random Llama-family model built with mlx-lm's own llama class (the defaults: issue 31's), with
    the tokenizer trained to exactly vocab_size tokens."""
    path = Path(path)
    tok = write_tokenizer(path, build_tokenizer(vocab_size), model_max_length=max_position_embeddings)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": 500000.0,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": False,
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(seed)
    save_random_weights(llama.Model(llama.ModelArgs.from_dict(config)), path)
    return path


TINY_FAMILY_CONFIG = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


HYBRID_OPTIONS = {
    "full_attention_interval": 2,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
}
PHI3_ROPE_DIMS = 24  # partial_rotary_factor 0.75 of head_dim 32
# each supported family with its distinctive options (tests/test_families.py, benchmarks/families.py)
FAMILY_OPTIONS = {
    "qwen2": {},
    "qwen3": {"head_dim": 64},  # q/k RMSNorms come with the class; head_dim not hidden / heads, as Qwen3's
    "llama": {"rope_scaling": LLAMA3_ROPE_SCALING, "attention_bias": True},
    "mistral": {"sliding_window": None},
    # Phi-4-mini's options: partial rotary, longrope (long factors; mscale from the context ratio), tied
    "phi3": {
        "partial_rotary_factor": 0.75,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": [1.0 + i / 4 for i in range(PHI3_ROPE_DIMS // 2)],
            "short_factor": [1.0] * (PHI3_ROPE_DIMS // 2),
        },
        "original_max_position_embeddings": 1024,
        "tie_word_embeddings": True,
    },
    # a local and a global layer; the window (40, mid-page) well inside the long prompt; its own rope
    # base for local layers, linear scaling for global ones, a query scale other than head_dim's
    "gemma3_text": {
        "sliding_window": 40,
        "sliding_window_pattern": 2,
        "rope_local_base_freq": 1000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "query_pre_attn_scalar": 24,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    # experts in layers 0 and 2, a dense MLP in layer 1
    "qwen3_moe": {
        "num_hidden_layers": 3,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
    },
    # GLM-4.5's options: a dense first layer, then routed experts picked by sigmoid scores within the best
    # expert groups (a correction bias, scaled weights) beside a shared expert; q/k norms, biased q/k/v,
    # rope on half of each head
    "glm4_moe": {
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "use_qk_norm": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
        "rope_scaling": None,
    },
    # hybrids: gated delta net layers (a recurrent state each, a convolution of 4) and a gated attention
    # layer every second one, the last layer a linear one; Qwen3-Next's fused projections and sparse
    # block (a dense layer 1), rope on a quarter of each head
    "qwen3_next": {
        "num_hidden_layers": 3,
        **HYBRID_OPTIONS,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [1],
        "moe_intermediate_size": 64,
        "partial_rotary_factor": 0.25,
        "norm_topk_prob": True,
    },
    "qwen3_5": {"num_hidden_layers": 4, **HYBRID_OPTIONS},  # the last layer an attention one
    # Gemma 4's options: local layers (window 40) and global ones with other head sizes and counts and a
    # proportional rope, the last two layers reading earlier layers' K/V (a double-wide MLP there), per-layer
    # inputs, soft-capped logits
    "gemma4_text": {
        "num_hidden_layers": 5,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "sliding_attention",
            "full_attention",
        ],
        "head_dim": 32,
        "global_head_dim": 64,
        "num_key_value_heads": 2,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 16,
        "vocab_size_per_layer_input": 362,
        "sliding_window": 40,
        "final_logit_softcapping": 30.0,
    },
    # gpt-oss's options: a sliding (window 40, mid-page, inside the long prompt) and a full layer, attention
    # sinks, experts with its clamped SwiGLU and biases, yarn rope
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "sliding_window": 40,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    },
}


def make_tiny_family_model(
    path: str | Path,
    model_type: str,
    *,
    seed: int = 0,
    vocab_size: int = 362,
    special_tokens: list[str] = SPECIAL_TOKENS,
    chat_template: str = CHAT_TEMPLATE,
    **config,
):
    """A random model of any family mlx-lm implements, built with mlx-lm's own class for model_type, with
    TINY_FAMILY_CONFIG overridden by `config` (a family's own options: q/k norms come with qwen3, experts
    with qwen3_moe's num_experts, ...)."""
    path = Path(path)
    tokenizer = build_tokenizer(vocab_size, special_tokens)
    tok = write_tokenizer(path, tokenizer, model_max_length=4096, chat_template=chat_template)
    config = {
        "model_type": model_type,
        **TINY_FAMILY_CONFIG,
        "vocab_size": vocab_size,
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        **config,
    }
    return save_random_model(path, config, seed)


def save_random_model(path: Path, config: dict, seed: int) -> Path:
    """config.json and random weights of mlx-lm's own class for config's model_type, in path."""
    from mlx_lm.utils import _get_classes

    (path / "config.json").write_text(json.dumps(config, indent=2))
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    save_random_weights(model_class(args_class.from_dict(config)), path)
    return path


def make_tiny_thinking_model(path: str | Path, seed: int = 0) -> Path:
    """A random Qwen3 model that thinks: <think> tokens, and a template that opens its thinking."""
    return make_tiny_family_model(
        path,
        "qwen3",
        seed=seed,
        special_tokens=[*SPECIAL_TOKENS, *THINK_TOKENS],
        chat_template=THINKING_CHAT_TEMPLATE,
        **FAMILY_OPTIONS["qwen3"],
    )


def write_tokenizer(
    path: Path,
    tok: Tokenizer,
    model_max_length: int,
    chat_template: str = CHAT_TEMPLATE,
    eos_token: str = "<|im_end|>",
) -> Tokenizer:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": eos_token,
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "add_bos_token": False,
                "chat_template": chat_template,
                "model_max_length": model_max_length,
            },
            indent=2,
        )
    )
    return tok


def save_random_weights(model, path: Path, scale: float = 4.0) -> None:
    # Wider random weights than the default init, so greedy outputs vary from token to token (with the
    # default init's, scale 1, they fall into loops: what prompt-lookup drafts predict).
    params = {k: v * scale if v.ndim >= 2 else v for k, v in tree_flatten(model.parameters())}  # 3-D: experts
    # attention sinks (gpt-oss's) start at zero: logits of the scores' size, so that they weigh
    params |= {k: 2 * mx.random.normal(v.shape) for k, v in params.items() if k.endswith(".sinks")}
    mx.save_safetensors(str(path / "model.safetensors"), params)


def make_tiny_4bit_model(src: str | Path, dst: str | Path) -> Path:
    """A 4-bit (affine, group 32) copy of a tiny model, the way mlx-lm quantizes checkpoints."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    src, dst = Path(src), Path(dst)
    model, config = load_model(src)
    model, config = quantize_model(model, config, group_size=32, bits=4)
    save_model(dst, model)
    save_config(config, dst / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def make_tiny_qwen_tokenizer_model(
    path: str | Path, tokenizer_dir: str | Path, context: int = 32768, end_probability: float = 0.15
) -> Path:
    """A random 2-layer Qwen2 with a real model's tokenizer and chat template (tokenizer_dir: the default
    model's) and its context: coding agents' 10-12k-token prompts fit and prefill in seconds. A random model
    never ends its answer by itself; this one, sampled, ends each token with about end_probability (its
    answers average 1 / end_probability tokens): every embedding carries a constant in dimension 0, which the
    final norm keeps (the layers write little), and only the end-of-sequence row of the output layer reads
    it."""
    path, tokenizer_dir = Path(path), Path(tokenizer_dir)
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tokenizer_dir / name).read_bytes())
    source = json.loads((tokenizer_dir / "config.json").read_text())
    hidden, vocab, eos = 64, source["vocab_size"], source["eos_token_id"]
    config = {
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": context,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "eos_token_id": eos,
        "bos_token_id": source.get("bos_token_id"),
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.random.seed(0)
    params = dict(tree_flatten(qwen2.Model(qwen2.ModelArgs.from_dict(config)).parameters()))
    for name in params:  # the layers write little into the residual stream: dimension 0 stays the largest
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            params[name] = params[name] * 0.01
    embed = params["model.embed_tokens.weight"]
    # ... except the newline's: the generation prompt ends with one, so no answer is empty
    newline = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]["\u010a"]  # "\n"
    constant = mx.full((vocab, 1), 4.0).at[newline, 0].add(-8.0)
    params["model.embed_tokens.weight"] = mx.concatenate([constant, embed[:, 1:] * 0.1], axis=1)
    # after the norm, dimension 0 is about sqrt(hidden); the end token's logit b * sqrt(hidden) against
    # vocab - 1 others near 0 gives it the probability asked for
    b = math.log(end_probability / (1 - end_probability) * (vocab - 1)) / math.sqrt(hidden)
    head = params["lm_head.weight"]
    column = mx.zeros((vocab, 1)).at[eos, 0].add(b)
    params["lm_head.weight"] = mx.concatenate([column, head[:, 1:]], axis=1)
    mx.save_safetensors(str(path / "model.safetensors"), params)
    return path


# -- gpt-oss with its own vocabulary, for Harmony --------------------------------------------------------------
O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
# o200k's pre-tokenizer pattern (tiktoken_ext.openai_public.o200k_base)
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
# Only says that the model writes Harmony (its <|channel|> marker): the server renders Harmony with
# openai-harmony, never with the template
HARMONY_STAND_IN_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def harmony_vocabulary(folder: str | Path) -> Path:
    """OpenAI's o200k_base vocabulary offline, for openai-harmony: copied into folder from the copy that
    litellm's wheel carries (tiktoken's cache file for it, by its SHA-256), and TIKTOKEN_ENCODINGS_BASE set
    to folder. Returns the file."""
    import hashlib
    import importlib.util
    import os
    import shutil

    from server.harmony import O200K_SHA256

    spec = importlib.util.find_spec("litellm")  # found, not imported (importing it goes to the network)
    assert spec is not None and spec.origin, (
        "the Harmony tests need litellm's copy of o200k_base (pip install litellm)"
    )
    cached = (
        Path(spec.origin).parent
        / "litellm_core_utils"
        / "tokenizers"
        / hashlib.sha1(O200K_URL.encode()).hexdigest()
    )
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == O200K_SHA256, f"{cached} is not o200k_base"
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cached, folder / "o200k_base.tiktoken")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    return folder / "o200k_base.tiktoken"


def make_tiny_harmony_model(path: str | Path, vocabulary: Path, seed: int = 0, **config) -> Path:
    """A random gpt-oss model with gpt-oss's own vocabulary (o200k_harmony: o200k_base and Harmony's special
    tokens at their ids, as openai-harmony numbers them) and a template that marks it as writing Harmony."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding
    from transformers.convert_slow_tokenizer import TikTokenConverter

    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    first, size = 199998, 201088  # o200k_base's size; the vocabulary's, with the special tokens
    specials = [encoding.decode([i]) for i in range(first, size)]
    tok = TikTokenConverter(str(vocabulary), pattern=O200K_PATTERN, extra_special_tokens=specials).converted()
    path = Path(path)
    write_tokenizer(path, tok, 4096, HARMONY_STAND_IN_TEMPLATE, eos_token="<|return|>")
    ids = [tok.token_to_id(t) for t in ("<|return|>", "<|endoftext|>", "<|call|>")]
    config = {
        "model_type": "gpt_oss",
        **TINY_FAMILY_CONFIG,
        **FAMILY_OPTIONS["gpt_oss"],
        "hidden_size": 64,
        "vocab_size": size,
        "eos_token_id": ids,
        "bos_token_id": tok.token_to_id("<|startoftext|>"),
        **config,
    }
    return save_random_model(path, config, seed)
