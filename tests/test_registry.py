"""AdapterRegistry: names, refcounts, load/unload lifecycle, pinning, the host LRU tier and the
device slot LRU. Plain Python: a fake reader stands in for the adapter folder."""

from __future__ import annotations

import numpy as np
import pytest

from multilora.adapters.adapter import AdapterError, LoRAAdapter
from multilora.config import NO_ADAPTER
from multilora.adapters.registry import (AdapterConflictError, AdapterRegistry, AdapterUnloadingError,
                                     UnknownAdapterError)


class FakeReader:
    """read_adapter stand-in: counts reads per name; a path starting with "bad" fails."""

    def __init__(self):
        self.calls: list[str] = []

    def __call__(self, name: str, path: str) -> LoRAAdapter:
        self.calls.append(name)
        if str(path).startswith("bad"):
            raise AdapterError(name, f"adapter folder {path!r} does not exist")
        # "/r<N>/..." reads an adapter of rank N (rank 2 otherwise)
        part = str(path).split("/")[1] if str(path).count("/") > 1 else ""
        r = int(part[1:]) if part[:1] == "r" and part[1:].isdigit() else 2
        a = np.full((1, r, 8), len(self.calls), np.float32)
        b = np.zeros((1, 8, r), np.float32)
        return LoRAAdapter(name=name, path=str(path), rank=r, scaling=0.5, modules={"q_proj": (a, b)})


def make(num_slots=3, max_loaded=None, num_rows=None, max_rank=None):
    reader = FakeReader()
    return AdapterRegistry(num_slots, max_loaded, reader, num_rows=num_rows, max_rank=max_rank), reader


def test_register_resolve_and_ids():
    reg, reader = make()
    a = reg.register("a", "/p/a")
    b = reg.register("b", "/p/b")
    assert reg.resolve("a") is a and a.path == "/p/a" and a.rank == 2
    assert a.id != b.id and a.id != NO_ADAPTER and b.id != NO_ADAPTER
    assert reader.calls == ["a", "b"]
    assert a.refcount == 0 and a.slot is None and not a.pinned and not a.unloading
    # ids are never reused, even after an unload
    reg.unregister("a")
    c = reg.register("a", "/p/a2")
    assert c.id not in (a.id, b.id)


def test_duplicate_and_bad_names():
    reg, _ = make()
    reg.register("a", "/p/a")
    with pytest.raises(AdapterConflictError, match="'a' is already loaded"):
        reg.register("a", "/p/other")
    assert reg.resolve("a").path == "/p/a"
    with pytest.raises(ValueError, match="non-empty"):
        reg.register("", "/p/x")


def test_failed_read_changes_nothing():
    reg, reader = make()
    reg.register("a", "/p/a")
    with pytest.raises(AdapterError, match="'b'.*does not exist"):
        reg.register("b", "bad/folder")
    assert set(reg.entries) == {"a"} and reg.num_host_copies == 1
    with pytest.raises(UnknownAdapterError):
        reg.resolve("b")
    reg.register("b", "/p/b")  # the name is still free


def test_unknown_adapter_error_names_it_and_the_known_ones():
    reg, _ = make()
    with pytest.raises(UnknownAdapterError) as e:
        reg.resolve("nope")
    assert "'nope'" in str(e.value) and "(none)" in str(e.value)
    assert isinstance(e.value, KeyError) and e.value.adapter_name == "nope"
    reg.register("b", "/p/b")
    reg.register("a", "/p/a")
    with pytest.raises(UnknownAdapterError) as e:
        reg.acquire("nope")
    assert "loaded adapters: a, b" in str(e.value)


def test_acquire_release_refcounts():
    reg, _ = make()
    reg.register("a", "/p/a")
    for _ in range(3):
        reg.acquire("a")
    assert reg.resolve("a").refcount == 3
    for _ in range(3):
        assert reg.release("a") == []
    assert reg.resolve("a").refcount == 0
    assert reg.release("unknown") == []


def test_unregister_with_references_waits_for_them():
    reg, _ = make()
    reg.register("a", "/p/a")
    reg.acquire("a")
    reg.acquire("a")
    [(slot, entry)] = reg.assign_slots({"a"}, set())
    assert reg.unregister("a") == []           # still referenced: nothing freed yet
    assert entry.unloading and "a" in reg.entries
    with pytest.raises(AdapterUnloadingError, match="'a' is being unloaded") as e:
        reg.acquire("a")
    assert e.value.adapter_name == "a"
    with pytest.raises(AdapterUnloadingError):
        reg.resolve("a")
    assert reg.resolve("a", allow_unloading=True) is entry
    assert reg.slot_of("a") == slot            # running requests keep using their slot
    assert reg.release("a") == []
    assert reg.release("a") == [slot]          # last reference: removed, its slot freed
    assert "a" not in reg.entries and reg.num_host_copies == 0
    with pytest.raises(UnknownAdapterError):
        reg.acquire("a")
    # the freed slot is handed out again first
    reg.register("b", "/p/b")
    assert reg.assign_slots({"b"}, set()) == [(slot, reg.resolve("b"))]


