"""The prefix cache end to end on a tiny Llama: greedy tokens equal transformers + PEFT with cache
hits (shared prefixes across base rows and several adapters in one batch, a second pass that
hits, a page shared by two running requests, a sharer preempted), and isolation: no request ever
reads K/V computed under another adapter, or under other weights behind the same name.

The engines use test_engine.py's shapes, so the persistent compilation cache serves them.
"""

from __future__ import annotations

import numpy as np
import pytest

from multilora.engine.engine import Engine
from multilora.engine.request import SamplingParams
from tests.test_engine import KW, MAX_MODEL_LEN, PAGE_SIZE, assert_clean

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def dirs(tiny_adapters):
    return {"a": tiny_adapters[("llama", "a_all_r8")], "b": tiny_adapters[("llama", "b_attn_r4_rslora")],
            "c": tiny_adapters[("llama", "c_mlp_r16")]}


@pytest.fixture(scope="module")
def engine(model_dir, dirs):
    return Engine(str(model_dir), {"a": str(dirs["a"]), "b": str(dirs["b"])}, **KW, warmup=False)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 256, size=n).tolist()


def peft(cache, model_dir, folder, prompts, n=MAX_NEW):
    return cache.many(model_dir, [(folder, p) for p in prompts], n)


def run(eng: Engine, prompts, loras):
    outs = eng.generate(prompts, GREEDY, lora=loras)
    assert_clean(eng)
    return outs


def test_shared_prefix_mixed_batch_then_a_second_pass_hits(engine, model_dir, dirs, peft_greedy_cache):
    eng = engine
    prefix = tokens(1, 5 * PAGE_SIZE)  # five full pages, shared by every request
    loras = [None, "a", "b", None, "a", "b"]
    folders = [None if l is None else dirs[l] for l in loras]
    for round_ in range(2):
        prompts = [prefix + tokens(100 + 10 * round_ + i, 3 + i) for i in range(len(loras))]
        hits0 = eng.scheduler.stats["prefix_hit_tokens"]
        outs = run(eng, prompts, loras)
        for o, p, f in zip(outs, prompts, folders):
            assert o.token_ids == peft(peft_greedy_cache, model_dir, f, [p])[0], (round_, o.lora)
        if round_ == 1:  # every request finds the five prefix pages of its own adapter
            assert [o.num_cached_tokens for o in outs] == [5 * PAGE_SIZE] * len(loras)
            assert eng.scheduler.stats["prefix_hit_tokens"] - hits0 == 5 * PAGE_SIZE * len(loras)


def test_page_shared_by_two_running_requests_and_a_preempted_sharer(engine, model_dir, dirs, peft_greedy_cache):
    eng = engine
    prefix = tokens(2, 4 * PAGE_SIZE)
    p1, p2, p3 = prefix + tokens(21, 6), prefix + tokens(22, 9), prefix + tokens(23, 2)
    r1 = eng.add_request(p1, GREEDY, lora="a")
    while not eng.request(r1).output_token_ids:
        eng.step()                                  # r1's prompt is in: its full pages are cached
    r2 = eng.add_request(p2, GREEDY, lora="a")
    r3 = eng.add_request(p3, GREEDY, lora="a")
    eng.step()                                      # r2 and r3 admitted beside r1's decode row
    req1, req2, req3 = (eng.request(r) for r in (r1, r2, r3))
    shared = req1.block_table[:4]
    assert req2.block_table[:4] == shared and req3.block_table[:4] == shared
    assert [eng.pages.ref_count(p) for p in shared] == [3] * 4
    assert req2.num_cached_tokens == req3.num_cached_tokens == 4 * PAGE_SIZE
    # Preempt the latest sharer: only its references go; the others keep running on the pages.
    eng.scheduler.preempt(req3)
    assert [eng.pages.ref_count(p) for p in shared] == [2] * 4
    while eng.has_unfinished():
        eng.step()
    outs = [eng.pop_output(r) for r in (r1, r2, r3)]
    want = peft(peft_greedy_cache, model_dir, dirs["a"], [p1, p2, p3])
    assert [o.token_ids for o in outs] == want
    assert req3.num_preemptions == 1
    assert_clean(eng)


def test_same_prompt_under_a_then_b_then_base_never_shares(engine, model_dir, dirs, peft_greedy_cache):
    eng = engine
    prompt = tokens(3, 5 * PAGE_SIZE + 3)
    for lora in ["a", "b", None, "a", None]:
        out = run(eng, [prompt], lora)[0]
        folder = None if lora is None else dirs[lora]
        assert out.token_ids == peft(peft_greedy_cache, model_dir, folder, [prompt])[0], lora
    # Only the repeats ("a" and the base model the second time) found pages.
    hits = [run(eng, [prompt], lora)[0].num_cached_tokens for lora in ["b", "a", None]]
    assert hits == [5 * PAGE_SIZE] * 3


def test_a_name_reloaded_with_other_weights_never_reuses_its_pages(engine, model_dir, dirs, peft_greedy_cache):
    eng = engine
    prompt = tokens(4, 4 * PAGE_SIZE + 5)
    eng.load_lora_adapter("x", str(dirs["a"]))
    first = run(eng, [prompt], "x")[0]
    assert first.token_ids == peft(peft_greedy_cache, model_dir, dirs["a"], [prompt])[0]
    eng.unload_lora_adapter("x")
    eng.load_lora_adapter("x", str(dirs["c"]))     # same name, other weights (vLLM #42125)
    again = run(eng, [prompt], "x")[0]
    assert again.num_cached_tokens == 0
    assert again.token_ids == peft(peft_greedy_cache, model_dir, dirs["c"], [prompt])[0]
    eng.unload_lora_adapter("x")
    # Another name with the first weights: the pages are keyed by contents, so they are found.
    eng.load_lora_adapter("y", str(dirs["a"]))
    same = run(eng, [prompt], "y")[0]
    assert same.num_cached_tokens == 4 * PAGE_SIZE and same.token_ids == first.token_ids
    eng.unload_lora_adapter("y")


def test_cached_pages_are_evicted_before_anything_is_preempted(engine):
    eng = engine
    for i in range(12):   # fill the cache with many different prompts' pages
        run(eng, [tokens(500 + i, 3 * PAGE_SIZE + 1)], None)
    assert eng.pages.num_cached > 0 and eng.pages.num_free == eng.pages.capacity
    held = eng.pages.allocate(eng.pages.capacity - 2 * (-(-MAX_MODEL_LEN // PAGE_SIZE)))
    try:
        assert eng.pages.num_evictable == eng.pages.num_free  # what is left is cached pages only
        pre = eng.stats["preemptions"]
        outs = eng.generate([tokens(600, 20), tokens(601, 25)], GREEDY, lora=[None, "a"])
        assert [len(o.token_ids) for o in outs] == [MAX_NEW, MAX_NEW]
        assert eng.stats["preemptions"] == pre
    finally:
        eng.pages.free(held)
    assert_clean(eng)


def test_prefix_caching_off(model_dir, dirs, peft_greedy_cache):
    eng = Engine(str(model_dir), {"a": str(dirs["a"])}, **KW, enable_prefix_caching=False, warmup=False)
    prompt = tokens(5, 4 * PAGE_SIZE + 2)
    outs = [run(eng, [prompt], "a")[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outs] == [0, 0] and eng.pages.num_cached == 0
    assert outs[1].token_ids == peft(peft_greedy_cache, model_dir, dirs["a"], [prompt])[0]
