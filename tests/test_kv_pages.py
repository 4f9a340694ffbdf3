"""PagePool: the refcounted KV page pool and prefix cache (plain Python, no jax, no model)."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from pathlib import Path

import pytest

from multilora.engine.kv_pages import RESERVED_PAGES, OutOfPagesError, PagePool, page_keys


def test_capacity_and_reserved_page_never_handed_out():
    pool = PagePool(num_pages=9, page_size=4)
    assert pool.capacity == 8 == pool.num_free
    assert pool.num_used == 0
    got = pool.allocate(8)
    assert sorted(got) == list(range(RESERVED_PAGES, 9))
    assert 0 not in got
    assert pool.num_free == 0 and pool.num_used == 8
    with pytest.raises(OutOfPagesError, match="asked for 1 KV pages, 0 free"):
        pool.allocate(1)
    # churn: whatever order pages come back in, page 0 never goes out
    pool.free(got[::2])
    pool.free(got[1::2])
    for _ in range(5):
        again = pool.allocate(8)
        assert 0 not in again and len(set(again)) == 8
        pool.free(again)
    assert pool.num_free == pool.capacity


def test_allocate_free_roundtrip_and_distinct_pages():
    pool = PagePool(num_pages=6, page_size=2)
    a, b = pool.allocate(2), pool.allocate(3)
    assert not set(a) & set(b)
    assert pool.num_free == 0
    pool.free(a)
    assert pool.num_free == 2 and pool.num_used == 3
    c = pool.allocate(2)
    assert set(c) == set(a)
    assert pool.allocate(0) == []


def test_out_of_pages_changes_nothing():
    pool = PagePool(num_pages=4, page_size=4)
    pool.allocate(2)
    with pytest.raises(OutOfPagesError):
        pool.allocate(2)
    assert pool.num_free == 1 and pool.num_used == 2
    table = [pool.allocate(1)[0]]
    pool.free(table)
    # grow raises before changing the block table
    table = []
    with pytest.raises(OutOfPagesError):
        pool.grow(table, 4 * 2)
    assert table == [] and pool.num_free == 1


def test_double_free_and_foreign_pages_raise():
    pool = PagePool(num_pages=5, page_size=4)
    pages = pool.allocate(2)
    pool.free(pages)
    with pytest.raises(ValueError, match="double free"):
        pool.free(pages)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([0])       # the reserved page
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([99])
    # a partly bad list frees nothing
    p = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.free(p + [99])
    assert pool.num_used == 1
    pool.free(p)
    assert pool.num_free == pool.capacity


def test_pages_for_and_grow():
    pool = PagePool(num_pages=10, page_size=4)
    assert [pool.pages_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    table: list[int] = []
    pool.grow(table, 3)
    assert len(table) == 1
    pool.grow(table, 4)          # still fits
    assert len(table) == 1
    pool.grow(table, 5)
    assert len(table) == 2
    first = list(table)
    pool.grow(table, 13)
    assert len(table) == 4 and table[:2] == first
    pool.grow(table, 2)          # never shrinks
    assert len(table) == 4


def test_bad_construction():
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(num_pages=RESERVED_PAGES, page_size=4)
    with pytest.raises(ValueError, match="page_size"):
        PagePool(num_pages=4, page_size=0)


A = hashlib.sha256(b"adapter A weights").digest()
B = hashlib.sha256(b"adapter B weights").digest()
BASE = hashlib.sha256(b"base model").digest()


def cached_pool(num_pages=9, page_size=2, **kw):
    return PagePool(num_pages=num_pages, page_size=page_size, **kw)


def fill(pool, adapter, tokens):
    """Allocate pages for tokens, register every full one; returns (pages, keys)."""
    keys = page_keys(adapter, tokens, pool.page_size)
    pages = pool.allocate(pool.pages_for(len(tokens)))
    for p, k in zip(pages, keys):
        pool.register(p, k)
    return pages, keys


# -- hash chain ------------------------------------------------------------------------------

def test_page_keys_deterministic_and_full_pages_only():
    toks = list(range(10))
    k1 = page_keys(A, toks, 4)
    assert k1 == page_keys(A, toks, 4) == page_keys(A, tuple(toks), 4)
    assert len(k1) == 2                                # 10 tokens, page 4: two full pages
    assert all(isinstance(k, bytes) and len(k) >= 16 for k in k1)
    assert len(set(k1)) == 2
    assert page_keys(A, toks[:3], 4) == []
    assert page_keys(A, [], 4) == []
    assert page_keys(A, toks[:8], 4) == k1 == page_keys(A, toks[:11], 4)
    twelve = list(range(12))
    assert page_keys(A, twelve, 4)[:2] == k1 and len(page_keys(A, twelve, 4)) == 3


def test_page_keys_differ_by_adapter_parent_and_content():
    toks = [5, 6, 7, 8, 9, 10]
    ka, kb, kbase = page_keys(A, toks, 3), page_keys(B, toks, 3), page_keys(BASE, toks, 3)
    assert not set(ka) & set(kb) and not set(ka) & set(kbase) and not set(kb) & set(kbase)
    # same second-page tokens after a different first page -> different key
    other = page_keys(A, [1, 2, 3, 8, 9, 10], 3)
    assert other[0] != ka[0] and other[1] != ka[1]
    # a single token changed
    assert page_keys(A, [5, 6, 7, 8, 9, 11], 3)[1] != ka[1]
    assert page_keys(A, [5, 6, 7, 8, 9, 11], 3)[0] == ka[0]
    # order within a page matters
    assert page_keys(A, [6, 5, 7], 3)[0] != ka[0]
    # token boundaries: joining ids as strings would make these collide
    assert page_keys(A, [1, 23], 2) != page_keys(A, [12, 3], 2)
    assert page_keys(A, [11, 1], 2) != page_keys(A, [1, 11], 2)
    # large and negative ids encode without collision
    assert page_keys(A, [2**40, 0], 2) != page_keys(A, [0, 2**40], 2)
    assert page_keys(A, [-1, 0], 2) != page_keys(A, [2**64 - 1 - 2**63, 0], 2)
    # adapter hash is length-prefixed: moving bytes between adapter hash and content can't collide
    assert page_keys(b"ab", [1], 1) != page_keys(b"a", [1], 1)


def test_page_keys_token_moved_across_page_boundary():
    # same multiset / same concatenation, different split into pages
    a = page_keys(A, [1, 2, 3, 4, 5, 6], 3)
    b = page_keys(A, [1, 2, 4, 3, 5, 6], 3)
    assert a[0] != b[0] and a[1] != b[1]
    # tokens shifted by one position: pages (1,2,3)(4,5,6) vs (0,1,2)(3,4,5)(6,..)
    c = page_keys(A, [0, 1, 2, 3, 4, 5, 6], 3)
    assert not set(a) & set(c)
    # different page sizes over the same tokens give unrelated keys
    assert not set(page_keys(A, list(range(12)), 2)) & set(page_keys(A, list(range(12)), 4))


def test_page_keys_continuation_equals_one_shot():
    toks = list(range(100, 123))
    whole = page_keys(A, toks, 4)
    assert len(whole) == 5
    for k in range(1, 6):
        assert whole[:k] + page_keys(A, toks, 4, parent=whole[k - 1], start_page=k) == whole
    # a continuation over a longer sequence extends the chain
    more = toks + [7, 7, 7, 7]
    assert page_keys(A, more, 4, parent=whole[-1], start_page=5) == page_keys(A, more, 4)[5:]


def test_page_keys_argument_checks():
    with pytest.raises(ValueError, match="parent"):
        page_keys(A, list(range(8)), 4, start_page=1)
    with pytest.raises(ValueError, match="parent"):
        page_keys(A, list(range(8)), 4, parent=b"x" * 32)
    with pytest.raises(ValueError, match="page_size"):
        page_keys(A, [1], 0)
    with pytest.raises(TypeError):
        page_keys("adapter-name", [1], 1)


# -- refcounts -------------------------------------------------------------------------------

def test_shared_page_freed_by_two_owners():
    pool = cached_pool()
    pages, keys = fill(pool, A, [1, 2, 3, 4])
    other = pool.match_prefix(keys)
    assert other == pages
    assert [pool.ref_count(p) for p in pages] == [2, 2]
    assert pool.num_used == 2 and pool.num_evictable == 0
    pool.free(pages)
    assert [pool.ref_count(p) for p in pages] == [1, 1]
    assert pool.num_used == 2 and pool.num_evictable == 0
    pool.free(other)
    assert pool.num_used == 0 and pool.num_evictable == 2 and pool.num_cached == 2
    assert pool.num_free == pool.capacity
    pool.check_invariants()


def test_double_free_of_shared_page_changes_nothing():
    pool = cached_pool()
    pages, keys = fill(pool, A, [1, 2, 3, 4])
    pool.match_prefix(keys[:1])                       # page[0] refcount 2, page[1] refcount 1
    with pytest.raises(ValueError, match=f"page {pages[1]} is not allocated"):
        pool.free([pages[0], pages[1], pages[1]])     # page[1] freed twice in one call
    assert [pool.ref_count(p) for p in pages] == [2, 1]
    pool.free([pages[0], pages[0], pages[1]])        # two refs on page[0] is fine
    assert pool.num_used == 0
    with pytest.raises(ValueError, match="double free"):
        pool.free([pages[0]])
    assert pool.num_evictable == 2
    pool.check_invariants()


# -- LRU eviction ----------------------------------------------------------------------------

def test_lru_evicts_least_recently_released_first():
    pool = cached_pool(num_pages=5, page_size=2)      # capacity 4
    (p1,), (k1,) = fill(pool, A, [1, 1])
    (p2,), (k2,) = fill(pool, A, [2, 2])
    (p3,), (k3,) = fill(pool, A, [3, 3])
    pool.free([p2])
    pool.free([p3])
    pool.free([p1])                                   # LRU order: p2, p3, p1
    assert pool.num_free == 4 and pool.num_evictable == 3
    (fresh,) = pool.allocate(1)                       # free list first
    assert fresh not in (p1, p2, p3)
    assert pool.allocate(1) == [p2]                   # then the least recently released
    assert pool.cached_key(p2) is None and pool.match_prefix([k2]) == []
    assert pool.peek_prefix([k3]) == 1 and pool.peek_prefix([k1]) == 1
    assert pool.allocate(1) == [p3]
    assert pool.allocate(1) == [p1]
    assert pool.num_cached == 0 and pool.num_free == 0
    pool.check_invariants()


def test_referenced_cached_pages_never_evicted():
    pool = cached_pool(num_pages=4, page_size=2)      # capacity 3
    held, hkeys = fill(pool, A, [1, 1, 2, 2])         # 2 pages cached and held
    (p,), (k,) = fill(pool, A, [9, 9])
    pool.free([p])
    assert pool.num_free == 1
    with pytest.raises(OutOfPagesError, match="asked for 2 KV pages, 1 free"):
        pool.allocate(2)
    assert pool.allocate(1) == [p]                    # only the unreferenced one goes
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)
    assert pool.match_prefix(hkeys) == held           # held pages still cached
    pool.check_invariants()


def test_revival_from_lru():
    pool = cached_pool(num_pages=5, page_size=2)
    pages, keys = fill(pool, A, [1, 1, 2, 2])
    pool.free(pages)
    assert pool.num_evictable == 2 and pool.num_used == 0
    again = pool.match_prefix(keys)
    assert again == pages
    assert [pool.ref_count(p) for p in again] == [1, 1]
    assert pool.num_evictable == 0 and pool.num_used == 2 and pool.num_free == 2
    # revived pages are not evictable: allocating everything else leaves them alone
    rest = pool.allocate(2)
    assert not set(rest) & set(pages)
    pool.free(rest)
    # revival moves a page out of the LRU; releasing it again puts it at the MRU end
    pool.free([pages[0]])
    pool.free([pages[1]])
    (x,) = pool.match_prefix(keys[:1])
    assert x == pages[0]
    pool.free([x])                                    # LRU: pages[1], pages[0]
    got = pool.allocate(4)
    assert got[-2:] == [pages[1], pages[0]]
    pool.check_invariants()


# -- matching --------------------------------------------------------------------------------

def test_match_prefix_stops_at_first_miss():
    pool = cached_pool(num_pages=9, page_size=2)
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    keys = page_keys(A, toks, 2)
    pages = pool.allocate(4)
    for i in (0, 1, 3):                               # page 2 never registered
        pool.register(pages[i], keys[i])
    assert pool.peek_prefix(keys) == 2
    before = [pool.ref_count(p) for p in pages]
    assert pool.peek_prefix(keys) == 2 and [pool.ref_count(p) for p in pages] == before
    assert pool.match_prefix(keys) == pages[:2]
    assert [pool.ref_count(p) for p in pages] == [2, 2, 1, 1]
    assert pool.match_prefix(keys[2:]) == []          # first key missing: nothing, page 3 untouched
    assert pool.ref_count(pages[3]) == 1
    assert pool.match_prefix(keys[3:]) == [pages[3]]  # matching is by key, not by position
    pool.free(pages[:2] + [pages[3]])
    # different adapter, same tokens: nothing matches
    assert pool.match_prefix(page_keys(B, toks, 2)) == []
    assert pool.match_prefix([]) == []
    pool.check_invariants()


def test_register_duplicate_key_and_rekey():
    pool = cached_pool()
    (k,) = page_keys(A, [4, 2], 2)
    a, b = pool.allocate(2)
    pool.register(a, k)
    pool.register(b, k)                               # duplicate: b stays private
    assert pool.cached_key(a) == k and pool.cached_key(b) is None
    assert pool.num_cached == 1
    (k2,) = page_keys(A, [4, 3], 2)
    pool.register(a, k2)                              # a keeps its first key
    assert pool.cached_key(a) == k and pool.peek_prefix([k2]) == 0
    pool.free([a, b])
    assert pool.num_evictable == 1 and pool.num_cached == 1
    assert pool.num_free == pool.capacity
    assert pool.match_prefix([k]) == [a]
    with pytest.raises(ValueError, match="not allocated"):
        pool.register(b, k2)                          # b is free
    with pytest.raises(ValueError, match="not allocated"):
        pool.register(0, k2)
    pool.check_invariants()


def test_disabled_prefix_caching():
    pool = cached_pool(enable_prefix_caching=False)
    pages, keys = fill(pool, A, [1, 2, 3, 4])
    assert pool.num_cached == 0
    assert pool.peek_prefix(keys) == 0 and pool.match_prefix(keys) == []
    pool.free(pages)
    assert pool.num_evictable == 0 and pool.num_free == pool.capacity
    assert pool.reset_prefix_cache() == 0
    pool.check_invariants()


def test_reset_prefix_cache():
    pool = cached_pool(num_pages=9, page_size=2)
    held, hkeys = fill(pool, A, [1, 1, 2, 2])
    gone, gkeys = fill(pool, B, [3, 3, 4, 4, 5, 5])
    pool.free(gone)
    assert pool.num_cached == 5 and pool.num_evictable == 3
    assert pool.reset_prefix_cache() == 3
    assert pool.num_cached == 0 and pool.num_evictable == 0
    assert pool.num_used == 2 and pool.num_free == pool.capacity - 2
    assert pool.peek_prefix(hkeys) == 0 and pool.peek_prefix(gkeys) == 0
    assert [pool.ref_count(p) for p in held] == [1, 1]
    pool.free(held)                                   # uncached now: straight to the free list
    assert pool.num_evictable == 0 and pool.num_free == pool.capacity
    pool.check_invariants()


def test_allocate_failure_has_no_side_effects():
    pool = cached_pool(num_pages=5, page_size=2)
    pages, keys = fill(pool, A, [1, 1, 2, 2])
    pool.free(pages)
    held = pool.allocate(1)
    state = pool.snapshot()
    with pytest.raises(OutOfPagesError, match="asked for 4 KV pages, 3 free"):
        pool.allocate(4)
    table = list(held)
    with pytest.raises(OutOfPagesError):
        pool.grow(table, 2 * 5)
    assert table == held
    assert state == pool.snapshot()
    assert pool.match_prefix(keys) == pages
    with pytest.raises(ValueError):
        pool.allocate(-1)
    pool.check_invariants()


def test_randomized_invariants():
    rng = random.Random(1234)
    for trial in range(20):
        page_size = rng.choice([1, 2, 4])
        pool = PagePool(num_pages=rng.randint(2, 24), page_size=page_size,
                        enable_prefix_caching=trial % 5 != 4)
        adapters = [A, B, BASE]
        owners: list[list[int]] = []                  # each owner's block table
        for _ in range(300):
            op = rng.random()
            if op < 0.45:
                adapter = rng.choice(adapters)
                toks = [rng.randint(0, 3) for _ in range(rng.randint(1, 4 * page_size))]
                keys = page_keys(adapter, toks, page_size)
                expect = pool.peek_prefix(keys)
                hit = pool.match_prefix(keys)
                assert len(hit) == expect
                need = pool.pages_for(len(toks)) - len(hit)
                if need > pool.num_free:
                    with pytest.raises(OutOfPagesError):
                        pool.allocate(need)
                    pool.free(hit[::-1])
                    continue
                table = hit + pool.allocate(need)
                assert 0 not in table and len(set(table)) == len(table)
                for p, k in zip(table, keys):
                    pool.register(p, k)
                    if pool.enable_prefix_caching:
                        assert pool.peek_prefix([k]) == 1
                owners.append(table)
            elif op < 0.85 and owners:
                table = owners.pop(rng.randrange(len(owners)))
                pool.free(table[::-1])
            elif op < 0.9 and owners:
                table = owners[rng.randrange(len(owners))]
                if table:
                    with pytest.raises(ValueError):
                        pool.free(table + [table[0]] * (pool.ref_count(table[0])))
            elif op < 0.93:
                pool.reset_prefix_cache()
            else:
                n = rng.randint(0, pool.num_free)
                owners.append(pool.allocate(n))
            # invariants
            pool.check_invariants()
            refs = {}
            for t in owners:
                for p in t:
                    refs[p] = refs.get(p, 0) + 1
            assert {p: pool.ref_count(p) for p in refs} == refs
            assert pool.num_used == len(refs)
            assert sum(pool.ref_count(p) for p in range(pool.num_pages)) == sum(map(len, owners))
            assert pool.num_free + pool.num_used == pool.capacity
            assert pool.num_free == pool.num_free_uncached + pool.num_evictable
            assert pool.ref_count(0) == 0 and 0 not in refs
            if not pool.enable_prefix_caching:
                assert pool.num_cached == 0
        for t in owners:
            pool.free(t)
        assert pool.num_used == 0 and pool.num_free == pool.capacity
        pool.check_invariants()


@pytest.mark.parametrize("module", ["multilora.engine.kv_pages", "multilora.engine.scheduler",
                                    "multilora.engine.request", "multilora.adapters.registry"])
def test_host_bookkeeping_imports_no_jax(module):
    """House rule 5: host bookkeeping is plain Python; importing it must not pull in jax."""
    code = (f"import sys, {module}\n"
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))[:5])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {module} imports jax: {out.stdout.strip()}"
