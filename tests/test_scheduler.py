"""Scheduler: continuous batching budgets, chunked prefill, prefill/decode alternation, the adapter
budget with its starvation guard, preemption and first come, first served. Plain Python: no jax,
no model; a "step" here is schedule() + commit() + a fake sampled token for completed prefills."""

from __future__ import annotations

import pytest

from multilora.engine.kv_pages import PagePool
from multilora.engine.request import Request, RequestStatus, SamplingParams
from multilora.engine.scheduler import Scheduler, SchedulerConfig

PARAMS = SamplingParams(max_tokens=64)


def req(i: int, n_prompt: int, adapter=None) -> Request:
    return Request(request_id=f"r{i}", prompt_token_ids=list(range(1, n_prompt + 1)), params=PARAMS,
                   arrival=i, adapter=adapter)


def make(num_pages=200, page_size=4, adapters_fit=None, **cfg) -> Scheduler:
    pool = PagePool(num_pages, page_size)
    if adapters_fit is None:
        return Scheduler(SchedulerConfig(**cfg), pool)
    return Scheduler(SchedulerConfig(**cfg), pool, adapters_fit)


def step(s: Scheduler):
    """One engine step without a model: every chunk that completes its prefill samples token 7."""
    out = s.schedule()
    done = [c.request for c in out.chunks if c.completes_prefill]
    s.commit(out)
    for r in done:
        r.output_token_ids.append(7)
    return out


def check_pages(s: Scheduler):
    """Block tables hold exactly the used pages, each enough for the computed tokens."""
    tables = [p for r in s.running for p in r.block_table]
    assert len(tables) == len(set(tables)) == s.pages.num_used
    assert 0 not in tables
    for r in s.running:
        assert len(r.block_table) * s.pages.page_size >= r.num_computed_tokens
    for r in s.waiting:
        assert r.block_table == []


def test_idle_when_empty():
    s = make()
    out = s.schedule()
    assert out.kind == "idle" and out.chunks == [] and not s.has_work


def test_token_budget_per_step_and_chunking():
    s = make(max_num_batched_tokens=64, max_num_seqs=8, max_prefill_seqs=8)
    rs = [req(i, 30) for i in range(3)]
    for r in rs:
        s.add(r)
    out = step(s)
    assert out.kind == "prefill"
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == \
        [("r0", 0, 30), ("r1", 0, 30), ("r2", 0, 4)]
    assert out.num_tokens == 64
    assert [len(r.output_token_ids) for r in rs] == [1, 1, 0]   # r2's prefill is unfinished
    check_pages(s)
    kinds = [out.kind]
    while rs[2].is_prefilling:
        o = step(s)
        kinds.append(o.kind)
        assert o.num_tokens <= 64
        check_pages(s)
    # r2's remaining 26 tokens arrive in one later prefill chunk, starting where it stopped
    assert rs[2].num_computed_tokens == 30 and rs[2].output_token_ids == [7]


def test_long_prompt_is_prefilled_in_chunks_over_several_steps():
    s = make(max_num_batched_tokens=32, num_pages=64, page_size=4)
    r = req(0, 100)
    s.add(r)
    chunks = []
    while not r.output_token_ids:
        out = step(s)
        assert out.kind == "prefill"
        assert len(out.chunks) == 1
        c = out.chunks[0]
        chunks.append((c.start, c.num_tokens))
        assert len(r.block_table) == s.pages.pages_for(c.start + c.num_tokens)
    assert chunks == [(0, 32), (32, 32), (64, 32), (96, 4)]
    assert r.num_computed_tokens == 100 and not r.is_prefilling
    out = step(s)
    assert out.kind == "decode" and [(c.start, c.num_tokens) for c in out.chunks] == [(100, 1)]


def test_max_num_seqs():
    s = make(max_num_seqs=3, max_num_batched_tokens=64)
    rs = [req(i, 4) for i in range(5)]
    for r in rs:
        s.add(r)
    for _ in range(6):
        step(s)
        assert len(s.running) <= 3
    assert [r.request_id for r in s.running] == ["r0", "r1", "r2"]
    assert [r.request_id for r in s.waiting] == ["r3", "r4"]
    s.remove(rs[1])
    assert rs[1].status == RequestStatus.FINISHED and rs[1].block_table == []
    for _ in range(2):
        step(s)
    assert [r.request_id for r in s.running] == ["r0", "r2", "r3"]
    check_pages(s)


