"""Scheduler: one mixed step (decode rows + prefill chunks under one token budget), chunked prefill,
the adapter budget with its starvation guard, preemption, first come, first served, and the prefix
cache. Plain Python: no jax, no model; a "step" here is schedule() + postprocess() with a fake
sampled token for every chunk."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from multilora.engine.kv_pages import PagePool, page_keys
from multilora.engine.request import BASE_MODEL_HASH, Request, RequestStatus, SamplingParams
from multilora.engine.scheduler import Scheduler, SchedulerConfig

PARAMS = SamplingParams(max_tokens=64)
RUNNING, WAITING = RequestStatus.RUNNING, RequestStatus.WAITING


def req(i: int, n_prompt: int = 0, adapter=None, tokens=None, lora_hash=None) -> Request:
    """Request r{i} arriving i-th. Its prompt is `tokens`, or n_prompt tokens unique to it (so no
    two requests share a prefix by accident). lora_hash defaults to the adapter's name."""
    if tokens is None:
        tokens = [1000 * (i + 1) + k for k in range(n_prompt)]
    if lora_hash is None:
        lora_hash = BASE_MODEL_HASH if adapter is None else adapter.encode()
    return Request(request_id=f"r{i}", prompt_token_ids=list(tokens), params=PARAMS, arrival=i,
                   adapter=adapter, lora_hash=lora_hash)


def make(num_pages=200, page_size=4, adapters_fit=None, prefix=True, **cfg) -> Scheduler:
    pool = PagePool(num_pages, page_size, enable_prefix_caching=prefix)
    if adapters_fit is None:
        return Scheduler(SchedulerConfig(**cfg), pool)
    return Scheduler(SchedulerConfig(**cfg), pool, adapters_fit)


def step(s: Scheduler, token: int = 7):
    """One engine step without a model: the fake compute samples `token` for every chunk."""
    plan = s.schedule()
    s.postprocess(plan, [token] * len(plan.chunks))
    return plan


def rows(plan):
    return [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks]


def ids(reqs):
    return [r.request_id for r in reqs]


def check_pages(s: Scheduler):
    """Pool bookkeeping holds; block tables cover the computed tokens; a page sits in several
    tables only as a cached page, at the position its key says, with one reference per table."""
    pool = s.pages
    pool.check_invariants()
    count = Counter(p for r in s.running for p in r.block_table)
    assert 0 not in count
    assert pool.num_used == len(count)
    for p, n in count.items():
        assert pool.ref_count(p) == n
        assert n == 1 or pool.cached_key(p) is not None, f"page {p} shared but not cached"
    for r in s.running:
        assert r.status == RUNNING
        assert len(r.block_table) * pool.page_size >= r.num_computed_tokens
        for i, p in enumerate(r.block_table):
            if pool.cached_key(p) is not None:
                assert i < len(r.page_keys) and r.page_keys[i] == pool.cached_key(p)
    for r in s.waiting:
        assert r.status == WAITING and r.block_table == [] and r.num_computed_tokens == 0


# ---- budgets and chunking ----------------------------------------------------------------------

def test_idle_when_empty():
    s = make()
    plan = s.schedule()
    assert plan.kind == "idle" and plan.chunks == [] and not s.has_work
    assert s.postprocess(plan, []) == []


def test_token_budget_per_step_and_chunking():
    s = make(max_num_batched_tokens=64, max_num_seqs=8, max_prefill_seqs=8)
    rs = [req(i, 30) for i in range(3)]
    for r in rs:
        s.add(r)
    plan = s.schedule()
    assert plan.kind == "prefill" and rows(plan) == [("r0", 0, 30), ("r1", 0, 30), ("r2", 0, 4)]
    assert plan.num_tokens == 64
    assert [c.completes_prefill for c in plan.chunks] == [True, True, False]
    got = s.postprocess(plan, [5, 6, 9])
    assert got == rs[:2]                      # r2's prefill is unfinished: nothing sampled
    assert [r.output_token_ids for r in rs] == [[5], [6], []]
    assert [r.num_computed_tokens for r in rs] == [30, 30, 4]
    check_pages(s)
    # r0, r1 decode; r2's remaining 26 tokens ride in the same step, starting where it stopped
    plan = step(s)
    assert plan.kind == "mixed" and rows(plan) == [("r0", 30, 1), ("r1", 30, 1), ("r2", 4, 26)]
    assert plan.num_tokens == 28
    assert [r.output_token_ids for r in rs] == [[5, 7], [6, 7], [7]]
    plan = step(s)
    assert plan.kind == "decode" and rows(plan) == [("r0", 31, 1), ("r1", 31, 1), ("r2", 30, 1)]
    check_pages(s)


