"""Per-request generation parameters."""

import hashlib
import math
from dataclasses import dataclass, field

GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the output must match, enforced token by token (llguidance masks). Exactly one of:
    a JSON schema, any JSON object, or a Lark grammar in llguidance's dialect (which may embed JSON
    schemas as `%json {...}`). JSON is generated compact, with `", "` and `": "` separators and no
    other whitespace, so a weak model cannot pad it with newlines until max_tokens."""

    json_schema: dict | None = None
    json_object: bool = False
    lark: str | None = None

    def __post_init__(self) -> None:
        given = (self.json_schema is not None) + self.json_object + (self.lark is not None)
        if given != 1:
            raise ValueError("structured output needs exactly one of json_schema, json_object, lark")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError("json_schema must be a JSON object (a dict)")


@dataclass
class SamplingParams:
    max_tokens: int | None = 256  # None: up to the end of the context
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the top k alternatives
    min_p: float = 0.0  # 0 = off; else drop tokens below min_p x the top token's probability
    # OpenAI's penalties, over the tokens generated so far: subtract presence_penalty from every token
    # that appeared, frequency_penalty times its count
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # CTRL-style, over prompt and output: a seen token's logit is divided by it if positive, else
    # multiplied (1 = off)
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    structured_output: StructuredOutput | None = None
    # (a request's cache domain and pins are no sampling controls: minivllm.cache.hints.CacheHints)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")

    @property
    def greedy(self) -> bool:
        # a temperature this small is greedy anyway, and dividing logits by it would overflow them
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `seed` (n > 1): choice 0 keeps the seed; the others
    get one hashed from (seed, index), so requests with nearby seeds never share a choice's draws."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # 62 bits, like the seeds the engine draws itself
