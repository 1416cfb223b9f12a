"""The free pages, and where in the pool a request's new pages go: consecutive to its others where possible.

Attention reads a request's context as runs of consecutive pages (kernels.paged_attention): one run is
one slice of the KV pool, a view; every further run costs more graph operations, and past a bound a copy.
So pages are placed to keep runs long:
  - a growing request takes the pages right after its last one while they are free;
  - otherwise (a new request, or its next page is taken) it starts a new run in the largest gap of free
    pages, placed so that the gap's room is split evenly before and after it: the room after is its
    own to grow into, the room before is left for the next request.
"""

from collections.abc import Iterator


class FreePages:
    def __init__(self, num_pages: int):
        self._free = set(range(num_pages))

    def __len__(self) -> int:
        return len(self._free)

    def __iter__(self) -> Iterator[int]:
        return iter(self._free)

    def __contains__(self, page: int) -> bool:
        return page in self._free

    def add(self, page: int) -> None:
        assert page not in self._free, f"page {page} freed twice"
        self._free.add(page)

    def take(self, n: int, after: int | None = None) -> list[int]:
        """n free pages, in order; `after`: the request's last page, which they should follow."""
        assert n <= len(self._free), f"{n} pages asked, {len(self._free)} free"
        pages: list[int] = []
        page = after + 1 if after is not None else -1
        while len(pages) < n and page in self._free:
            self._free.remove(page)
            pages.append(page)
            page += 1
        while len(pages) < n:
            start, length = self._largest_gap()
            need = n - len(pages)
            first = start + max(0, length - need) // 2
            run = range(first, first + min(need, length))
            self._free.difference_update(run)
            pages.extend(run)
        return pages

    def _largest_gap(self) -> tuple[int, int]:
        """(first page, length) of the longest run of free pages; the lowest one on ties."""
        best, start, prev = (0, 0), 0, None
        for page in sorted(self._free):
            if prev is None or page != prev + 1:
                start = page
            prev = page
            if page - start + 1 > best[1]:
                best = (start, page - start + 1)
        return best