def test_long_prompt_is_prefilled_in_chunks_over_several_steps():
    s = make(max_num_batched_tokens=32, num_pages=64, page_size=4)
    r = req(0, 97)
    s.add(r)
    chunks = []
    while not r.output_token_ids:
        plan = s.schedule()
        assert len(plan.chunks) == 1
        c = plan.chunks[0]
        chunks.append((c.start, c.num_tokens))
        done = c.completes_prefill            # read before postprocess appends a token
        assert done == (c.start + c.num_tokens == 97)
        assert s.postprocess(plan, [7]) == ([r] if done else [])
        assert len(r.block_table) == s.pages.pages_for(c.start + c.num_tokens)
    # nothing is sampled before the last prompt token, even one token short of it
    assert chunks == [(0, 32), (32, 32), (64, 32), (96, 1)]
    assert r.num_computed_tokens == 97 and not r.is_prefilling and r.output_token_ids == [7]
    plan = step(s)
    assert plan.kind == "decode" and rows(plan) == [("r0", 97, 1)]


def test_token_budget_counts_decode_rows():
    s = make(max_num_batched_tokens=8)
    rs = [req(i, 2) for i in range(3)]
    for r in rs:
        s.add(r)
    step(s)                                   # three 2-token prompts
    big = req(3, 20)
    s.add(big)
    plan = step(s)
    # three decode rows first, the new prompt gets what is left of the 8 tokens
    assert plan.kind == "mixed"
    assert rows(plan) == [("r0", 2, 1), ("r1", 2, 1), ("r2", 2, 1), ("r3", 0, 5)]
    plan = step(s)
    assert rows(plan) == [("r0", 3, 1), ("r1", 3, 1), ("r2", 3, 1), ("r3", 5, 5)]
    # a budget smaller than the running set: the oldest rows go first, the rest wait a step
    s2 = make(max_num_batched_tokens=2)
    for i in range(3):
        s2.add(req(i, 1))
    assert rows(step(s2)) == [("r0", 0, 1), ("r1", 0, 1)]
    assert rows(step(s2)) == [("r0", 1, 1), ("r1", 1, 1)]


def test_mixed_steps_decode_rows_never_wait_for_a_prefill():
    s = make(max_num_batched_tokens=16, num_pages=64)
    a = req(0, 4)
    s.add(a)
    assert step(s).kind == "prefill"
    b = req(1, 60)            # prefilled in chunks of 15 beside a's decode row
    s.add(b)
    kinds, a_tokens, b_chunks = [], [], []
    while not b.output_token_ids:
        plan = step(s)
        kinds.append(plan.kind)
        a_tokens.append(len(a.output_token_ids))
        assert plan.chunks[0].request is a and plan.chunks[0].num_tokens == 1
        assert plan.num_tokens <= 16
        b_chunks.append(rows(plan)[1])
    assert kinds == ["mixed"] * 4
    assert b_chunks == [("r1", 0, 15), ("r1", 15, 15), ("r1", 30, 15), ("r1", 45, 15)]
    assert a_tokens == [2, 3, 4, 5]           # the stream got a token every step
    plan = step(s)
    assert plan.kind == "decode" and rows(plan) == [("r0", 8, 1), ("r1", 60, 1)]


def test_max_num_seqs():
    s = make(max_num_seqs=3, max_num_batched_tokens=64)
    rs = [req(i, 4) for i in range(5)]
    for r in rs:
        s.add(r)
    for _ in range(4):
        step(s)
        assert len(s.running) <= 3
    assert ids(s.running) == ["r0", "r1", "r2"] and ids(s.waiting) == ["r3", "r4"]
    s.remove(rs[1])
    assert rs[1].status == RequestStatus.FINISHED and rs[1].block_table == []
    plan = step(s)
    assert plan.kind == "mixed" and rows(plan) == [("r0", 7, 1), ("r2", 7, 1), ("r3", 0, 4)]
    assert ids(s.running) == ["r0", "r2", "r3"] and ids(s.waiting) == ["r4"]
    check_pages(s)


