"""Continuous batching with one mixed step: which requests compute which tokens. Plain Python, no jax.

    plan = scheduler.schedule()          # decode rows + prefill chunks, pages granted
    ...                                  # the runner computes the plan and samples
    sampled = scheduler.postprocess(plan, tokens)

Every step carries all running requests first (oldest first: one token for each decoding one, a
chunk for each one still prefilling), then admits waiting requests as prefill chunks, all under
one token budget (max_num_batched_tokens): chunked prefill rides along with decode, as in vLLM V1
and Sarathi-Serve, so a stream never waits for a whole prompt's prefill.

Admission is fair across adapters: waiting requests form one queue per adapter (the base model
counts as one), first come first served within each, and the queues take turns, the adapter with
the fewest requests already running going first (ties: the one waiting longest). The other
choices of an n > 1 request wait until the first choice's prompt is prefilled and then take its
pages from the prefix cache: one prefill for all of them. So a hot
adapter with a thousand queued requests shares the free rows with a cold one's single request
instead of starving it (LoRAX's per-adapter queues, round-robin), and a request waits at most
one turn per other adapter that is waiting. Preempted requests go before all others.

Budgets: tokens per step (max_num_batched_tokens; below it, where the engine budgets steps by
their measured costs, what token_budget allows a step with its decode rows: a long prompt then
prefills in smaller chunks while streams decode, multilora.engine.step_budget), running
sequences (max_num_seqs), prefill chunks per step (max_prefill_seqs), free KV pages, and distinct adapters among running requests (adapters_fit,
pinned adapters included): a request whose adapter does not fit waits. Later requests may pass a
blocked one, but only for `starvation_steps` steps; after that nothing passes it. When pages run out, the latest-arrived running request
not yet served this step is preempted (its page references dropped, recomputed later; its full
pages stay in the prefix cache, so the recompute mostly hits).

Prefix cache (multilora.engine.kv_pages): at admission a request's full prompt pages are looked
up by their hash chain, which starts from the hash of its adapter's contents, so pages are shared
among requests of the same adapter (or among base-model requests) and never across adapters. The
last prompt token is always computed (it gives the logits). After each step, pages that became
full are registered under their keys.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Callable, Optional, Sequence

from multilora.engine.kv_pages import PagePool, page_keys
from multilora.engine.request import PENDING_TOKEN, Request, RequestStatus


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
    # After this chunk every known token has K/V: the step samples the next one (fixed when
    # scheduled; postprocess appends that token).
    completes_prefill: bool = dataclasses.field(init=False)
    # speculative decoding (multilora.engine.speculative): tokens drafted after a decode row's
    # last token, computed in the same step; resolve sets how many the step's tokens accepted
    draft: list[int] = dataclasses.field(default_factory=list)
    accepted: int = 0

    def __post_init__(self):
        self.completes_prefill = self.start + self.num_tokens == self.request.num_tokens


@dataclasses.dataclass
class StepPlan:
    chunks: list[ScheduledChunk]
    preempted: list[Request] = dataclasses.field(default_factory=list)
    prefix_queried_tokens: int = 0     # prompt tokens looked up in the prefix cache this step
    prefix_hit_tokens: int = 0         # of those, found
    awaiting: list[int] = dataclasses.field(default_factory=list)  # chunks given a PENDING_TOKEN (advance)

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes: the chunks' and their drafts'."""
        return sum(c.num_tokens + len(c.draft) for c in self.chunks)

    @property
    def kind(self) -> str:
        """"idle", "decode" (single-token chunks only), "prefill" (chunks only) or "mixed"."""
        if not self.chunks:
            return "idle"
        single = sum(c.num_tokens == 1 for c in self.chunks)
        return "decode" if single == len(self.chunks) else "prefill" if single == 0 else "mixed"


