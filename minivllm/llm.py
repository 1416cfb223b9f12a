"""The synchronous API for scripts and tests: LLM(...).generate(prompts, sampling_params)."""

import itertools
from dataclasses import dataclass

from tqdm import tqdm

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.sampling_params import SamplingParams
from minivllm.engine.sequence import TokenLogprob


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int
    logprobs: list[TokenLogprob]


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
    ) -> list[Completion]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        seqs = [self.engine.add_request(f"llm-{next(self._ids)}", p, sp) for p, sp in zip(prompts, params)]
        with tqdm(total=len(seqs), disable=not use_tqdm, desc="generate") as bar:
            while any(not s.is_finished for s in seqs):
                bar.update(sum(o.finished for o in self.engine.step()))
        return [
            Completion(
                request_id=s.request_id,
                prompt_token_ids=s.prompt_token_ids,
                token_ids=s.output_token_ids,
                text=self.tokenizer.decode(s.output_token_ids),
                finish_reason=s.finish_reason,
                num_cached_tokens=s.num_cached_tokens,
                logprobs=s.logprobs,
            )
            for s in seqs
        ]