def test_max_prefill_seqs():
    s = make(max_num_seqs=8, max_prefill_seqs=2, max_num_batched_tokens=64)
    for i in range(5):
        s.add(req(i, 3))
    assert rows(step(s)) == [("r0", 0, 3), ("r1", 0, 3)]
    assert rows(step(s)) == [("r0", 3, 1), ("r1", 3, 1), ("r2", 0, 3), ("r3", 0, 3)]
    assert rows(step(s)) == [("r0", 4, 1), ("r1", 4, 1), ("r2", 3, 1), ("r3", 3, 1), ("r4", 0, 3)]
    # a running request still prefilling counts against the limit too
    s = make(max_prefill_seqs=1, max_num_batched_tokens=64)
    s.add(req(0, 100))
    s.add(req(1, 4))
    assert rows(step(s)) == [("r0", 0, 64)]
    assert rows(step(s)) == [("r0", 64, 36)]
    assert rows(step(s)) == [("r0", 100, 1), ("r1", 0, 4)]


def late_admitted_older_prefill(max_prefill_seqs=16, z_len=20):
    """x runs; z (older than y, adapter z) waits for the one adapter slot while base y passes it
    and decodes; x finishes; z is admitted beside y's decode row and still prefills next step."""
    s = make(adapters_fit=lambda names: len(names) <= 1, max_num_batched_tokens=16,
             max_prefill_seqs=max_prefill_seqs)
    x, z, y = req(0, 4, "x"), req(1, z_len, "z"), req(2, 4)
    for r in (x, z, y):
        s.add(r)
    step(s)
    step(s)
    s.remove(x)
    plan = step(s)
    assert [(r, n) for r, _, n in rows(plan)] == [("r2", 1), ("r1", 15)]
    return s


def test_decode_rows_do_not_count_as_prefill_chunks():
    s = late_admitted_older_prefill(max_prefill_seqs=1)
    plan = step(s)        # z's last 5 prompt tokens and y's decode row
    assert sorted(rows(plan)) == [("r1", 15, 5), ("r2", 5, 1)]


def test_decode_row_not_stalled_by_an_older_arrivals_prefill():
    s = late_admitted_older_prefill(z_len=120)   # z's prompt takes several more steps
    for _ in range(3):
        assert ("r2", 1) in [(c.request.request_id, c.num_tokens) for c in step(s).chunks]


# ---- adapters and fairness ---------------------------------------------------------------------

def test_adapter_budget_blocks_until_an_adapter_frees():
    fits = lambda names: len(names) <= 2  # noqa: E731
    s = make(adapters_fit=fits, starvation_steps=100)
    x, y, z = req(0, 4, "x"), req(1, 4, "y"), req(2, 4, "z")
    base, x2 = req(3, 4), req(4, 4, "x")
    for r in (x, y, z, base, x2):
        s.add(r)
    plan = step(s)
    # z does not fit beside x and y; base rows and more x rows may pass it
    assert ids(c.request for c in plan.chunks) == ["r0", "r1", "r3", "r4"]
    assert list(s.waiting) == [z] and s.running_adapters() == {"x", "y"}
    for _ in range(4):
        step(s)
        assert z.status == WAITING
    assert z.skipped_steps == 1               # passed in the first step only
    s.remove(y)
    plan = step(s)                            # the next step admits z beside the decode rows
    assert plan.kind == "mixed"
    assert rows(plan) == [("r0", 8, 1), ("r3", 8, 1), ("r4", 8, 1), ("r2", 0, 4)]
    assert z.status == RUNNING and s.running_adapters() == {"x", "z"}


