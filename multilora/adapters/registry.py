"""Adapter lifecycle: name -> unique id, refcounts, load and unload at run time, and the two
tiers below the registry: host copies (LRU, bounded by max_loaded_loras and bytes) and the device
pool (LRU, never evicting an adapter that a running sequence uses, never a pinned one). A resident
adapter holds a slot (its row table, one per adapter in a batch) and its rank's pages of the
pool's rank rows (multilora.adapters.pool): eviction frees both, as many adapters as it takes.

Plain Python, no jax: the engine applies the slot writes this module decides.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections import OrderedDict
from typing import Callable, Iterable, Optional

from multilora.config import NO_ADAPTER, PAGE_ROWS, round_to_pages
from multilora.adapters.adapter import AdapterProbe, LoRAAdapter


class UnknownAdapterError(KeyError):
    def __init__(self, name: str, known: Iterable[str]):
        known = sorted(known)
        super().__init__(f"unknown LoRA adapter {name!r}; loaded adapters: "
                         f"{', '.join(known) if known else '(none)'}")
        self.adapter_name = name

    def __str__(self) -> str:
        return self.args[0]


class AdapterUnloadingError(RuntimeError):
    def __init__(self, name: str):
        super().__init__(f"LoRA adapter {name!r} is being unloaded and takes no new requests")
        self.adapter_name = name


class AdapterConflictError(ValueError):
    pass


@dataclasses.dataclass(eq=False)
class AdapterEntry:
    name: str
    path: str
    id: int
    pinned: bool = False
    refcount: int = 0          # requests (waiting or running) that use it
    unloading: bool = False
    slot: Optional[int] = None
    rows: tuple[int, ...] = ()  # its pool rows while resident: the rows of its pages
    rank: int = 0
    content_hash: bytes = b""  # of its weights and scaling: the root of its prefix-cache keys
    version: int = 1           # loads of this name so far: an in-place load takes the next one
    # an adapter given as arrays (no folder to read again): its host copy, kept outside the host
    # tier's LRU for as long as the entry lives
    held: Optional[LoRAAdapter] = dataclasses.field(default=None, repr=False)

    @property
    def public_name(self) -> str:
        """The name requests use: a replaced entry is kept under a hidden name until its last
        request ends (replace)."""
        return public_name(self.name)


HIDDEN = "\0"  # joins a replaced entry's name to its id: no adapter name holds it


def public_name(name: Optional[str]) -> Optional[str]:
    return None if name is None else name.split(HIDDEN, 1)[0]


@dataclasses.dataclass
class TierStats:
    slot_hits: int = 0
    slot_misses: int = 0
    slot_evictions: int = 0
    host_hits: int = 0
    host_misses: int = 0
    host_evictions: int = 0
    loads: int = 0             # background reads finished (multilora.adapters.loader)
    load_failures: int = 0


class AdapterRegistry:
    def __init__(self, num_slots: int, max_loaded_loras: Optional[int],
                 read_adapter: Callable[[str, str], LoRAAdapter], max_host_bytes: Optional[int] = None,
                 num_rows: Optional[int] = None, max_rank: Optional[int] = None):
        """num_slots: device slots for adapters (slot 0, the base model, not counted); num_rows:
        the pool's rank rows for adapters, whole pages of PAGE_ROWS (page 0, the zero page, not
        counted; None: rows never limit); max_rank: the widest adapter accepted (pinning keeps
        room for one). Host copies are kept LRU within max_loaded_loras copies and
        max_host_bytes bytes (either None: no bound); the copy just read always stays."""
        if max_loaded_loras is not None and max_loaded_loras < 1:
            raise ValueError(f"max_loaded_loras must be >= 1 or None, got {max_loaded_loras}")
        self.num_slots = num_slots
        self.num_rows = num_rows
        self.max_rank = max_rank
        num_pages = (num_rows or 0) // PAGE_ROWS
        self._free_pages: list[int] = list(range(1, num_pages + 1))  # a heap: lowest first
        self._next_page = num_pages + 1  # rows unbounded: new pages past every one given
        self.max_loaded_loras = max_loaded_loras
        self.max_host_bytes = max_host_bytes
        self.host_bytes = 0
        self._host_nbytes: dict[str, int] = {}  # what each host copy was counted at
        self._read = read_adapter
        self._ids = itertools.count(1)
        self.entries: dict[str, AdapterEntry] = {}
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # LRU: oldest first
        self._slot_of: dict[int, AdapterEntry] = {}
        self._slot_lru: OrderedDict[int, None] = OrderedDict()     # slot -> (), oldest first
        self.stats = TierStats()

    # ---- lifecycle -------------------------------------------------------------------------
    def release_host_copies(self) -> None:
        """Drop every host copy (the engine's shutdown): the names stay registered, nothing is
        served any more."""
        self._host.clear()
        self._host_nbytes.clear()
        self.host_bytes = 0
        for e in self.entries.values():
            e.held = None

    def register(self, name: str, path: str, pinned: bool = False,
                 adapter: Optional[LoRAAdapter] = None, probe: Optional[AdapterProbe] = None,
                 held: bool = False, version: int = 1) -> AdapterEntry:
        """Read and validate the adapter now (or take `adapter`, already read off the engine
        thread); on any error nothing changes. With `probe` (its config and header, validated)
        and no adapter, it is registered unread: its weights are read on first use, and until
        then its content hash is the probe's fingerprint."""
        if not name or not isinstance(name, str):
            raise ValueError("adapter name must be a non-empty string")
        if name in self.entries:
            raise AdapterConflictError(f"LoRA adapter {name!r} is already loaded; unload it first")
        if pinned and sum(e.pinned for e in self.entries.values()) + 1 >= self.num_slots:
            raise AdapterConflictError(
                f"cannot pin {name!r}: pinned adapters would fill all {self.num_slots} device slots "
                "and leave none for the others")
        if HIDDEN in name:
            raise ValueError("adapter name must not hold a NUL character")
        if adapter is None and (probe is None or pinned):
            adapter = self._read(name, path)
        rank = adapter.rank if adapter is not None else probe.rank
        if pinned and self.num_rows is not None:
            pinned_rows = sum(round_to_pages(e.rank) for e in self.entries.values() if e.pinned) \
                + round_to_pages(rank)
            room = self.num_rows - round_to_pages(self.max_rank or 1)
            if pinned_rows > room:
                raise AdapterConflictError(
                    f"cannot pin {name!r}: pinned adapters would hold {pinned_rows} of the pool's "
                    f"{self.num_rows} rank rows and leave no room for an adapter of rank "
                    f"{self.max_rank or 1}; raise lora_memory_gb or pin fewer")
        entry = AdapterEntry(name=name, path=str(path), id=next(self._ids), pinned=pinned, rank=rank,
                             content_hash=adapter.content_hash if adapter is not None else probe.fingerprint,
                             version=version, held=adapter if held else None)
        self.entries[name] = entry
        if adapter is not None and not held:
            self._put_host(name, adapter)
        return entry

    def replace(self, name: str, path: str, adapter: LoRAAdapter, held: bool = False) -> tuple[AdapterEntry, list[int]]:
        """An in-place load: `name` takes `adapter` (read and validated already) for the requests
        acquired from now on, copy-on-write. The old entry moves to a hidden name
        (`name` NUL its id), taking no new requests; its requests keep its slot and weights and it
        is removed when the last of them ends. Returns (the old entry, whose requests the caller
        points at its hidden name; slots freed now, for the engine to zero). Any error before the
        swap leaves everything as it was."""
        old = self.resolve(name, allow_unloading=True)
        if old.pinned:
            raise AdapterConflictError(f"LoRA adapter {name!r} is pinned; an in-place load of a pinned "
                                       "adapter is not supported: unload it first")
        if self.max_rank is not None and adapter.rank > self.max_rank:
            raise AdapterConflictError(f"LoRA adapter {name!r}: rank {adapter.rank} exceeds max_lora_rank={self.max_rank}: "
                                       f"serve it with --max-lora-rank {adapter.rank} or more")
        freed = self.retire(name)
        self.register(name, path, adapter=adapter, held=held, version=old.version + 1)
        return old, freed

    def retire(self, name: str) -> list[int]:
        """Move `name`'s entry to its hidden name (`name` NUL its id), taking no new requests and
        removed when its last request ends; the name is free at once. Returns slots freed now.
        Its host copy, if any, is held until then (out of the LRU): its requests must not read
        its folder again, which an in-place load from the same folder has just overwritten."""
        old = self.resolve(name, allow_unloading=True)
        hidden = f"{name}{HIDDEN}{old.id}"  # ids never repeat (versions do, after an unload)
        if old.held is None:
            old.held = self._host.get(name)
        self.drop_host_copy(name)
        del self.entries[name]
        old.name, old.unloading = hidden, True
        self.entries[hidden] = old
        return self._maybe_remove(old)

    def unregister(self, name: str) -> list[int]:
        """Refuse new requests for `name`; remove it once its requests finish. Returns slots that
        were freed now (the engine zeroes them)."""
        entry = self.resolve(name, allow_unloading=True)
        entry.unloading = True
        return self._maybe_remove(entry)

    def resolve(self, name: str, allow_unloading: bool = False) -> AdapterEntry:
        entry = self.entries.get(name)
        if entry is None:
            raise UnknownAdapterError(name, self.entries)
        if entry.unloading and not allow_unloading:
            raise AdapterUnloadingError(name)
        return entry

    def acquire(self, name: str) -> AdapterEntry:
        entry = self.resolve(name)
        entry.refcount += 1
        return entry

    def release(self, name: str) -> list[int]:
        entry = self.entries.get(name)
        if entry is None:
            return []
        entry.refcount -= 1
        assert entry.refcount >= 0, name
        return self._maybe_remove(entry)

    def _maybe_remove(self, entry: AdapterEntry) -> list[int]:
        if not entry.unloading or entry.refcount > 0:
            return []
        del self.entries[entry.name]
        self.drop_host_copy(entry.name)
        freed = []
        if entry.slot is not None:
            freed.append(entry.slot)
            self._evict(entry)
        return freed

    # ---- host tier -------------------------------------------------------------------------
    def _put_host(self, name: str, adapter: LoRAAdapter) -> None:
        self.drop_host_copy(name)
        self._host[name] = adapter
        self._host_nbytes[name] = adapter.nbytes
        self.host_bytes += self._host_nbytes[name]
        while len(self._host) > 1 and (
                (self.max_loaded_loras is not None and len(self._host) > self.max_loaded_loras)
                or (self.max_host_bytes is not None and self.host_bytes > self.max_host_bytes)):
            self.drop_host_copy(next(iter(self._host)))
            self.stats.host_evictions += 1

    def drop_host_copy(self, name: str) -> None:
        """Forget `name`'s host copy, as the host tier's LRU would: its next use reads its folder."""
        if self._host.pop(name, None) is not None:
            self.host_bytes -= self._host_nbytes.pop(name)

    def recount_host(self, name: str) -> None:
        """Count a host copy's bytes again (a slot write took the layout prepared for it)."""
        adapter = self._host.get(name)
        if adapter is not None:
            self.host_bytes += adapter.nbytes - self._host_nbytes[name]
            self._host_nbytes[name] = adapter.nbytes

    def host_copy(self, entry: AdapterEntry) -> LoRAAdapter:
        if entry.held is not None:
            return entry.held
        adapter = self._host.get(entry.name)
        if adapter is None:
            self.stats.host_misses += 1
            adapter = self._read(entry.name, entry.path)  # evicted: read its folder again
            # The folder may have changed since: new requests key their pages by what is read now.
            entry.content_hash = adapter.content_hash
            entry.rank = adapter.rank
            self._put_host(entry.name, adapter)
        else:
            self.stats.host_hits += 1
            self._host.move_to_end(entry.name)
        return adapter

    def ready(self, name: str) -> bool:
        """Can a step use it without touching a disk: in a device slot, or its host copy here?"""
        entry = self.entries.get(name)
        return entry is not None and (entry.slot is not None or entry.held is not None or name in self._host)

    def put_host(self, name: str, path: str, adapter: LoRAAdapter) -> None:
        """A host copy read in the background from `path` arrives (ignored if the name went away
        meanwhile, or was reloaded from another folder)."""
        entry = self.entries.get(name)
        if entry is None or entry.path != path or entry.slot is not None or entry.held is not None:
            return  # gone, reloaded elsewhere, or made resident meanwhile (its rows fit what was written)
        entry.content_hash, entry.rank = adapter.content_hash, adapter.rank
        self._put_host(name, adapter)

    @property
    def num_host_copies(self) -> int:
        return len(self._host)

    @property
    def host_copies(self) -> list[LoRAAdapter]:
        """The adapters the host tier holds now (least recently used first)."""
        return list(self._host.values())

    # ---- device slots and pool rows -------------------------------------------------------
    def fits(self, names: set[str]) -> bool:
        """Can these adapters be resident at once, beside the pinned ones (slots and rows)?"""
        together = {e.name for e in self.entries.values() if e.pinned} | set(names)
        if len(together) > self.num_slots:
            return False
        return self.num_rows is None or sum(round_to_pages(self.entries[n].rank) for n in together
                                            if n in self.entries) <= self.num_rows

    @property
    def rows_in_use(self) -> int:
        return sum(len(e.rows) for e in self._slot_of.values())

    def assign_slots(self, needed: set[str], in_use: set[str]) -> list[tuple[int, AdapterEntry]]:
        """Give every adapter in `needed` a slot and its rank's pages of rows (entry.rows). Returns
        the (slot, entry) pairs whose contents must be written. Evicts least recently used
        adapters outside needed | in_use, never pinned, until both fit."""
        writes = []
        for name in sorted(needed, key=lambda n: self.entries[n].id):
            entry = self.entries[name]
            if entry.slot is not None:
                self.stats.slot_hits += 1
                self._slot_lru.move_to_end(entry.slot)
                continue
            self.stats.slot_misses += 1
            slot = self._make_room(needed | in_use, entry.rank)
            entry.slot = slot
            entry.rows = self._take_rows(entry.rank)
            self._slot_of[slot] = entry
            self._slot_lru[slot] = None
            writes.append((slot, entry))
        return writes

    def drop_slot(self, name: str) -> None:
        """Forget that `name` is resident (its write failed): the next assign_slots gives it a
        slot and rows again and has it written."""
        entry = self.entries.get(name)
        if entry is None or entry.slot is None:
            return
        self._evict(entry)

    def _evict(self, entry: AdapterEntry) -> None:
        self._slot_of.pop(entry.slot, None)
        self._slot_lru.pop(entry.slot, None)
        for row in entry.rows[::PAGE_ROWS]:
            heapq.heappush(self._free_pages, row // PAGE_ROWS)
        entry.slot, entry.rows = None, ()

    def _take_rows(self, rank: int) -> tuple[int, ...]:
        n = round_to_pages(rank) // PAGE_ROWS
        if self.num_rows is None:
            while len(self._free_pages) < n:
                heapq.heappush(self._free_pages, self._next_page)
                self._next_page += 1
        pages = [heapq.heappop(self._free_pages) for _ in range(n)]
        return tuple(p * PAGE_ROWS + i for p in pages for i in range(PAGE_ROWS))

    def _room(self, rank: int) -> bool:
        slot_free = len(self._slot_of) < self.num_slots
        return slot_free and (self.num_rows is None
                              or len(self._free_pages) * PAGE_ROWS >= round_to_pages(rank))

    def _make_room(self, keep: set[str], rank: int) -> int:
        """A free slot, with room for `rank` rows beside it, evicting LRU adapters as needed."""
        if self.num_rows is not None and round_to_pages(rank) > self.num_rows:
            raise RuntimeError(f"an adapter of rank {rank} cannot fit the pool's {self.num_rows} rank rows")
        while not self._room(rank):
            victim = next((self._slot_of[s] for s in self._slot_lru
                           if not self._slot_of[s].pinned and self._slot_of[s].name not in keep), None)
            if victim is None:
                held = f"{self.num_slots} slots" + ("" if self.num_rows is None else f" and {self.num_rows} rank rows")
                raise RuntimeError(f"no room in the device pool for an adapter of rank {rank}: its {held} "
                                   "hold adapters that running sequences use or that are pinned")
            self._evict(victim)
            self.stats.slot_evictions += 1
        return next(s for s in range(NO_ADAPTER + 1, self.num_slots + 1) if s not in self._slot_of)

    def pinned_names(self) -> set[str]:
        return {e.name for e in self.entries.values() if e.pinned}

    def slot_of(self, name: Optional[str]) -> int:
        if name is None:
            return NO_ADAPTER
        slot = self.entries[name].slot
        assert slot is not None, f"adapter {name!r} has no slot"
        return slot
