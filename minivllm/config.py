"""Engine settings, validated once."""

import os
from dataclasses import dataclass

EVICTION_POLICIES = ("adaptive", "s3fifo", "lru", "fifo")  # minivllm.cache.eviction.POLICIES
DEFAULT_EVICTION = "adaptive"
PUBLICATION_MODES = ("incremental", "completion")
SINGLE_FLIGHT_MODES = ("off", "at_completion", "after_prefill")
SPECULATIVE_MODES = ("off", "ngram")
CPU_WEIGHT_LAYOUTS = ("auto", "transposed", "native")  # minivllm.models.cpu_layout.LAYOUTS


@dataclass
class EngineConfig:
    model: str | None = None  # model dir, Hugging Face repo id, .gguf file; None = the offline default model
    page_size: int = 16
    kv_cache_bytes: int | None = None  # None: kv_cache_fraction of physical memory, at most 2 GiB
    kv_cache_fraction: float = 0.1
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512  # prefill chunk budget per step (decode tokens included)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_waiting: int = 256  # requests waiting beyond the free running slots; past it: QueueFull (HTTP 429)
    enable_prefix_caching: bool = True
    eviction: str = DEFAULT_EVICTION
    publication: str = "incremental"
    single_flight: str = "after_prefill"
    # build and queue step n+1 while step n runs, when its tokens are not needed first. None: on a GPU backend,
    # and on a CPU for small models, whose step is mostly host work (llm_engine.OVERLAP_CPU_MAX_WEIGHT_BYTES)
    overlap: bool | None = None
    # CPU backend: float32 weight matrices as nn.Linear keeps them ([out, in]), transposed ([in, out]), or
    # each shape in the layout measured faster on this machine (minivllm.models.cpu_layout)
    cpu_weight_layout: str = "native"
    # speculative decoding: "ngram" drafts tokens by prompt lookup (minivllm.engine.ngram_draft) and
    # verifies them in the step; speculative_tokens: the most tokens drafted in one step, all requests'
    speculative: str = "off"
    speculative_tokens: int = 8
    # a second tier of the prefix cache on disk, persistent across restarts (minivllm.cache.disk_tier)
    kv_disk_dir: str | None = None  # None: no disk tier
    kv_disk_bytes: int | None = None  # None: 10% of the disk's free space, at most 20 GiB
    # the cache advice (minivllm.shadow) replays the page hashes of the last this many requests; 0: off
    shadow_requests: int = 2000

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check(self.page_size >= 1, "page_size must be >= 1")
        _check(self.kv_cache_bytes is None or self.kv_cache_bytes > 0, "kv_cache_bytes must be > 0")
        _check(0 < self.kv_cache_fraction <= 0.9, "kv_cache_fraction must be in (0, 0.9]")
        _check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _check(
            self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens must be >= max_num_seqs"
        )
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
        _check(self.max_waiting >= 1, "max_waiting must be >= 1")
        _check(self.eviction in EVICTION_POLICIES, f"eviction must be one of {EVICTION_POLICIES}")
        _check(self.publication in PUBLICATION_MODES, f"publication must be one of {PUBLICATION_MODES}")
        _check(
            self.single_flight in SINGLE_FLIGHT_MODES, f"single_flight must be one of {SINGLE_FLIGHT_MODES}"
        )
        _check(
            self.cpu_weight_layout in CPU_WEIGHT_LAYOUTS,
            f"cpu_weight_layout must be one of {CPU_WEIGHT_LAYOUTS}",
        )
        _check(self.speculative in SPECULATIVE_MODES, f"speculative must be one of {SPECULATIVE_MODES}")
        _check(self.speculative_tokens >= 1, "speculative_tokens must be >= 1")
        _check(self.kv_disk_bytes is None or self.kv_disk_bytes > 0, "kv_disk_bytes must be > 0")
        _check(self.shadow_requests >= 0, "shadow_requests must be >= 0")
        _check(
            self.kv_disk_dir is None or self.enable_prefix_caching,
            "kv_disk_dir is a tier of the prefix cache: it needs the prefix cache on",
        )
        _check(
            self.enable_prefix_caching or self.single_flight == "off",
            "single_flight needs the prefix cache (followers restore the leader's pages); set it to 'off'",
        )


def default_kv_cache_bytes(fraction: float) -> int:
    """The KV pool budget when kv_cache_bytes is unset: `fraction` of physical memory, at most 2 GiB."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(int(total * fraction), 2 << 30)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