def test_blocked_request_is_not_starved():
    fits = lambda names: len(names) <= 2  # noqa: E731
    s = make(adapters_fit=fits, starvation_steps=3, max_num_seqs=32)
    x, y, z = req(0, 4, "x"), req(1, 4, "y"), req(2, 4, "z")
    for r in (x, y, z):
        s.add(r)
    step(s)
    assert z.skipped_steps == 0               # nothing later than z was admitted
    passed = []
    w = req(4, 4, "w")                        # a second blocked request, later than z
    for arrival in range(3, 11):
        if arrival == 4:
            s.add(w)
            continue
        late = req(arrival, 4, "x")
        s.add(late)
        step(s)
        if late.status == RUNNING:
            passed.append(late.request_id)
    assert z.status == WAITING and w.status == WAITING
    assert passed == ["r3", "r5", "r6"]       # starvation_steps=3 passes of z, then none
    assert z.skipped_steps == 3               # the guard counts for the first blocked request
    assert ids(s.waiting) == ["r2", "r4", "r7", "r8", "r9", "r10"]
    s.remove(y)
    plan = step(s)
    # decode rows first; then z, then the x requests that queued behind it, in arrival order;
    # w does not fit beside x and z, and has not waited long enough to stop them
    admitted = [c.request.request_id for c in plan.chunks if c.start == 0]
    assert admitted == ["r2", "r7", "r8", "r9", "r10"]
    assert all(c.num_tokens == 1 for c in plan.chunks[:3])
    assert z.status == RUNNING and list(s.waiting) == [w]


def test_fcfs_on_pages_large_prompt_not_overtaken():
    # capacity 8 pages of 4 = 32 tokens
    s = make(num_pages=9, page_size=4, max_num_batched_tokens=64)
    a, big, small = req(0, 20), req(1, 24), req(2, 4)
    for r in (a, big, small):
        s.add(r)
    plan = step(s)
    # a takes 5 pages; big needs 6 of the 3 left; small would fit but must not pass big
    assert rows(plan) == [("r0", 0, 20)]
    assert list(s.waiting) == [big, small]
    for k in range(2):
        assert rows(step(s)) == [("r0", 20 + k, 1)]
    check_pages(s)
    s.remove(a)
    plan = step(s)
    assert rows(plan) == [("r1", 0, 24), ("r2", 0, 4)]
    check_pages(s)


# ---- preemption --------------------------------------------------------------------------------

def test_preempts_latest_arrival_when_pages_run_out():
    # capacity 4 pages of 4 tokens
    s = make(num_pages=5, page_size=4, max_num_batched_tokens=64)
    a, b = req(0, 7), req(1, 7)
    s.add(a)
    s.add(b)
    plan = step(s)
    assert plan.kind == "prefill" and len(plan.chunks) == 2 and s.pages.num_free == 0
    plan = step(s)                 # both at 8 tokens: fits in their 2 pages
    assert plan.kind == "decode" and not plan.preempted and len(plan.chunks) == 2
    b_first_page = b.block_table[0]
    c = req(2, 4)                  # arrives later: no pages for it
    s.add(c)
    plan = step(s)                 # 9 tokens: each needs a third page, none free
    assert plan.preempted == [b] and rows(plan) == [("r0", 8, 1)]
    assert b.status == WAITING and list(s.waiting) == [b, c]    # b first in line
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.output_token_ids == [7, 7]        # generated tokens are kept and recomputed later
    # b's pages were cached: a's new page evicted b's tail page, b's first page is still cached
    assert s.pages.num_evictable == 1 and s.pages.cached_key(b_first_page) is not None
    check_pages(s)
    for _ in range(3):             # a fills its third page; b waits (FCFS on pages)
        step(s)
        assert b.status == WAITING
        check_pages(s)
    s.remove(a)
    assert s.pages.num_free == s.pages.capacity and s.pages.num_used == 0
    plan = step(s)
    # b recomputes prompt + outputs, except its first page, which is still in the prefix cache
    assert plan.kind == "prefill" and rows(plan) == [("r1", 4, 5), ("r2", 0, 4)]
    assert plan.prefix_hit_tokens == 4 and b.block_table[0] == b_first_page
    assert b.num_cached_tokens == 0            # counts the first admission only
    assert b.output_token_ids == [7, 7, 7]
    check_pages(s)


def test_running_prefill_chunk_shrinks_to_free_pages_instead_of_preempting():
    s = make(num_pages=7, page_size=4, max_num_batched_tokens=16)   # capacity 6
    a = req(0, 40)
    s.add(a)
    assert rows(step(s)) == [("r0", 0, 16)]
    plan = step(s)                 # 16 more tokens need 4 pages, 2 are free: 8 tokens
    assert rows(plan) == [("r0", 16, 8)] and plan.preempted == []
    assert a.status == RUNNING and len(a.block_table) == 6 and s.pages.num_free == 0
    check_pages(s)


