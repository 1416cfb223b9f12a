"""Engine settings, validated once."""

import os
from dataclasses import dataclass
from enum import Enum


class StrEnum(str, Enum):
    """Python 3.11's enum.StrEnum, for 3.10: a member is its value as a str (str(), f-strings, JSON), so
    settings, logs and responses see the plain name, and comparisons with the name hold."""

    __str__ = str.__str__
    __format__ = str.__format__


# Each choice is one enum, the one list of its names.
class Eviction(StrEnum):
    """The prefix cache's eviction policies (minivllm.cache.eviction.POLICIES is this list)."""

    ADAPTIVE = "adaptive"
    S3FIFO = "s3fifo"
    LRU = "lru"
    FIFO = "fifo"


class Publication(StrEnum):
    """When a request's full KV pages become reusable: after every step, or when it ends."""

    INCREMENTAL = "incremental"
    COMPLETION = "completion"


class SingleFlight(StrEnum):
    """Requests that share a prompt (prefix) wait for one computation of it (minivllm.engine.single_flight)."""

    OFF = "off"
    AT_COMPLETION = "at_completion"
    AFTER_PREFILL = "after_prefill"


class Speculative(StrEnum):
    OFF = "off"
    NGRAM = "ngram"


# the names as plain strings, for settings and messages
EVICTION_POLICIES = tuple(m.value for m in Eviction)
DEFAULT_EVICTION = Eviction.ADAPTIVE
PUBLICATION_MODES = tuple(m.value for m in Publication)
SINGLE_FLIGHT_MODES = tuple(m.value for m in SingleFlight)
SPECULATIVE_MODES = tuple(m.value for m in Speculative)
CPU_WEIGHT_LAYOUTS = ("auto", "transposed", "native")  # minivllm.models.cpu_layout.LAYOUTS
CPU_ATTENTION_MODES = ("compiled", "mlx")  # kernels.cpu_attention, or MLX ops only
CPU_MATMUL_MODES = ("compiled", "mlx")  # kernels.cpu_quantized_matmul for decode, or float32 weights only


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
    eviction: Eviction = DEFAULT_EVICTION  # a name (str) is taken too, and converted
    publication: Publication = Publication.INCREMENTAL
    single_flight: SingleFlight = SingleFlight.AFTER_PREFILL
    # build and queue step n+1 while step n runs, when its tokens are not needed first. None: on a GPU backend,
    # and on a CPU for small models, whose step is mostly host work (llm_engine.OVERLAP_CPU_MAX_WEIGHT_BYTES)
    overlap: bool | None = None
    # CPU backend: float32 weight matrices as nn.Linear keeps them ([out, in]), transposed ([in, out]), or
    # each shape in the layout measured faster on this machine (minivllm.models.cpu_layout)
    cpu_weight_layout: str = "auto"
    # CPU backend: attention with many scores (long contexts) in kernels/cpu_attention.cpp, built on this
    # machine at load ("compiled"; MLX ops where it cannot be built), or always with MLX ops ("mlx")
    cpu_attention: str = "compiled"
    # CPU backend: decode-sized products with a quantized checkpoint's weights read its levels (one byte a
    # weight) in kernels/cpu_quantized_matmul.cpp, built on this machine at load ("compiled"; the float32
    # copy where it cannot be built), or always the float32 copy ("mlx")
    cpu_matmul: str = "compiled"
    # speculative decoding: "ngram" drafts tokens by prompt lookup (minivllm.engine.ngram_draft) and
    # verifies them in the step; speculative_tokens: the most tokens drafted in one step, all requests'
    speculative: Speculative = Speculative.OFF
    speculative_tokens: int = 8
    # a second tier of the prefix cache on disk, persistent across restarts (minivllm.cache.disk_tier)
    kv_disk_dir: str | None = None  # None: no disk tier
    kv_disk_bytes: int | None = None  # None: 10% of the disk's free space, at most 20 GiB
    # the cache advice (minivllm.shadow) replays the page hashes of the last this many requests; 0: off
    shadow_requests: int = 2000
    # hybrid models (linear-attention layers with a recurrent state): the share of the KV budget their
    # state snapshots may take, and the tokens between the snapshots a long prompt or output keeps (a
    # multiple of page_size; prompts' ends keep one too: minivllm.cache.kv_manager). None: the tokens whose
    # KV takes as much memory as one snapshot (LLMEngine.snapshot_every)
    state_cache_fraction: float = 0.25
    state_snapshot_tokens: int | None = None

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
        self.eviction = _member(Eviction, self.eviction, "eviction")
        self.publication = _member(Publication, self.publication, "publication")
        self.single_flight = _member(SingleFlight, self.single_flight, "single_flight")
        self.speculative = _member(Speculative, self.speculative, "speculative")
        _check(
            self.cpu_weight_layout in CPU_WEIGHT_LAYOUTS,
            f"cpu_weight_layout must be one of {CPU_WEIGHT_LAYOUTS}",
        )
        _check(
            self.cpu_attention in CPU_ATTENTION_MODES, f"cpu_attention must be one of {CPU_ATTENTION_MODES}"
        )
        _check(self.cpu_matmul in CPU_MATMUL_MODES, f"cpu_matmul must be one of {CPU_MATMUL_MODES}")
        _check(self.speculative_tokens >= 1, "speculative_tokens must be >= 1")
        _check(self.kv_disk_bytes is None or self.kv_disk_bytes > 0, "kv_disk_bytes must be > 0")
        _check(self.shadow_requests >= 0, "shadow_requests must be >= 0")
        _check(0 < self.state_cache_fraction < 1, "state_cache_fraction must be in (0, 1)")
        _check(
            self.state_snapshot_tokens is None
            or (
                self.state_snapshot_tokens >= self.page_size
                and self.state_snapshot_tokens % self.page_size == 0
            ),
            "state_snapshot_tokens must be a multiple of page_size",
        )
        _check(
            self.kv_disk_dir is None or self.enable_prefix_caching,
            "kv_disk_dir is a tier of the prefix cache: it needs the prefix cache on",
        )
        _check(
            self.enable_prefix_caching or self.single_flight == SingleFlight.OFF,
            "single_flight needs the prefix cache (followers restore the leader's pages); set it to 'off'",
        )


def default_kv_cache_bytes(fraction: float) -> int:
    """The KV pool budget when kv_cache_bytes is unset: `fraction` of physical memory, at most 2 GiB."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(int(total * fraction), 2 << 30)


def _member(kind: type[StrEnum], value: str, name: str) -> StrEnum:
    """value as a member of kind (a member, or its name); a ValueError naming the setting if it is none."""
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {tuple(m.value for m in kind)}") from None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