def test_unregister_without_references_is_immediate():
    reg, _ = make()
    reg.register("a", "/p/a")
    assert reg.unregister("a") == []
    assert "a" not in reg.entries
    with pytest.raises(UnknownAdapterError):
        reg.unregister("a")
    reg.register("b", "/p/b")
    [(slot, _)] = reg.assign_slots({"b"}, set())
    assert reg.unregister("b") == [slot]


def test_slots_are_numbered_past_the_base_slot():
    reg, _ = make(num_slots=3)
    for n in "abc":
        reg.register(n, f"/p/{n}")
    writes = reg.assign_slots({"a", "b", "c"}, set())
    slots = sorted(s for s, _ in writes)
    assert slots == [1, 2, 3] and NO_ADAPTER not in slots
    assert reg.slot_of(None) == NO_ADAPTER
    assert {reg.slot_of(n) for n in "abc"} == {1, 2, 3}
    # already resident: no writes, hits counted
    assert reg.assign_slots({"a", "b"}, set()) == []
    assert reg.stats.slot_hits == 2 and reg.stats.slot_misses == 3 and reg.stats.slot_evictions == 0


def test_slot_lru_evicts_least_recent_and_never_in_use():
    reg, _ = make(num_slots=2)
    for n in "abcd":
        reg.register(n, f"/p/{n}")
    reg.assign_slots({"a"}, set())
    reg.assign_slots({"b"}, set())
    reg.assign_slots({"a"}, set())              # a is now the most recent
    b_slot = reg.slot_of("b")
    [(slot, entry)] = reg.assign_slots({"c"}, set())
    assert entry.name == "c" and reg.resolve("b").slot is None and slot == b_slot
    assert reg.stats.slot_evictions == 1
    # LRU now: a, c. a is in use by a running sequence: c goes although a is older
    [(slot2, entry2)] = reg.assign_slots({"d"}, {"a"})
    assert entry2.name == "d" and reg.resolve("c").slot is None and reg.resolve("a").slot is not None
    assert slot2 == slot
    # both slots needed by running sequences: nothing can be evicted
    with pytest.raises(RuntimeError, match="no room in the device pool for an adapter of rank 2: its 2 slots hold"):
        reg.assign_slots({"b"}, {"a", "d"})
    # a batch that needs more adapters than slots cannot be placed either
    with pytest.raises(RuntimeError, match="no room in the device pool"):
        reg.assign_slots({"a", "b", "c"}, set())


def test_fits_counts_pinned_adapters():
    reg, _ = make(num_slots=3)
    reg.register("p", "/p/p", pinned=True)
    for n in "abc":
        reg.register(n, f"/p/{n}")
    assert reg.fits({"a", "b"}) and reg.fits({"a", "b", "p"})
    assert not reg.fits({"a", "b", "c"})
    assert reg.pinned_names() == {"p"}


def test_pin_limit_leaves_a_slot_for_the_others():
    reg, _ = make(num_slots=3)
    reg.register("p1", "/p/1", pinned=True)
    reg.register("p2", "/p/2", pinned=True)
    with pytest.raises(AdapterConflictError, match="cannot pin 'p3'"):
        reg.register("p3", "/p/3", pinned=True)
    assert "p3" not in reg.entries
    reg.register("p3", "/p/3")  # unpinned is fine


def test_pinned_adapters_are_never_evicted():
    reg, _ = make(num_slots=2, max_loaded=1)
    reg.register("p", "/p/p", pinned=True)
    [(pslot, _)] = reg.assign_slots({"p"}, set())
    for n in "abcdef":
        reg.register(n, f"/p/{n}")
    for n in "abcdefabc":
        reg.assign_slots({n}, set())  # p is not in use, yet it is the oldest: it must stay
        assert reg.slot_of("p") == pslot
        assert reg.slot_of(n) != pslot
    with pytest.raises(RuntimeError):
        reg.assign_slots({"a", "b"}, set())
    assert reg.slot_of("p") == pslot