def test_preemption_victim_can_be_the_request_needing_pages():
    s = make(num_pages=5, page_size=4)
    a, b = req(0, 8), req(1, 7)
    s.add(a)
    s.add(b)
    step(s)      # a: 2 pages, b: 2 pages; both sample one token
    plan = s.schedule()
    # a (9 tokens) needs a 3rd page: b, the latest, is preempted; b is not decoded this step
    assert plan.preempted == [b] and rows(plan) == [("r0", 8, 1)]
    check_pages(s)
    s2 = make(num_pages=5, page_size=4)
    a, b = req(0, 7), req(1, 8)
    s2.add(a)
    s2.add(b)
    step(s2)
    plan = s2.schedule()
    # only b needs a page and b is itself the latest: it preempts itself, a decodes on
    assert plan.preempted == [b] and rows(plan) == [("r0", 7, 1)]
    assert b.status == WAITING and b.block_table == []
    check_pages(s2)


def test_remove_frees_pages_in_any_state():
    s = make(num_pages=40, max_num_batched_tokens=16)
    a, b, c = req(0, 40), req(1, 4), req(2, 4)
    for r in (a, b, c):
        s.add(r)
    step(s)                       # a partly prefilled
    assert a.is_prefilling and a.block_table
    s.remove(a)
    s.remove(c)                   # still waiting
    assert a.block_table == [] and a.status == RequestStatus.FINISHED
    assert c.status == RequestStatus.FINISHED and c not in s.waiting
    while b.status != RUNNING or b.is_prefilling:
        step(s)
    s.remove(b)
    assert not s.has_work and s.pages.num_free == s.pages.capacity and s.pages.num_used == 0
    s.pages.check_invariants()


def test_request_removed_during_the_step_gets_nothing():
    s = make(page_size=4)
    a, b = req(0, 9), req(1, 9)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    s.remove(b)                   # aborted while the step ran
    assert s.postprocess(plan, [5, 6]) == [a]
    assert a.output_token_ids == [5] and a.num_computed_tokens == 9
    assert b.output_token_ids == [] and b.block_table == [] and b.page_keys == []
    assert s.pages.num_cached == 2 and s.pages.num_used == 3    # a's 2 full pages only
    check_pages(s)


# ---- prefix cache ------------------------------------------------------------------------------

SHARED = list(range(500, 512))               # 3 pages of 4


def test_prefix_hit_shares_pages():
    s = make(page_size=4)
    a = req(0, tokens=SHARED + [1, 2, 3, 4, 5])
    s.add(a)
    plan = step(s)
    assert (plan.prefix_queried_tokens, plan.prefix_hit_tokens) == (17, 0)
    assert s.pages.num_cached == 4            # a's 4 full pages, registered after the step
    b = req(1, tokens=SHARED + [9, 9, 9, 9, 9])
    s.add(b)
    plan = s.schedule()
    assert (plan.prefix_queried_tokens, plan.prefix_hit_tokens) == (17, 12)
    assert rows(plan) == [("r0", 17, 1), ("r1", 12, 5)]
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert b.num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert b.page_keys == a.page_keys[:3]
    assert [s.pages.ref_count(p) for p in a.block_table] == [2, 2, 2, 1, 1]
    s.postprocess(plan, [7, 7])
    assert s.stats == {"prefix_queried_tokens": 34, "prefix_hit_tokens": 12}
    assert s.pages.num_cached == 5            # b's 4th page (its own tokens) joined
    check_pages(s)


def test_last_prompt_token_is_always_computed():
    s = make(page_size=4)
    a = req(0, tokens=SHARED + [1])
    s.add(a)
    step(s)
    step(s)                                   # all of a's 3 shared pages are cached
    exact = req(1, tokens=SHARED)             # exactly 3 full pages: only 2 lie in its first 11
    longer = req(2, tokens=SHARED + [1])      # 13 tokens: 3 pages hit, 1 token computed
    s.add(exact)
    s.add(longer)
    plan = s.schedule()
    assert rows(plan) == [("r0", 14, 1), ("r1", 8, 4), ("r2", 12, 1)]
    assert (exact.num_cached_tokens, longer.num_cached_tokens) == (8, 12)
    assert plan.prefix_hit_tokens == 20
    assert exact.block_table[:2] == a.block_table[:2] and exact.block_table[2] != a.block_table[2]
    assert longer.block_table[:3] == a.block_table[:3]
    s.postprocess(plan, [7, 7, 7])
    assert exact.output_token_ids == [7] and longer.output_token_ids == [7]
    check_pages(s)


