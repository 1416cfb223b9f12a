"""What the hardware allows a model, measured in the same run as the engines: the float32 matmul rate at
the model's prefill shapes (compute limit of a prefill) and one batch-1 pass over its weight matrices
(memory limit of a decode step).

  - prefill limit at n tokens: the matmul rate over the FLOPs of a token, its linear layers (2 x their
    weights; the logits are computed for the last token only) and its attention (QK and PV: 4 x heads x
    head_dim x the keys it sees, on average (first + last + 1) / 2 over the prompt's positions);
  - decode limit at a context of c tokens: one step reads every weight matrix once and each sequence's c
    tokens of K/V, at the pass's bandwidth; a quantized layer's decode reads its levels, scales and
    biases (minivllm.models.quantized_linear), not its float32 copy.
"""

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from benchmarks.harness.engine_timing import median_seconds
from minivllm.models.cpu_layout import TransposedLinear
from minivllm.models.quantized_linear import DecodeQuantizedLinear


@dataclass
class Limits:
    matmul_flops: float  # float32 FLOP/s at the model's prefill shapes
    weight_pass_s: float  # one batch-1 pass over every weight matrix, the output layer's included
    weight_bytes: int  # of the float32 matrices the pass reads
    decode_bytes: int  # of what a decode step reads of them (levels where a layer has them)
    linear_params: int  # of the layers (the output layer excluded)
    attention_flops_per_key: int  # 4 x heads x head_dim x layers
    kv_bytes_per_token: int

    def prefill(self, first: int, last: int) -> float:
        """tok/s of prefilling positions first .. last - 1 (first: the tokens already cached)."""
        keys = (first + last + 1) / 2
        return self.matmul_flops / (2 * self.linear_params + self.attention_flops_per_key * keys)

    def decode(self, context: int, batch: int = 1) -> float:
        bandwidth = self.weight_bytes / self.weight_pass_s
        step = (self.decode_bytes + batch * context * self.kv_bytes_per_token) / bandwidth
        return batch / step


def measure_limits(model: nn.Module, kv_bytes_per_token: int, rows: int = 512, repeats: int = 5) -> Limits:
    head = getattr(model, "lm_head", None)  # None: tied to the embedding
    head = getattr(head, "dense", head)  # a DecodeQuantizedLinear's float32 copy
    quantized = [m for _, m in model.named_modules() if isinstance(m, DecodeQuantizedLinear)]
    layers = [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, TransposedLinear))]
    # [in, out] views (no copy) in the layout the engine keeps
    weights = [in_out_weight(m) for m in layers if m is not head]
    weights_and_head = weights + [
        in_out_weight(head) if head is not None else model.model.embed_tokens.weight.T
    ]
    args = model.args
    heads = args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    big = max(weights, key=lambda w: w.size)  # the largest layer's shape: the prefill's typical product
    x = mx.ones((rows, big.shape[0]))
    matmul_s = median_seconds(lambda: mx.eval(x @ big), repeats)
    ones = {w.shape[0]: mx.ones((1, w.shape[0])) for w in weights_and_head}
    pass_s = median_seconds(lambda: mx.eval([ones[w.shape[0]] @ w for w in weights_and_head]), repeats)
    weight_bytes = sum(w.nbytes for w in weights_and_head)
    saved = sum(  # a quantized layer's decode reads its levels, scales and biases, not its float32 copy
        in_out_weight(m.dense).nbytes - m.levels.nbytes - m.scales.nbytes - m.biases.nbytes for m in quantized
    )
    return Limits(
        matmul_flops=2 * rows * big.size / matmul_s,
        weight_pass_s=pass_s,
        weight_bytes=weight_bytes,
        decode_bytes=weight_bytes - saved,
        linear_params=sum(w.size for w in weights),
        attention_flops_per_key=4 * heads * head_dim * len(model.model.layers),
        kv_bytes_per_token=kv_bytes_per_token,
    )


def in_out_weight(layer: nn.Module) -> mx.array:
    """A linear layer's weight as [in, out], a view in the layout the engine keeps (no copy)."""
    return layer.weight_t if isinstance(layer, TransposedLinear) else layer.weight.T
