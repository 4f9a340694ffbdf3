"""PagePool: the KV page free list (plain Python, no jax, no model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from multilora.engine.kv_pages import RESERVED_PAGES, OutOfPagesError, PagePool


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


@pytest.mark.parametrize("module", ["multilora.engine.kv_pages", "multilora.engine.scheduler",
                                    "multilora.engine.request", "multilora.lora.registry"])
def test_host_bookkeeping_imports_no_jax(module):
    """House rule 5: host bookkeeping is plain Python; importing it must not pull in jax."""
    code = (f"import sys, {module}\n"
            "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))[:5])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {module} imports jax: {out.stdout.strip()}"