def test_adapters_never_share_pages():
    s = make(page_size=4)
    first = req(0, tokens=SHARED + [1], adapter="x", lora_hash=b"hash-x")
    s.add(first)
    step(s)
    others = [req(1, tokens=SHARED + [1], adapter="y", lora_hash=b"hash-y"),   # other adapter
              req(2, tokens=SHARED + [1]),                                     # base model
              req(3, tokens=SHARED + [1], adapter="x", lora_hash=b"hash-x"),   # same adapter
              req(4, tokens=SHARED + [1], adapter="x-copy", lora_hash=b"hash-x")]  # same content
    for r in others:
        s.add(r)
    plan = step(s)
    assert [r.num_cached_tokens for r in others] == [0, 0, 12, 12]
    assert plan.prefix_hit_tokens == 24
    mine = set(first.block_table)
    assert not mine & set(others[0].block_table) and not mine & set(others[1].block_table)
    assert others[2].block_table[:3] == others[3].block_table[:3] == first.block_table[:3]
    assert not set(others[0].block_table) & set(others[1].block_table)
    check_pages(s)


def test_finished_requests_pages_stay_cached_and_hit_later():
    s = make(num_pages=20, page_size=4)
    a = req(0, tokens=SHARED + [1, 2, 3, 4])  # 16 tokens
    s.add(a)
    step(s)
    table = list(a.block_table)
    s.remove(a)
    assert s.pages.num_used == 0 and s.pages.num_evictable == 4 and s.pages.num_cached == 4
    again = req(1, tokens=SHARED + [1, 2, 3, 4])
    s.add(again)
    plan = step(s)
    assert rows(plan) == [("r1", 12, 4)] and plan.prefix_hit_tokens == 12
    assert again.block_table[:3] == table[:3] and again.block_table[3] != table[3]
    # the 4th page holds the last prompt token, so it is recomputed in a page of its own; that
    # copy's key is already held, so it stays private and a's 4th page stays evictable
    assert s.pages.num_evictable == 1 and s.pages.cached_key(table[3]) is not None
    assert s.pages.cached_key(again.block_table[3]) is None
    check_pages(s)


def test_cached_pages_are_evicted_lru_instead_of_preempting():
    s = make(num_pages=7, page_size=4)        # capacity 6
    a = req(0, tokens=SHARED)
    s.add(a)
    step(s)
    pa = list(a.block_table)
    s.remove(a)                               # freed tail first: pa[2] is the oldest in the LRU
    assert s.pages.num_evictable == 3
    b = req(1, 17)                            # 5 pages: 3 free + 2 evicted
    s.add(b)
    plan = step(s)
    assert plan.preempted == [] and rows(plan) == [("r1", 0, 17)]
    assert set(b.block_table) >= {pa[2], pa[1]} and pa[0] not in b.block_table
    assert s.pages.cached_key(pa[0]) is not None and s.pages.num_evictable == 1
    for _ in range(3):                        # b decodes within its 5 pages
        assert step(s).preempted == []
    plan = step(s)                            # b's 6th page evicts a's last cached page
    assert plan.preempted == [] and b.block_table[5] == pa[0]
    assert s.pages.num_evictable == 0 and s.pages.num_free == 0
    check_pages(s)
    s.remove(b)
    c = req(2, tokens=SHARED)                 # a's pages are gone: nothing hits
    s.add(c)
    assert step(s).prefix_hit_tokens == 0


