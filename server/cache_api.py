"""The prefix cache's own endpoints: POST /v1/cache/pin prefills a prompt and pins it (e.g. a long system
prompt, before the first user arrives), and GET /v1/cache/explain returns the last requests' reports of
what they restored and where and why their restore stopped (server.prefix_report). Both sit under /v1, so
the API key guards them like every other route (server.gateway).
"""

import time
import uuid
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from minivllm.cache.hints import TTL_DEFAULT_S, TTL_MAX_S, CacheHints
from minivllm.engine.sampling_params import SamplingParams
from server import chat
from server import protocol as p
from server.core import ServerState, cache_salt, key_domain, protocol_names, state_for, until_disconnect
from server.errors import APIError
from server.generation import Generation

router = APIRouter()
TTLS = {"5m": TTL_DEFAULT_S, "1h": TTL_MAX_S}


class PinRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: p.Text | None = None  # if given, the served model's id (else 404, as on the generation endpoints)
    prompt: p.Text | None = None  # a raw prompt, tokenized as /v1/completions does (valid Unicode)
    messages: list[p.ChatMessage] | None = None  # a conversation, templated as /v1/chat/completions does
    ttl: Literal["5m", "1h"] | int = "5m"  # Anthropic's TTLs, or seconds
    cache_salt: p.Text | None = Field(None, min_length=1)  # the cache domain, as on the generation endpoints

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages is required")
        if not self.prompt and not self.messages:
            raise ValueError("the prompt is empty")
        return self

    def ttl_s(self) -> float:
        if isinstance(self.ttl, str):
            return TTLS[self.ttl]
        if not 0 < self.ttl <= TTL_MAX_S:
            raise APIError(400, f"ttl: seconds must be in [1, {TTL_MAX_S:g}], got {self.ttl}", param="ttl")
        return float(self.ttl)


class PinResponse(BaseModel):
    tokens: int  # the prompt's first tokens that are pinned (whole pages)
    pages: int
    prompt_tokens: int
    ttl_s: float
    expires_at: float  # Unix time, unless a hit refreshes the pin


@router.post("/v1/cache/pin")
async def pin(body: PinRequest, request: Request) -> PinResponse:
    """Prefill the prompt (one token generated, then dropped) and pin its whole pages for the TTL."""
    st: ServerState = request.app.state.server if body.model is None else state_for(request, body.model)
    ttl_s = body.ttl_s()
    names = {"prompt": "messages" if body.messages is not None else "prompt", "pins": "ttl"}
    with protocol_names(names):
        if body.messages is not None:
            turns = chat.turns_of(body.messages)
            ids = await until_disconnect(request, lambda: st.prompts.chat(turns, 1))
        else:
            (ids,) = await until_disconnect(request, lambda: st.prompts.completion(body.prompt, 1))
        salt = cache_salt(request, body.cache_salt)
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        hints = CacheHints(salt, pins=((len(ids), ttl_s),))
        gen = Generation(st.engine, f"pin-{uuid.uuid4().hex}", [ids], [[params]], [], st.metrics, cache=hints)
        try:
            await until_disconnect(request, gen.start)
            await until_disconnect(request, gen.collect)
        finally:
            gen.close()
    (pinned,) = gen.choices[0].last.pins
    return PinResponse(
        tokens=pinned.tokens,
        pages=pinned.pages,
        prompt_tokens=len(ids),
        ttl_s=ttl_s,
        expires_at=time.time() + pinned.ttl_s,
    )


@router.get("/v1/cache/explain")
async def explain(request: Request) -> dict:
    """The last requests' prefix-cache reports of each served model, oldest first (as their
    x-minivllm-prefix-cache headers): those of the caller's API key only, as the cache itself is per key."""
    states: dict[str, ServerState] = request.app.state.models
    domain = key_domain(request)
    reports = [r for st in states.values() for r in st.explained if r.domain == domain]
    return {"object": "list", "data": [r.as_dict() for r in reports]}
