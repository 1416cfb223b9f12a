"""Trace generator families for the eviction benchmarks: many traces drawn from a few shapes.

A family draws a seed and a parameter set (``draw(family, seed)``), so a benchmark checks a property over
a distribution of traces rather than on a list of cases a tuned policy passes. Every trace is a list of
replay requests (chained block hashes, 512-token blocks) whose last block is partial, as in the Mooncake
traces.

- forest: a few shared system prompts (1-4 blocks), tens of live conversations; each request continues a
  random live conversation by 1-3 blocks (probability ``continue_prob``), or starts a new one over a random
  system prompt in place of a random live one, which retires. The shape of coding agents and chat
  sessions: a forest of growing prefixes. With ``continue_partial`` (the default) a turn continues the
  previous request of its conversation whole, its partial last block included (the next prompt holds the
  previous one and more); without it the partial block is dropped, as in the Mooncake traces.
- conversations: benchmarks.adversarial_traces' conversation and recency forests (one root, forks).
- agent: agent sessions on long shared system prompts with one-off scans, prompts rotating or not.
- scan: a few hot conversations under long one-off scans.
- zipf: prompts drawn from a Zipf popularity over a catalogue of shared prefixes, each with a fresh tail.
- revisits: popular prompts beside one-off prompts that come back once after a long pause (one to a few
  caches' worth of blocks later), some also soon after they first came (a retry, a follow-up): the shape
  of windows of the Mooncake synthetic trace where a long memory of counts keeps the returning prompts
  as frequent and gives up the popular ones.
- mooncake: a random contiguous window (a quarter to a half) of one of the two Mooncake traces.

``draw(family, seed, wide=True)`` draws forests, conversations and agent sessions from wider ranges of
parameters (``WIDE_PARAMS``) than the ones the default policy was measured on.

    python -m benchmarks.trace_families forest 7 OUT.jsonl   # write one drawn trace
    python -m benchmarks.trace_families forest 7 OUT.jsonl --wide   # its parameters from the wide ranges
    python -m benchmarks.trace_families forest 101 OUT.jsonl --params '{"live": 50, "n_systems": 6}'
                                                  # the generator's defaults but for the given parameters
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.adversarial_traces import (
    BLOCK,
    _Blocks,
    _request,
    agent_sessions,
    conversation_forest,
    recency_forest,
    write_trace,
)
from minivllm.replay import TraceRequest, load_trace

TRACES_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
MOONCAKE = ("mooncake_conversation_trace", "mooncake_synthetic_trace")


def _partial(blocks: list[int], rng: random.Random) -> TraceRequest:
    """A request over blocks whose last block does not fill its page."""
    return TraceRequest(list(blocks), len(blocks) * BLOCK - rng.randint(1, BLOCK - 1))


def forest(
    seed: int = 0,
    n_requests: int = 3000,
    n_systems: int = 6,
    system_blocks: tuple[int, int] = (1, 4),
    live: int = 50,
    continue_prob: float = 0.6,
    turn_blocks: tuple[int, int] = (1, 3),
    continue_partial: bool = True,
) -> list[TraceRequest]:
    """Live conversations over shared system prompts: continue a random one, or replace a random one by a
    new conversation over a random system prompt."""
    rng, blocks = random.Random(seed), _Blocks()
    systems = [blocks.new(rng.randint(*system_blocks)) for _ in range(n_systems)]

    def start() -> list[int]:
        return rng.choice(systems) + blocks.new(rng.randint(*turn_blocks))

    conversations = [start() for _ in range(live)]
    out: list[TraceRequest] = []
    while len(out) < n_requests:
        i = rng.randrange(live)
        if rng.random() < continue_prob:
            conversations[i] = conversations[i] + blocks.new(rng.randint(*turn_blocks))
        else:
            conversations[i] = start()
        if continue_partial:  # the conversation so far is the prompt, its last block partial
            out.append(_partial(conversations[i], rng))
        else:  # a fresh partial block that no later prompt holds
            out.append(_request(conversations[i], blocks, rng))
    return out


def scans(
    seed: int = 0,
    n_requests: int = 3000,
    hot: int = 8,
    prompt_blocks: tuple[int, int] = (4, 20),
    scan_prob: float = 0.3,
    scan_blocks: tuple[int, int] = (100, 400),
) -> list[TraceRequest]:
    """A few hot conversations, each request adding a block to one, interleaved with one-off scans."""
    rng, blocks = random.Random(seed), _Blocks()
    conversations = [blocks.new(rng.randint(*prompt_blocks)) for _ in range(hot)]
    out: list[TraceRequest] = []
    while len(out) < n_requests:
        if rng.random() < scan_prob:
            out.append(_request(blocks.new(rng.randint(*scan_blocks)), blocks, rng))
            continue
        i = rng.randrange(hot)
        conversations[i] = conversations[i] + blocks.new(1)
        out.append(_request(conversations[i], blocks, rng))
    return out


def zipf(
    seed: int = 0,
    n_requests: int = 4000,
    catalogue: int = 500,
    exponent: float = 1.0,
    prefix_blocks: tuple[int, int] = (4, 40),
    tail_blocks: tuple[int, int] = (0, 4),
) -> list[TraceRequest]:
    """Prompts drawn by Zipf popularity from a catalogue of prefixes, each request adding a fresh tail."""
    rng, blocks = random.Random(seed), _Blocks()
    prefixes = [blocks.new(rng.randint(*prefix_blocks)) for _ in range(catalogue)]
    weights = [1 / (i + 1) ** exponent for i in range(catalogue)]
    picks = rng.choices(range(catalogue), weights, k=n_requests)
    return [_request(prefixes[i] + blocks.new(rng.randint(*tail_blocks)), blocks, rng) for i in picks]


def revisits(
    seed: int = 0,
    n_requests: int = 4000,
    hot: int = 12,
    hot_prob: float = 0.5,
    prompt_blocks: tuple[int, int] = (10, 40),
    soon_prob: float = 0.5,
    gap: tuple[int, int] = (50, 300),
) -> list[TraceRequest]:
    """Each request is a popular prompt (Zipf over ``hot``, probability ``hot_prob``), a one-off prompt's
    return, or a new one-off prompt: it comes back once ``gap`` requests later and, with ``soon_prob``,
    also 1-3 requests later. Every request ends in a fresh partial block."""
    rng, blocks = random.Random(seed), _Blocks()
    popular = [blocks.new(rng.randint(*prompt_blocks)) for _ in range(hot)]
    weights = [1 / (i + 1) for i in range(hot)]
    returns: dict[int, list[int]] = {}  # request number -> the one-off prompt it repeats
    out: list[TraceRequest] = []
    for i in range(n_requests):
        if i in returns:
            prompt = returns.pop(i)
        elif rng.random() < hot_prob:
            prompt = rng.choices(popular, weights)[0]
        else:
            prompt = blocks.new(rng.randint(*prompt_blocks))
            returns.setdefault(i + rng.randint(*gap), prompt)
            if rng.random() < soon_prob:
                returns.setdefault(i + rng.randint(1, 3), prompt)
        out.append(_request(prompt, blocks, rng))
    return out


def mooncake_window(seed: int = 0, name: str = MOONCAKE[0], share: float = 0.33) -> list[TraceRequest]:
    """A contiguous window of a Mooncake trace (share of its length), starting at a random request."""
    requests = _mooncake(name)
    n = max(1, int(len(requests) * share))
    start = random.Random(seed).randrange(len(requests) - n + 1)
    return requests[start : start + n]


_LOADED: dict[str, list[TraceRequest]] = {}


def _mooncake(name: str) -> list[TraceRequest]:
    if name not in _LOADED:
        _LOADED[name] = load_trace(TRACES_DIR / f"{name}.jsonl")
    return _LOADED[name]


def mooncake_present() -> bool:
    return all((TRACES_DIR / f"{name}.jsonl").is_file() for name in MOONCAKE)


# --- the families: each draws its generator's parameters from ranges around the shapes above ---


@dataclass(frozen=True)
class Drawn:
    """One drawn trace: its family, seed and parameters (enough to draw it again)."""

    family: str
    seed: int
    params: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.family}#{self.seed}({args})"

    def requests(self) -> list[TraceRequest]:
        return GENERATORS[self.family](self.seed, **self.params)


def _forest_params(rng: random.Random) -> dict:
    return dict(
        n_requests=rng.choice((3000, 6000)),
        n_systems=rng.randint(2, 12),
        live=rng.choice((10, 20, 30, 50, 80, 120, 200)),
        continue_prob=round(rng.uniform(0.45, 0.75), 2),
        turn_blocks=rng.choice(((1, 3), (1, 3), (1, 2), (2, 4))),
        continue_partial=rng.random() < 0.75,
    )


def _conversations_params(rng: random.Random) -> dict:
    if rng.random() < 0.5:
        return dict(
            kind="forest",
            n_requests=rng.choice((2000, 4000)),
            active=rng.choice((8, 16, 40, 100, 200)),
            mean_turns=rng.choice((6, 10, 25, 40)),
            fork_prob=round(rng.uniform(0.0, 0.4), 2),
            zipf=rng.choice((0.0, 0.0, 1.0)),
        )
    return dict(
        kind="recency",
        n_requests=rng.choice((2000, 4000)),
        new_prob=round(rng.uniform(0.05, 0.25), 2),
        stay_prob=round(rng.uniform(0.5, 0.9), 2),
        fork_prob=round(rng.uniform(0.0, 0.4), 2),
    )


def _conversations(seed: int, kind: str, **params) -> list[TraceRequest]:
    return (conversation_forest if kind == "forest" else recency_forest)(seed, **params)


def _agent_params(rng: random.Random) -> dict:
    return dict(
        n_requests=rng.choice((1500, 3000)),
        n_prompts=rng.randint(1, 12),
        prompt_blocks=rng.choice(((5, 20), (20, 60), (40, 120))),
        active=rng.choice((4, 8, 24, 64)),
        turn_blocks=rng.choice(((1, 3), (1, 6), (1, 8))),
        mean_turns=rng.choice((8, 15, 40)),
        scan_prob=rng.choice((0.0, 0.15, 0.3, 0.6)),
        scan_blocks=rng.choice(((10, 50), (50, 250))),
        prompt_lifetime=rng.choice((0, 0, 400, 1000)),
    )


def _scan_params(rng: random.Random) -> dict:
    return dict(
        n_requests=rng.choice((1000, 2000)),
        hot=rng.choice((2, 8, 32, 100)),
        prompt_blocks=rng.choice(((4, 20), (20, 80))),
        scan_prob=rng.choice((0.1, 0.3, 0.6)),
        scan_blocks=rng.choice(((20, 100), (50, 300))),
    )


def _zipf_params(rng: random.Random) -> dict:
    return dict(
        n_requests=rng.choice((2000, 4000)),
        catalogue=rng.choice((100, 500, 2000)),
        exponent=rng.choice((0.6, 0.8, 1.0, 1.2)),
        prefix_blocks=rng.choice(((4, 40), (10, 80))),
        tail_blocks=rng.choice(((0, 2), (0, 8))),
    )


def _revisits_params(rng: random.Random) -> dict:
    return dict(
        n_requests=rng.choice((3000, 6000)),
        hot=rng.choice((4, 12, 40)),
        hot_prob=round(rng.uniform(0.2, 0.6), 2),
        prompt_blocks=rng.choice(((5, 20), (10, 40), (20, 80))),
        soon_prob=rng.choice((0.0, 0.3, 0.6)),
        gap=rng.choice(((20, 100), (50, 300), (200, 800))),
    )


def _mooncake_params(rng: random.Random) -> dict:
    return dict(name=rng.choice(MOONCAKE), share=rng.choice((0.25, 0.33, 0.5)))


# --- wide ranges: the shapes of the agent traffic (forests, conversations, agent sessions) with parameters
# beyond the ranges above, which the default policy's constants were measured on: a few or hundreds of live
# conversations, shared prompts of one to 300 blocks, turns of one to 16 blocks, continuations from 1 in 5 to
# 19 in 20, sessions of one to 128 agents. A check that the property holds past the draw it was tuned on.


def _wide_forest_params(rng: random.Random) -> dict:
    return dict(
        n_requests=rng.choice((2000, 3000, 6000, 6000, 10000)),
        n_systems=rng.randint(1, 20),
        system_blocks=rng.choice(((1, 4), (1, 1), (4, 16), (8, 32))),
        live=rng.choice((3, 5, 10, 50, 120, 300, 500)),
        continue_prob=round(rng.uniform(0.2, 0.95), 2),
        turn_blocks=rng.choice(((1, 1), (1, 3), (2, 6), (4, 10))),
        continue_partial=rng.random() < 0.6,
    )


def _wide_conversations_params(rng: random.Random) -> dict:
    common = dict(
        n_requests=rng.choice((1000, 3000, 6000)),
        root_blocks=rng.choice((1, 2, 8, 24)),
        turn_blocks=rng.choice(((1, 1), (1, 4), (3, 10))),
        fork_prob=round(rng.uniform(0.0, 0.7), 2),
    )
    if rng.random() < 0.5:
        return dict(
            kind="forest",
            **common,
            active=rng.choice((3, 8, 40, 300, 600)),
            mean_turns=rng.choice((3, 10, 60, 120)),
            zipf=rng.choice((0.0, 0.5, 1.0, 1.5)),
        )
    return dict(
        kind="recency",
        **common,
        new_prob=round(rng.uniform(0.02, 0.5), 2),
        stay_prob=round(rng.uniform(0.3, 0.97), 2),
        keep=rng.choice((50, 400, 2000)),
    )


def _wide_agent_params(rng: random.Random) -> dict:
    return dict(
        n_requests=rng.choice((1000, 3000, 5000)),
        n_prompts=rng.randint(1, 30),
        prompt_blocks=rng.choice(((2, 8), (5, 20), (40, 120), (100, 300))),
        active=rng.choice((1, 2, 16, 128)),
        turn_blocks=rng.choice(((1, 2), (1, 8), (4, 16))),
        mean_turns=rng.choice((4, 15, 80, 200)),
        scan_prob=rng.choice((0.0, 0.05, 0.3, 0.8)),
        scan_blocks=rng.choice(((5, 20), (50, 250), (100, 300))),
        prompt_lifetime=rng.choice((0, 100, 400, 3000)),
    )


GENERATORS: dict[str, Callable[..., list[TraceRequest]]] = {
    "forest": forest,
    "conversations": _conversations,
    "agent": agent_sessions,
    "scan": scans,
    "zipf": zipf,
    "revisits": revisits,
    "mooncake": mooncake_window,
}
PARAMS: dict[str, Callable[[random.Random], dict]] = {
    "forest": _forest_params,
    "conversations": _conversations_params,
    "agent": _agent_params,
    "scan": _scan_params,
    "zipf": _zipf_params,
    "revisits": _revisits_params,
    "mooncake": _mooncake_params,
}
FAMILIES = tuple(GENERATORS)
WIDE_PARAMS: dict[str, Callable[[random.Random], dict]] = {
    "forest": _wide_forest_params,
    "conversations": _wide_conversations_params,
    "agent": _wide_agent_params,
}


def draw(family: str, seed: int, wide: bool = False) -> Drawn:
    """The trace of `family` that `seed` picks: its parameters are drawn from the same seed (from the wide
    ranges with ``wide``)."""
    if wide:
        return Drawn(family, seed, WIDE_PARAMS[family](random.Random(f"wide-{family}-{seed}")))
    return Drawn(family, seed, PARAMS[family](random.Random(f"{family}-{seed}")))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", choices=FAMILIES)
    p.add_argument("seed", type=int)
    p.add_argument("out", type=Path)
    p.add_argument("--params", type=json.loads, help="JSON object: these parameters instead of drawn ones")
    p.add_argument("--wide", action="store_true", help="draw the parameters from the wide ranges")
    args = p.parse_args(argv)
    if args.params is not None:
        drawn = Drawn(args.family, args.seed, args.params)
    else:
        drawn = draw(args.family, args.seed, args.wide)
    write_trace(drawn.requests(), args.out)
    print(drawn.name)


if __name__ == "__main__":
    main()