def test_preempted_sharer_keeps_the_other_intact_and_hits_its_own_pages():
    s = make(num_pages=7, page_size=4)        # capacity 6
    a = req(0, tokens=SHARED[:8] + [1, 2, 3, 4])
    s.add(a)
    step(s)                                   # a: 3 pages, all full and cached
    b = req(1, tokens=SHARED[:8] + [5, 6, 7, 8])
    s.add(b)
    plan = step(s)
    assert rows(plan) == [("r0", 12, 1), ("r1", 8, 4)]
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared and [s.pages.ref_count(p) for p in shared] == [2, 2]
    b_own = b.block_table[2]                  # b's 3rd page, full and cached after this step
    assert s.pages.cached_key(b_own) is not None
    for _ in range(3):
        assert step(s).preempted == []
    # a: 16 tokens computed, 4 full pages; b: 15 computed, 4 pages; all 6 pages in use
    assert (a.num_computed_tokens, b.num_computed_tokens) == (16, 15) and s.pages.num_free == 0
    a_table = list(a.block_table)
    plan = step(s)                            # a needs a 5th page: b, the latest, goes
    assert plan.preempted == [b] and rows(plan) == [("r0", 16, 1)]
    assert a.block_table[:4] == a_table and len(a.block_table) == 5
    assert [s.pages.ref_count(p) for p in shared] == [1, 1]
    assert all(s.pages.cached_key(p) is not None for p in shared + [b_own])
    assert s.pages.num_evictable == 1         # b_own; b's partial 4th page went to a
    assert b.block_table == [] and b.status == WAITING and len(b.output_token_ids) == 4
    check_pages(s)
    step(s)                                   # a decodes on; b still waits for pages
    assert b.status == WAITING and s.pages.ref_count(shared[0]) == 1
    s.remove(a)
    plan = step(s)
    # b hits the shared prefix and its own 3rd page, and recomputes its partial 4th page
    assert rows(plan) == [("r1", 12, 4)] and plan.prefix_hit_tokens == 12
    assert b.block_table[:3] == shared + [b_own]
    assert b.num_cached_tokens == 8           # its first admission's hits
    check_pages(s)


def test_stats_add_up():
    s = make(page_size=4)
    plans = []
    for i, tail in enumerate([[1], [2], [3, 4, 5, 6, 7]]):
        s.add(req(i, tokens=SHARED + tail))
        plans.append(step(s))
    assert [(p.prefix_queried_tokens, p.prefix_hit_tokens) for p in plans] == \
        [(13, 0), (13, 12), (17, 12)]
    assert s.stats == {"prefix_queried_tokens": 43, "prefix_hit_tokens": 24}
    assert s.stats["prefix_queried_tokens"] == sum(p.prefix_queried_tokens for p in plans)
    assert s.stats["prefix_hit_tokens"] == sum(p.prefix_hit_tokens for p in plans)


def test_no_hits_with_prefix_caching_disabled():
    s = make(page_size=4, prefix=False)
    a = req(0, tokens=SHARED + [1])
    s.add(a)
    step(s)
    s.remove(a)
    assert s.pages.num_cached == 0 and s.pages.num_evictable == 0
    b, c = req(1, tokens=SHARED + [1]), req(2, tokens=SHARED + [1])
    s.add(b)
    s.add(c)
    plan = step(s)
    assert rows(plan) == [("r1", 0, 13), ("r2", 0, 13)]
    assert plan.prefix_hit_tokens == 0 and plan.prefix_queried_tokens == 26
    assert not set(b.block_table) & set(c.block_table)
    assert s.stats == {"prefix_queried_tokens": 39, "prefix_hit_tokens": 0}
    check_pages(s)


# ---- randomized --------------------------------------------------------------------------------

