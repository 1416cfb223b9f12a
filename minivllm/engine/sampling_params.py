"""Per-request generation parameters."""

import hashlib
from dataclasses import dataclass, field

GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the top k alternatives

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        # a temperature this small is greedy anyway, and dividing logits by it would overflow them
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `seed` (n > 1): choice 0 keeps the seed; the others
    get one hashed from (seed, index), so requests with nearby seeds never share a choice's draws."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # 62 bits, like the seeds the engine draws itself
