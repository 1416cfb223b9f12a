"""A request's state as it moves through the engine."""

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from minivllm.engine.ngram_draft import DraftState
from minivllm.engine.sampling_params import SamplingParams
from minivllm.outputs import FinishReason, TokenLogprob

if TYPE_CHECKING:
    from llguidance import LLMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    finish_detail: str | None = None  # why, when the reason alone does not say (a fault, a pool too small)
    error_param: str | None = None  # an "error" due to the request's own input: the parameter at fault
    stop_token_id: int | None = None  # the EOS / stop token that ended it (not part of the text)
    matcher: "LLMatcher | None" = None  # structured output: the grammar's state after token_ids
    # the KV cache's state for this request (minivllm.cache.kv_request.KVRequest: page table, cursors,
    # what it restored, published and pinned), attached by the engine; only the KV manager changes it.
    # Typed loosely so that the request and the cache import nothing of each other.
    cache: Any = None
    num_cached_tokens: int = 0  # prompt tokens restored from the prefix cache at first admission
    num_computed_prompt_tokens: int = (
        0  # prompt tokens this request ran through the model, over all admissions
    )
    num_admissions: int = 0  # readmissions after a preemption or a fault count too
    num_preemptions: int = 0
    flight_role: str | None = None  # "leader" | "follower" under single flight
    waited_for_prefix: bool = False  # a prefix flight: it waited for pages another prefill computed
    seed: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # speculation: the tokens drafted after token_ids for the step being computed (its inputs after the
    # last token; verified by it, never part of token_ids unless accepted), and the request's backoff
    draft_token_ids: list[int] = field(default_factory=list)
    draft: DraftState = field(default_factory=DraftState)
    # a hybrid model's linear layers' states (minivllm.models.linear_attention.RecurrentState): after its
    # computed tokens (recurrent), at its latest page boundary, and at the boundaries the KV manager asked
    # for whose snapshots are not kept yet
    recurrent: Any = None
    boundary_state: Any = None
    kept_states: list = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    last_token_step: int = 0  # the engine step that gave its latest token (0: none yet)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    def drop_states(self) -> None:
        """Its recurrent states go with its pages (preempted, finished)."""
        self.recurrent, self.boundary_state, self.kept_states = None, None, []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:  # without output_token_ids' copy: the engine asks every step
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_computed_tokens(self) -> int:  # tokens whose KV is in the pool (the KV manager's count)
        return self.cache.num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, n: int) -> None:  # the scheduler counts what a step computed
        self.cache.num_computed_tokens = n

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
