"""The timed client: streamed chat requests through the official openai client, TTFT and cached tokens."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class RequestResult:
    ttft_s: float  # send -> first chunk with non-empty content (nan if none)
    latency_s: float  # send -> end of stream
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens: restored prompt tokens
    text: str
    sent_at: float  # time.perf_counter() at send
    first_token_at: float
    finished_at: float
    first_chunk_at: float = math.nan  # the first streamed chunk of any kind (a role-only or empty one too)


def make_client(api_url: str, timeout_s: float = 3600.0):
    import openai

    # No retries: a retried request would silently add its first attempt's time to the measurement.
    return openai.AsyncOpenAI(base_url=api_url, api_key="x", timeout=timeout_s, max_retries=0)


async def stream_chat(
    client,
    messages: list[dict[str, str]],
    max_tokens: int,
    *,
    model: str = "default_model",
    first_token: asyncio.Event | None = None,
    **kw: Any,
) -> RequestResult:
    """One streamed greedy chat completion, timed on the client. `first_token` is set on first content."""
    sent = time.perf_counter()
    first = first_chunk = math.nan
    parts: list[str] = []
    usage = None
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    async for chunk in stream:
        if math.isnan(first_chunk):
            first_chunk = time.perf_counter()
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content = choice.delta.content if choice.delta else None
            if content:
                if not parts:
                    first = time.perf_counter()
                    if first_token is not None:
                        first_token.set()
                parts.append(content)
    end = time.perf_counter()
    if first_token is not None:
        first_token.set()  # never leave a waiter hanging on an empty completion
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return RequestResult(
        ttft_s=first - sent,
        latency_s=end - sent,
        prompt_tokens=usage.prompt_tokens if usage else 0,
        completion_tokens=usage.completion_tokens if usage else len(parts),
        cached_tokens=(getattr(details, "cached_tokens", None) or 0) if details else 0,
        text="".join(parts),
        sent_at=sent,
        first_token_at=first,
        finished_at=end,
        first_chunk_at=first_chunk,
    )


async def chat_burst(
    client, prompts: list[list[dict[str, str]]], max_tokens: int, **kw: Any
) -> list[RequestResult]:
    """Send all prompts at the same moment and wait for all of them."""
    return list(await asyncio.gather(*(stream_chat(client, p, max_tokens, **kw) for p in prompts)))


async def warmup(client, model: str) -> None:
    # The first request pays one-off costs (graph building, allocations); keep them out of the numbers.
    await stream_chat(client, [{"role": "user", "content": "Hi"}], 4, model=model)


def scrape(base_url: str) -> list:
    """The server's /metrics, parsed into metric families; [] when it is absent or unreadable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = httpx.get(base_url + "/metrics", timeout=5.0)
    except httpx.HTTPError:
        return []
    if resp.status_code != 200:
        return []
    try:
        return list(text_string_to_metric_families(resp.text))
    except ValueError:
        return []


def sample_sums(families: list) -> dict[str, float]:
    """Prometheus samples summed over labels, by sample name."""
    values: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def bucket_counts(families: list, histogram: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound (summed over other labels); {} if absent."""
    buckets: dict[float, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name == histogram + "_bucket":
                bound = float(sample.labels["le"])
                buckets[bound] = buckets.get(bound, 0.0) + sample.value
    return buckets


def fetch_metrics(base_url: str) -> dict[str, float]:
    """Prometheus samples summed over labels, by sample name; {} when /metrics is absent."""
    return sample_sums(scrape(base_url))
