"""Inter-token gaps counted in engine steps: how many steps pass between two tokens of one request.

A request that decodes in every step has gaps of 1; a gap of k means it sat out k - 1 steps (not
scheduled: preempted, waiting for pages, or crowded out). Counted per generated token after a request's
first, as a histogram of bucket counts: one integer addition per token, nothing kept per token.
"""

from dataclasses import dataclass, field

# upper bounds of the histogram's buckets, in steps (a last bucket holds the larger gaps)
GAP_BUCKETS = (1, 2, 3, 4, 8, 16, 64, 256)


@dataclass
class TokenGaps:
    counts: list[int] = field(default_factory=lambda: [0] * (len(GAP_BUCKETS) + 1))
    total_steps: int = 0  # the sum of all gaps, in steps

    def record(self, steps: int) -> None:
        """One token that came `steps` engine steps after the request's previous token."""
        self.total_steps += steps
        for i, bound in enumerate(GAP_BUCKETS):
            if steps <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound in steps, tokens with a gap up to it), the last bound infinite: a histogram's
        buckets as Prometheus counts them."""
        bounds = [*GAP_BUCKETS, float("inf")]
        return [(float(b), sum(self.counts[: i + 1])) for i, b in enumerate(bounds)]
