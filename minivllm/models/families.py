"""Which model families the forward runs exactly, checked at load, and each family's forward.

mlx-lm loads many more architectures than the forward implements, and a model whose layers need
something the forward skips (a sliding window, soft-capping, experts, other norms) would load and
silently answer wrong tokens. So a model is served only when its `model_type` is listed here and its
config uses no option the family's entry does not cover; the error names the architecture and what is
missing. Each family listed is checked token for token against mlx-lm's own implementation in the tests.
The blocks' computation lives in one file per family that differs: qwen2 (Qwen2, Qwen3, Llama, Mistral,
Qwen3-MoE, GLM-4.5 MoE), phi3, gemma3_text, gemma4_text, gpt_oss, qwen3_next (Qwen3-Next and Qwen3.5:
hybrid).
"""

from collections.abc import Callable
from dataclasses import dataclass

import mlx.nn as nn

from minivllm.models import gemma3_text, gemma4_text, gpt_oss, phi3, qwen2, qwen3_next
from minivllm.models.layers import Architecture

Check = Callable[[dict, nn.Module], str | None]  # the unsupported option it finds, or None

# rope variants whose mlx-lm modules take one offset per token (the flat ragged batch needs that)
ROPE_TYPES = {None, "default", "linear", "llama3", "yarn", "longrope", "su"}
ACTIVATIONS = {None, "silu", "swish"}  # the forward's SwiGLU


def rope_scaling(config: dict, model: nn.Module) -> str | None:
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("type") or scaling.get("rope_type")
    return None if kind in ROPE_TYPES else f"rope scaling type {kind!r}"


def activation(config: dict, model: nn.Module) -> str | None:
    act = config.get("hidden_act") or config.get("hidden_activation")
    return None if act in ACTIVATIONS else f"activation {act!r} (the forward computes SwiGLU with silu)"


def no_sliding_window(config: dict, model: nn.Module) -> str | None:
    """Every layer attends to the whole context (the forward has no sliding-window mask)."""
    layer_types = config.get("layer_types") or ()
    window = config.get("sliding_window")
    if config.get("use_sliding_window") or "sliding_attention" in layer_types:
        return f"sliding-window attention (window {window})"
    if any(getattr(block, "use_sliding", False) for block in model.model.layers):
        return "sliding-window attention"
    return None


def window_below_context(config: dict, model: nn.Module) -> str | None:
    """Mistral and Phi-3 configs set sliding_window alone (no layer_types), and their mlx-lm modules
    attend to the whole context; below the context it is a real window."""
    window, context = config.get("sliding_window"), config.get("max_position_embeddings")
    if window is not None and context is not None and window < context:
        return f"sliding-window attention (window {window} < context {context})"
    return None


def no_experts(config: dict, model: nn.Module) -> str | None:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if config.get(key):
            return f"mixture of experts ({key}={config[key]})"
    return None


def no_softcapping(config: dict, model: nn.Module) -> str | None:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if config.get(key):
            return f"logit soft-capping ({key}={config[key]})"
    return None


# the submodules each family's forward reads, and no others: a module the forward does not know of (a
# norm, a projection) would be skipped silently
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj", "rope"}
QK_NORMS = {"q_norm", "k_norm"}
BLOCK = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
SWIGLU = {"gate_proj", "up_proj", "down_proj"}
GEMMA_NORMS = {"pre_feedforward_layernorm", "post_feedforward_layernorm"}
EXPERTS = {"gate", "switch_mlp"}  # Qwen3-MoE's sparse block: the router and mlx-lm's SwitchGLU
SHARED_EXPERT = {"shared_experts"}  # GLM-4.5's: a dense SwiGLU beside the routed experts