def _done_when_resolved(req: Request) -> bool:
    """Its pending token (async scheduling) is its last: nothing more to compute for it."""
    return bool(req.awaiting) and len(req.output_token_ids) >= req.max_tokens


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pages: PagePool,
                 adapters_fit: Callable[[set[str]], bool] = lambda names: True,
                 adapter_ready: Callable[[str], bool] = lambda name: True,
                 token_budget: Optional[Callable[[int], int]] = None):
        """adapters_fit: can these adapters be resident at once; adapter_ready: can a step use
        this adapter without a disk read (a request waits, and others pass it, until it can);
        token_budget: the tokens a step with this many decode rows may carry, below
        max_num_batched_tokens (multilora.engine.step_budget: decode streams keep their
        inter-token latency while prompts arrive); None: max_num_batched_tokens alone."""
        self.cfg = cfg
        self.pages = pages
        self.adapters_fit = adapters_fit
        self.adapter_ready = adapter_ready
        self.token_budget = token_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = {"prefix_queried_tokens": 0, "prefix_hit_tokens": 0}

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
        """Take a request out of the queues and drop its page references (finish or abort)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release_pages(req)
        req.status = RequestStatus.FINISHED

    def _release_pages(self, req: Request) -> None:
        if req.block_table:
            self.pages.free(req.block_table[::-1])  # tail pages first in line for eviction
        req.block_table = []
        req.page_keys = []

    # ---- scheduling ------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan([])
        budget = self.cfg.max_num_batched_tokens
        if self.token_budget is not None:
            decode_rows = sum(r.status is RequestStatus.RUNNING and not r.is_prefilling and not _done_when_resolved(r)
                              for r in self.running)
            budget = min(budget, self.token_budget(decode_rows))
        served: set[int] = set()
        prefill_chunks = 0
        # Decode rows first (one token each), then running prefills: an older request admitted
        # late never holds a stream back for its whole prompt.
        for req in sorted(self.running, key=lambda r: (r.is_prefilling, r.arrival)):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if _done_when_resolved(req):
                continue
            prefilling = req.is_prefilling
            if prefilling and prefill_chunks >= self.cfg.max_prefill_seqs:
                continue
            n = self._grant(req, min(req.num_uncomputed, budget), served, plan)
            if n == 0:
                continue
            plan.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            served.add(id(req))
            budget -= n
            prefill_chunks += n > 1
        self._admit(plan, budget, prefill_chunks)
        return plan

    def _grant(self, req: Request, n: int, served: set[int], plan: StepPlan) -> int:
        """Pages for req's next n tokens: fewer tokens when a prefill chunk can shrink, else
        preempt the latest-arrived running request not served this step. 0: req itself was
        preempted (it was the latest)."""
        start = req.num_computed_tokens
        while True:
            need = self.pages.pages_for(start + n) - len(req.block_table)
            if need <= self.pages.num_free:
                self.pages.grow(req.block_table, start + n)
                return n
            fit = (len(req.block_table) + self.pages.num_free) * self.pages.page_size - start
            if fit >= 1 and n > 1:
                n = min(n, fit)
                continue
            victim = max((r for r in self.running if id(r) not in served), key=lambda r: r.arrival)
            self.preempt(victim)
            plan.preempted.append(victim)
            if victim is req:
                return 0

    def _admit(self, plan: StepPlan, budget: int, prefill_chunks: int) -> None:
        adapters = self.running_adapters()
        blocked_head: Optional[Request] = None
        admitted: list[Request] = []
        for req in self.admission_order():
            if budget <= 0 or prefill_chunks >= self.cfg.max_prefill_seqs \
                    or len(self.running) >= self.cfg.max_num_seqs:
                break
            if req.adapter is not None and not self.adapter_ready(req.adapter):
                continue  # its adapter is being read in the background: the others go on
            lead = req.follows
            if lead is not None and not lead.finished and (lead.status is RequestStatus.WAITING
                                                           or lead.is_prefilling):
                continue  # n > 1: the prompt's pages come from its first choice's prefill
            wanted = adapters | ({req.adapter} if req.adapter else set())
            if not self.adapters_fit(wanted):
                if blocked_head is None:
                    blocked_head = req
                continue
            if blocked_head is not None and blocked_head.skipped_steps >= self.cfg.starvation_steps:
                break  # the blocked request has waited long enough: nothing passes it now
            hits = self._match_prefix(req)
            n = min(req.num_uncomputed, budget)
            start = req.num_computed_tokens
            free_tokens = (len(req.block_table) + self.pages.num_free) * self.pages.page_size - start
            if free_tokens < n:
                # FCFS on pages: no smaller prompt overtakes this one; give back what it matched
                self._release_pages(req)
                req.num_computed_tokens = 0
                break
            self.pages.grow(req.block_table, start + n)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(req)
            plan.chunks.append(ScheduledChunk(req, start, n))
            plan.prefix_queried_tokens += req.num_tokens
            plan.prefix_hit_tokens += hits
            if req.num_preemptions == 0:
                req.num_cached_tokens = hits
            budget -= n
            prefill_chunks += n > 1
            adapters = wanted
        if blocked_head is not None and any(r.arrival > blocked_head.arrival for r in admitted):
            blocked_head.skipped_steps += 1
        self.stats["prefix_queried_tokens"] += plan.prefix_queried_tokens
        self.stats["prefix_hit_tokens"] += plan.prefix_hit_tokens

    def admission_order(self) -> list[Request]:
        """The waiting requests in the order they are offered rows: preempted ones first, then
        the per-adapter queues in turns (the k-th waiting request of an adapter with m running
        goes at turn m + k; within a turn, the earlier arrival first)."""
        running: dict = {}
        for r in self.running:
            running[r.adapter] = running.get(r.adapter, 0) + 1
        queued: dict = {}
        keyed = []
        for req in self.waiting:
            k = queued.get(req.adapter, 0)
            queued[req.adapter] = k + 1
            turn = running.get(req.adapter, 0) + k
            keyed.append(((req.num_preemptions == 0, turn, req.arrival), req))
        return [req for _, req in sorted(keyed, key=lambda kr: kr[0])]

    def _match_prefix(self, req: Request) -> int:
        """Take the cached pages of req's longest cached prefix (never its last known token);
        returns the tokens they hold."""
        if not self.pages.enable_prefix_caching or req.num_computed_tokens or req.block_table:
            return 0
        if req.params.prompt_logprobs is not None:  # its prompt's logprobs need every position computed
            return 0
        p = self.pages.page_size
        keys = page_keys(req.lora_hash, req.all_token_ids[:req.num_tokens - 1], p)
        pages = self.pages.match_prefix(keys) if keys else []
        req.block_table = list(pages)
        req.page_keys = keys[:len(pages)]
        req.num_computed_tokens = len(pages) * p
        return req.num_computed_tokens

    def preempt(self, req: Request) -> None:
        """Recompute later: drop its page references, put it first in line."""
        self.running.remove(req)
        self._release_pages(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    # ---- after the step --------------------------------------------------------------------
    def postprocess(self, plan: StepPlan, sampled: Sequence[int], spec: Optional[Sequence] = None) -> list[Request]:
        """The step ran: its chunks' tokens are in the cache. Pages that became full join the
        prefix cache; every chunk that completed its request's known tokens gets its sampled
        token appended. Returns those requests (in plan order)."""
        self.advance(plan)
        return self.resolve(plan, sampled, spec)

    def advance(self, plan: StepPlan) -> None:
        """The step is dispatched: its chunks count as computed, and every chunk that completed
        its request's known tokens appends a PENDING_TOKEN, so the next plan can be made before
        the step's tokens are read (async scheduling; resolve fills them in)."""
        for i, c in enumerate(plan.chunks):
            req = c.request
            if req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens = c.start + c.num_tokens
            if c.completes_prefill:
                req.output_token_ids.append(PENDING_TOKEN)
                req.awaiting = True
                plan.awaiting.append(i)

    def resolve(self, plan: StepPlan, sampled: Sequence[int], spec: Optional[Sequence] = None) -> list[Request]:
        """The advanced step's tokens were read: each PENDING_TOKEN it appended becomes its
        token (also for a request preempted since: the token stands, its pages are recomputed),
        and pages that became full join the prefix cache. Returns the requests that got a token
        (in plan order); finished ones (their pending token dropped) are skipped.
        spec: per chunk with a draft, the tokens sampled at its 1 + len(draft) positions: the
        drafts equal to them are accepted up to the first that is not (their K/V counts as
        computed), and the token sampled after the last accepted one follows them."""
        if len(sampled) != len(plan.chunks):
            raise ValueError(f"{len(sampled)} sampled tokens for {len(plan.chunks)} chunks")
        got = []
        for i in plan.awaiting:
            c = plan.chunks[i]
            req = c.request
            if req.finished or not req.awaiting:
                continue
            assert req.output_token_ids[-1] == PENDING_TOKEN, "a pending token is the last one"
            req.output_token_ids[-1] = int(sampled[i])
            if c.draft and req.status is RequestStatus.RUNNING:
                tokens = [int(t) for t in spec[i]]
                a = 0
                while a < len(c.draft) and tokens[a] == c.draft[a]:
                    a += 1
                c.accepted = a
                req.output_token_ids[-1:] = tokens[:a + 1]
                req.num_computed_tokens += a
            req.awaiting = False
            got.append(req)
        for c in plan.chunks:
            if c.request.status is RequestStatus.RUNNING:
                self._register_full_pages(c.request)
        return got

    def _register_full_pages(self, req: Request) -> None:
        if not self.pages.enable_prefix_caching:
            return
        p = self.pages.page_size
        full = req.num_computed_tokens // p
        have = len(req.page_keys)
        if full <= have:
            return
        new = page_keys(req.lora_hash, req.all_token_ids[:full * p], p,
                        parent=req.page_keys[-1] if have else None, start_page=have)
        for i, key in enumerate(new, start=have):
            self.pages.register(req.block_table[i], key)
        req.page_keys.extend(new)
