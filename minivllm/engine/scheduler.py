"""Decides what each step computes: continuous batching, chunked prefill, prefix reuse, preemption.

Waiting requests are admitted first come, first served when the pool can hold their prompt; running
requests get one decode token or their next prefill chunk under the step's token budget. When pages
run out mid-decode the newest running request is preempted (its pages released, requeued at the front
to be restored or recomputed, not in the same step); a request that could never fit the pool is stopped
instead of preempting others. After each evaluated step, completed pages are published to the prefix cache.
With speculation on, a few decoding requests also verify drafted tokens in the step (minivllm.engine.
ngram_draft): the drafts count in the step's budget, take only free pages, and what is rejected is
given back before anything is published.
"""

import logging
from collections import deque
from dataclasses import dataclass

from minivllm.cache.kv_manager import KVManager
from minivllm.config import EngineConfig, Publication, SingleFlight, Speculative
from minivllm.engine.grammar import MaskCounters, advance, grammar_error
from minivllm.engine.ngram_draft import accepted_tokens, propose
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.engine.single_flight import FlightCoordinator
from minivllm.outputs import FinishReason, TokenLogprob

logger = logging.getLogger(__name__)

# No drafts when more than this many requests decode in a step: a step's cost grows with its tokens once
# they are a handful (the 0.5B default model on 2 CPU cores: a 5-token step costs ~2x a 1-token one, a
# 9-token one ~2.4x; docs/speculative.md), so a larger batch is compute-bound already and a rejected
# draft costs nearly its full compute.
SPEC_MAX_DECODES = 4


@dataclass
class CacheCounters:
    # lookups, query and hit tokens: at a request's first admission only (readmissions are not hits)
    lookups: int = 0
    query_tokens: int = 0  # prompt tokens looked up (token-weighted, as vLLM counts)
    hit_tokens: int = 0  # prompt tokens restored (from RAM or disk)
    disk_hit_tokens: int = 0  # of those, the tokens read back from the disk tier
    computed_prompt_tokens: int = 0  # prompt tokens run through the model
    preemptions: int = 0
    prefix_waiters: int = 0  # requests that waited for pages another request's prefill was computing


@dataclass
class SpecCounters:
    draft_tokens: int = 0  # tokens drafted and verified
    accepted_tokens: int = 0  # drafted tokens accepted (and kept: none after an EOS)


@dataclass
class ScheduledStep:
    """What one step computes: num_tokens[i] new tokens of seqs[i] (decode tokens and prefill chunks)."""

    seqs: list[Sequence]
    num_tokens: list[int]

    def __bool__(self) -> bool:
        return bool(self.seqs)