def layout(attention: set[str] | tuple[set[str], ...], block: set[str], mlps: tuple[set[str], ...]) -> Check:
    """Every block has exactly these submodules (its attention module one of `attention`, its MLP one of
    `mlps`), and the attention module the head counts and scale the forward reads."""
    attentions = attention if isinstance(attention, tuple) else (attention,)

    def check(config: dict, model: nn.Module) -> str | None:
        for block_module in model.model.layers:
            attn = getattr(block_module, "self_attn", None)
            absent = [n for n in ("n_heads", "n_kv_heads", "scale") if not hasattr(attn, n)]
            found = [
                differs("an attention module", attn, min(attentions, key=lambda a: len(a ^ _children(attn)))),
                differs("a block", block_module, block),
                mlp_differs(getattr(block_module, "mlp", None), mlps),
            ]
            if absent:
                return f"an attention module without {', '.join(absent)}"
            if any(found):
                return next(f for f in found if f)
        return None

    return check


def _children(module: nn.Module | None) -> set[str]:
    return set(module.children()) if module is not None else set()


def differs(what: str, module: nn.Module | None, expected: set[str]) -> str | None:
    names = _children(module)
    if names == expected:
        return None
    parts = [f"with {', '.join(sorted(names - expected))}"] if names - expected else []
    parts += [f"without {', '.join(sorted(expected - names))}"] if expected - names else []
    return f"{what} {' and '.join(parts)}"


def mlp_differs(mlp: nn.Module | None, expected: tuple[set[str], ...]) -> str | None:
    names = _children(mlp)
    return None if names in expected else f"an MLP of {', '.join(sorted(names)) or 'no submodules'}"


def phi3_rope(config: dict, model: nn.Module) -> str | None:
    """mlx-lm's phi3 module drops (with a warning) a rope scaling other than these."""
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("type") or scaling.get("rope_type")
    return None if kind in {None, "longrope", "su", "linear"} else f"rope scaling type {kind!r}"


def no_rope_scaling(config: dict, model: nn.Module) -> str | None:
    """mlx-lm's qwen3_moe module applies plain rope whatever the config says."""
    scaling = config.get("rope_scaling")
    return f"rope scaling ({scaling})" if scaling else None


def gemma_activation(config: dict, model: nn.Module) -> str | None:
    act = config.get("hidden_activation") or config.get("hidden_act")
    return None if act in {None, "gelu_pytorch_tanh"} else f"activation {act!r} (the MLP computes gelu-tanh)"


def gemma_layer_types(config: dict, model: nn.Module) -> str | None:
    """Local and global layers follow sliding_window_pattern (mlx-lm's rule); a config listing other
    layer_types, or attending both ways, is not this forward's."""
    if config.get("use_bidirectional_attention"):
        return "bidirectional attention"
    listed = config.get("layer_types")
    actual = ["sliding_attention" if b.self_attn.is_sliding else "full_attention" for b in model.model.layers]
    if listed is not None and list(listed) != actual:
        return f"layer_types {listed} (sliding_window_pattern gives {actual})"
    return None


GPT_OSS_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj", "rope"}  # and its `sinks` array
GPT_OSS_EXPERTS = {"router", "experts"}


def gpt_oss_layout(config: dict, model: nn.Module) -> str | None:
    """gpt-oss's modules as the forward reads them: its own attribute names (num_attention_heads, sm_scale,
    sinks), layers each sliding or full, and the window mlx-lm's module keeps."""
    kinds = set(model.model.layer_types)
    if not kinds <= {"sliding_attention", "full_attention"}:
        return f"layer_types {sorted(kinds)}"
    if "sliding_attention" in kinds and not model.model.window_size:
        return "sliding-window layers without a window"
    for block in model.model.layers:
        attn = block.self_attn
        absent = [
            n
            for n in ("num_attention_heads", "num_key_value_heads", "sm_scale", "sinks")
            if not hasattr(attn, n)
        ]
        if absent:
            return f"an attention module without {', '.join(absent)}"
        found = differs("an attention module", attn, GPT_OSS_ATTENTION) or differs("a block", block, BLOCK)
        if found or (found := mlp_differs(block.mlp, (GPT_OSS_EXPERTS,))):
            return found
    return None


