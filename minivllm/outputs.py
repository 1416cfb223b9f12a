"""What the engine gives back: its public result types. The server and the entry points read a request's
outcome here, never in the engine's own modules.

It may import `minivllm.config` and `minivllm.cache` (the cache's own reports: why a restore stopped short,
what a pin got), nothing else of minivllm.
"""

from dataclasses import dataclass, field

from minivllm.cache.kv_request import PrefixMiss
from minivllm.cache.pins import PinInfo
from minivllm.config import StrEnum


class FinishReason(StrEnum):
    """Why a request ended (each is also its name as a str, as OpenAI's finish_reason spells it)."""

    STOP = "stop"  # an EOS or stop token, a stop string, or a complete grammar
    LENGTH = "length"  # max_tokens, the context's end, or a pool that could never hold it
    ABORT = "abort"  # the caller (or the server shutting down) ended it
    ERROR = "error"  # a fault in a step, or the request's own input (error_param names it)


class QueueFull(RuntimeError):
    """max_waiting requests already wait beyond the free running slots; retry later."""


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) of the most likely tokens


@dataclass
class RequestOutput:
    """What one step did for one request: the new tokens, and how it ended if it did."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    prefix_miss: PrefixMiss | None = None  # where and why that restore stopped short, if it did
    pins: list[PinInfo] = field(default_factory=list)  # what the request's pins got (its last output)
    num_computed_prompt_tokens: int = 0  # prompt tokens run through the model
    num_pages_published: int = 0
    num_published_prompt_tokens: int = 0  # prompt tokens in the pages it published: cache it created
    num_output_tokens: int = 0
    flight_role: str | None = None
    stop_token_id: int | None = None  # the EOS / stop token that ended the request, if one did
    error: str | None = None  # why it ended, when the finish reason alone does not say
    error_param: str | None = None  # an "error" the request's own input caused (its grammar): that parameter


@dataclass
class EngineStats:
    """The engine's counters and gauges at one moment (`LLMEngine.stats()`): what /metrics exports and
    /v1/cache/stats serves (its number fields, as `dataclasses.asdict` names them). The kv_disk fields are
    None without a disk tier, the single-flight ones without single flight; stats_reports is set by a
    cluster replica only."""

    running: int = 0
    waiting: int = 0
    pages_total: int = 0
    pages_free: int = 0
    pages_cached: int = 0
    pages_in_use: int = 0
    prefix_lookups: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_hit_tokens_ram: int = 0
    prefix_hit_tokens_disk: int = 0
    computed_prompt_tokens: int = 0
    preemptions: int = 0
    prefix_waiters: int = 0
    pages_published: int = 0
    pages_evicted: int = 0
    pages_unreachable: int = 0
    pages_restored: int = 0
    pages_from_disk: int = 0
    pages_pinned: int = 0
    pins: int = 0
    pins_made: int = 0
    pins_refreshed: int = 0
    pins_expired: int = 0
    pins_given_way: int = 0
    steps: int = 0
    steps_ahead: int = 0
    token_gap_buckets: list[tuple[float, int]] = field(default_factory=list)  # TokenGaps.cumulative()
    token_gap_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    grammar_masks: int = 0
    grammar_mask_seconds: float = 0.0
    # the disk tier's (DiskTier.stats())
    kv_disk_pages: int | None = None
    kv_disk_bytes: int | None = None
    kv_disk_capacity_bytes: int | None = None
    kv_disk_pages_written: int | None = None
    kv_disk_pages_read: int | None = None
    kv_disk_pages_evicted: int | None = None
    kv_disk_pages_rejected: int | None = None
    kv_disk_writes_dropped: int | None = None
    kv_disk_write_errors: int | None = None
    kv_disk_bytes_written: int | None = None
    kv_disk_bytes_read: int | None = None
    # a hybrid model's recurrent-state snapshots (minivllm.cache.state_snapshots), in RAM and on disk
    state_snapshots: int | None = None
    state_snapshot_bytes: int | None = None
    state_snapshot_capacity_bytes: int | None = None
    state_snapshots_kept: int | None = None
    state_snapshots_dropped: int | None = None
    state_snapshots_restored: int | None = None
    state_disk_snapshots: int | None = None
    # single flight's
    flights_opened: int | None = None
    followers_coalesced: int | None = None
    leader_handovers: int | None = None
    follower_wait_seconds: float | None = None
    stats_reports: int | None = None  # the reports a cluster replica has sent its router
