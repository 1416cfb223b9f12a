"""One API request's generation: n engine requests, detokenized, cut at stop strings, merged into one
stream of deltas that each protocol formats its own way.

Each choice runs in its own task, consuming the engine's `generate`; closing a Generation cancels the tasks,
which closes the engine iterators and so aborts the requests and frees their pages.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace

from minivllm.cache.hints import CacheHints
from minivllm.engine.sampling_params import SamplingParams
from minivllm.engine.validation import RequestError
from minivllm.models.tokenizer import Tokenizer
from minivllm.outputs import FinishReason, QueueFull, RequestOutput, TokenLogprob
from server.engine_client import EngineClient
from server.errors import APIError, named

logger = logging.getLogger(__name__)
RETRY_AFTER_S = "1"  # a full queue drains as requests finish: seconds at the model's speed


class TextStream:
    """Incremental detokenization that releases text only once it cannot be the start of a stop string,
    so a stop string split across tokens never leaks into the output. Hidden tokens (the special tokens,
    unless a request asks for them) add no text.

    The text is what decoding all tokens at once gives (tokenizers' DecodeStream: it waits for a whole
    UTF-8 character, and keeps the first token's leading space, which a completion needs: "The quick
    brown" + " fox"). An output that ends inside a character ends as that decode ends it, the incomplete
    bytes as U+FFFD."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str], hidden: frozenset[int] = frozenset()):
        self.tokenizer = tokenizer
        self.decode = tokenizer.decode_stream()
        self.hidden = hidden
        self.stops = stops
        self.longest_stop = max((len(s) for s in stops), default=0)
        self.ids: list[int] = []  # the tokens that make the text
        self.pending = False  # the last tokens hold an incomplete character, not in text yet
        self.text = ""  # everything decoded so far
        self.sent = 0  # text[:sent] has been released
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text (Anthropic reports it)

    def add(self, token_ids: list[int]) -> str:
        for t in token_ids:
            if t not in self.hidden:
                self.ids.append(t)
                piece = self.decode(t)  # None: a character still incomplete
                self.pending = piece is None
                self.text += piece or ""
        return self._release(final=False)

    def finish(self) -> str:
        if self.pending:  # DecodeStream never gives the bytes of a last, incomplete character
            self.pending = False
            whole = self.tokenizer.decode(self.ids)
            if whole.startswith(self.text):
                self.text = whole
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        # text held back earlier always covers the start of any stop string, so search from `sent`
        hits = [(i, len(s), s) for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        if hits:
            self.stopped = True
            end, _, self.stop_string = min(hits)  # the first in the text; of two there, the one done first
        else:
            end = len(self.text) if final else len(self.text) - self._held_back()
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest unsent suffix that is a proper prefix of a stop string."""
        tail = self.text[self.sent :]
        for k in range(min(len(tail), self.longest_stop - 1), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stops):
                return k
        return 0


@dataclass
class Delta:
    """New output of one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None = None
    error: str | None = None
    stop_string: str | None = None  # with finish reason "stop": the stop string that matched, if one did
    error_param: str | None = None  # an error the request's own input caused: that engine parameter (a 400)

    @property
    def error_status(self) -> int:
        """The HTTP status of its error: the client's input, the server stopping it, or a fault."""
        return 400 if self.error_param else 503 if self.finish_reason == FinishReason.ABORT else 500


@dataclass
class Usage:
    """A generation's token counts, which each protocol's writer renders in its own names. The prompt's
    tokens are restored from the cache (cached), published to it by this request (created: whole pages
    within the prompt), or computed and kept private."""

    prompt: int
    cached: int
    created: int
    completion: int
    reasoning: int = 0  # of completion: thinking tokens

    def openai(self) -> dict:
        """Chat's and completions' usage object."""
        return {
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning},
        }


@dataclass(frozen=True)
class ThinkingBudget:
    """Thinking closes after `tokens` output tokens: the engine request stops there (or where the model
    closes it itself, at `end`), and a second one continues from the prompt, the thinking and `end`; the
    prefix cache restores what the first computed."""

    end: int  # the think-end token
    tokens: int
    # what follows the end before the answer (Harmony's `<|start|>assistant`: the next message's header)
    resume: tuple[int, ...] = ()


@dataclass
class Choice:
    index: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stops: list[str]
    first_of_prompt: bool  # counts the prompt in usage (the other n-1 choices share it)
    started: asyncio.Future | None = None  # resolved by the first output, or failed by the refusal
    last: RequestOutput | None = None
    first: RequestOutput | None = None  # the first engine request's last output (a thinking budget: two)
    done: bool = False  # its last delta is out
    earlier_output_tokens: int = 0  # output tokens of a first engine request (a thinking budget)

    def to_delta(self, out: RequestOutput, text: TextStream) -> Delta:
        tokens, logprobs = out.new_token_ids, out.new_logprobs
        if out.stop_token_id is not None and tokens:  # the EOS / stop token: not part of the text
            logprobs = logprobs[: len(tokens) - 1]
            tokens = tokens[:-1]
        piece = text.add(tokens)
        if out.finished:
            piece += text.finish()
        reason = FinishReason.STOP if text.stopped else out.finish_reason if out.finished else None
        error = None
        if reason in (FinishReason.ERROR, FinishReason.ABORT):
            error = out.error or ("request aborted" if reason == FinishReason.ABORT else "request failed")
        self.done = reason is not None
        return Delta(self.index, piece, tokens, logprobs, reason, error, text.stop_string, out.error_param)


class Generation:
    def __init__(
        self,
        engine: EngineClient,
        request_id: str,
        prompts: list[list[int]],
        params: list[list[SamplingParams]],
        stops: list[str],
        metrics=None,
        hidden_token_ids: frozenset[int] = frozenset(),
        names: Mapping[str, str] | None = None,
        thinking_budget: ThinkingBudget | None = None,
        cache: CacheHints | None = None,
    ):
        """params[i][j]: sampling params of choice j of prompt i; choices are numbered prompt-major.
        cache: every choice's cache domain and pins.
        hidden_token_ids: tokens that add no output text (they still count, and show in logprobs).
        names: the protocol's fields by engine parameter, for an error the request's input caused."""
        self.engine = engine
        self.metrics = metrics
        self.hidden_token_ids = hidden_token_ids
        self.names = names or {}
        self.thinking_budget = thinking_budget
        self.cache = cache
        self.arrival = time.monotonic()
        self.first_token_time: float | None = None
        self.choices: list[Choice] = []
        for prompt, plist in zip(prompts, params, strict=True):
            for j, p in enumerate(plist):
                i = len(self.choices)
                self.choices.append(Choice(i, f"{request_id}-{i}", prompt, p, stops, j == 0))
        self.events: asyncio.Queue[Delta | None] = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.closed = False

    # -- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Submit every choice; return once each has its first output. Raises APIError (or the engine's
        RequestError) if one is refused."""
        loop = asyncio.get_running_loop()
        for c in self.choices:
            c.started = loop.create_future()
            self.tasks.append(asyncio.create_task(self._run(c)))
        results = await asyncio.gather(*(c.started for c in self.choices), return_exceptions=True)
        refused = next((r for r in results if isinstance(r, BaseException)), None)
        if refused is not None:
            self.close()
            raise _api_error(refused)

    def fail(self, reason: str) -> None:
        """End every unfinished choice with an error (its stream's error event), then close."""
        if self.closed:
            return
        for c in self.choices:
            if not c.done:
                self.events.put_nowait(Delta(c.index, "", [], [], FinishReason.ABORT, reason))
        self.close()

    def close(self) -> None:
        """Abort what still runs (synchronous, so it is safe in any finally, even under cancellation)."""
        if self.closed:
            return
        self.closed = True
        for task in self.tasks:
            task.cancel()
        self.events.put_nowait(None)  # wakes a consumer of deltas(): nothing more will come
        self._record_metrics()

    # -- output ---------------------------------------------------------------------------------------
    async def deltas(self) -> AsyncIterator[Delta]:
        """Every choice's deltas, as they come, until all have finished (or the generation is closed)."""
        remaining = len(self.choices)
        while remaining:
            delta = await self.events.get()
            if delta is None:
                return
            remaining -= delta.finish_reason is not None
            yield delta

    async def collect(self) -> list[list[Delta]]:
        """Wait for the whole output: the deltas of each choice. Raises APIError if one failed."""
        per_choice: list[list[Delta]] = [[] for _ in self.choices]
        async for d in self.deltas():
            if d.error:
                raise APIError(d.error_status, d.error, param=d.error_param)
            per_choice[d.index].append(d)
        if self.closed:
            raise APIError(503, "request closed before it finished")
        return per_choice

    def usage(self) -> Usage:
        outs = [(c, c.first or c.last) for c in self.choices if c.last is not None]
        firsts = [o for c, o in outs if c.first_of_prompt]
        prompt = sum(o.num_prompt_tokens for o in firsts)
        cached = sum(o.num_cached_tokens for o in firsts)
        # a page evicted and computed again after a preemption is published twice: at most the rest
        created = sum(
            min(o.num_published_prompt_tokens, o.num_prompt_tokens - o.num_cached_tokens) for o in firsts
        )
        completion = sum(c.earlier_output_tokens + c.last.num_output_tokens for c, _ in outs)
        return Usage(prompt, cached, created, completion)

    # -- one choice -----------------------------------------------------------------------------------
    async def _run(self, c: Choice) -> None:
        text = TextStream(self.engine.tokenizer, c.stops, self.hidden_token_ids)
        budget = self.thinking_budget
        params = c.params
        if budget is not None:  # the first engine request: the thinking, up to its budget
            cap = budget.tokens if params.max_tokens is None else min(budget.tokens, params.max_tokens)
            params = replace(params, max_tokens=cap, stop_token_ids=[*params.stop_token_ids, budget.end])
        try:
            closed = await self._segment(c, c.prompt, params, text, budget)
            if closed is not None:  # the answer, after the thinking (and its end, where the budget ended it)
                c.first, c.earlier_output_tokens = c.last, len(closed)
                left = None if c.params.max_tokens is None else c.params.max_tokens - len(closed)
                if left is not None and left <= 0:
                    self.events.put_nowait(Delta(c.index, text.finish(), [], [], FinishReason.LENGTH))
                    return
                await self._segment(c, c.prompt + closed, replace(c.params, max_tokens=left), text, None)
        except Exception as e:
            if not c.started.done():
                c.started.set_exception(e)
            else:
                logger.exception("request %s failed", c.request_id)
                self.events.put_nowait(
                    Delta(c.index, "", [], [], FinishReason.ERROR, f"{type(e).__name__}: {e}")
                )
        finally:
            if not c.started.done():
                c.started.cancel()

    async def _segment(
        self,
        c: Choice,
        prompt: list[int],
        params: SamplingParams,
        text: TextStream,
        budget: ThinkingBudget | None,
    ) -> list[int] | None:
        """One engine request's outputs as deltas. With a budget: its output tokens, ending with the think
        end, when the answer is still to come (None when the output ended here)."""
        rid = c.request_id if budget is not None or c.first is None else f"{c.request_id}-answer"
        stream = self.engine.generate(rid, prompt, params, self.cache)
        tokens: list[int] = []
        try:
            async for out in stream:
                c.last = out
                if not c.started.done():
                    c.started.set_result(None)
                if out.new_token_ids and self.first_token_time is None:
                    self.first_token_time = time.monotonic()
                tokens += out.new_token_ids
                if budget is not None and out.finished and self._thinking_ends(out, budget, c):
                    # the budget ended the thinking: close it; then what leads to the answer
                    closing = [budget.end] if out.stop_token_id != budget.end else []
                    closing += budget.resume
                    tokens += closing
                    piece = text.add(
                        out.new_token_ids if out.stop_token_id is None else out.new_token_ids[:-1]
                    )
                    piece += text.add([budget.end, *budget.resume])
                    ids = out.new_token_ids + closing
                    self.events.put_nowait(Delta(c.index, piece, ids, out.new_logprobs))
                    return tokens
                delta = c.to_delta(out, text)
                if delta.error_param:  # the request's own input at fault: its field in the protocol's name
                    refusal = named(RequestError(delta.error, param=delta.error_param), self.names)
                    delta.error, delta.error_param = refusal.message, refusal.param
                self.events.put_nowait(delta)
                if delta.finish_reason:
                    return None  # a stop string: closing the stream below aborts the request
            self.events.put_nowait(Delta(c.index, "", [], [], FinishReason.ERROR, "stream ended early"))
            return None
        finally:
            await stream.aclose()

    @staticmethod
    def _thinking_ends(out: RequestOutput, budget: ThinkingBudget, c: Choice) -> bool:
        """The first engine request ended at the think end or at the budget, with room left for an answer."""
        if out.stop_token_id == budget.end:
            return True
        within_max = c.params.max_tokens is None or out.num_output_tokens < c.params.max_tokens
        return out.finish_reason == FinishReason.LENGTH and within_max

    def _record_metrics(self) -> None:
        if self.metrics is None:
            return
        if self.first_token_time is not None:
            self.metrics.ttft.observe(self.first_token_time - self.arrival)
        if all(c.done for c in self.choices):
            self.metrics.latency.observe(time.monotonic() - self.arrival)
        usage = self.usage()
        self.metrics.prompt_tokens.inc(usage.prompt)
        self.metrics.completion_tokens.inc(usage.completion)


def _api_error(e: BaseException) -> Exception:
    """A refusal as the HTTP error; the engine's RequestError goes up as it is, for the protocol to name
    its parameter in its own words (server.core.protocol_names)."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, QueueFull):
        return APIError(429, f"server busy: {e}", code="queue_full", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    if isinstance(e, asyncio.CancelledError):
        return APIError(503, "request cancelled")
    logger.error("request refused: %r", e)
    return APIError(503, f"engine unavailable: {e}")
