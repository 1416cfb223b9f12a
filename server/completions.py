"""POST /v1/completions: OpenAI's (legacy) completions API: one or several raw prompts, as text or ids, or
with a `suffix`, fill-in-the-middle in the model's FIM tokens."""

from collections.abc import Callable

from fastapi import APIRouter, Request

from minivllm.outputs import TokenLogprob
from server import protocol as p
from server.core import OpenAIEvents, generate, protocol_names, state_for, until_disconnect
from server.errors import APIError
from server.generation import Delta
from server.prompts import FimTokens

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: p.CompletionRequest, request: Request):
    st = state_for(request, body.model)
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo")
    with protocol_names({}):
        if body.suffix:  # "" is no suffix: a plain completion
            prompts = await until_disconnect(
                request, lambda: st.prompts.infill(body.prompt, body.suffix, body.max_tokens)
            )
            body = _stops_after_the_middle(body, st.prompts.fim)
        else:
            prompts = await until_disconnect(
                request, lambda: st.prompts.completion(body.prompt, body.max_tokens)
            )
        fmt = CompletionFormat(st.token_text, body.logprobs is not None)
        return await generate(request, st, fmt, body, prompts, body.max_tokens, body.logprobs)


def _stops_after_the_middle(body: p.CompletionRequest, fim: FimTokens) -> p.CompletionRequest:
    """A FIM model ends the middle with its end-of-text token, which need not be its EOS (Qwen2.5-Coder's
    instruct models stop at <|im_end|>): stop there too."""
    if fim.end is None:
        return body
    return body.model_copy(update={"stop_token_ids": [*(body.stop_token_ids or ()), fim.end]})


class CompletionFormat(OpenAIEvents):
    id_prefix = "cmpl"

    def __init__(self, token_text: Callable[[int], str], logprobs: bool):
        self.token_text = token_text
        self.logprobs = logprobs
        self._offsets: dict[int, int] = {}  # text offset of each choice's next token

    def response(
        self, rid: str, model: str, per_choice: list[list[Delta]], usage: dict
    ) -> p.CompletionResponse:
        choices = [self._choice(i, deltas) for i, deltas in enumerate(per_choice)]
        return p.CompletionResponse(id=rid, model=model, choices=choices, usage=usage)

    def _choice(self, index: int, deltas: list[Delta]) -> p.CompletionChoice:
        return p.CompletionChoice(
            index=index,
            text="".join(d.text for d in deltas),
            logprobs=self._logprobs(index, [lp for d in deltas for lp in d.logprobs]),
            finish_reason=deltas[-1].finish_reason,
        )

    def chunks(self, rid: str, model: str, d: Delta) -> list[p.CompletionResponse]:
        return [p.CompletionResponse(id=rid, model=model, choices=[self._choice(d.index, [d])])]

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