def fake_compute(s: Scheduler, plan, kv: dict) -> None:
    """Check each chunk attends to its own earlier tokens (same chain root), then write its own
    (lora_hash, token) at each computed position: kv[page][slot]."""
    p = s.pages.page_size
    for c in plan.chunks:
        r = c.request
        toks = r.all_token_ids
        for pos in range(c.start):
            assert kv[r.block_table[pos // p]][pos % p] == (r.lora_hash, toks[pos]), r.request_id
        for pos in range(c.start, c.start + c.num_tokens):
            kv.setdefault(r.block_table[pos // p], [None] * p)[pos % p] = (r.lora_hash, toks[pos])


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_invariants(seed):
    """Random arrivals with shared prefixes, adapters, finishes and a tight page pool: budgets
    hold every step, pages never leak, cached pages hold what their users expect, every request
    eventually completes."""
    rnd = random.Random(seed)
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=16, max_prefill_seqs=3, starvation_steps=4)
    fits = lambda names: len(names) <= 2  # noqa: E731
    s = make(num_pages=1 + 14, page_size=4, adapters_fit=fits, **cfg)
    prefixes = [[rnd.randint(1, 50) for _ in range(rnd.randint(0, 14))] for _ in range(3)]
    reqs, target, kv, arrival = [], {}, {}, 0
    for _ in range(600):
        if arrival < 24 and rnd.random() < 0.5:
            tokens = rnd.choice(prefixes) + [rnd.randint(1, 3) for _ in range(rnd.randint(1, 12))]
            r = req(arrival, tokens=tokens, adapter=rnd.choice([None, "x", "y", "z"]))
            target[r.request_id] = rnd.randint(1, 10)
            reqs.append(r)
            s.add(r)
            arrival += 1
        plan = s.schedule()
        fake_compute(s, plan, kv)
        s.postprocess(plan, [rnd.randint(1, 3) for _ in plan.chunks])
        assert plan.num_tokens <= cfg["max_num_batched_tokens"]
        assert sum(c.num_tokens > 1 for c in plan.chunks) <= cfg["max_prefill_seqs"]
        assert len({id(c.request) for c in plan.chunks}) == len(plan.chunks)
        assert len(s.running) <= cfg["max_num_seqs"]
        assert fits(s.running_adapters())
        check_pages(s)
        for r in list(s.running):
            if len(r.output_token_ids) >= target[r.request_id] and not r.is_prefilling:
                s.remove(r)
        if arrival == 24 and not s.has_work:
            break
    assert not s.has_work, "requests left unfinished"
    assert all(len(r.output_token_ids) >= target[r.request_id] for r in reqs)
    assert s.pages.num_used == 0 and s.pages.num_free == s.pages.capacity
    assert 0 < s.stats["prefix_hit_tokens"] < s.stats["prefix_queried_tokens"]
    s.pages.check_invariants()


def test_page_keys_of_a_request_match_the_chain():
    """The keys a request registers are the one-shot chain over its tokens (from its lora_hash)."""
    s = make(page_size=4)
    a = req(0, tokens=SHARED + [1, 2, 3, 4, 5], adapter="x", lora_hash=b"hash-x")
    s.add(a)
    step(s)
    assert a.page_keys == page_keys(b"hash-x", a.all_token_ids, 4)
    assert [s.pages.cached_key(p) for p in a.block_table[:4]] == a.page_keys


def test_a_hot_adapter_does_not_starve_a_cold_one():
    """Per-adapter queues in turns: 20 requests for a hot adapter arrive before one for a cold
    adapter and one for the base model; with room for 4 new rows per step the cold and base
    requests are admitted in the first step, not after the hot queue drains. Within an adapter
    the order stays first come, first served."""
    s = make(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_seqs=4)
    hot = [req(i, 4, adapter="hot") for i in range(20)]
    cold, base = req(20, 4, adapter="cold"), req(21, 4)
    for r in (*hot, cold, base):
        s.add(r)
    first = ids(c.request for c in step(s).chunks)
    assert set(first) == {"r0", "r1", "r20", "r21"}, first
    assert [x for x in first if x in {"r0", "r1"}] == ["r0", "r1"]


def test_fair_turns_count_what_each_adapter_already_runs():
    """The adapter with fewer running requests goes first: with 'a' running three and 'b' one,
    the next free rows go to b's queue before a's; preempted requests go before all."""
    s = make(max_num_seqs=8, max_num_batched_tokens=256, max_prefill_seqs=8)
    for r in (req(0, 4, "a"), req(1, 4, "a"), req(2, 4, "a"), req(3, 4, "b")):
        s.add(r)
    step(s)
    later = [req(4, 4, "a"), req(5, 4, "a"), req(6, 4, "b"), req(7, 4, "b"), req(8, 4, "b")]
    for r in later:
        s.add(r)
    order = ids(s.admission_order())
    assert order == ["r6", "r7", "r4", "r8", "r5"], order  # b: 1 running, a: 3
    later[1].num_preemptions = 1
    assert ids(s.admission_order())[0] == "r5"
