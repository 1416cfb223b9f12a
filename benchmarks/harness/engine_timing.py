"""Timing an engine in this process (no server): decode rates measured the same way for every checkout."""

import statistics
import time
from collections.abc import Callable


def decode_rate(engine, seqs: list) -> float:
    """Aggregate decode tok/s of requests already added to `engine` (an LLMEngine of any checkout), counted
    from when every one has its first token (their prefill excluded) until all finish."""
    while any(not s.output_token_ids for s in seqs):
        engine.step()
    start, done = time.perf_counter(), sum(len(s.output_token_ids) for s in seqs)
    while engine.has_unfinished_requests():
        engine.step()
    return (sum(len(s.output_token_ids) for s in seqs) - done) / (time.perf_counter() - start)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median seconds of fn() over `repeats` calls, after one call to warm it up."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)
