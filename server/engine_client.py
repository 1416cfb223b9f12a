"""What the HTTP layer needs from an engine: the local `AsyncEngine`, or the Ray Serve ingress's client of
engine replicas (`server.cluster.remote_engine.RemoteEngine`)."""

from collections.abc import AsyncIterator
from typing import Any, Protocol

from minivllm.engine.grammar import GrammarCompiler
from minivllm.engine.llm_engine import RequestOutput
from minivllm.engine.sampling_params import SamplingParams


class EngineClient(Protocol):
    tokenizer: Any  # mlx-lm TokenizerWrapper: chat template, encode, detokenizer

    @property
    def is_running(self) -> bool: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output grammars (cached): the server checks a schema compiles before
        it queues the request."""
        ...

    def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raise ValueError / QueueFull before the first output if refused."""
        ...

    def replica_stats(self) -> dict[str | None, dict]:
        """Engine stats by replica name (None: a single unnamed engine)."""
        ...