def test_host_lru_evicts_and_rereads():
    reg, reader = make(num_slots=4, max_loaded=2)
    a = reg.register("a", "/p/a")
    reg.register("b", "/p/b")
    assert reg.num_host_copies == 2 and reg.stats.host_evictions == 0
    reg.register("c", "/p/c")                  # a, the oldest host copy, is dropped
    assert reg.num_host_copies == 2 and reg.stats.host_evictions == 1
    assert reader.calls == ["a", "b", "c"]
    got = reg.host_copy(a)                     # re-read from its folder
    assert got.name == "a" and got.path == "/p/a"
    assert reader.calls == ["a", "b", "c", "a"]
    assert reg.stats.host_misses == 1 and reg.stats.host_evictions == 2   # b dropped
    reg.host_copy(reg.resolve("c"))            # hit: no read
    reg.host_copy(a)
    assert reader.calls == ["a", "b", "c", "a"] and reg.stats.host_hits == 2
    reg.host_copy(reg.resolve("b"))            # miss: c is the least recent now
    assert reader.calls[-1] == "b" and reg.stats.host_misses == 2
    reg.host_copy(a)
    assert reader.calls.count("a") == 2
    # unbounded host tier never re-reads
    reg2, reader2 = make(max_loaded=None)
    for n in "abcdefgh":
        reg2.register(n, f"/p/{n}")
    for n in "abcdefgh":
        reg2.host_copy(reg2.resolve(n))
    assert reader2.calls == list("abcdefgh") and reg2.stats.host_evictions == 0


def test_host_reread_failure_surfaces_as_adapter_error(tmp_path):
    reg, reader = make(max_loaded=1)
    a = reg.register("a", "/p/a")
    reg.register("b", "/p/b")                  # a dropped from the host tier
    a.path = "bad/gone"                        # its folder went bad since
    with pytest.raises(AdapterError, match="'a'"):
        reg.host_copy(a)
    assert reg.host_copy(reg.resolve("b")).name == "b"


def test_bad_limits():
    with pytest.raises(ValueError, match="max_loaded_loras"):
        AdapterRegistry(2, 0, FakeReader())


def test_drop_slot_makes_the_adapter_written_again():
    """The engine drops a slot whose write failed: the adapter must not count as resident."""
    reg, _ = make(num_slots=2)
    reg.register("a", "/p/a")
    reg.register("b", "/p/b")
    [(slot, _)] = reg.assign_slots({"a"}, set())
    reg.drop_slot("a")
    assert reg.resolve("a").slot is None
    assert reg.assign_slots({"b"}, set()) == [(slot, reg.resolve("b"))]   # the slot is free again
    [(slot_a, entry)] = reg.assign_slots({"a"}, set())                     # and a is written anew
    assert entry.name == "a" and slot_a != slot
    reg.drop_slot("unknown")
    reg.drop_slot("b")
    reg.drop_slot("b")


def test_host_tier_is_bounded_by_bytes():
    """Each fake adapter holds 2 * 8 + 8 * 2 float32 = 128 bytes: a 300-byte bound keeps two."""
    reader = FakeReader()
    reg = AdapterRegistry(4, None, reader, max_host_bytes=300)
    for n in "abc":
        reg.register(n, f"/p/{n}")
    assert reg.num_host_copies == 2 and reg.host_bytes == 256 and reg.stats.host_evictions == 1
    assert not reg.ready("a") and reg.ready("b") and reg.ready("c")
    reg.host_copy(reg.resolve("a"))            # read again; b (least recent) goes
    assert reg.host_bytes == 256 and not reg.ready("b") and reader.calls == ["a", "b", "c", "a"]
    reg.unregister("c")                        # no references: gone, its bytes too
    assert reg.host_bytes == 128 and reg.num_host_copies == 1
    # a bound smaller than one adapter still keeps the copy just read (it is about to be used)
    tiny = AdapterRegistry(4, None, FakeReader(), max_host_bytes=10)
    tiny.register("x", "/p/x")
    assert tiny.num_host_copies == 1


def test_background_read_arrives_only_for_the_folder_it_was_read_from():
    reg, reader = make(num_slots=4, max_loaded=1)
    reg.register("a", "/p/a")
    reg.register("b", "/p/b")                  # a's host copy is evicted
    assert not reg.ready("a")
    stale = reader("a", "/p/old")
    reg.put_host("a", "/p/old", stale)         # read from a folder it no longer names: ignored
    assert not reg.ready("a")
    fresh = reader("a", "/p/a")
    reg.put_host("a", "/p/a", fresh)
    assert reg.ready("a") and reg.resolve("a").content_hash == fresh.content_hash
    reg.put_host("gone", "/p/gone", fresh)     # a name unloaded meanwhile: ignored
    assert "gone" not in reg.entries


# --- pool rows: each resident adapter holds as many rank rows as its rank ---------------------

