"""Synthetic prefix-cache traces that stress an eviction policy where LRU or S3FIFO are strong.

Each generator returns replay requests (chained block hashes, 512-token blocks) like the Mooncake traces:
a request's last block is partial and new (its content differs from whatever continues it later).

- agent_sessions: coding agents sharing a few long system prompts, each session growing turn by turn
  (tool outputs appended), interleaved with one-off long document scans under the same prompts.
- rotating_prompts: the same, but system prompts are retired and replaced over time (popularity shifts,
  where frequency-based policies hold on to the past).
- conversation_forest: recency-heavy chat: a small set of active conversations growing turn by turn
  from a shared root, some forking from an earlier turn (edits, regenerations), ending and replaced.
- recency_forest: conversations picked by how recently they were active (a user keeps talking to the
  conversation they just used, and comes back to older ones ever more rarely), where LRU is strong.
- windows: contiguous slices of a real trace.

    python -m benchmarks.adversarial_traces OUT_DIR   # writes every trace of SUITE as JSON lines
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

from minivllm.replay import TraceRequest

BLOCK = 512


class _Blocks:
    """Fresh block hashes."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def new(self, n: int) -> list[int]:
        return [next(self._next) for _ in range(n)]


def _request(full_blocks: list[int], blocks: _Blocks, rng: random.Random) -> TraceRequest:
    """A request over full_blocks plus a fresh partial last block."""
    return TraceRequest(
        full_blocks + blocks.new(1), (len(full_blocks) + 1) * BLOCK - rng.randint(1, BLOCK - 1)
    )


