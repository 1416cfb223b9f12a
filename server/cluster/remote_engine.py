"""The ingress's client of the engine replicas: tokenizer here, generation there.

It is what the OpenAI app needs of an engine (`server.engine_client.EngineClient`), so the app serves a
cluster exactly as it serves one local engine. The live replicas and their stats come from the request
router of this process (`server.cluster.router`), which Ray Serve keeps up to date.
"""

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.handle import DeploymentHandle

from minivllm.cache.hints import CacheHints
from minivllm.engine.sampling_params import SamplingParams
from minivllm.models.loader import load_tokenizer
from minivllm.outputs import EngineStats, FinishReason, RequestOutput
from server.cluster import router_registry
from server.settings import Settings

if TYPE_CHECKING:  # the live router is Ray Serve's by-value copy of this class, so never isinstance it
    from server.cluster.router import PageHashRouter


class RemoteEngine:
    def __init__(
        self,
        handle: DeploymentHandle,
        tokenizer,
        max_model_len: int,
        vocab_size: int,
        router: "PageHashRouter",
    ):
        self._stream = handle.options(stream=True)
        self.tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size
        self._router = router

    @classmethod
    async def connect(cls, handle: DeploymentHandle, settings: Settings) -> "RemoteEngine":
        """Load the tokenizer and wait until a replica answers (which also sets up the router)."""
        tokenizer = await asyncio.to_thread(load_tokenizer, settings.model)
        info = await handle.describe.remote()
        router = router_registry.lookup(handle.app_name, handle.deployment_name)
        if router is None:
            raise RuntimeError(f"deployment {handle.deployment_name} is not routed by PageHashRouter")
        return cls(handle, tokenizer, info["max_model_len"], info["vocab_size"], router)

    @property
    def is_running(self) -> bool:
        return bool(self._router.live)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def replica_stats(self) -> dict[str | None, EngineStats]:
        """The stats each live replica last reported (Ray Serve polls them every second or so; all zero
        until the first report)."""
        return {
            name: EngineStats(**(replica.routing_stats or {})) for name, replica in self._router.live.items()
        }

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, cache: CacheHints | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream from the replica the router picks. A refusal re-raises the engine's own error; a replica
        that dies mid-stream ends the stream with an error output (the request is not retried: its tokens
        may already be with the client)."""
        response = self._stream.generate.remote(
            request_id=request_id, prompt=prompt, params=params, cache=cache
        )
        try:
            async for out in response:
                yield out
        except RayTaskError as e:  # the engine refused the request (ValueError, QueueFull) or failed
            raise (e.cause if isinstance(e.cause, Exception) else e) from None
        except (RayActorError, ActorUnavailableError) as e:
            yield RequestOutput(
                request_id,
                [],
                finished=True,
                finish_reason=FinishReason.ABORT,
                error=f"the engine replica serving this request failed ({type(e).__name__}); retry the request",
            )
        finally:
            response.cancel()  # a no-op once finished; otherwise the replica aborts the request
