"""Exact-input single flight: one prefill for identical simultaneous prompts.

The first request with a given input is the leader; identical requests that arrive while its flight is
open are followers and are not admitted. When the flight releases (leader's prefill published, or
leader finished, by policy) the flight is deleted; the followers then restore the leader's pages through
the ordinary prefix-cache lookup and each samples its own tokens.

Only state that still affects execution is kept: open flights (who waits for whom) and, separately,
the ids of released requests that have not terminated yet, so that a termination notice for an
id this coordinator never saw is still an error.
"""

import time
from collections import deque
from dataclasses import dataclass, field

from minivllm.config import SingleFlight
from minivllm.engine.sequence import Sequence
from minivllm.outputs import FinishReason


@dataclass
class Flight:
    key: tuple  # (cache salt, *prompt token ids)
    leader: Sequence
    followers: deque[Sequence] = field(default_factory=deque)
    opened_at: float = field(default_factory=time.monotonic)


@dataclass
class FlightCounters:
    flights_opened: int = 0
    followers_coalesced: int = 0
    leader_handovers: int = 0
    follower_wait_seconds: float = 0.0


class FlightCoordinator:
    def __init__(self, mode: SingleFlight):
        assert mode in (SingleFlight.AT_COMPLETION, SingleFlight.AFTER_PREFILL)
        self.mode = mode
        self.flights: dict[tuple[int, ...], Flight] = {}
        self.flight_of: dict[str, Flight] = {}  # request id -> its open flight
        self.released: set[str] = set()  # released, not yet terminated
        self.counters = FlightCounters()

    def join(self, seq: Sequence) -> None:
        key = (seq.cache.hints.salt, *seq.prompt_token_ids)  # a domain's followers restore its pages only
        flight = self.flights.get(key)
        if flight is None:
            flight = self.flights[key] = Flight(key, leader=seq)
            self.counters.flights_opened += 1
            seq.flight_role = "leader"
        else:
            flight.followers.append(seq)
            self.counters.followers_coalesced += 1
            seq.flight_role = "follower"
        self.flight_of[seq.request_id] = flight

    def is_waiting(self, seq: Sequence) -> bool:
        """A follower of an open flight must not be admitted."""
        flight = self.flight_of.get(seq.request_id)
        return flight is not None and flight.leader is not seq

    def is_open_leader(self, seq: Sequence) -> bool:
        flight = self.flight_of.get(seq.request_id)
        return flight is not None and flight.leader is seq

    def release(self, leader: Sequence) -> None:
        """The leader's pages are published: delete the flight, its followers become admissible."""
        flight = self.flight_of.get(leader.request_id)
        if flight is None or flight.leader is not leader:
            return
        del self.flight_of[leader.request_id]
        self.released.add(leader.request_id)
        self._close(flight)

    def hand_over(self, leader: Sequence) -> None:
        """The leader lost its KV before publishing (preempted): the oldest follower leads, the old
        leader waits behind it like any follower."""
        flight = self.flight_of.get(leader.request_id)
        if flight is None or flight.leader is not leader or not flight.followers:
            return
        self._promote(flight)
        flight.followers.append(leader)
        leader.flight_role = "follower"

    def terminate(self, seq: Sequence) -> None:
        """seq finished, was aborted or failed. Unknown ids are an error."""
        rid = seq.request_id
        if rid in self.released:
            self.released.discard(rid)
            return
        flight = self.flight_of.pop(rid, None)
        if flight is None:
            raise KeyError(f"single flight: unknown request id {rid!r}")
        if flight.leader is not seq:
            flight.followers.remove(seq)
            return
        if flight.followers and seq.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
            self._promote(flight)  # no follower may wait forever: the oldest computes the prompt itself
            return
        self._close(flight)  # the leader finished: its pages are published

    def _promote(self, flight: Flight) -> None:
        flight.leader = flight.followers.popleft()
        flight.leader.flight_role = "leader"
        self.counters.leader_handovers += 1

    def _close(self, flight: Flight) -> None:
        del self.flights[flight.key]
        now = time.monotonic()
        for follower in flight.followers:
            del self.flight_of[follower.request_id]
            self.released.add(follower.request_id)
            self.counters.follower_wait_seconds += now - follower.arrival_time
