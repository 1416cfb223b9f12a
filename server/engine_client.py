"""What the HTTP layer needs from an engine: the local `AsyncEngine`, or the Ray Serve ingress's client of
engine replicas (`server.cluster.remote_engine.RemoteEngine`)."""

from collections.abc import AsyncIterator
from typing import Protocol

from minivllm.cache.hints import CacheHints
from minivllm.engine.sampling_params import SamplingParams
from minivllm.models.tokenizer import Tokenizer
from minivllm.outputs import EngineStats, RequestOutput


class EngineClient(Protocol):
    tokenizer: Tokenizer

    @property
    def is_running(self) -> bool: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, cache: CacheHints | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raise RequestError (minivllm.engine.validation) / QueueFull before
        the first output if refused."""
        ...

    def replica_stats(self) -> dict[str | None, EngineStats]:
        """Engine stats by replica name (None: a single unnamed engine)."""
        ...