# the hybrids' linear-attention modules: Qwen3-Next's fused projections, Qwen3.5's separate ones
GATED_DELTA = (
    {"conv1d", "in_proj_qkvz", "in_proj_ba", "norm", "out_proj"},
    {"conv1d", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm", "out_proj"},
)
NEXT_EXPERTS = {"gate", "switch_mlp", "shared_expert", "shared_expert_gate"}  # Qwen3-Next's sparse block
HYBRID_BLOCK = {"mlp", "input_layernorm", "post_attention_layernorm"}


def hybrid_layout(config: dict, model: nn.Module) -> str | None:
    """Qwen3-Next's and Qwen3.5's blocks: each a gated delta net or a gated attention (q/k norms), the
    attribute names the forward reads, and a convolution that keeps a state (kernel of 2 or more)."""
    for block in model.model.layers:
        linear = getattr(block, "linear_attn", None)
        mixer = linear if linear is not None else getattr(block, "self_attn", None)
        names = ("conv_kernel_size", "num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim", "key_dim")
        names = names if linear is not None else ("num_attention_heads", "num_key_value_heads", "scale")
        absent = [n for n in names if not hasattr(mixer, n)]
        if absent:
            return f"a mixer without {', '.join(absent)}"
        if linear is not None:
            found = differs(
                "a linear-attention module",
                linear,
                min(GATED_DELTA, key=lambda g: len(g ^ _children(linear))),
            )
            if not found and linear.conv_kernel_size < 2:
                found = f"a convolution of kernel {linear.conv_kernel_size}"
        else:
            found = differs("an attention module", mixer, ATTENTION | QK_NORMS)
        found = found or differs(
            "a block", block, HYBRID_BLOCK | {"linear_attn" if linear is not None else "self_attn"}
        )
        if found or (found := mlp_differs(block.mlp, (SWIGLU, NEXT_EXPERTS))):
            return found
    return None


GEMMA4_ROPES = {"default", "proportional"}
GEMMA4_BLOCK = BLOCK | GEMMA_NORMS
GEMMA4_MOE = {
    "router",
    "experts",
    "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_1",
    "post_feedforward_layernorm_2",
}
GEMMA4_PER_LAYER = {"per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm"}


def gemma4_layout(config: dict, model: nn.Module) -> str | None:
    """Gemma 4's blocks as the forward reads them: sliding or full layers, each kind's rope one of mlx-lm's
    that take a position per token, no attention soft-capping, and blocks of mlx-lm's modules only."""
    if config.get("attn_logit_softcapping"):
        return f"attention logit soft-capping ({config['attn_logit_softcapping']})"
    kinds = {b.self_attn.layer_type for b in model.model.layers}
    if not kinds <= {"sliding_attention", "full_attention"}:
        return f"layer_types {sorted(kinds)}"
    for kind, params in (config.get("rope_parameters") or {}).items():
        rope_type = (params or {}).get("rope_type", "default")
        if rope_type not in GEMMA4_ROPES:
            return f"rope type {rope_type!r} on {kind} layers"
    for block in model.model.layers:
        expected = GEMMA4_BLOCK | (GEMMA4_MOE if block.enable_moe else set())
        expected |= GEMMA4_PER_LAYER if block.per_layer_input_gate is not None else set()
        if found := differs("a block", block, expected):
            return found
    return None


@dataclass(frozen=True)
class Family:
    checks: tuple[Check, ...]
    architecture: Callable[[nn.Module], Architecture]  # the model's forward


def fixed(arch: Architecture) -> Callable[[nn.Module], Architecture]:
    return lambda model: arch


SHARED = (no_softcapping,)
LLAMA = SHARED + (rope_scaling, activation, no_experts, no_sliding_window)
LLAMA_LAYOUT = layout(ATTENTION, BLOCK, (SWIGLU,))
QWEN3_LAYOUT = layout(ATTENTION | QK_NORMS, BLOCK, (SWIGLU,))
FAMILIES = {
    "qwen2": Family(LLAMA + (LLAMA_LAYOUT,), fixed(qwen2.ARCHITECTURE)),
    "llama": Family(LLAMA + (LLAMA_LAYOUT,), fixed(qwen2.ARCHITECTURE)),
    "mistral": Family(LLAMA + (window_below_context, LLAMA_LAYOUT), fixed(qwen2.ARCHITECTURE)),
    "qwen3": Family(LLAMA + (QWEN3_LAYOUT,), fixed(qwen2.ARCHITECTURE)),
    "qwen3_moe": Family(
        SHARED
        + (no_rope_scaling, activation, no_sliding_window)
        + (layout(ATTENTION | QK_NORMS, BLOCK, (SWIGLU, EXPERTS)),),
        fixed(qwen2.ARCHITECTURE),
    ),
    # GLM-4.5 / 4.6 / 4.7: mlx-lm's MoE module runs whole in the MLP's place (its router's sigmoid and
    # group selection, the shared expert); attention is the Llama block's, q/k norms optional
    "glm4_moe": Family(
        SHARED
        + (no_rope_scaling, activation, no_sliding_window)
        + (layout((ATTENTION, ATTENTION | QK_NORMS), BLOCK, (SWIGLU, EXPERTS, EXPERTS | SHARED_EXPERT)),),
        fixed(qwen2.ARCHITECTURE),
    ),
    "phi3": Family(
        SHARED
        + (phi3_rope, activation, no_experts, window_below_context)
        + (layout({"qkv_proj", "o_proj", "rope"}, BLOCK, ({"gate_up_proj", "down_proj"},)),),
        fixed(phi3.ARCHITECTURE),
    ),
    # gpt-oss: alternating sliding and full layers with attention sinks; mlx-lm's experts module whole
    "gpt_oss": Family(SHARED + (rope_scaling, gpt_oss_layout), gpt_oss.architecture),
    # hybrids: gated delta net layers with a recurrent state, a gated attention layer every few
    "qwen3_next": Family(SHARED + (rope_scaling, activation, hybrid_layout), qwen3_next.architecture),
    "qwen3_5": Family(SHARED + (rope_scaling, activation, hybrid_layout), qwen3_next.architecture),
    "qwen3_5_moe": Family(SHARED + (rope_scaling, activation, hybrid_layout), qwen3_next.architecture),
    # Gemma 4: mlx-lm's blocks whole but attention (pools per kind of layer, KV shared by the last layers)
    "gemma4_text": Family((gemma4_layout,), gemma4_text.architecture),
    "gemma4": Family((gemma4_layout,), gemma4_text.architecture),  # the loader keeps its text model alone
    "gemma3_text": Family(
        SHARED
        + (rope_scaling, gemma_activation, no_experts, gemma_layer_types)
        + (layout(ATTENTION | QK_NORMS, BLOCK | GEMMA_NORMS, (SWIGLU,)),),
        gemma3_text.architecture,
    ),
}


def architecture_of(model: nn.Module) -> Architecture:
    """How the model's blocks compute (its family passed check_supported at load)."""
    return FAMILIES[model.model_type].architecture(model)


def check_supported(config: dict, model: nn.Module) -> None:
    """Raise ValueError naming the architecture and what the forward does not implement."""
    model_type = config.get("model_type")
    config = {**config, **(config.get("text_config") or {})}  # Qwen3.5's text model's options
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"unsupported architecture {model_type!r}: minivllm runs {', '.join(sorted(FAMILIES))}"
        )
    missing = [found for check in family.checks if (found := check(config, model)) is not None]
    if missing:
        raise ValueError(
            f"unsupported {model_type} model: the forward does not implement {'; '.join(missing)}"
        )