def test_rows_at_true_rank_are_given_distinct_and_freed_on_eviction_and_unload():
    reg, _ = make(num_slots=8, num_rows=40, max_rank=32)
    for name, r in (("a", 8), ("b", 16), ("c", 4), ("d", 32)):
        reg.register(name, f"/r{r}/{name}")
    writes = dict((e.name, e.rows) for _, e in reg.assign_slots({"a", "b", "c"}, set()))
    assert {n: len(r) for n, r in writes.items()} == {"a": 8, "b": 16, "c": 8}  # whole pages of 8
    rows = [r for rs in writes.values() for r in rs]
    assert len(set(rows)) == 32 and min(rows) >= 8 and max(rows) < 48  # never the zero page
    assert all(rs[i:i + 8] == tuple(range(rs[i], rs[i] + 8)) and rs[i] % 8 == 0
               for rs in writes.values() for i in range(0, len(rs), 8))  # aligned runs: pages
    assert reg.rows_in_use == 32
    # d (rank 32) needs 32 of 40 rows: 8 are free, so LRU adapters go until it fits (a, then b);
    # c, in use by a running sequence, stays.
    reg.assign_slots({"c"}, set())  # c the most recent
    [(d_slot, d)] = reg.assign_slots({"d"}, {"c"})
    assert len(d.rows) == 32 and not set(d.rows) & set(writes["c"])
    assert reg.resolve("a").slot is None and reg.resolve("b").slot is None and reg.resolve("a").rows == ()
    assert reg.stats.slot_evictions == 2 and reg.rows_in_use == 40
    # unloading a resident adapter gives its rows back at once
    assert reg.unregister("d") == [d_slot]
    assert reg.rows_in_use == 8
    reg.drop_slot("c")
    assert reg.rows_in_use == 0 and reg.resolve("c").slot is None


def test_fits_counts_rows_as_well_as_slots():
    reg, _ = make(num_slots=8, num_rows=40, max_rank=32)
    for name, r in (("a", 8), ("b", 16), ("c", 32)):
        reg.register(name, f"/r{r}/{name}")
    assert reg.fits({"a", "b"}) and reg.fits({"a", "c"})
    assert not reg.fits({"b", "c"})       # 48 rows > 40, though 2 slots of 8 are plenty
    with pytest.raises(RuntimeError, match="no room in the device pool for an adapter of rank 32: "
                                           "its 8 slots and 40 rank rows hold"):
        reg.assign_slots({"b", "c"}, set())


def test_a_rank_larger_than_the_pool_is_refused():
    reg, _ = make(num_slots=2, num_rows=8, max_rank=8)
    reg.register("big", "/r16/big")
    with pytest.raises(RuntimeError, match="an adapter of rank 16 cannot fit the pool's 8 rank rows"):
        reg.assign_slots({"big"}, set())
    assert reg.rows_in_use == 0 and reg.resolve("big").slot is None


def test_pinning_leaves_rows_for_one_adapter_of_max_rank():
    reg, _ = make(num_slots=8, num_rows=48, max_rank=16)
    reg.register("p1", "/r16/p1", pinned=True)
    reg.register("p2", "/r16/p2", pinned=True)
    with pytest.raises(AdapterConflictError, match="cannot pin 'p3': pinned adapters would hold 40 of "
                                                   "the pool's 48 rank rows"):
        reg.register("p3", "/r8/p3", pinned=True)
    assert "p3" not in reg.entries
    reg.register("p3", "/r8/p3")  # unpinned is fine


def test_replace_is_copy_on_write():
    """An in-place load: the old entry keeps its slot under a hidden name while it has requests,
    the name takes the new weights (a new id, the next version), the old slot is freed with the
    last request; a held adapter (from arrays) is never read again."""
    reg, reader = make(num_slots=2)
    reg.register("a", "/p/a")
    old = reg.acquire("a")  # a request running on the old weights
    [(slot, _)] = reg.assign_slots({"a"}, set())
    held = reader("a", "/p/new")
    was, freed = reg.replace("a", "<tensors>", held, held=True)
    assert was is old and freed == [] and old.slot == slot and old.unloading
    assert old.name != "a" and old.public_name == "a" and reg.entries[old.name] is old
    new = reg.resolve("a")
    assert new is not old and new.version == 2 and new.content_hash == held.content_hash
    assert reg.ready("a") and reg.host_copy(new) is held and new.slot is None
    calls = len(reader.calls)
    reg.drop_host_copy("a")
    assert reg.host_copy(new) is held and len(reader.calls) == calls
    assert reg.release(old.name) == [slot] and old.name not in reg.entries
    # replacing an idle entry frees its slot at once
    reg.assign_slots({"a"}, set())
    _, freed = reg.replace("a", "/p/a3", reader("a", "/p/a3"))
    assert len(freed) == 1 and reg.resolve("a").version == 3 and list(reg.entries) == ["a"]
    reg.register("p", "/p/p", pinned=True)
    with pytest.raises(AdapterConflictError, match="pinned"):
        reg.replace("p", "/p/p2", reader("p", "/p/p2"))
    assert reg.resolve("p").pinned and reg.resolve("p").version == 1