def fair_shares(needs: list[int], budget: int) -> list[int]:
    """Split budget over requests needing `needs` tokens, max-min fairly: each gets its need or an equal
    share of what the smaller ones leave, whichever is less (so the budget is used whenever needs allow)."""
    shares = [0] * len(needs)
    left = budget
    order = sorted(range(len(needs)), key=needs.__getitem__)
    for k, i in enumerate(order):
        shares[i] = min(needs[i], left // (len(order) - k))
        left -= shares[i]
    return shares


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVManager,
        eos_token_ids: set[int],
        max_model_len: int,
        mask_counters: MaskCounters,
    ):
        self.config = config
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.flights = (
            FlightCoordinator(config.single_flight) if config.single_flight != SingleFlight.OFF else None
        )
        self.counters = CacheCounters()
        self.spec_counters = SpecCounters()
        self.finished: list[Sequence] = []  # ended since the engine last collected them
        self.step_seqs: list[Sequence] = []
        self.mask_counters = mask_counters

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if self.flights:
            self.flights.join(seq)

    def num_queued(self) -> int:
        """Waiting requests beyond the free running slots: those the next schedule() cannot start at once.
        Admission bounds this, not len(waiting), since requests arrive in waiting before any is scheduled."""
        free_slots = max(0, self.config.max_num_seqs - len(self.running))
        return max(0, len(self.waiting) - free_slots)

    # -- scheduling ---------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        """The step: every running decode first (one token each), then the prefill chunks, the running
        prefills' and the newly admitted requests' together, sharing what is left of the token budget
        max-min fairly (fair_shares): a long prompt takes only what shorter ones leave, so a request that
        arrives during a 200k-token prefill still starts in the next step."""
        budget = self.config.max_num_batched_tokens
        # The step's requests, the one being scheduled or admitted last too: what a fault in it fails.
        self.step_seqs = []
        seqs: list[Sequence] = []
        num_tokens: list[int] = []
        preemptions = self.counters.preemptions
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING or seq.num_uncomputed_tokens != 1 or budget == 0:
                continue
            self.step_seqs.append(seq)
            if not self._reserve(seq, seq.num_computed_tokens + 1):
                self.step_seqs.pop()
                continue
            seqs.append(seq)
            num_tokens.append(1)
            budget -= 1
        if self.config.speculative != Speculative.OFF:
            budget -= self._draft(seqs, num_tokens, budget)
        prefills = [
            s for s in self.running if s.status == SequenceStatus.RUNNING and s.num_uncomputed_tokens > 1
        ]
        # A step that preempted admits nobody: the pool is short of pages, and a victim readmitted in the
        # step that preempted it would only be preempted again by the next page its preemptor needs.
        if self.counters.preemptions == preemptions:
            prefills += self._admit_waiting(budget - len(prefills))
        # a request whose prefix pages are still being read from disk waits for them; nobody else does
        prefills = [s for s in prefills if not self.kv.is_restoring(s.cache)]
        for seq, n in zip(prefills, fair_shares([s.num_uncomputed_tokens for s in prefills], budget)):
            # pages for the whole prompt came with admission: a prefill chunk never needs to preempt
            if n > 0 and self.kv.pages_short(seq.cache, seq.num_computed_tokens + n) <= 0:
                seqs.append(seq)
                num_tokens.append(n)
        self.step_seqs = list(dict.fromkeys(self.step_seqs + seqs))
        return ScheduledStep(seqs, num_tokens)

    def _draft(self, seqs: list[Sequence], num_tokens: list[int], budget: int) -> int:
        """Draft tokens for the step's decodes (seqs, one token each so far): the step's drafts share the
        speculative_tokens limit (and what is left of the budget) max-min fairly by how many each
        request would draft, and take only free pages (a draft never evicts nor preempts). Returns the
        tokens drafted."""
        if len(seqs) > SPEC_MAX_DECODES:
            return 0
        wants = [self._draft_room(seq) for seq in seqs]
        drafted = 0
        for i, share in enumerate(fair_shares(wants, min(budget, self.config.speculative_tokens))):
            if share == 0:
                continue
            seq = seqs[i]
            room = min(share, self.kv.free_room(seq.cache) - len(seq.token_ids))
            if room <= 0:
                continue  # no free page: a full pool is no sign that drafts miss
            draft = propose(seq.token_ids, room)
            if not draft:
                seq.draft.back_off()
                continue
            self.kv.grow(
                seq.cache, len(seq.token_ids) + len(draft)
            )  # the draft's KV goes after the last token
            seq.draft_token_ids = draft
            num_tokens[i] += len(draft)
            drafted += len(draft)
        return drafted

    def _draft_room(self, seq: Sequence) -> int:
        """The most seq may draft now: 0 while it backs off, or when it needs each token on the host before
        the next is drawn (log-probabilities, penalties, a grammar: those decode without speculation);
        else its adaptive limit, within max_tokens and the context (a verification appends the accepted
        drafted tokens and one more)."""
        p = seq.params
        if seq.draft.pause or seq.matcher is not None or p.penalized or p.logprobs is not None:
            return 0
        left = min(p.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq.token_ids))
        return max(0, min(seq.draft.limit, self.config.speculative_tokens, left - 1))

    def _admit_waiting(self, room: int) -> list[Sequence]:
        """Admit waiting requests in arrival order while each can get a token of the step (room) and a
        running slot. A follower of an open flight waits, and so does a request whose next page is being
        computed right now by a running prefill (a prefix flight: it restores that page once published
        instead of computing it a second time; if that prefill stops, the page is no longer in flight and
        the waiter computes it itself)."""
        admitted: list[Sequence] = []
        if not self.waiting or room <= 0:
            return admitted  # no step hashes the running prefills' pages for nobody
        computing = self._pages_in_prefill(self.running)
        for seq in list(self.waiting):
            if room <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self.flights and self.flights.is_waiting(seq):
                continue
            if computing and self._next_page_in(seq, computing):
                if not seq.waited_for_prefix:
                    seq.waited_for_prefix = True
                    self.counters.prefix_waiters += 1
                continue
            self.step_seqs.append(seq)
            if not self._admit(seq):
                self.step_seqs.pop()
                break
            admitted.append(seq)
            computing |= self._pages_in_prefill([seq])
            room -= 1
        return admitted

    def _pages_in_prefill(self, seqs: list[Sequence]) -> set[bytes]:
        """Hashes of the prompt pages these requests' prefills compute and have not published yet (none
        without prefix flights: single_flight "off", or no prefix cache)."""
        if self.flights is None:
            return set()
        size = self.kv.page_size
        return {
            h
            for s in seqs
            if s.in_prefill
            for h in s.cache.full_page_hashes(size)[s.cache.publish_cursor : s.num_prompt_tokens // size]
        }

    def _next_page_in(self, seq: Sequence, computing: set[bytes]) -> bool:
        """Whether the first page of seq's prompt that the cache does not hold is in `computing`."""
        restorable = seq.cache.full_page_hashes(self.kv.page_size)[
            : (len(seq.token_ids) - 1) // self.kv.page_size
        ]
        cached = self.kv.cached_prefix_pages(seq.cache)
        if cached >= len(restorable) or restorable[cached] not in computing:
            return False
        shared = cached
        while shared < len(restorable) and restorable[shared] in computing:
            shared += 1
        # a hybrid model's waiter resumes where the pages it waits for end: their prefill keeps the state
        self.kv.want_state(seq.cache, shared)
        return True

    def schedule_ahead(self, step: ScheduledStep) -> ScheduledStep:
        """The requests of the next step (one decode token each), chosen while `step` still runs: each
        goes on with the token that step samples for it, unknown on the host yet. Only when that is all
        the next step would do: nobody waits, every running request is in the step and samples a token
        in it, none needs that token on the host (a grammar's mask, penalties' counts), and each gets its
        page without preempting anyone; else an empty step and the next step is scheduled as usual. A
        request whose token turns out to end it computes one token more than it needs, which is dropped."""
        none = ScheduledStep([], [])
        live = [(seq, n) for seq, n in zip(step.seqs, step.num_tokens) if not seq.is_finished]
        if self.waiting or len(live) != len(self.running):
            return none
        if self._drafting() and any(self._draft_room(seq) for seq, _ in live):
            return none  # its next step may verify a draft, which is made from the running step's token
        ahead = []
        for seq, n in live:
            if (
                seq.num_computed_tokens + n != len(seq.token_ids)
                or seq.matcher is not None
                or seq.params.penalized
            ):
                return none
            if not self._reached_length_limit(seq, len(seq.token_ids) + 1):
                ahead.append(seq)  # else the running step's token is its last for sure
        # its KV goes after the running step's token: len(token_ids) + 1 tokens in all
        need = [max(0, self.kv.pages_short(seq.cache, len(seq.token_ids) + 1)) for seq in ahead]
        if sum(need) > self.kv.num_available():
            return none
        for seq in ahead:
            self.kv.grow(seq.cache, len(seq.token_ids) + 1)
        self.step_seqs.extend(ahead)
        return ScheduledStep(ahead, [1] * len(ahead))

    def _drafting(self) -> bool:
        return self.config.speculative != Speculative.OFF and len(self.running) <= SPEC_MAX_DECODES

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Give seq pages for num_tokens, preempting the newest requests if needed. False if seq lost."""
        need = self.kv.pages_short(seq.cache, num_tokens)
        if need > self.kv.num_available() and self._stop_if_it_never_fits(seq):
            return False
        while need > self.kv.num_available():
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.kv.grow(seq.cache, num_tokens)
        return True

    def _stop_if_it_never_fits(self, seq: Sequence) -> bool:
        """A request whose longest possible context needs more pages than the whole pool would push every
        other request out and still be cut short: stop it now, before it preempts anyone."""
        max_len = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
        pages = self.kv.pages_for(max_len - 1)  # the last sampled token never gets KV
        if pages <= self.kv.num_pages:
            return False
        seq.finish_detail = (
            f"stopped at {len(seq.token_ids)} tokens: up to {max_len} tokens need {pages} KV pages and "
            f"the pool has {self.kv.num_pages}"
        )
        logger.warning("request %s %s", seq.request_id, seq.finish_detail)
        self.finish(seq, FinishReason.LENGTH)
        return True

    def _admit(self, seq: Sequence) -> bool:
        """Restore the longest cached prefix, allocate pages for the rest of the prompt, start running."""
        restored = self.kv.admit(seq.cache)
        if restored is None:
            return False
        seq.status = SequenceStatus.RUNNING
        self.waiting.remove(seq)
        self.running.append(seq)
        # Usage and hit counters count prompt tokens restored at first admission only: a readmitted
        # request restores what it lost to preemption (its generated tokens too), not a prompt cache hit.
        if self.config.enable_prefix_caching and seq.num_admissions == 0:
            seq.num_cached_tokens = restored
            self.counters.lookups += 1
            self.counters.query_tokens += len(seq.token_ids)
            self.counters.hit_tokens += seq.num_cached_tokens
        seq.num_admissions += 1
        return True

    def restored_from_disk(self, seq: Sequence, tokens: int | None) -> None:
        """seq's pages read back from disk are in the pool: at its first admission they are cached prompt
        tokens like those restored from RAM (admission counted those). None: a hybrid model's restore
        that could not be completed; seq gives its pages back and is admitted again."""
        if tokens is None:
            self.requeue(seq)
            return
        if self.config.enable_prefix_caching and seq.num_admissions == 1:
            seq.num_cached_tokens += tokens
            self.counters.hit_tokens += tokens
            self.counters.disk_hit_tokens += tokens

    def preempt(self, seq: Sequence) -> None:
        """For lack of pages: requeue seq first; it restores or recomputes its tokens when readmitted."""
        self.requeue(seq)
        seq.num_preemptions += 1
        self.counters.preemptions += 1

    def requeue(self, seq: Sequence) -> None:
        """Free seq's pages and put it first in the waiting queue."""
        if self.flights and self.flights.is_open_leader(seq):
            self.flights.hand_over(seq)
        self.kv.release(seq.cache)
        seq.drop_states()
        seq.draft_token_ids = []  # e.g. after a fault in its verification: readmitted, it recomputes
        seq.status = SequenceStatus.WAITING
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    # -- after the step ---------------------------------------------------------------------------------
    def postprocess(self, step: ScheduledStep, outputs: list) -> None:
        """Record what the evaluated step computed; accept or reject drafts; publish pages; append the new
        tokens and finish requests that are done."""
        incremental = self.config.publication == Publication.INCREMENTAL
        for seq, n, out in zip(step.seqs, step.num_tokens, outputs):
            was_prefill = seq.in_prefill
            prompt_part = min(n, max(0, seq.num_prompt_tokens - seq.num_computed_tokens))
            seq.num_computed_prompt_tokens += prompt_part
            self.counters.computed_prompt_tokens += prompt_part
            draft, seq.draft_token_ids = seq.draft_token_ids, []
            tokens = accepted_tokens(draft, out.tokens) if draft else out.tokens
            # a rejected drafted token's KV was computed from a token the sequence does not have: it does
            # not count as computed, so it is never published, and the next tokens overwrite it
            rejected = len(draft) + 1 - len(tokens) if draft else 0
            seq.num_computed_tokens += n - rejected
            release = (
                was_prefill and not seq.in_prefill and self.config.single_flight == SingleFlight.AFTER_PREFILL
            )
            if incremental or release:  # on release: the followers' checkpoint, even under completion
                self.kv.publish(seq.cache)
                seq.kept_states = self.kv.publish_states(seq.cache, seq.kept_states)
            if release:
                self.flights.release(seq)
            length = len(seq.token_ids)
            for token in tokens:
                self._append_token(seq, token, out.logprob)
                if seq.is_finished:
                    break  # tokens after an EOS, a stop token or the length limit are dropped
            if draft:  # its accepted drafted tokens: those appended before the last one (or an end)
                self._verified(seq, len(draft), min(len(tokens) - 1, len(seq.token_ids) - length))
            elif tokens:
                seq.draft.decoded_without_draft()

    def _verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """After seq verified `drafted` tokens and kept `accepted`: the counters, its backoff, and the
        pages only rejected drafted tokens were written to go back to the pool."""
        seq.draft.record(drafted, accepted)
        self.spec_counters.draft_tokens += drafted
        self.spec_counters.accepted_tokens += accepted
        if not seq.is_finished:
            self.kv.truncate(seq.cache, len(seq.token_ids))

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> None:
        seq.token_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if seq.matcher is not None:
            advance(seq.matcher, token, self.mask_counters)
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            seq.stop_token_id = token
            self.finish(seq, FinishReason.STOP)
        elif seq.matcher is not None and seq.matcher.is_error():  # past the grammar engine's limits
            refusal = grammar_error(seq.matcher.get_error())
            seq.finish_detail, seq.error_param = refusal.message, refusal.param
            logger.warning("request %s: %s", seq.request_id, seq.finish_detail)
            self.finish(seq, FinishReason.ERROR)
        elif seq.matcher is not None and seq.matcher.is_stopped():
            if token in self.eos_token_ids:  # an EOS the grammar took as its end, under ignore_eos
                seq.stop_token_id = token
            self.finish(seq, FinishReason.STOP)  # the grammar is complete and allows nothing more
        elif self._reached_length_limit(seq, len(seq.token_ids)):
            self.finish(seq, FinishReason.LENGTH)

    def _reached_length_limit(self, seq: Sequence, length: int) -> bool:
        """With `length` tokens, seq has its max_tokens or fills the context."""
        return length - seq.num_prompt_tokens >= seq.params.max_tokens or length >= self.max_model_len

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End seq for good: finished (STOP, LENGTH), aborted (ABORT) or failed (ERROR)."""
        if seq.is_finished:
            return  # e.g. an abort that arrives after the step that finished it
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.kv.publish(seq.cache)
            # and where its tokens' last page ends: the next turn of a conversation resumes there
            self.kv.publish_states(seq.cache, seq.kept_states + [s for s in (seq.boundary_state,) if s])
        seq.draft.log(seq.request_id)
        self.kv.pin(seq.cache)  # what it published of the prefixes it asked to pin, before its pages go
        seq.drop_states()
        self.kv.release(seq.cache)
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.finished.append(seq)
        if self.flights:
            self.flights.terminate(seq)