def agent_sessions(
    seed: int = 0,
    n_requests: int = 2000,
    n_prompts: int = 3,
    prompt_blocks: tuple[int, int] = (20, 60),
    active: int = 8,
    turn_blocks: tuple[int, int] = (1, 6),
    mean_turns: float = 15,
    scan_prob: float = 0.3,
    scan_blocks: tuple[int, int] = (50, 250),
    prompt_lifetime: int = 0,
) -> list[TraceRequest]:
    """Agent sessions on shared system prompts plus one-off scans; prompt_lifetime > 0 retires one prompt
    every prompt_lifetime / n_prompts requests."""
    rng, blocks = random.Random(seed), _Blocks()
    prompts = [blocks.new(rng.randint(*prompt_blocks)) for _ in range(n_prompts)]
    sessions = [list(rng.choice(prompts)) for _ in range(active)]
    out: list[TraceRequest] = []
    while len(out) < n_requests:
        if prompt_lifetime and out and len(out) % max(1, prompt_lifetime // n_prompts) == 0:
            prompts[rng.randrange(n_prompts)] = blocks.new(rng.randint(*prompt_blocks))
        if rng.random() < scan_prob:
            out.append(_request(rng.choice(prompts) + blocks.new(rng.randint(*scan_blocks)), blocks, rng))
            continue
        i = rng.randrange(active)
        sessions[i] += blocks.new(rng.randint(*turn_blocks))
        out.append(_request(sessions[i], blocks, rng))
        if rng.random() < 1 / mean_turns:
            sessions[i] = list(rng.choice(prompts))
    return out


def rotating_prompts(seed: int = 0, prompt_lifetime: int = 600, **kw) -> list[TraceRequest]:
    return agent_sessions(seed, prompt_lifetime=prompt_lifetime, **kw)


def conversation_forest(
    seed: int = 0,
    n_requests: int = 2000,
    root_blocks: int = 2,
    active: int = 16,
    turn_blocks: tuple[int, int] = (1, 4),
    mean_turns: float = 25,
    fork_prob: float = 0.1,
    zipf: float = 0.0,
) -> list[TraceRequest]:
    """Active conversations (chosen uniformly, or Zipf-skewed) growing turn by turn; an ending one is
    replaced by a new conversation or, with fork_prob, by a fork of a recent turn."""
    rng, blocks = random.Random(seed), _Blocks()
    root = blocks.new(root_blocks)
    conversations = [list(root) for _ in range(active)]
    recent_turns: list[list[int]] = []
    weights = [1 / (i + 1) ** zipf for i in range(active)]
    out: list[TraceRequest] = []
    while len(out) < n_requests:
        i = rng.choices(range(active), weights)[0]
        conversations[i] += blocks.new(rng.randint(*turn_blocks))
        recent_turns = (recent_turns + [list(conversations[i])])[-200:]
        out.append(_request(conversations[i], blocks, rng))
        if rng.random() < 1 / mean_turns:
            if rng.random() < fork_prob:
                turn = rng.choice(recent_turns)
                conversations[i] = turn[: rng.randint(len(root), len(turn))]
            else:
                conversations[i] = list(root)
    return out


def recency_forest(
    seed: int = 0,
    n_requests: int = 4000,
    root_blocks: int = 2,
    new_prob: float = 0.15,
    stay_prob: float = 0.7,
    turn_blocks: tuple[int, int] = (1, 4),
    fork_prob: float = 0.2,
    keep: int = 400,
) -> list[TraceRequest]:
    """Conversations in a recency stack: with new_prob a new one starts (a fork of a recent turn with
    fork_prob), else the one at stack depth d continues, d geometric (each step down taken with
    stay_prob); the `keep` most recent conversations can come back."""
    rng, blocks = random.Random(seed), _Blocks()
    root = blocks.new(root_blocks)
    stack: list[list[int]] = []  # most recently active first
    out: list[TraceRequest] = []
    while len(out) < n_requests:
        if not stack or rng.random() < new_prob:
            conversation = list(root)
            if stack and rng.random() < fork_prob:
                turn = rng.choice(stack[:20])
                conversation = turn[: rng.randint(len(root), len(turn))]
        else:
            depth = 0
            while depth < len(stack) - 1 and rng.random() < stay_prob:
                depth += 1
            conversation = stack.pop(depth)
        conversation = conversation + blocks.new(rng.randint(*turn_blocks))
        stack = [conversation] + stack[: keep - 1]
        out.append(_request(conversation, blocks, rng))
    return out


def windows(requests: Sequence[TraceRequest], parts: int = 4) -> list[list[TraceRequest]]:
    """The trace cut in `parts` contiguous slices."""
    n = len(requests)
    return [list(requests[i * n // parts : (i + 1) * n // parts]) for i in range(parts)]


# The suite the robustness benchmark replays: name -> generator (each a few hundred thousand block accesses).
SUITE: dict[str, Callable[[], list[TraceRequest]]] = {
    "agent-3prompts": lambda: agent_sessions(0),
    "agent-6prompts-24sessions": lambda: agent_sessions(1, n_prompts=6, active=24, scan_prob=0.5),
    "agent-1prompt-few-scans": lambda: agent_sessions(
        2, n_prompts=1, active=4, scan_prob=0.15, prompt_blocks=(40, 80)
    ),
    "agent-rotating-3prompts": lambda: rotating_prompts(3),
    "agent-rotating-8prompts": lambda: rotating_prompts(
        4, n_prompts=8, prompt_lifetime=400, active=32, prompt_blocks=(40, 120)
    ),
    "agent-rotating-scan-heavy": lambda: rotating_prompts(
        5, n_prompts=2, prompt_lifetime=1000, active=4, scan_prob=0.6
    ),
    "forest-16": lambda: conversation_forest(6, n_requests=5000),
    "forest-64-long": lambda: conversation_forest(7, n_requests=5000, active=64, mean_turns=40),
    "forest-8-zipf": lambda: conversation_forest(8, n_requests=5000, active=8, mean_turns=10, zipf=1.0),
    "forest-200-short": lambda: conversation_forest(
        9, n_requests=5000, active=200, mean_turns=8, turn_blocks=(2, 8)
    ),
    "forest-400-forky": lambda: conversation_forest(
        10, n_requests=8000, active=400, mean_turns=6, turn_blocks=(1, 6), fork_prob=0.4
    ),
    "recency-forest": lambda: recency_forest(11),
    "recency-forest-sticky": lambda: recency_forest(
        12, new_prob=0.1, stay_prob=0.9, turn_blocks=(1, 6), fork_prob=0.4
    ),
    "agent-12prompts-64sessions": lambda: agent_sessions(
        13,
        n_requests=3000,
        n_prompts=12,
        prompt_blocks=(40, 120),
        active=64,
        turn_blocks=(1, 8),
        scan_prob=0.0,
    ),
    "agent-4prompts-long-sessions": lambda: agent_sessions(
        14,
        n_requests=3000,
        n_prompts=4,
        prompt_blocks=(40, 120),
        active=20,
        turn_blocks=(1, 8),
        mean_turns=40,
        scan_prob=0.1,
    ),
}


def write_trace(requests: Sequence[TraceRequest], path: Path) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"input_length": r.input_length, "hash_ids": r.hash_ids}) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    args = p.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, make in SUITE.items():
        write_trace(make(), args.out_dir / f"{name}.jsonl")


if __name__ == "__main__":
    main()