def test_max_prefill_seqs():
    s = make(max_num_seqs=8, max_prefill_seqs=2, max_num_batched_tokens=64)
    for i in range(5):
        s.add(req(i, 3))
    seen = []
    for _ in range(8):
        out = step(s)
        if out.kind == "prefill":
            assert len(out.chunks) <= 2
            seen += [c.request.request_id for c in out.chunks]
    assert seen == ["r0", "r1", "r2", "r3", "r4"]  # first come, first served


def test_prefill_and_decode_steps_alternate():
    s = make(max_num_batched_tokens=16, num_pages=64)
    a = req(0, 4)
    s.add(a)
    assert step(s).kind == "prefill"
    b = req(1, 60)            # 4 prefill chunks of 16, 16, 16, 12
    s.add(b)
    kinds, a_tokens = [], []
    while b.is_prefilling or not b.output_token_ids:
        out = step(s)
        kinds.append(out.kind)
        a_tokens.append(len(a.output_token_ids))
        if out.kind == "decode":
            assert [c.request for c in out.chunks] == [a]   # b is still prefilling
        else:
            assert [c.request for c in out.chunks] == [b]
    assert kinds == ["decode", "prefill"] * 4
    # the running stream got a token every other step while b's prompt went in
    assert a_tokens == [2, 2, 3, 3, 4, 4, 5, 5]
    out = step(s)
    assert out.kind == "decode" and {c.request.request_id for c in out.chunks} == {"r0", "r1"}


def test_decode_only_and_prefill_only_do_not_wait_for_each_other():
    s = make()
    a = req(0, 4)
    s.add(a)
    assert [step(s).kind for _ in range(3)] == ["prefill", "decode", "decode"]
    s.add(req(1, 4))
    s.add(req(2, 4))
    # last step was a decode: the waiting prompts go now
    out = step(s)
    assert out.kind == "prefill" and len(out.chunks) == 2


def test_adapter_budget_blocks_until_an_adapter_frees():
    fits = lambda names: len(names) <= 2  # noqa: E731
    s = make(adapters_fit=fits, starvation_steps=100)
    x, y, z = req(0, 4, "x"), req(1, 4, "y"), req(2, 4, "z")
    base, x2 = req(3, 4), req(4, 4, "x")
    for r in (x, y, z, base, x2):
        s.add(r)
    out = step(s)
    # z does not fit beside x and y; base rows and more x rows may pass it
    assert [c.request.request_id for c in out.chunks] == ["r0", "r1", "r3", "r4"]
    assert list(s.waiting) == [z] and s.running_adapters() == {"x", "y"}
    for _ in range(4):
        step(s)
        assert z.status == RequestStatus.WAITING
    s.remove(y)
    kinds = [step(s).kind for _ in range(2)]  # alternation: at most one decode step comes first
    assert "prefill" in kinds
    assert z.status == RequestStatus.RUNNING
    assert s.running_adapters() == {"x", "z"}


def test_blocked_request_is_not_starved():
    fits = lambda names: len(names) <= 2  # noqa: E731
    s = make(adapters_fit=fits, starvation_steps=3, max_num_seqs=32)
    x, y, z = req(0, 4, "x"), req(1, 4, "y"), req(2, 4, "z")
    for r in (x, y, z):
        s.add(r)
    step(s)
    arrival = 3
    passed = []
    for _ in range(8):
        late = req(arrival, 4, "x")
        arrival += 1
        s.add(late)
        step(s)
        step(s)
        if late.status == RequestStatus.RUNNING:
            passed.append(late.request_id)
    assert z.status == RequestStatus.WAITING
    assert passed == ["r3", "r4", "r5"]          # starvation_steps=3 passes, then none
    assert z.skipped_steps == 3
    assert list(s.waiting)[0] is z and len(s.waiting) == 6
    s.remove(y)
    out = step(s)
    if out.kind == "decode":
        out = step(s)
    assert out.kind == "prefill"
    # z first, then the x requests that queued behind it, in arrival order
    ids = [c.request.request_id for c in out.chunks]
    assert ids[0] == "r2" and ids[1:] == sorted(ids[1:], key=lambda i: int(i[1:]))
    assert z.status == RequestStatus.RUNNING


def test_fcfs_on_pages_large_prompt_not_overtaken():
    # capacity 8 pages of 4 = 32 tokens
    s = make(num_pages=9, page_size=4, max_num_batched_tokens=64)
    a, big, small = req(0, 20), req(1, 24), req(2, 4)
    for r in (a, big, small):
        s.add(r)
    out = step(s)
    # a takes 5 pages; big needs 6 of the 3 left; small would fit but must not pass big
    assert [c.request for c in out.chunks] == [a]
    assert list(s.waiting) == [big, small]
    check_pages(s)


