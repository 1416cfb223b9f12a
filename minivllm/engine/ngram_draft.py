"""Prompt-lookup speculation: draft tokens by n-gram matching, verify them in the normal step, keep what
the model itself draws.

Drafting: the last n tokens of the context (n = 3, then 2, then 1) are looked up in the prompt and the
output so far; the tokens that followed their most recent earlier occurrence are the draft. An edit
that copies most of a file from the prompt is drafted a line at a time; free-form text rarely matches.

Verification (Scheduler, ModelRunner): the draft goes into the step's ragged batch like a short prefill
after the last token, and the step samples every drafted position with the sampler's own per-position
draw, the one the step without a draft would make there. A drafted token is accepted when that draw
equals it; the first draw that differs is kept in its place and ends the verification; when every
drafted token is accepted, the last row's draw is a bonus token. Greedy, that is the argmax check. With
temperature, it is exactly the rejection sampling of a deterministic draft: the draft token d is
accepted with probability p(d) (the draw's own), and a rejection leaves the draw conditioned on not
being d, which is p with d removed and renormalized. Since the draws are the ones decoding without a
draft makes, a seeded request's tokens do not depend on whether, or how much, it speculated.

Adaptivity (DraftState): a request keeps its draft length while its drafts are accepted at least in part,
doubles it after a full acceptance and halves it after none (up to the step's limit). After tries that
gain nothing (a draft wholly rejected, or no match) it pauses drafting: not after the first, then for 1, 3,
7 and at most 15 decode steps, until a draft is accepted again. A copy that diverges for a token or two
resumes drafting at once; free-form text soon drafts rarely.
"""

import logging
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

MAX_NGRAM = 3  # the longest context tail looked up
MIN_NGRAM = 1
MAX_PAUSE = 15  # decode steps without drafting after repeated misses, at most


def propose(token_ids: list[int], max_tokens: int) -> list[int]:
    """Up to max_tokens tokens that followed the most recent earlier occurrence of the context's last n
    tokens, for the longest n from MAX_NGRAM down to MIN_NGRAM that occurs; [] if none does."""
    if max_tokens <= 0:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        if length <= n:
            continue
        # starts i < length - n of n-token windows equal to the tail (the tail itself excluded)
        hits = tokens[: length - n] == tokens[length - n]
        for j in range(1, n):
            hits &= tokens[j : length - n + j] == tokens[length - n + j]
        found = np.flatnonzero(hits)
        if len(found):
            start = int(found[-1]) + n
            return tokens[start : start + max_tokens].tolist()
    return []


def accepted_tokens(draft: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verification appends. sampled[j]: the target's draw after the context and draft[:j]
    (len(draft) + 1 draws). The drafted tokens the draws confirm, then the first draw that differs, or
    the bonus draw after a fully accepted draft."""
    n = 0
    while n < len(draft) and sampled[n] == draft[n]:
        n += 1
    return draft[:n] + sampled[n : n + 1]


@dataclass(slots=True)
class DraftState:
    """One request's speculation: how much it drafts next, its backoff, and its totals."""

    limit: int = 1 << 30  # the most it drafts next (the engine's speculative_tokens caps it)
    misses: int = 0  # consecutive tries that accepted nothing
    pause: int = 0  # decode steps left without drafting
    drafted: int = 0  # tokens drafted, over the request's life
    accepted: int = 0  # of those, accepted

    def record(self, drafted: int, accepted: int) -> None:
        """After a verification of `drafted` tokens that accepted `accepted` of them."""
        self.drafted += drafted
        self.accepted += accepted
        if accepted == 0:
            self.limit = max(1, drafted // 2)
            self.back_off()
        else:
            self.misses = 0
            self.limit = 2 * drafted if accepted == drafted else max(self.limit, accepted + 1)

    def back_off(self) -> None:
        """A try that gained nothing (a rejected draft, or no match): pause 0, 1, 3, 7, ... decode steps
        (measured on the edit benchmark: pausing after the first miss already cost ~10% there)."""
        self.misses += 1
        self.pause = min(2 ** (self.misses - 1) - 1, MAX_PAUSE)

    def decoded_without_draft(self) -> None:
        self.pause = max(0, self.pause - 1)

    def log(self, request_id: str) -> None:
        if self.drafted:
            logger.debug(
                "request %s: speculation accepted %d of %d drafted tokens (%.0f%%)",
                request_id,
                self.accepted,
                self.drafted,
                100 * self.accepted / self.drafted,
            )
