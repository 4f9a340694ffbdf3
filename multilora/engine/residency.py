"""Which adapters a step can use: host copies read off the engine thread are taken in, reads are
started (or moved ahead) for the adapters waiting requests need, and a step's adapters are written
into device slots before it runs. A read or write that fails fails only the requests of that
adapter. Host bookkeeping; the device writes go through the runner."""

from __future__ import annotations

import logging
from typing import Callable

from multilora.adapters.adapter import AdapterError
from multilora.engine.request import Request
from multilora.engine.scheduler import StepPlan

log = logging.getLogger("multilora.engine")


class AdapterResidency:
    """The engine's adapters between disk, host memory and device slots, for its steps."""

    def __init__(self, registry, loader, runner, scheduler, fail: Callable[[Request], None]):
        """fail(request): end a request whose adapter could not be read or written (its `error`
        says why) with finish reason "error"."""
        self.registry, self.loader, self.runner, self.scheduler = registry, loader, runner, scheduler
        self.fail = fail
        self.waited_reads: set[str] = set()  # adapters whose read a request waits for (host misses)

    def write_slots(self, needed: set[str]) -> None:
        in_use = self.scheduler.running_adapters() | self.registry.pinned_names()
        # Host copies first: a copy read again may have another rank, and the rows follow it.
        adapters = {n: self.registry.host_copy(self.registry.entries[n])
                    for n in needed if self.registry.entries[n].slot is None}
        writes = self.registry.assign_slots(needed, in_use)
        for i, (slot, entry) in enumerate(writes):
            try:
                self.runner.write_slot(slot, entry.rows, adapters[entry.name])
                self.registry.recount_host(entry.name)  # the write took its prepared layout
            except BaseException:
                # The registry already counts these as resident, but their rows were never
                # written: forget them, or a later batch would run on the rows' old contents.
                for _, e in writes[i:]:
                    self.registry.drop_slot(e.name)
                raise

    def fetch(self) -> None:
        """Host copies read in the background: take the finished reads (a failed one fails its
        waiting requests, nothing else), and start reads for waiting requests whose adapter is
        neither in a slot nor in host memory. The scheduler admits a request only once its
        adapter is ready, so a step never waits on a disk."""
        for name, path, adapter, error in self.loader.poll():
            self.waited_reads.discard(name)
            if adapter is not None:
                self.registry.stats.loads += 1
                self.registry.put_host(name, path, adapter)
                entry = self.registry.entries.get(name)
                if entry is not None:  # its content is known now: waiting requests key pages by it
                    for req in self.scheduler.waiting:
                        if req.adapter == name and not req.block_table and not req.num_computed_tokens:
                            req.lora_hash = entry.content_hash
                continue
            self.registry.stats.load_failures += 1
            log.warning("reading adapter %r from %s failed: %s", name, path, error)
            for req in list(self.scheduler.waiting):
                if req.adapter == name:
                    req.error = str(error)
                    self.fail(req)
        for req in self.scheduler.waiting:
            if req.adapter is not None and not self.registry.ready(req.adapter):
                entry = self.registry.entries.get(req.adapter)
                if entry is None:
                    continue
                self.loader.prefetch(req.adapter, entry.path, urgent=True)  # started, moved ahead or rushed
                if req.adapter not in self.waited_reads:  # a request waits for this read (counted once,
                    self.waited_reads.add(req.adapter)     # a read-ahead already under way included)
                    self.registry.stats.host_misses += 1

    def make_resident(self, plan: StepPlan) -> None:
        """Every adapter of the plan in a device slot. An adapter that cannot be read again (an
        evicted host copy whose folder went bad) fails its requests, which leave the plan."""
        needed = {c.request.adapter for c in plan.chunks if c.request.adapter is not None}
        while needed:  # each failure takes one adapter out, so this ends
            try:
                self.write_slots(needed)
                break
            except AdapterError as e:
                bad = e.adapter_name
                for c in plan.chunks:
                    if c.request.adapter == bad and not c.request.finished:
                        c.request.error = str(e)
                        self.fail(c.request)
                needed = needed - {bad}
        plan.chunks = [c for c in plan.chunks if not c.request.finished]
