"""A request as the KV cache sees it: its tokens and hints, and the cache's state for it (page table,
cursors, what it restored, published and pinned). The engine holds one per request and reads it; only
the KV manager writes it (the scheduler's count of computed tokens aside: minivllm.engine.sequence)."""

from dataclasses import dataclass, field

from minivllm.cache.hints import CacheHints
from minivllm.cache.page_hash import extend_page_hashes, root_hash
from minivllm.cache.pins import PinInfo
from minivllm.config import StrEnum


class MissReason(StrEnum):
    EVICTED = "evicted"  # cached once and given up lately
    NEW = "new"  # never cached (or long ago)
    OFF = "off"  # the prefix cache is off
    NO_STATE = "no_state"  # a hybrid model's pages are cached, but no recurrent state at their end


@dataclass(frozen=True)
class PrefixMiss:
    """Why a prompt restored less than it could: the first page of it the cache did not hold."""

    token: int  # the first token that differs from the cached prompts (new), or the page's first (evicted)
    reason: MissReason


@dataclass(slots=True, eq=False)
class KVRequest:
    request_id: str
    token_ids: list[int]  # the request's own list (prompt + generated), shared: read here, never written
    num_prompt_tokens: int
    hints: CacheHints = field(default_factory=CacheHints)
    page_table: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full pages of token_ids
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    publish_cursor: int = 0  # pages of page_table already considered for publication
    num_pages_published: int = 0  # pages this request made reusable, over all admissions
    num_published_prompt_tokens: int = 0  # prompt tokens of those pages (whole pages within the prompt)
    admitted: bool = False  # once admitted, its restores are readmissions: prefix_miss stays the first's
    prefix_miss: PrefixMiss | None = (
        None  # why its first restore stopped short of the whole prompt, if it did
    )
    pins: list[PinInfo] = field(default_factory=list)  # what hints.pins got, once the request ended
    # a hybrid model's recurrent state at the end of the pages its admission restored (the engine's,
    # opaque here; minivllm.cache.state_snapshots), None when it restored none
    restored_state: object | None = None
    branch_pages: int = 0  # a hybrid model's: the pages of its prompt cached at admission, resumable or not

    def full_page_hashes(self, page_size: int) -> list[bytes]:
        if len(self.page_hashes) < len(self.token_ids) // page_size:
            extend_page_hashes(self.page_hashes, self.token_ids, page_size, root_hash(self.hints.salt))
        return self.page_hashes
