"""KV cache pages: a reference-counted page pool with a prefix cache. Plain Python, no jax.

What this module owns
---------------------
* Which KV pages are free, which are referenced (and by how many owners), and which hold cached,
  reusable K/V for a known token prefix. It never touches the K/V arrays themselves.
* The prefix-cache key of a page: `page_keys`, a pure hash chain.

The rules
---------
1. Page 0 is reserved (`RESERVED_PAGES`): padding tokens of a batch write their K/V there, so it
   is never handed out, freed, cached or evicted.
2. Every handed-out page has a reference count. A page may sit in several block tables (shared
   prefix); each owner frees its own reference with `free`. A page with refcount > 0 is never
   evicted, never re-handed out, and its key is never dropped from under it except by
   `reset_prefix_cache` (which only forgets the key; the page stays with its owners).
3. At refcount 0 an uncached page goes back on the free list; a cached page (one carrying a key)
   becomes *evictable*: it keeps its K/V and key and joins the LRU at the most-recently-released
   end. `allocate` takes from the free list first, then evicts the least recently released
   evictable page (which loses its key). `num_free` = free list + evictable = what `allocate` can
   hand out. A caller freeing a whole block table may pass it reversed so the tail pages (least
   likely to be shared) are evicted first.
4. Every mutating call validates first and changes nothing when it raises (`OutOfPagesError`
   from `allocate`/`grow`, `ValueError` from `free`/`register`).
5. A page's key is a hash chain (docs/design.md, "Prefix cache: the rule"): sha256 over the adapter's
   *content* hash (never its name or id; the base model uses a fixed constant the caller
   supplies), the parent page's key (or an explicit root marker), and the page's token ids
   encoded unambiguously (count + fixed-width little-endian int64). Only FULL pages get keys.
   Different adapters never share pages; the same tokens after a different prefix never match.
6. `register` caches a page only once its page is full and its K/V computed. A key already held
   by another page is left alone (the caller keeps its private duplicate); a page keeps its
   first key. The caller must still compute the last prompt token (never match the whole
   prompt), so it has logits to sample from.
7. With `enable_prefix_caching=False` the pool is a plain refcounted allocator: `register` is a
   no-op and `match_prefix` always returns [].
8. Hit/query counters are the scheduler's job, not this module's.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Sequence

RESERVED_PAGES = 1

_KEY_DOMAIN = b"multilora/kv-page/v1\x00"
_ROOT_MARKER = b"\x00root"
_PARENT_MARKER = b"\x01parent"


class OutOfPagesError(RuntimeError):
    pass


def _len_prefixed(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def page_keys(adapter_hash: bytes, token_ids: Sequence[int], page_size: int,
              parent: bytes | None = None, start_page: int = 0) -> list[bytes]:
    """One prefix-cache key per FULL page of token_ids, from page `start_page` on.

    token_ids is the whole sequence; parent is the key of page start_page-1 (None iff
    start_page == 0). key_i = sha256(domain, adapter_hash, parent-or-root, count, ids as int64 LE),
    so the continuation (start_page=k, parent=keys[k-1]) equals the one-shot chain's tail.
    """
    if not isinstance(adapter_hash, (bytes, bytearray)):
        raise TypeError(f"adapter_hash must be bytes, got {type(adapter_hash).__name__}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if start_page < 0:
        raise ValueError(f"start_page must be >= 0, got {start_page}")
    if (parent is None) != (start_page == 0):
        raise ValueError("parent must be given exactly when start_page > 0 "
                         f"(start_page={start_page}, parent={'None' if parent is None else 'set'})")
    prefix = _KEY_DOMAIN + _len_prefixed(bytes(adapter_hash))
    keys: list[bytes] = []
    for i in range(start_page, len(token_ids) // page_size):
        ids = token_ids[i * page_size:(i + 1) * page_size]
        h = hashlib.sha256(prefix)
        h.update(_ROOT_MARKER if parent is None else _PARENT_MARKER + _len_prefixed(parent))
        h.update(struct.pack(f"<Q{len(ids)}q", len(ids), *ids))
        parent = h.digest()
        keys.append(parent)
    return keys


class PagePool:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages <= RESERVED_PAGES:
            raise ValueError(f"num_pages must be > {RESERVED_PAGES}, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        # Pop from the end: low page ids go out first, which keeps dumps readable.
        self._free = list(range(num_pages - 1, RESERVED_PAGES - 1, -1))
        self._refs: dict[int, int] = {}                  # page -> refcount (> 0 only)
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable cached pages, oldest first
        self._key_of: dict[int, bytes] = {}              # cached page -> key
        self._page_of: dict[bytes, int] = {}             # key -> cached page

    # -- sizes -------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.num_pages - RESERVED_PAGES

    @property
    def num_free(self) -> int:
        """Pages allocate() can hand out: the free list plus evictable cached pages."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Pages with refcount > 0."""
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Pages carrying a cache key, referenced or not."""
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        """Unreferenced cached pages (reused by match_prefix, or evicted by allocate)."""
        return len(self._lru)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def ref_count(self, page: int) -> int:
        return self._refs.get(page, 0)

    def cached_key(self, page: int) -> bytes | None:
        return self._key_of.get(page)

    # -- allocation --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n pages with refcount 1: free list first, then evict LRU cached pages."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            raise OutOfPagesError(f"asked for {n} KV pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:
                p, _ = self._lru.popitem(last=False)
                del self._page_of[self._key_of.pop(p)]
            self._refs[p] = 1
            pages.append(p)
        return pages

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend block_table in place to hold num_tokens (raises before changing anything)."""
        need = self.pages_for(num_tokens) - len(block_table)
        if need > 0:
            block_table.extend(self.allocate(need))

    def free(self, pages: Sequence[int]) -> None:
        """Drop one reference per listed page (validates all first; changes nothing on error)."""
        for p, times in Counter(pages).items():
            if self._refs.get(p, 0) < times:
                raise ValueError(f"page {p} is not allocated (double free?)")
        for p in pages:
            left = self._refs[p] - 1
            if left:
                self._refs[p] = left
                continue
            del self._refs[p]
            if p in self._key_of:
                self._lru[p] = None          # MRU end
            else:
                self._free.append(p)

    # -- prefix cache ------------------------------------------------------------------------
    def peek_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are cached (what match_prefix would return), changing nothing."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        for k in keys:
            if k not in self._page_of:
                break
            n += 1
        return n

    def match_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """Pages of the longest cached run keys[0..k), one new reference taken on each."""
        n = self.peek_prefix(keys)
        pages = [self._page_of[k] for k in keys[:n]]
        for p in pages:
            if p in self._refs:
                self._refs[p] += 1
            else:
                del self._lru[p]             # revive
                self._refs[p] = 1
        return pages

    def register(self, page: int, key: bytes) -> None:
        """Cache a full, computed page (referenced by the caller) under key.

        No-op when the key is already held by another page, when the page already has a key,
        or when prefix caching is disabled.
        """
        if not self.enable_prefix_caching:
            return
        if page not in self._refs:
            raise ValueError(f"page {page} is not allocated (cannot register it)")
        if not isinstance(key, (bytes, bytearray)):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        key = bytes(key)
        if key in self._page_of or page in self._key_of:
            return
        self._key_of[page] = key
        self._page_of[key] = page

    def reset_prefix_cache(self) -> int:
        """Forget every key; unreferenced cached pages go to the free list. Returns how many."""
        dropped = list(self._lru)
        self._lru.clear()
        self._free.extend(reversed(dropped))   # oldest released goes out first
        self._key_of.clear()
        self._page_of.clear()
        return len(dropped)

    def snapshot(self) -> tuple[list[int], list[int], dict[int, int], dict[int, bytes]]:
        """Copies of the bookkeeping: (free list, evictable pages oldest first, refcounts, keys of
        cached pages). For tests that an operation refused leaves everything as it was."""
        return list(self._free), list(self._lru), dict(self._refs), dict(self._key_of)

    @property
    def num_free_uncached(self) -> int:
        """Free pages that hold no cached prefix (num_free less the evictable ones)."""
        return len(self._free)

    def check_invariants(self) -> None:
        """Assert the pool's bookkeeping is consistent (for tests and debugging)."""
        free, lru, refs = set(self._free), set(self._lru), set(self._refs)
        assert len(free) == len(self._free), "duplicate page on the free list"
        assert not (free & lru) and not (free & refs) and not (lru & refs), "page in two states"
        assert free | lru | refs == set(range(RESERVED_PAGES, self.num_pages)), "pages lost"
        assert all(c > 0 for c in self._refs.values()), "non-positive refcount"
        assert lru <= set(self._key_of), "evictable page without a key"
        assert not (free & set(self._key_of)), "free page with a key"
        assert len(self._key_of) == len(self._page_of)
        assert all(self._page_of[k] == p for p, k in self._key_of.items()), "key maps disagree"
