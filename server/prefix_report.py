"""Why a prompt restored what it did from the prefix cache: every response's `x-minivllm-prefix-cache`
header, a line in the log (info), and the last requests' reports for GET /v1/cache/explain.

The engine says how many prompt tokens a request restored and, when that was less than it could (all whole
pages but the one holding the last token), where the chain of cached pages stopped: the first token of the
first page it did not find, and whether the cache had held that page and evicted it lately ("evicted") or
never ("new": the prompt differs there from every cached one, or the page was given up long ago). The
server adds the message that token belongs to (for chat-shaped requests): the place to look for the
volatile header or reordered tool list that broke the cache.
"""

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field

from server.generation import Generation

logger = logging.getLogger(__name__)
HEADER = "x-minivllm-prefix-cache"
EXPLAINED = 64  # reports kept for GET /v1/cache/explain

# the index of the message holding a prompt token (of the request's only prompt), or None
MessageLocator = Callable[[int], Awaitable[int | None]]


@dataclass
class PrefixReport:
    request_id: str
    endpoint: str
    time: float  # Unix time of the report
    prompt_tokens: int
    restored_tokens: int
    miss: str | None = None  # None: restored all it could; else "evicted", "new", "no_state" or "off"
    miss_token: int | None = None  # the first token of the first page not restored
    miss_message: int | None = None  # the message holding it (chat-shaped requests)
    ttft_s: float | None = None  # from the request's arrival to its first output (every choice's)
    domain: str | None = field(default=None, repr=False)  # the API key's cache domain: who may read it

    def header(self) -> str:
        parts = [f"restored={self.restored_tokens}", f"prompt={self.prompt_tokens}"]
        if self.miss is not None:
            parts += [f"miss={self.miss}", f"token={self.miss_token}"]
            if self.miss_message is not None:
                parts.append(f"message={self.miss_message}")
        return "; ".join(parts)

    def as_dict(self) -> dict:
        out = asdict(self)
        del out["domain"]
        return out


async def reports(gen: Generation, endpoint: str, locate: MessageLocator | None) -> list[PrefixReport]:
    """One report per prompt of a started generation (from its first choice's first output)."""
    out = []
    for c in gen.choices:
        if not c.first_of_prompt or c.last is None:
            continue
        first, miss = c.last, c.last.prefix_miss
        report = PrefixReport(
            c.request_id, endpoint, time.time(), first.num_prompt_tokens, first.num_cached_tokens
        )
        report.ttft_s = round(time.monotonic() - gen.arrival, 3)
        if miss is not None:
            report.miss, report.miss_token = miss.reason, miss.token
            if locate is not None and miss.reason != "off":
                report.miss_message = await locate(miss.token)
        out.append(report)
    return out


def header_value(found: list[PrefixReport]) -> str:
    """The header: one report per prompt, comma-separated."""
    return ", ".join(r.header() for r in found)


def log(found: list[PrefixReport]) -> None:
    for r in found:
        logger.info("prefix cache %s %s: %s", r.endpoint, r.request_id, r.header())