def test_preempts_latest_arrival_when_pages_run_out():
    # capacity 4 pages of 4 tokens
    s = make(num_pages=5, page_size=4, max_num_batched_tokens=64)
    a, b = req(0, 7), req(1, 7)
    s.add(a)
    s.add(b)
    out = step(s)
    assert out.kind == "prefill" and len(out.chunks) == 2 and s.pages.num_free == 0
    out = step(s)                 # both at 8 tokens: fits in their 2 pages
    assert out.kind == "decode" and not out.preempted and len(out.chunks) == 2
    out = step(s)                 # 9 tokens: each needs a third page, none free
    assert out.kind == "decode"
    assert out.preempted == [b]
    assert [c.request for c in out.chunks] == [a]
    assert b.status == RequestStatus.WAITING and list(s.waiting) == [b]
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.output_token_ids == [7, 7]        # generated tokens are kept and recomputed later
    check_pages(s)
    # b waits (FCFS on pages) while a runs; when a finishes, b recomputes prompt + outputs
    for _ in range(3):
        step(s)
        assert b.status == RequestStatus.WAITING
        check_pages(s)
    s.remove(a)
    assert s.pages.num_free == s.pages.capacity
    out = step(s)
    assert out.kind == "prefill" and [(c.request, c.start, c.num_tokens) for c in out.chunks] == [(b, 0, 9)]
    assert b.output_token_ids == [7, 7, 7]


def test_preemption_victim_can_be_the_request_needing_pages():
    s = make(num_pages=5, page_size=4)
    a, b = req(0, 8), req(1, 7)
    s.add(a)
    s.add(b)
    step(s)      # a: 2 pages, b: 2 pages; both sample one token
    out = step(s)
    # a (9 tokens) needs a 3rd page: b, the latest, is preempted; b is not decoded this step
    assert out.preempted == [b] and [c.request for c in out.chunks] == [a]
    s2 = make(num_pages=5, page_size=4)
    a, b = req(0, 7), req(1, 8)
    s2.add(a)
    s2.add(b)
    step(s2)
    out = step(s2)
    # only b needs a page and b is itself the latest: it preempts itself, a decodes on
    assert out.preempted == [b] and [c.request for c in out.chunks] == [a]
    check_pages(s2)


def test_remove_frees_pages_in_any_state():
    s = make(num_pages=40, max_num_batched_tokens=16)
    a, b, c = req(0, 40), req(1, 4), req(2, 4)
    for r in (a, b, c):
        s.add(r)
    step(s)                       # a half prefilled
    assert a.is_prefilling and a.block_table
    s.remove(a)
    s.remove(c)                   # still waiting
    assert a.block_table == [] and a.status == RequestStatus.FINISHED
    assert c.status == RequestStatus.FINISHED and c not in s.waiting
    while b.status != RequestStatus.RUNNING or b.is_prefilling:
        step(s)
    s.remove(b)
    assert not s.has_work and s.pages.num_free == s.pages.capacity


@pytest.mark.parametrize("seed", range(3))
def test_random_workload_keeps_invariants(seed):
    """Random arrivals, finishes and a tight page pool: budgets hold every step, pages never leak,
    every request eventually completes."""
    import random
    rnd = random.Random(seed)
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=16, max_prefill_seqs=3, starvation_steps=4)
    fits = lambda names: len(names) <= 2  # noqa: E731
    s = make(num_pages=1 + 12, page_size=4, adapters_fit=fits, **cfg)
    reqs, target, arrival = [], {}, 0
    for step_no in range(400):
        if arrival < 20 and rnd.random() < 0.5:
            r = req(arrival, rnd.randint(1, 30), rnd.choice([None, "x", "y", "z"]))
            target[r.request_id] = rnd.randint(1, 12)
            reqs.append(r)
            s.add(r)
            arrival += 1
        out = step(s)
        assert out.num_tokens <= cfg["max_num_batched_tokens"]
        assert len(s.running) <= cfg["max_num_seqs"]
        if out.kind == "prefill":
            assert len(out.chunks) <= cfg["max_prefill_seqs"]
        assert fits(s.running_adapters())
        check_pages(s)
        for r in list(s.running):
            if len(r.output_token_ids) >= target[r.request_id] and not r.is_prefilling:
                s.remove(r)
        if arrival == 20 and not s.has_work:
            break
    assert not s.has_work, "requests left unfinished"
    assert all(len(r.output_token_ids) >= target[r.request_id] for r in reqs)
    assert s.pages.num_free == s.pages.capacity
