"""One engine replica: an AsyncEngine with its own model copy and KV pool, as a Ray Serve deployment."""

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, replace

from minivllm.cache.hints import CacheHints
from minivllm.engine.async_engine import AsyncEngine
from minivllm.engine.sampling_params import SamplingParams
from minivllm.outputs import RequestOutput
from server.settings import Settings


class EngineReplica:
    async def __init__(self, settings: Settings):
        for name in ("minivllm", "server"):
            logging.getLogger(name).setLevel(settings.log_level.upper())
        self.engine = await asyncio.to_thread(AsyncEngine, settings.engine_config())
        self.engine.start()  # the stepping thread delivers to this (the replica's) event loop
        self.stats_reports = 0

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, cache: CacheHints | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The engine's stream; when the caller cancels, closing it aborts the request and frees its pages."""
        async for out in self.engine.generate(request_id, prompt, params, cache):
            yield out

    def describe(self) -> dict:
        return {"max_model_len": self.engine.max_model_len, "vocab_size": self.engine.vocab_size}

    def record_routing_stats(self) -> dict:
        """Ray Serve polls this and hands it to the routers (the ingress's /metrics reads it there). The
        report count tells a reader that the stats it sees are newer than an event it waits for."""
        self.stats_reports += 1
        return asdict(replace(self.engine.stats_snapshot, stats_reports=self.stats_reports))

    def check_health(self) -> None:
        """Ray Serve replaces a replica whose engine thread has stopped."""
        if not self.engine.is_running:
            raise RuntimeError("the engine's stepping thread is not running")
