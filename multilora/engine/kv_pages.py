"""KV cache pages: a free list and per-sequence block tables. Plain Python, no jax.

Page 0 is reserved: padding tokens of a batch write their K/V there, so it is never handed out.
"""

from __future__ import annotations

RESERVED_PAGES = 1


class OutOfPagesError(RuntimeError):
    pass


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages <= RESERVED_PAGES:
            raise ValueError(f"num_pages must be > {RESERVED_PAGES}, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        # Pop from the end: low page ids go out first, which keeps dumps readable.
        self._free = list(range(num_pages - 1, RESERVED_PAGES - 1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def capacity(self) -> int:
        return self.num_pages - RESERVED_PAGES

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend block_table in place to hold num_tokens (raises before changing anything)."""
        need = self.pages_for(num_tokens) - len(block_table)
        if need > 0:
            block_table.extend(self.allocate(need))

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} is not allocated (double free?)")
        for p in pages:
            self._used.remove(p)
            self._free.append(p)
