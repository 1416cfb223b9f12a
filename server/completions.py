"""POST /v1/completions: OpenAI's (legacy) completions API: one or several raw prompts, as text or ids, or
with a `suffix`, fill-in-the-middle in the model's FIM tokens."""

from collections.abc import Callable
from dataclasses import replace

from fastapi import APIRouter, Request

from minivllm.outputs import TokenLogprob
from server import protocol as p
from server.chat import FINISH, sampling_of
from server.conversation import Conversation
from server.core import (
    OpenAIEvents,
    prepare_prompts,
    protocol_names,
    serve,
    sse,
    state_for,
    until_disconnect,
)
from server.errors import APIError
from server.events import Answer, Event, Finished, TextDelta
from server.generation import Usage
from server.prompts import FimTokens

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: p.CompletionRequest, request: Request):
    st = state_for(request, body.model)
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo")
    conv = parse(body)
    with protocol_names(conv.names):
        if body.suffix:  # "" is no suffix: a plain completion
            prompts = await until_disconnect(
                request, lambda: st.prompts.infill(body.prompt, body.suffix, None)
            )
            conv = _stops_after_the_middle(conv, st.prompts.fim)
        else:
            prompts = await until_disconnect(request, lambda: st.prompts.completion(body.prompt, None))
    prepared = prepare_prompts(request, st, conv, prompts)
    return await serve(request, st, conv, prepared, CompletionWriter(st.token_text, conv))


def parse(body: p.CompletionRequest) -> Conversation:
    """The raw prompts' request: no turns, the rest as any conversation's."""
    return Conversation(
        turns=(),
        max_tokens=body.max_tokens,
        stops=tuple(body.stop),
        sampling=sampling_of(body),
        logprobs=body.logprobs,
        hide_special_tokens=body.skip_special_tokens,
        stream=body.stream,
        include_usage=body.include_usage,
        cache_salt=body.cache_salt,
        names={"prompt": "prompt", "max_tokens": "max_tokens"},
        ignored=("user",) if body.user else (),
    )


def _stops_after_the_middle(conv: Conversation, fim: FimTokens) -> Conversation:
    """A FIM model ends the middle with its end-of-text token, which need not be its EOS (Qwen2.5-Coder's
    instruct models stop at <|im_end|>): stop there too."""
    if fim.end is None:
        return conv
    stops = (*conv.sampling.stop_token_ids, fim.end)
    return replace(conv, sampling=replace(conv.sampling, stop_token_ids=stops))


class CompletionWriter(OpenAIEvents):
    id_prefix = "cmpl"

    def __init__(self, token_text: Callable[[int], str], conv: Conversation):
        super().__init__(conv.include_usage)
        self.token_text = token_text
        self.logprobs = conv.logprobs is not None
        self._offsets: dict[int, int] = {}  # text offset of each choice's next token

    def response(self, rid: str, model: str, answers: list[Answer], usage: Usage) -> dict:
        choices = [self._choice(a.index, a.text, a.logprobs, FINISH[a.reason]) for a in answers]
        return p.CompletionResponse(id=rid, model=model, choices=choices, usage=usage.openai()).model_dump()

    def event(self, rid: str, model: str, event: Event) -> list[str]:
        if isinstance(event, TextDelta):
            choice = self._choice(event.index, event.text, list(event.logprobs), None)
        elif isinstance(event, Finished):
            choice = self._choice(event.index, "", [], FINISH[event.reason])
        else:
            return []
        return [sse(p.CompletionResponse(id=rid, model=model, choices=[choice]))]

    def _choice(self, index: int, text: str, lps: list, reason: str | None) -> p.CompletionChoice:
        return p.CompletionChoice(
            index=index, text=text, logprobs=self._logprobs(index, lps), finish_reason=reason
        )

    def usage_chunk(self, rid: str, model: str, usage: dict) -> p.CompletionResponse:
        return p.CompletionResponse(id=rid, model=model, choices=[], usage=usage)

    def _logprobs(self, index: int, lps: list[TokenLogprob]) -> p.CompletionLogprobs | None:
        if not self.logprobs:
            return None
        out = p.CompletionLogprobs()
        offset = self._offsets.get(index, 0)
        for lp in lps:
            token = self.token_text(lp.token_id)
            out.tokens.append(token)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self.token_text(t): v for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return out
