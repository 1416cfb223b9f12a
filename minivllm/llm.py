"""The synchronous API for scripts and tests: LLM(...).generate(prompts, sampling_params).

A request the engine fails (finish reason "error": a fault in a step) raises GenerationError once the
call's other requests are done; it is never returned as a short or empty completion. Aborted requests
(finish reason "abort") are returned as they are.
"""

import itertools
from dataclasses import dataclass

from tqdm import tqdm

from minivllm.cache.hints import CacheHints
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sampling_params import SamplingParams
from minivllm.engine.sequence import Sequence
from minivllm.outputs import FinishReason, TokenLogprob


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    num_cached_tokens: int
    logprobs: list[TokenLogprob]
    error: str | None = None  # why it ended, when the finish reason alone does not say


class GenerationError(RuntimeError):
    """Requests of one LLM.generate call failed. failed: their completions (the tokens they had, the
    fault as `error`); completions: every request of the call, in prompt order."""

    def __init__(self, failed: list[Completion], completions: list[Completion]):
        self.failed, self.completions = failed, completions
        faults = "; ".join(f"request {c.request_id}: {c.error}" for c in failed)
        super().__init__(f"{len(failed)} of {len(completions)} requests failed: {faults}")


class LLM:
    def __init__(self, model: str | None = None, **settings):
        self.engine = LLMEngine(EngineConfig(model=model, **settings))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        cache: CacheHints | list[CacheHints] | None = None,
    ) -> list[Completion]:
        """cache: the requests' cache domain and pins (one for all, or one per prompt)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        hints = cache if isinstance(cache, list) else [cache] * len(prompts)
        if len(hints) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(hints)} cache hints")
        seqs = [
            self.engine.add_request(f"llm-{next(self._ids)}", p, sp, cache=h)
            for p, sp, h in zip(prompts, params, hints)
        ]
        with tqdm(total=len(seqs), disable=not use_tqdm, desc="generate") as bar:
            while any(not s.is_finished for s in seqs):
                bar.update(sum(o.finished for o in self.engine.step()))
        completions = [self._completion(s) for s in seqs]
        failed = [c for c in completions if c.finish_reason == FinishReason.ERROR]
        if failed:
            raise GenerationError(failed, completions)
        return completions

    def close(self) -> None:
        """Write the disk tier's queued pages and release its directory (with kv_disk_dir set)."""
        self.engine.close()

    def _completion(self, seq: Sequence) -> Completion:
        return Completion(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=self.tokenizer.decode(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
            logprobs=seq.logprobs,
            error=seq.finish_detail,
        )
