"""Prometheus metrics, in a registry of the app's own.

Request-level series (counts, latencies, tokens) are recorded by the server; the engine's counters and
gauges are read from the engine's `replica_stats()` at scrape time by a custom collector: unlabelled for
one local engine, one series per model (label `model`) when several are served, one per replica (label
`replica`) behind the Ray Serve router.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from minivllm.outputs import EngineStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

# (metric name, help, EngineStats attribute)
_GAUGES = (
    ("minivllm_num_requests_running", "Requests running in the engine", "running"),
    ("minivllm_num_requests_waiting", "Requests waiting for admission", "waiting"),
    ("minivllm_pages_total", "KV pages in the pool", "pages_total"),
    ("minivllm_pages_free", "KV pages free", "pages_free"),
    ("minivllm_pages_cached", "KV pages cached (published, unreferenced)", "pages_cached"),
    ("minivllm_pages_in_use", "KV pages referenced by requests", "pages_in_use"),
    (
        "minivllm_pages_pinned",
        "KV pages pinned (cache_control, /v1/cache/pin): never evicted",
        "pages_pinned",
    ),
    ("minivllm_pins", "Pins held (each a prompt prefix, until its TTL)", "pins"),
    ("minivllm_kv_disk_pages", "KV pages on the disk tier", "kv_disk_pages"),
    ("minivllm_kv_disk_bytes", "Bytes the disk tier's page files occupy", "kv_disk_bytes"),
    ("minivllm_kv_disk_capacity_bytes", "The disk tier's budget in bytes", "kv_disk_capacity_bytes"),
    ("minivllm_state_snapshots", "Recurrent-state snapshots kept in RAM (hybrid models)", "state_snapshots"),
    (
        "minivllm_state_snapshot_bytes",
        "Bytes the recurrent-state snapshots take in RAM",
        "state_snapshot_bytes",
    ),
)
_COUNTERS = (
    ("minivllm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_query_tokens"),
    ("minivllm_computed_prompt_tokens", "Prompt tokens run through the model", "computed_prompt_tokens"),
    ("minivllm_pages_published", "KV pages published to the prefix cache", "pages_published"),
    ("minivllm_kv_disk_reads", "KV pages read back from the disk tier", "kv_disk_pages_read"),
    ("minivllm_kv_disk_writes", "KV pages written to the disk tier", "kv_disk_pages_written"),
    ("minivllm_kv_disk_evictions", "KV pages the disk tier deleted for room", "kv_disk_pages_evicted"),
    ("minivllm_kv_disk_read_bytes", "Bytes of KV read back from the disk tier", "kv_disk_bytes_read"),
    ("minivllm_kv_disk_written_bytes", "Bytes of KV written to the disk tier", "kv_disk_bytes_written"),
    (
        "minivllm_kv_disk_rejected_files",
        "Disk tier files deleted unserved: another model or layout, truncated, corrupt, leftovers",
        "kv_disk_pages_rejected",
    ),
    (
        "minivllm_kv_disk_write_errors",
        "KV pages the disk tier failed to write (a full disk, an I/O error)",
        "kv_disk_write_errors",
    ),
    (
        "minivllm_kv_disk_writes_dropped",
        "KV pages not written because the disk tier's write queue was full",
        "kv_disk_writes_dropped",
    ),
    ("minivllm_pages_evicted", "Cached KV pages evicted", "pages_evicted"),
    (
        "minivllm_state_snapshots_restored",
        "Restores that resumed a hybrid model's recurrent state from a snapshot",
        "state_snapshots_restored",
    ),
    (
        "minivllm_pages_unreachable",
        "Cached KV pages freed because a page of their prefix was evicted (0 under a prefix-aware policy)",
        "pages_unreachable",
    ),
    ("minivllm_pins_made", "Prompt prefixes pinned", "pins_made"),
    (
        "minivllm_pins_refreshed",
        "Pins refreshed by a hit on their whole prefix or a pin of it",
        "pins_refreshed",
    ),
    ("minivllm_pins_expired", "Pins released at the end of their TTL", "pins_expired"),
    (
        "minivllm_pins_given_way",
        "Pins released before their TTL to make room for newer ones (pins hold at most half the pool)",
        "pins_given_way",
    ),
    ("minivllm_preemptions", "Requests preempted for lack of pages", "preemptions"),
    (
        "minivllm_single_flight_prefix_waiters",
        "Requests that waited for shared prompt pages another request's prefill was computing (prefix flights)",
        "prefix_waiters",
    ),
    ("minivllm_engine_steps", "Engine steps", "steps"),
    (
        "minivllm_replica_stats_reports",
        "Engine stats reports received from the replica (replicas only)",
        "stats_reports",
    ),
    (
        "minivllm_engine_steps_ahead",
        "Engine steps built and queued while the previous step still ran (overlap)",
        "steps_ahead",
    ),
    (
        "minivllm_spec_draft_tokens",
        "Tokens drafted by speculative decoding and verified",
        "spec_draft_tokens",
    ),
    ("minivllm_spec_accepted_tokens", "Drafted tokens accepted", "spec_accepted_tokens"),
    ("minivllm_grammar_masks", "Token masks computed for structured output", "grammar_masks"),
    (
        "minivllm_grammar_mask_seconds",
        "Host seconds computing token masks and advancing grammars",
        "grammar_mask_seconds",
    ),
    ("minivllm_single_flight_flights_opened", "Single-flight flights opened", "flights_opened"),
    (
        "minivllm_single_flight_followers_coalesced",
        "Requests that waited for a leader's prefix",
        "followers_coalesced",
    ),
    (
        "minivllm_single_flight_leader_handovers",
        "Flights handed to a follower when their leader was preempted or ended early",
        "leader_handovers",
    ),
    (
        "minivllm_single_flight_follower_wait_seconds",
        "Seconds followers waited for leaders",
        "follower_wait_seconds",
    ),
)


# (metric name, help, label, {label value: EngineStats attribute}): counters split by a label; their sum over
# it is the unsplit total (sum(minivllm_prefix_cache_hits_total) is every prefix-cache hit)
_SPLIT_COUNTERS = (
    (
        "minivllm_prefix_cache_hits",
        "Prompt tokens restored from the prefix cache, by the tier they came from",
        "tier",
        {"ram": "prefix_hit_tokens_ram", "disk": "prefix_hit_tokens_disk"},
    ),
)


class _EngineCollector:
    def __init__(self):
        self.engines: dict = {}  # served model id -> engine, bound when the engines have started
        self.shadows: dict = {}  # served model id -> its cache advice (minivllm.shadow), where it runs

    def collect(self):
        labels, rows = self._rows()
        for family, table in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for name, help_, attr in table:  # None (no disk tier, no single flight): 0
                if not labels:
                    yield family(name, help_, value=getattr(rows[0][1], attr) or 0)
                    continue
                metric = family(name, help_, labels=labels)
                for values, stats in rows:
                    metric.add_metric(values, getattr(stats, attr) or 0)
                yield metric
        for name, help_, label, attrs in _SPLIT_COUNTERS:
            metric = CounterMetricFamily(name, help_, labels=labels + [label])
            for values, stats in rows:
                for value, attr in attrs.items():
                    metric.add_metric(values + [value], getattr(stats, attr))
            yield metric
        yield _token_gaps(labels, rows)
        if any(shadow.rates for shadow in self.shadows.values()):
            several = len(self.engines) > 1
            metric = GaugeMetricFamily(
                "minivllm_cache_shadow_hit_rate",
                "Prompt-token hit rate of the recent requests replayed with this policy and pool size "
                "(times the pool's pages); belady-prefix is the best possible",
                labels=(["model"] if several else []) + ["policy", "pool_factor"],
            )
            for model, shadow in self.shadows.items():
                for rate in shadow.rates:
                    labels = [rate.policy, f"{rate.pool_factor:g}"]
                    metric.add_metric(([model] if several else []) + labels, rate.hit_rate)
            yield metric

    def _rows(self) -> tuple[list[str], list[tuple[list[str], EngineStats]]]:
        """The label names, and each engine's label values and stats: unlabelled for one local engine,
        `model` when several models are served, `replica` behind the Ray Serve router."""
        if not self.engines:
            return [], [([], EngineStats())]
        by_model = {model: engine.replica_stats() for model, engine in self.engines.items()}
        several, replicas = len(by_model) > 1, any(None not in stats for stats in by_model.values())
        labels = (["model"] if several else []) + (["replica"] if replicas else [])
        rows = [
            (([model] if several else []) + ([replica] if replicas else []), stats)
            for model, by_replica in by_model.items()
            for replica, stats in sorted(by_replica.items(), key=lambda item: item[0] or "")
        ]
        return labels, rows


def _token_gaps(labels: list[str], rows: list[tuple[list[str], EngineStats]]) -> HistogramMetricFamily:
    """The engines' inter-token gaps in steps (their cumulative bucket counts) as a Prometheus histogram."""
    metric = HistogramMetricFamily(
        "minivllm_inter_token_steps",
        "Engine steps between two tokens of a request (1: it got a token in every step)",
        labels=labels,
    )
    for values, stats in rows:
        buckets = [(floatToGoString(b), n) for b, n in stats.token_gap_buckets or [(float("inf"), 0)]]
        metric.add_metric(values, buckets, stats.token_gap_steps)
    return metric


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("minivllm_http_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.ttft = Histogram(
            "minivllm_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "minivllm_e2e_request_latency_seconds",
            "Request latency, arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "minivllm_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.completion_tokens = Counter("minivllm_generation_tokens", "Tokens generated", registry=r)
        self._engine = _EngineCollector()
        r.register(self._engine)

    def bind_engines(self, engines: dict, shadows: dict | None = None) -> None:
        """The engine of each served model id, and the cache advice of those that have one."""
        self._engine.engines = engines
        self._engine.shadows = shadows or {}

    def render(self) -> bytes:
        return generate_latest(self.registry)
