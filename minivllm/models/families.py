"""Which model families the forward (minivllm.models.qwen2) runs exactly, checked at load.

mlx-lm loads many more architectures than the forward implements, and a model whose layers need
something the forward skips (a sliding window, soft-capping, experts, other norms) would load and
silently answer wrong tokens. So a model is served only when its `model_type` is listed here and its
config uses no option the family's entry does not cover; the error names the architecture and what is
missing. Each family listed is checked token for token against mlx-lm's own implementation in the tests.
"""

from collections.abc import Callable
from dataclasses import dataclass

import mlx.nn as nn

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


def mistral_window(config: dict, model: nn.Module) -> str | None:
    """Mistral configs set sliding_window alone (no layer_types); below the context it is a real window."""
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


def layout(q_k_norm: bool) -> Check:
    """The module layout the forward reads: q/k/v/o projections, rope, two norms per block and SwiGLU
    (or the model's own MLP module); q/k RMSNorms only where the family has them."""

    def check(config: dict, model: nn.Module) -> str | None:
        block = model.model.layers[0]
        attn = getattr(block, "self_attn", None)
        needed = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")
        absent = [name for name in needed if not hasattr(attn, name)]
        if absent:
            return f"an attention module without {', '.join(absent)}"
        if hasattr(attn, "q_norm") != q_k_norm or hasattr(attn, "k_norm") != q_k_norm:
            return "q/k norms" if not q_k_norm else "an attention module without q/k norms"
        extra = [n for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm") if hasattr(block, n)]
        if extra:
            return f"extra norms ({', '.join(extra)})"
        return None

    return check


@dataclass(frozen=True)
class Family:
    checks: tuple[Check, ...]


COMMON = (rope_scaling, activation, no_experts, no_softcapping)
FAMILIES = {
    "qwen2": Family(COMMON + (no_sliding_window, layout(q_k_norm=False))),
    "llama": Family(COMMON + (no_sliding_window, layout(q_k_norm=False))),
    "mistral": Family(COMMON + (no_sliding_window, mistral_window, layout(q_k_norm=False))),
    "qwen3": Family(COMMON + (no_sliding_window, layout(q_k_norm=True))),
}


def check_supported(config: dict, model: nn.Module) -> None:
    """Raise ValueError naming the architecture and what the forward does not implement."""
    model_type = config.get("model_type")
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
