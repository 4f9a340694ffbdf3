"""Continuous batching: which requests compute which tokens this step. Plain Python, no jax.

A step is either a prefill step (chunks of prompts, up to max_num_batched_tokens tokens) or a
decode step (one token for every running request whose prompt is in the cache). When both kinds
have work they alternate, so new prompts never stall running streams and vice versa.

Budgets: tokens per step, running sequences (max_num_seqs), free KV pages, and distinct adapters
among running requests (max_loras_per_batch, pinned adapters included): a request whose adapter
does not fit waits. Later requests may pass a blocked one, but only for `starvation_steps` steps;
after that nothing passes it (first come, first served within the adapter budget). When pages run
out in decode, the latest-arrived running request is preempted (its pages freed, recomputed later).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable, Optional

from multilora.engine.kv_pages import PagePool
from multilora.engine.request import Request, RequestStatus


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_prefill_seqs: int = 16
    starvation_steps: int = 32


@dataclasses.dataclass
class ScheduledChunk:
    request: Request
    start: int        # first token computed this step
    num_tokens: int

    @property
    def completes_prefill(self) -> bool:
        return self.start + self.num_tokens == self.request.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    kind: str                                   # "prefill" | "decode" | "idle"
    chunks: list[ScheduledChunk]
    preempted: list[Request] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pages: PagePool,
                 adapters_fit: Callable[[set[str]], bool] = lambda names: True):
        self.cfg = cfg
        self.pages = pages
        self.adapters_fit = adapters_fit
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._last_kind = "decode"

    # ---- queue -----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def running_adapters(self) -> set[str]:
        return {r.adapter for r in self.running if r.adapter is not None}

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and give back its pages (finish or abort)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.block_table:
            self.pages.free(req.block_table)
            req.block_table = []
        req.status = RequestStatus.FINISHED

    # ---- scheduling ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        prefill_ready = any(r.is_prefilling for r in self.running) or bool(self.waiting)
        decode_ready = any(not r.is_prefilling for r in self.running)
        if prefill_ready and (self._last_kind == "decode" or not decode_ready):
            out = self._schedule_prefill()
            if out.chunks:
                self._last_kind = "prefill"
                return out
        if decode_ready:
            self._last_kind = "decode"
            return self._schedule_decode()
        return SchedulerOutput("idle", [])

    def _schedule_prefill(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []

        def take(req: Request) -> bool:
            nonlocal budget
            n = min(req.num_uncomputed, budget)
            start = req.num_computed_tokens
            if n <= 0:
                return False
            extra = self.pages.pages_for(start + n) - len(req.block_table)
            if extra > self.pages.num_free:
                n = (len(req.block_table) + self.pages.num_free) * self.pages.page_size - start
                if n <= 0:
                    return False
            self.pages.grow(req.block_table, start + n)
            chunks.append(ScheduledChunk(req, start, n))
            budget -= n
            return True

        for req in self.running:  # unfinished chunked prefills first
            if req.is_prefilling and budget > 0 and len(chunks) < self.cfg.max_prefill_seqs:
                take(req)
        adapters = self.running_adapters()
        blocked_head: Optional[Request] = None
        for req in list(self.waiting):
            if budget <= 0 or len(chunks) >= self.cfg.max_prefill_seqs \
                    or len(self.running) >= self.cfg.max_num_seqs:
                break
            wanted = adapters | ({req.adapter} if req.adapter else set())
            fits = self.adapters_fit(wanted)
            if not fits:
                if blocked_head is None:
                    blocked_head = req
                continue
            if blocked_head is not None:
                if blocked_head.skipped_steps >= self.cfg.starvation_steps:
                    break  # the blocked request has waited long enough: nothing passes it now
            if self.pages.pages_for(min(req.num_uncomputed, budget)) > self.pages.num_free:
                break  # FCFS on pages: don't let smaller prompts overtake a large one
            if not take(req):
                break
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            adapters = wanted
        if blocked_head is not None and any(c.request.arrival > blocked_head.arrival for c in chunks):
            blocked_head.skipped_steps += 1
        return SchedulerOutput("prefill", chunks)

    def _schedule_decode(self) -> SchedulerOutput:
        preempted: list[Request] = []
        decodable = sorted((r for r in self.running if not r.is_prefilling), key=lambda r: r.arrival)
        chunks = []
        i = 0
        while i < len(decodable):
            req = decodable[i]
            need = self.pages.pages_for(req.num_tokens) - len(req.block_table)
            while need > self.pages.num_free:
                victim = max(self.running, key=lambda r: r.arrival)
                self._preempt(victim)
                preempted.append(victim)
                if victim in decodable:
                    decodable.remove(victim)
                if victim is req:
                    break
            if req in preempted:
                continue
            self.pages.grow(req.block_table, req.num_tokens)
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, 1))
            i += 1
        return SchedulerOutput("decode", chunks, preempted)

    def _preempt(self, req: Request) -> None:
        """Recompute later: free the pages, put it first in line."""
        self.running.remove(req)
        self.pages.free(req.block_table)
        req.block_table = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    # ---- after the step --------------------------------------------------------------------
    def commit(self, out: SchedulerOutput) -> None:
        """The step ran: its chunks' tokens are in the cache."""
        for c in out.chunks:
            c.request.num_computed_tokens = c.start + c.num_tokens
