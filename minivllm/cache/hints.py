"""What a request asks of the prefix cache, beside its sampling: its cache domain and its pins. The engine
takes them with the request (LLMEngine.add_request, AsyncEngine.generate) and hands them to the KV manager."""

import math
from dataclasses import dataclass

from minivllm.cache.pins import TTL_DEFAULT_S, TTL_MAX_S

__all__ = ["TTL_DEFAULT_S", "TTL_MAX_S", "CacheHints"]


@dataclass(frozen=True, slots=True)
class CacheHints:
    # the request's prefix-cache domain: its pages are shared only with requests of the same salt
    salt: str | None = None
    # prompt prefixes to pin in the prefix cache when the request ends: (first tokens, TTL in seconds)
    # each (minivllm.cache.pins)
    pins: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for tokens, ttl_s in self.pins:
            if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
                raise ValueError(f"pins: a pin's tokens must be a positive integer, got {tokens!r}")
            if not (math.isfinite(ttl_s) and 0 < ttl_s <= TTL_MAX_S):
                raise ValueError(f"pins: a pin's TTL must be in (0, {TTL_MAX_S:g}] seconds, got {ttl_s}")
