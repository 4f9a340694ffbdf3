"""Model parity: multilora's forward against transformers + PEFT at fp32, every row of mixed
batches (base-model rows beside full adapter slots), for each tiny config (Llama, Qwen2 and a tied
Llama through every test and backend; Qwen3, Mistral, Gemma 2/3 and Qwen3-MoE through the prefill
and decode tests, a few backends and greedy decoding; Qwen3-MoE's mixed prefill through every
serving backend) and each backend.

Covers one mixed prefill batch, chunked prefill followed by decode steps over shuffled pages, a
mixed step (decode rows and prefill chunks in one batch) against the same work in separate steps,
ranks below max_lora_rank, slots rewritten and cleared, and config errors. The forward is jitted
once per (config, backend, step shape) over two fixed step shapes; reference logits are memoized
for the session (tests/reference.PeftReference).
"""

from __future__ import annotations

import copy
import itertools
import torch
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from multilora.config import LoRAConfig, ModelConfig, UnsupportedModelError
from multilora.engine.batching import SeqChunk, build_batch, decode_first
from multilora.engine.runner import jit_slot_writer
from multilora.adapters.adapter import load_adapter
from multilora import kernels  # `native` needs a C++ compiler (built on first use)
from multilora.lora.backend import get_backend
from multilora.lora.batch import NO_ADAPTER
from multilora.adapters.pool import LoRASlots, page_rows
from multilora.model import kv_lanes
from multilora.model.llama import (KVCache, forward, init_kv_cache, is_heads_major, kv_cache_formats, kv_page_bytes,
                                   make_kv_cache, split_layers)
from multilora.model import projections
from multilora.model.loader import load_weights
from multilora.model.sharding import make_mesh
from tests import reference

FWD = jax.jit(forward, static_argnames=("cfg", "backend", "native_attention"))
ATOL = 1e-4
BACKENDS = ("bgmv", "sgmv", "dense", "reference", "pallas") + (("native",) if kernels.available() else ())
KINDS = reference.CORE_KINDS            # every test, every backend (Pallas: PALLAS_KIND)
# The other kinds (Qwen3's q/k norms, Mistral's sliding window, Gemma 2's soft caps and alternating
# windows; windows shorter than most prompts here):
# the forward's parity tests and greedy tokens, through a few backends.
NEW_KINDS = tuple(k for k in reference.TINY_CONFIGS if k not in KINDS)
NEW_BACKENDS = ("bgmv", "sgmv") + (("native",) if kernels.available() else ())
# Pallas's TPU kernel runs here in its interpreter (tens of seconds a test): through one core kind
# (qwen2, with q/k/v biases) and Qwen3-MoE; the kernel itself is tested against its definition in
# tests/test_lora_pallas.py, and the LoRA delta does not depend on the kind around it.
PALLAS_KIND = "qwen2"
# `reference` (the backends' own oracle, held to numpy in tests/test_backends.py) through one kind;
# the tied head's narrower model (hidden 48) through the serving backends that tile its width.
KIND_ONLY = {"pallas": (PALLAS_KIND,), "reference": ("llama",), "dense": ("llama", "qwen2")}
CORE_KIND_BACKENDS = [(k, b) for k, b in itertools.product(KINDS, BACKENDS) if k in KIND_ONLY.get(b, KINDS)]
KIND_BACKENDS = CORE_KIND_BACKENDS + list(itertools.product(NEW_KINDS, NEW_BACKENDS))
# Qwen3-MoE (attention and experts' LoRA in one batch): the mixed prefill through the other serving
# backends too (the experts' LoRA is one op whichever backend; `reference`, the backends' own
# oracle in tests/test_backends.py, left out for the suite's time)
MOE_BACKENDS = [("qwen3_moe", b) for b in BACKENDS if b not in NEW_BACKENDS + ("reference",)]
ADAPTERS = tuple(reference.ADAPTER_SPECS)  # in the main slots, adapter i lives in slot i + 1
MAX_RANK = 16                              # the largest rank among ADAPTER_SPECS
# PEFT fuses an MoE's gate and up experts (gate_up_proj) at twice the rank: c_mlp_r16's is 32 there
MAX_RANKS = {"qwen3_moe": 32}

# Fixed step shapes (T tokens, X pages of the step in all), so each (config, backend) compiles
# twice: steps of single-token chunks only (decode) land on the small T, the others on the big one.
PAGE_SIZE = 4
NUM_PAGES = 64
STEP_TOKENS = (8, 64)
STEP_PAGES = 32

MESH = make_mesh(1)

# (length, slot): base rows first, in the middle and last, beside every adapter slot in use.
MIXED = [(7, 0), (12, 1), (5, 2), (9, 0), (11, 3), (3, 4), (8, 2), (6, 0)]
# (prompt length, slot, first prefill chunk length); chunk ends fall inside pages on purpose.
MULTI = [(9, 0, 5), (6, 1, 3), (13, 2, 6), (4, 3, 2), (10, 4, 7), (7, 0, 1)]
DECODE_STEPS = 4


def _tokens(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n).tolist() for n in lengths]


MIXED_TOKENS = _tokens(1, [n for n, _ in MIXED])
MULTI_TOKENS = _tokens(2, [n + DECODE_STEPS for n, _, _ in MULTI])


def _adapter_of(slot: int, slot_names: dict[int, str | None]) -> str | None:
    return None if slot == NO_ADAPTER else slot_names[slot]


def _fresh_kv(cfg):
    # Placed like the forward's output cache, so feeding it back does not recompile.
    kv = init_kv_cache(cfg, NUM_PAGES, PAGE_SIZE, jnp.float32)
    return jax.device_put(kv, NamedSharding(MESH, PartitionSpec()))


def _page_lists(seed: int, lengths) -> list[list[int]]:
    """Non-contiguous pages: each sequence's pages drawn from a shuffled free list (page 0 is
    reserved for padding)."""
    free = list(np.random.default_rng(seed).permutation(np.arange(1, NUM_PAGES)))
    out = []
    for n in lengths:
        need = -(-n // PAGE_SIZE)
        out.append([int(p) for p in free[:need]])
        del free[:need]
    return out


def _step(cfg, weights, slots, kv, chunks, backend, native_attention=False):
    """One step of the chunks, in any order (build_batch gets them single-token chunks first).
    Returns each chunk's logits rows (one per token), in the given order, and the cache.
    native_attention: through multilora's CPU attention kernels (as the engine runs on a CPU)."""
    order = decode_first(chunks)
    ordered = [chunks[i] for i in order]
    t = next(t for t in STEP_TOKENS if t >= sum(len(c.token_ids) for c in chunks))
    be = get_backend(backend)
    batch = build_batch(ordered, num_tokens=t, num_pages=STEP_PAGES, num_logits=t, page_size=PAGE_SIZE,
                        prepare_lora=lambda slot_T: be.prepare_lora_batch(slot_T, slots.scalings_S, slots.ranks_S,
                                                                          slots.rows_SR),
                        all_logits=True)
    assert int(batch.num_decode) == sum(len(c.token_ids) == 1 for c in chunks)
    logits, kv = FWD(weights, slots.weights, kv, batch, cfg=cfg, backend=backend, native_attention=native_attention)
    logits = np.asarray(logits)
    assert logits.shape == (t, cfg.vocab_size)
    ends = np.cumsum([len(c.token_ids) for c in ordered])
    rows = [None] * len(chunks)
    for j, i in enumerate(order):
        rows[i] = logits[ends[j] - len(ordered[j].token_ids):ends[j]]
    return rows, kv


def _check_rows(got, want, what):
    err = np.abs(got - want)
    assert err.max() <= ATOL, (
        f"{what}: max |err| {err.max():.3e} at row {np.unravel_index(err.argmax(), err.shape)[0]} "
        f"(atol {ATOL}); |want| max {np.abs(want).max():.3f}")


def _check_prefill(rows, chunks, tokens_of, ref, slot_names, what):
    """A step's rows (as _step returns them; prefill chunks, or decode rows and prefill chunks
    mixed): chunk i's rows equal the reference over its full sequence at the chunk's positions."""
    for i, (c, got) in enumerate(zip(chunks, rows)):
        n = len(c.token_ids)
        adapter = _adapter_of(c.slot, slot_names)
        want = ref.logits(adapter, tokens_of(i))[c.start_pos:c.start_pos + n]
        _check_rows(got, want, f"{what}: seq {i} (slot {c.slot}, adapter {adapter}, "
                               f"positions {c.start_pos}..{c.start_pos + n - 1})")


@pytest.fixture(scope="module")
def served(tiny_models, tiny_adapters):
    """kind -> (cfg, weights, slots with all four adapters in slots 1..4), built once per kind."""
    cache = {}

    def get(kind):
        if kind not in cache:
            cfg, weights = load_weights(tiny_models[kind], mesh=MESH)
            max_rank = MAX_RANKS.get(kind, MAX_RANK)
            slots = LoRASlots(cfg, LoRAConfig(max_loras_per_batch=len(ADAPTERS), max_lora_rank=max_rank),
                              jnp.float32, MESH, jit_writer=jit_slot_writer)
            # Each adapter's pages drawn from anywhere in the pool (true rank, in no order).
            free = list(np.random.default_rng(1).permutation(np.arange(1, slots.lora_cfg.num_rows // 8)))
            for i, name in enumerate(ADAPTERS):
                adapter = load_adapter(name, tiny_adapters[(kind, name)], cfg, max_rank)
                slots.load(i + 1, page_rows([free.pop() for _ in range(-(-adapter.rank // 8))]), adapter)
            cache[kind] = (cfg, weights, slots)
        return cache[kind]

    return get


MAIN_SLOT_NAMES = {i + 1: name for i, name in enumerate(ADAPTERS)}


@pytest.mark.parametrize("kind,backend", KIND_BACKENDS + MOE_BACKENDS)
def test_mixed_prefill_matches_peft(kind, backend, served, peft_refs):
    cfg, weights, slots = served(kind)
    assert slots.num_slots - 1 == len(ADAPTERS)  # every slot full: a base row sits beside them
    pages = _page_lists(10, [n for n, _ in MIXED])
    chunks = [SeqChunk(toks, 0, pg, slot) for toks, pg, (_, slot) in zip(MIXED_TOKENS, pages, MIXED)]
    rows, _ = _step(cfg, weights, slots, _fresh_kv(cfg), chunks, backend)
    _check_prefill(rows, chunks, lambda i: MIXED_TOKENS[i], peft_refs[kind], MAIN_SLOT_NAMES,
                   f"{kind}/{backend} mixed prefill")


@pytest.mark.parametrize("kind", KINDS + ("gemma2",))  # gemma2: each unrolled layer's own window
def test_split_layers_unrolled_match_peft(kind, served, peft_refs):
    """The layers as separate arrays (the forward unrolls them, nothing sliced out of a stack):
    the same logits as PEFT, and as the scan over the stacked layers."""
    cfg, weights, slots = served(kind)
    split = split_layers(weights)
    assert isinstance(split.layers, tuple) and len(split.layers) == cfg.num_layers
    assert split.layers[0].wq_LDO.shape == weights.layers.wq_LDO.shape[1:]
    pages = _page_lists(10, [n for n, _ in MIXED])
    chunks = [SeqChunk(toks, 0, pg, slot) for toks, pg, (_, slot) in zip(MIXED_TOKENS, pages, MIXED)]
    rows, _ = _step(cfg, split, slots, _fresh_kv(cfg), chunks, "bgmv")
    _check_prefill(rows, chunks, lambda i: MIXED_TOKENS[i], peft_refs[kind], MAIN_SLOT_NAMES,
                   f"{kind} split layers")
    stacked_rows, _ = _step(cfg, weights, slots, _fresh_kv(cfg), chunks, "bgmv")
    for got, want in zip(rows, stacked_rows):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    short = dataclasses.replace(split, layers=split.layers[:-1])
    with pytest.raises(ValueError, match=f"{cfg.num_layers - 1} split layers.*num_layers={cfg.num_layers}"):
        _step(cfg, short, slots, _fresh_kv(cfg), chunks, "bgmv")


@pytest.mark.parametrize("kind,backend", KIND_BACKENDS)
def test_chunked_prefill_then_decode_matches_peft(kind, backend, served, peft_refs):
    cfg, weights, slots = served(kind)
    ref = peft_refs[kind]
    pages = _page_lists(20, [len(t) for t in MULTI_TOKENS])
    kv = _fresh_kv(cfg)
    what = f"{kind}/{backend}"

    # Two prefill chunks; the second starts mid-page and reads the first chunk's pages.
    for part in (0, 1):
        chunks = []
        for toks, pg, (n, slot, c1) in zip(MULTI_TOKENS, pages, MULTI):
            lo, hi = (0, c1) if part == 0 else (c1, n)
            chunks.append(SeqChunk(toks[lo:hi], lo, pg, slot))
        rows, kv = _step(cfg, weights, slots, kv, chunks, backend)
        _check_prefill(rows, chunks, lambda i: MULTI_TOKENS[i], ref, MAIN_SLOT_NAMES,
                       f"{what} prefill chunk {part + 1}")

    # Decode: steps of single-token chunks, one per sequence, in a new order each step.
    order_rng = np.random.default_rng(30)
    for step in range(DECODE_STEPS):
        order = order_rng.permutation(len(MULTI))
        chunks = []
        for i in order:
            n, slot, _ = MULTI[i]
            pos = n + step
            chunks.append(SeqChunk([MULTI_TOKENS[i][pos]], pos, pages[i], slot))
        rows, kv = _step(cfg, weights, slots, kv, chunks, backend)
        for row, i in enumerate(order):
            n, slot, _ = MULTI[i]
            adapter = _adapter_of(slot, MAIN_SLOT_NAMES)
            want = ref.logits(adapter, MULTI_TOKENS[i])[n + step]
            _check_rows(rows[row], want[None], f"{what} decode step {step}: seq {i} "
                                               f"(slot {slot}, adapter {adapter}, position {n + step})")


# Greedy decoding through the forward: (prompt length, slot), base rows beside every adapter.
GREEDY_SEQS = [(9, 0), (6, 1), (11, 2), (4, 3), (8, 4), (5, 0)]
GREEDY_NEW = 8
GREEDY_PROMPTS = [np.random.default_rng(5).integers(3, 256, size=n).tolist() for n, _ in GREEDY_SEQS]


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_greedy_tokens_match_peft(kind, served, tiny_models, tiny_adapters, peft_greedy_cache):
    """The prompts prefilled in one mixed step, then decode steps each feeding back the argmax:
    PEFT's greedy tokens (transformers' generate) exactly, for base rows and every adapter. The
    attention runs through multilora's CPU kernels where they are built, as the engine's would
    (the logits tests above run XLA's; Gemma 2's soft-capped scores run XLA's here too)."""
    cfg, weights, slots = served(kind)
    pages = _page_lists(60, [n + GREEDY_NEW for n, _ in GREEDY_SEQS])
    kv = _fresh_kv(cfg)
    chunks = [SeqChunk(p, 0, pg, slot) for p, pg, (_, slot) in zip(GREEDY_PROMPTS, pages, GREEDY_SEQS)]
    got = [[] for _ in GREEDY_SEQS]
    for step in range(GREEDY_NEW):
        rows, kv = _step(cfg, weights, slots, kv, chunks, "bgmv", native_attention=kernels.available())
        for i, r in enumerate(rows):
            got[i].append(int(np.argmax(r[-1])))
        chunks = [SeqChunk([got[i][-1]], n + step, pages[i], slot) for i, (n, slot) in enumerate(GREEDY_SEQS)]
    dirs = {slot: tiny_adapters[(kind, name)] for slot, name in MAIN_SLOT_NAMES.items()}
    want = peft_greedy_cache.many(tiny_models[kind], [(dirs.get(slot), p) for p, (_, slot)
                                                       in zip(GREEDY_PROMPTS, GREEDY_SEQS)], GREEDY_NEW)
    assert got == want


# A mixed step: sequences decoding one token (position, slot) beside other sequences' prefill
# chunks (start, length, slot), base rows and adapters in both groups. Decode positions: a
# one-token prompt (position 0), a token opening a new page (8), one closing a page (11: length
# 12), others mid-page. Prefill chunks: first chunks and chunks behind a cached first part.
MIXED_DECODE = [(8, 1), (0, 0), (6, 3), (11, 0), (5, 2)]
MIXED_PREFILL = [(0, 9, 4), (5, 6, 0), (3, 7, 2), (0, 4, 1)]
# Every sequence's tokens: its prompt/context, the step's tokens, and one more decoded after it.
MIXED_STEP_TOKENS = _tokens(4, [pos + 2 for pos, _ in MIXED_DECODE]
                            + [st + n + 1 for st, n, _ in MIXED_PREFILL])


def _mixed_step_chunks(pages):
    """(before: what is cached ahead of the step, step: the mixed step's chunks interleaved
    decode/prefill, after: one more token of every sequence) over the sequences of
    MIXED_DECODE + MIXED_PREFILL, tokens MIXED_STEP_TOKENS."""
    before, step, after = [], [], []
    seqs = [(pos, 1, slot) for pos, slot in MIXED_DECODE] + list(MIXED_PREFILL)
    for i, ((start, n, slot), toks, pg) in enumerate(zip(seqs, MIXED_STEP_TOKENS, pages)):
        if start:
            before.append((i, SeqChunk(toks[:start], 0, pg, slot)))
        step.append((i, SeqChunk(toks[start:start + n], start, pg, slot)))
        after.append((i, SeqChunk([toks[start + n]], start + n, pg, slot)))
    # The step's chunks go in interleaved (decode, prefill, decode, ...): _step orders them
    # decode-first for build_batch and hands the rows back in this order.
    nd = len(MIXED_DECODE)
    dec, pre = step[:nd], step[nd:]
    step = [c for i in range(max(len(dec), len(pre))) for c in dec[i:i + 1] + pre[i:i + 1]]
    return before, step, after


@pytest.mark.parametrize("kind,backend", CORE_KIND_BACKENDS)
def test_mixed_step_matches_separate_steps_and_peft(kind, backend, served, peft_refs):
    """One step of decode rows and prefill chunks together (adapters and base rows in both
    groups) gives the logits of the same work done as a decode step and a prefill step, and
    PEFT's; the K/V it writes serve a following decode step of every sequence."""
    cfg, weights, slots = served(kind)
    ref = peft_refs[kind]
    what = f"{kind}/{backend}"
    pages = _page_lists(50, [len(t) for t in MIXED_STEP_TOKENS])
    before, step, after = _mixed_step_chunks(pages)
    tokens_of = lambda seqs: (lambda j: MIXED_STEP_TOKENS[seqs[j][0]])  # noqa: E731
    chunks_of = lambda seqs: [c for _, c in seqs]  # noqa: E731

    rows, kv0 = _step(cfg, weights, slots, _fresh_kv(cfg), chunks_of(before), backend)
    _check_prefill(rows, chunks_of(before), tokens_of(before), ref, MAIN_SLOT_NAMES, f"{what} context")

    # The mixed step.
    mixed, kv_mixed = _step(cfg, weights, slots, kv0, chunks_of(step), backend)
    kinds = [len(c.token_ids) == 1 for c in chunks_of(step)]
    assert kinds[:2] == [True, False] and sum(kinds) == len(MIXED_DECODE)  # interleaved
    _check_prefill(mixed, chunks_of(step), tokens_of(step), ref, MAIN_SLOT_NAMES, f"{what} mixed step")

    # The same work in two steps from the same cache: the decode rows, then the prefill chunks.
    dec = [(i, c) for i, c in step if len(c.token_ids) == 1]
    pre = [(i, c) for i, c in step if len(c.token_ids) > 1]
    dec_rows, kv_sep = _step(cfg, weights, slots, kv0, chunks_of(dec), backend)
    pre_rows, kv_sep = _step(cfg, weights, slots, kv_sep, chunks_of(pre), backend)
    separate = dict(zip([i for i, _ in dec] + [i for i, _ in pre], dec_rows + pre_rows))
    for (i, c), got in zip(step, mixed):
        _check_rows(got, separate[i], f"{what}: seq {i} (slot {c.slot}, {len(c.token_ids)} tokens) "
                                      f"mixed step against separate steps")

    # The mixed step's cache and the separate steps' cache serve the next token alike.
    for name, kv in (("mixed", kv_mixed), ("separate", kv_sep)):
        rows, _ = _step(cfg, weights, slots, kv, chunks_of(after), backend)
        _check_prefill(rows, chunks_of(after), tokens_of(after), ref, MAIN_SLOT_NAMES,
                       f"{what} decode after the {name} step(s)")


REWRITE_KIND = "llama"
REWRITE_SEQS = [(8, 0), (7, 1), (9, 2), (5, 0), (6, 2)]  # (length, slot)
REWRITE_TOKENS = _tokens(3, [n for n, _ in REWRITE_SEQS])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_pool_writes_equal_xla_writes(dtype, tiny_models, tiny_adapters):
    """LoRASlots writes through multilora's pool kernel where it can (in place, even in bfloat16,
    which XLA's CPU scatter widens to float32 over the whole pool): the same pools, bit for bit,
    as the XLA writer, for adapters of several ranks rewritten over each other."""
    if not kernels.available():
        pytest.skip(f"native kernels unavailable: {kernels.unavailable_reason()}")
    kind = REWRITE_KIND
    cfg, _ = load_weights(tiny_models[kind], mesh=MESH)
    lcfg = LoRAConfig(max_loras_per_batch=2, max_lora_rank=32)
    native = LoRASlots(cfg, lcfg, dtype, MESH, jit_writer=jit_slot_writer)
    assert native.native_write
    xla = LoRASlots(cfg, lcfg, dtype, MESH, native_write=False)
    for slot, name, pages in ((1, "c_mlp_r16", [7, 3]), (2, "a_all_r8", [5]), (1, "b_attn_r4_rslora", [3])):
        adapter = load_adapter(name, tiny_adapters[(kind, name)], cfg, 32)
        for slots in (native, xla):
            slots.load(slot, page_rows(pages), adapter)
    for field in vars(native.weights):
        a, b = getattr(native.weights, field), getattr(xla.weights, field)
        assert a.dtype == b.dtype == dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)),
                                      err_msg=field)


def test_pools_are_made_and_written_rows_major(tiny_models, tiny_adapters):
    """Every pool is made and stays rows-major (POOL_LAYOUT), the layout the backends read it in,
    whichever writer writes it: a TPU's default layout for a pool is another, and a step compiled
    for that copied every pool whole before its layer loop (benchmarks/log/24-2026-12-05-tpu-v5e-rows-major.md). rows_major moves a
    pool laid out otherwise, values unchanged."""
    from jax.experimental.layout import Format, Layout
    from multilora.adapters.pool import POOL_LAYOUT, rows_major
    kind = REWRITE_KIND
    cfg, _ = load_weights(tiny_models[kind], mesh=MESH)
    adapter = load_adapter("a_all_r8", tiny_adapters[(kind, "a_all_r8")], cfg, 32)
    for jit_writer in (jit_slot_writer, None):
        slots = LoRASlots(cfg, LoRAConfig(max_loras_per_batch=2, max_lora_rank=32), jnp.float32, MESH,
                          jit_writer=jit_writer)
        slots.load(1, page_rows([5]), adapter)
        for field, a in vars(slots.weights).items():
            assert a.format.layout.major_to_minor == POOL_LAYOUT.major_to_minor, field
            assert a.sharding.is_equivalent_to(getattr(slots.shardings, field), a.ndim), field
    pool = slots.weights.q_b_LUO
    other = jax.device_put(pool, Format(Layout(major_to_minor=(0, 2, 1)), pool.sharding))
    assert other.format.layout.major_to_minor == (0, 2, 1)
    moved = rows_major(dataclasses.replace(slots.weights, q_b_LUO=other)).q_b_LUO
    assert moved.format.layout.major_to_minor == POOL_LAYOUT.major_to_minor
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(pool))


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "reference"])
def test_small_ranks_slot_rewrite_and_clear(backend, tiny_models, tiny_adapters, peft_refs):
    """max_lora_rank 32 with adapters of rank 2..16; an occupied slot rewritten with an adapter of
    lower rank and other targets (nothing of the old one may survive); a cleared slot is base."""
    kind = REWRITE_KIND
    cfg, weights = load_weights(tiny_models[kind], mesh=MESH)
    slots = LoRASlots(cfg, LoRAConfig(max_loras_per_batch=2, max_lora_rank=32), jnp.float32, MESH,
                      jit_writer=jit_slot_writer)
    ref = peft_refs[kind]
    pages = _page_lists(40, [n for n, _ in REWRITE_SEQS])
    chunks = [SeqChunk(t, 0, pg, s) for t, pg, (_, s) in zip(REWRITE_TOKENS, pages, REWRITE_SEQS)]

    held = {}

    def load(slot, name, pages=None):
        adapter = load_adapter(name, tiny_adapters[(kind, name)], cfg, 32)
        pages = held[slot][:-(-adapter.rank // 8)] if pages is None else pages
        held[slot] = pages
        slots.load(slot, page_rows(pages), adapter)

    def check(slot_names, phase):
        rows, _ = _step(cfg, weights, slots, _fresh_kv(cfg), chunks, backend)
        _check_prefill(rows, chunks, lambda i: REWRITE_TOKENS[i], ref, slot_names,
                       f"{kind}/{backend} {phase}")

    load(1, "c_mlp_r16", [7, 3])   # pages out of order
    load(2, "a_all_r8", [5])
    check({1: "c_mlp_r16", 2: "a_all_r8"}, "first load, ranks 16 and 8 under max 32")

    load(2, "b_attn_r4_rslora")   # rank 4 attention-only over rank 8 on all modules, in its page
    load(1, "d_regex_patterns")   # ranks 8/2 over rank 16 MLP-only, in its first page
    assert slots.ranks_S.tolist() == [0, 8, 4]
    zero_page = list(range(8))
    assert slots.rows_SR[2].tolist() == page_rows([5]) + zero_page * 3   # past its page: the zero page
    check({1: "d_regex_patterns", 2: "b_attn_r4_rslora"}, "slots rewritten")

    slots.clear(2)
    assert slots.ranks_S[2] == 0 and slots.scalings_S[2] == 0.0 and slots.rows_SR[2].tolist() == zero_page * 4
    for name, buf in vars(slots.weights).items():
        b = buf.shape[1] // slots.lora_cfg.num_rows
        for j in range(b):
            assert not np.any(np.asarray(buf[:, j * slots.lora_cfg.num_rows:][:, :8])), f"zero page of {name}"
    check({1: "d_regex_patterns", 2: None}, "slot 2 cleared (its rows are base rows)")


def test_pool_refuses_rows_that_do_not_fit_the_adapter(tiny_models, tiny_adapters):
    """LoRASlots.load wants the rows of its rank's pages (aligned runs of 8), inside the pool,
    never the zero page; anything else is refused before a byte is written."""
    cfg, _ = load_weights(tiny_models[REWRITE_KIND], mesh=MESH)
    slots = LoRASlots(cfg, LoRAConfig(max_loras_per_batch=2, max_lora_rank=8), jnp.float32, MESH)
    adapter = load_adapter("a", tiny_adapters[(REWRITE_KIND, "a_all_r8")], cfg, 8)
    before = {k: np.asarray(v).copy() for k, v in vars(slots.weights).items()}
    table = slots.rows_SR.copy()
    for rows in ([8, 9, 10], page_rows([1, 2]), page_rows([0]), list(range(9, 17)), page_rows([3]),
                 [8, 9, 10, 11, 12, 13, 15, 14]):
        with pytest.raises(ValueError, match="needs the rows of 1 distinct pages of 8 in 1..2"):
            slots.load(1, rows, adapter)
    for k, v in vars(slots.weights).items():
        np.testing.assert_array_equal(np.asarray(v), before[k], err_msg=k)
    np.testing.assert_array_equal(slots.rows_SR, table)
    assert not slots.ranks_S.any()


# --- config errors -------------------------------------------------------------------------

def test_tiny_configs_parse():
    for kind, hf in reference.TINY_CONFIGS.items():
        cfg = ModelConfig.from_hf_dict(hf)
        assert cfg.num_kv_heads == hf["num_key_value_heads"], kind
    assert ModelConfig.from_hf_dict(reference.TINY_CONFIGS["llama"]).rope_scaling.factor == 8.0


def test_unsupported_architecture_is_named():
    gpt2 = dict(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=256, n_embd=64,
                n_layer=2, n_head=4, n_positions=256)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as e:
        ModelConfig.from_hf_dict(gpt2)
    assert "LlamaForCausalLM" in str(e.value)  # and says what is supported
    no_arch = {k: v for k, v in gpt2.items() if k != "architectures"}
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelConfig.from_hf_dict(no_arch)


@pytest.mark.parametrize("arch,model_type", [("Qwen2MoeForCausalLM", "qwen2_moe"),
                                               ("Gemma3ForConditionalGeneration", "gemma3")])  # multimodal
def test_unimplemented_families_are_refused_by_name(arch, model_type):
    hf = dict(reference.TINY_CONFIGS["qwen3"], architectures=[arch], model_type=model_type)
    with pytest.raises(UnsupportedModelError, match=f"unsupported architecture '{arch}'"):
        ModelConfig.from_hf_dict(hf)


def test_gemma3_config():
    """Gemma 3 (text) as transformers reads it, both forms of its config: transformers 5's
    rope_parameters keyed by layer type, and the older rope_theta / rope_local_base_freq /
    rope_scaling (the global layers'); layers local but every sliding_window_pattern-th (6 by
    default); no soft caps by default; q/k norms; a scaled local RoPE refused by name."""
    cfg = ModelConfig.from_hf_dict(reference.TINY_CONFIGS["gemma3"])
    assert cfg.layer_windows == (5, 5, None) and cfg.qk_norm and cfg.gemma_norms and cfg.embed_scale
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (1000000.0, 10000.0, None)
    assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
    old = {k: v for k, v in reference.TINY_CONFIGS["gemma3"].items()
           if k not in ("rope_parameters", "sliding_window_pattern", "head_dim", "tie_word_embeddings")}
    old.update(num_hidden_layers=7, rope_theta=500000.0, rope_local_base_freq=20000.0,
               rope_scaling=dict(rope_type="linear", factor=8.0))
    cfg = ModelConfig.from_hf_dict(old)
    assert cfg.layer_windows == (5, 5, 5, 5, 5, None, 5) and cfg.head_dim == 256 and cfg.tie_word_embeddings
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling.factor) == (500000.0, 20000.0, 8.0)
    scaled_local = dict(reference.TINY_CONFIGS["gemma3"], rope_parameters=dict(
        sliding_attention=dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
        full_attention=dict(rope_type="default", rope_theta=1e6)))
    with pytest.raises(UnsupportedModelError, match="scaled RoPE on its sliding-window layers"):
        ModelConfig.from_hf_dict(scaled_local)
    # the field is in Gemma 3's config class, but its attention never caps (transformers): only the
    # final logits' cap is read
    capped = ModelConfig.from_hf_dict(dict(reference.TINY_CONFIGS["gemma3"], attn_logit_softcapping=2.0,
                                           final_logit_softcapping=3.0))
    assert capped.attn_logit_softcapping is None and capped.final_logit_softcapping == 3.0


def test_qwen3_config():
    """Qwen3: q/k norms on, head_dim apart from hidden / heads (128 when config.json omits it, as
    transformers' Qwen3Config), no biases unless attention_bias (then o_proj's too)."""
    hf = reference.TINY_CONFIGS["qwen3"]
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.qk_norm and cfg.head_dim == 32 and cfg.q_dim == 128 != cfg.hidden_size
    assert not cfg.attention_bias and not cfg.o_proj_bias and cfg.hidden_act == "silu"
    assert cfg.module_dims("o_proj") == (128, 64)
    biased = ModelConfig.from_hf_dict(dict(hf, attention_bias=True))
    assert biased.attention_bias and biased.o_proj_bias
    no_head_dim = {k: v for k, v in hf.items() if k not in ("head_dim", "architectures")}
    assert ModelConfig.from_hf_dict(no_head_dim).head_dim == 128
    assert not ModelConfig.from_hf_dict(reference.TINY_CONFIGS["qwen2"]).qk_norm


@pytest.mark.parametrize("kind,flag,want", [
    ("qwen2", False, (True, False)), ("qwen2", True, (True, False)),    # q/k/v biases always, o never
    ("mistral", True, (False, False)),                                  # none, whatever the flag
    ("llama", True, (True, True)), ("llama", False, (False, False)),    # the flag, o included
    ("gemma2", True, (True, True)), ("qwen3_moe", True, (True, True)),
])
def test_attention_biases_as_transformers_builds_them(kind, flag, want):
    """Which projections carry biases follows each family's transformers attention, not the
    attention_bias field alone (Qwen2 and Mistral ignore it)."""
    cfg = ModelConfig.from_hf_dict(dict(reference.TINY_CONFIGS[kind], attention_bias=flag))
    assert (cfg.attention_bias, cfg.o_proj_bias) == want


def test_gemma2_config():
    """Gemma 2 as transformers' Gemma2Config reads it, defaults included: every other layer local
    from layer 0, soft caps 50 and 30, query_pre_attn_scalar 256, tied embeddings, GELU (tanh)."""
    cfg = ModelConfig.from_hf_dict(reference.TINY_CONFIGS["gemma2"])
    assert cfg.layer_windows == (5, None, 5) and cfg.attn_logit_softcapping == 2.0
    assert cfg.final_logit_softcapping == 3.0 and cfg.query_pre_attn_scalar == 24.0
    assert cfg.gemma_norms and cfg.embed_scale and cfg.hidden_act == "gelu_tanh" and cfg.tie_word_embeddings
    bare = {k: v for k, v in reference.TINY_CONFIGS["gemma2"].items()
            if k not in ("architectures", "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                         "sliding_window", "tie_word_embeddings", "head_dim", "hidden_activation")}
    cfg = ModelConfig.from_hf_dict(bare)
    assert cfg.architecture == "Gemma2ForCausalLM" and cfg.layer_windows == (4096, None, 4096)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
    assert cfg.tie_word_embeddings and cfg.head_dim == 256 and cfg.hidden_act == "gelu_tanh"
    uncapped = ModelConfig.from_hf_dict(dict(bare, attn_logit_softcapping=None, final_logit_softcapping=None))
    assert uncapped.attn_logit_softcapping is None and uncapped.final_logit_softcapping is None
    with pytest.raises(UnsupportedModelError, match="hidden_act 'silu' for Gemma2ForCausalLM"):
        ModelConfig.from_hf_dict(dict(bare, hidden_activation="silu"))
    # transformers' Gemma 2 never reads hidden_act: a "gelu" there leaves its GELU (tanh)
    assert ModelConfig.from_hf_dict(dict(bare, hidden_act="gelu")).hidden_act == "gelu_tanh"
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict(dict(bare, use_bidirectional_attention=True))


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_sliding_window_follows_layer_types(kind):
    """Qwen2/Qwen3 window only the layers from max_window_layers on (or those layer_types names),
    as transformers does; the others attend globally."""
    hf = dict(reference.TINY_CONFIGS[kind], use_sliding_window=True, sliding_window=8)
    hf.pop("max_window_layers", None)
    assert ModelConfig.from_hf_dict(dict(hf, max_window_layers=0)).layer_windows == (8, 8)
    assert ModelConfig.from_hf_dict(hf).layer_windows == (None, None)   # max_window_layers 28 by default
    assert ModelConfig.from_hf_dict(dict(hf, use_sliding_window=False, max_window_layers=0)).sliding_window is None
    assert ModelConfig.from_hf_dict(dict(hf, max_window_layers=1)).layer_windows == (None, 8)
    cfg = ModelConfig.from_hf_dict(dict(hf, layer_types=["sliding_attention", "full_attention"]))
    assert cfg.layer_windows == (8, None) and cfg.global_layers == (1,)
    with pytest.raises(UnsupportedModelError, match="layer_types must name each of the 2 layers"):
        ModelConfig.from_hf_dict(dict(hf, layer_types=["sliding_attention", "chunked_attention"]))
    mistral = dict(reference.TINY_CONFIGS["llama"], architectures=["MistralForCausalLM"], model_type="mistral",
                   sliding_window=8)
    mistral.pop("rope_scaling")
    assert ModelConfig.from_hf_dict(mistral).layer_windows == (8, 8)
    # a use_sliding_window in a Mistral config (Qwen2's field) changes nothing in transformers' Mistral
    assert ModelConfig.from_hf_dict(dict(mistral, use_sliding_window=False)).layer_windows == (8, 8)
    llama = dict(mistral, architectures=["LlamaForCausalLM"], model_type="llama", use_sliding_window=True,
                 max_window_layers=0)
    assert ModelConfig.from_hf_dict(llama).sliding_window is None  # transformers' Llama has none


@pytest.mark.parametrize("scaling,top", [
    (None, {}),
    (dict(rope_type="linear", factor=4.0), {}),
    (dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
          original_max_position_embeddings=64), {}),
    # YaRN as Qwen2.5's and Qwen3's cards add it ("type" the older key), and with each field that
    # changes its numbers: the original context from max_position_embeddings or from a top-level
    # field, its betas, no truncation, DeepSeek's two mscales, an explicit attention factor
    (dict(type="yarn", factor=4.0, original_max_position_embeddings=64), {}),
    (dict(rope_type="yarn", factor=2.0), dict(max_position_embeddings=100)),
    (dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=4096),
     dict(original_max_position_embeddings=32)),
    (dict(rope_type="yarn", factor=3.0, original_max_position_embeddings=50, beta_fast=16, beta_slow=2,
          truncate=False), {}),
    (dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=64, mscale=1.0,
          mscale_all_dim=0.707), {}),
    (dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, attention_factor=1.25), {}),
])
def test_rope_frequencies_match_transformers(scaling, top):
    """The rotary inverse frequencies, and the factor on cos and sin, equal transformers' own for
    each supported scaling."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from multilora.model.layers import rope_attention_factor, rope_inv_freq
    hf = copy.deepcopy(reference.TINY_CONFIGS["llama"])
    hf.pop("rope_scaling")
    hf.update(top)
    if scaling is not None:
        hf["rope_scaling"] = dict(scaling)
    config = AutoConfig.for_model(**copy.deepcopy(hf))
    if scaling is None:
        want, want_factor = 1.0 / (hf["rope_theta"] ** (np.arange(0, 16, 2, dtype=np.float64) / 16)), 1.0
    else:
        kind = scaling.get("rope_type", scaling.get("type"))
        want, want_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
        want = want.numpy()
    cfg = ModelConfig.from_hf_dict(hf)
    np.testing.assert_allclose(rope_inv_freq(cfg), want, rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(want_factor, rel=1e-6)


@pytest.mark.parametrize("scaling,missing", [
    (dict(rope_type="linear"), "factor"),
    (dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor="4"), "high_freq_factor"),
])
def test_rope_scaling_without_its_numbers_is_named(scaling, missing):
    hf = copy.deepcopy(reference.TINY_CONFIGS["llama"])
    hf["rope_scaling"] = scaling
    with pytest.raises(UnsupportedModelError, match=f"missing or not a number: .*{missing}"):
        ModelConfig.from_hf_dict(hf)


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_dynamic_rope_scaling_is_refused(key, type_key):
    """Dynamic NTK turns by each forward's sequence length (transformers), which a batch of
    sequences of many lengths cannot follow: refused, naming what is supported."""
    hf = copy.deepcopy(reference.TINY_CONFIGS["llama"])
    hf.pop("rope_scaling")
    hf[key] = {type_key: "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match="dynamic") as e:
        ModelConfig.from_hf_dict(hf)
    assert "llama3" in str(e.value) and "yarn" in str(e.value)  # names what is supported
    hf[key] = {type_key: "yarn", "factor": 4.0, "partial_rotary_factor": 0.5, "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor=0.5"):
        ModelConfig.from_hf_dict(hf)


def test_mlp_bias_is_refused_where_transformers_reads_it():
    """Llama's MLP takes biases with mlp_bias (refused, naming it); Qwen2's, Qwen3's, Mistral's and
    Gemma's never do, whatever their config says (transformers loads them without): served."""
    with pytest.raises(UnsupportedModelError, match="mlp_bias=true is not supported"):
        ModelConfig.from_hf_dict(dict(reference.TINY_CONFIGS["llama"], mlp_bias=True))
    for kind in ("qwen2", "qwen3", "mistral", "gemma2", "gemma3", "qwen3_moe"):
        assert ModelConfig.from_hf_dict(dict(reference.TINY_CONFIGS[kind], mlp_bias=True)).num_layers > 0



# bfloat16-packed-avx2: the packed GEMM and the LoRA group call held to their AVX2 paths
# ($MULTILORA_KERNEL_ISA), what a CPU without AVX512-BF16 runs
BF16_MODES = (("bfloat16",) + (("bfloat16-packed",) if kernels.bf16_gemm_isa() else ())
              + (("bfloat16-packed-avx2",) if "avx2" in kernels.bf16_gemm_isas()[:-1] else ()))
# bfloat16 projections: each sequence's largest logit error against PEFT at float32 is at most
# BF16_RTOL of its largest |logit|, and at most BF16_VS_PEFT times that of PEFT run in bfloat16.
BF16_RTOL = 0.02
BF16_VS_PEFT = 1.25


@pytest.fixture(scope="module")
def peft_bf16_refs(tiny_models, tiny_adapters):
    return {kind: reference.PeftReference(model_dir, {ad: tiny_adapters[(kind, ad)] for ad in ADAPTERS},
                                          dtype=torch.bfloat16)
            for kind, model_dir in tiny_models.items()}


@pytest.mark.parametrize("mode", BF16_MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_projections_close_to_peft(kind, mode, served, peft_refs, peft_bf16_refs, monkeypatch):
    """Projection matrices in bfloat16 (XLA's dot, or packed for multilora's bf16 GEMM and read in place
    in the scan), everything else float32: every sequence's logits are within bfloat16's
    tolerance of PEFT at float32, and no farther from it than transformers + PEFT in bfloat16."""
    cfg, weights, slots = served(kind)
    if mode == "bfloat16-packed-avx2":
        monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    bf16 = projections.convert(weights, mode.removesuffix("-avx2"))
    if mode.startswith("bfloat16-packed"):
        assert isinstance(bf16.layers.wq_LDO, projections.PackedBf16) and bf16.lm_head_DV is not None
        assert bf16.layers.wq_LDO.isa == kernels.bf16_gemm_isa()
        assert bf16.layers.wq_LDO.isa == "avx2" or not mode.endswith("-avx2")
    pages = _page_lists(10, [n for n, _ in MIXED])
    chunks = [SeqChunk(toks, 0, pg, slot) for toks, pg, (_, slot) in zip(MIXED_TOKENS, pages, MIXED)]
    # The adapters' pool in float32, and as the engine keeps it beside bf16 projections
    # (lora_dtype=auto: bfloat16).
    bf16_pool = copy.copy(slots)
    bf16_pool.weights = jax.tree.map(lambda a: a.astype(jnp.bfloat16), slots.weights)
    # each projection mode with the LoRA backend an engine runs beside it: the packed CPU GEMM with
    # the native group call, XLA's dot (a TPU's) with bgmv
    backends = ("native",) if mode.startswith("bfloat16-packed") and kernels.available() else ("bgmv",)
    for backend, (pool_name, pool) in itertools.product(backends, (("f32 pool", slots), ("bf16 pool", bf16_pool))):
        rows, _ = _step(cfg, bf16, pool, _fresh_kv(cfg), chunks, backend)
        for i, (c, got) in enumerate(zip(chunks, rows)):
            adapter = _adapter_of(c.slot, MAIN_SLOT_NAMES)
            want = peft_refs[kind].logits(adapter, MIXED_TOKENS[i])
            theirs = peft_bf16_refs[kind].logits(adapter, MIXED_TOKENS[i])
            ours_err, their_err = np.abs(got - want).max(), np.abs(theirs - want).max()
            what = f"{kind}/{mode}/{backend}/{pool_name} seq {i} (adapter {adapter})"
            assert ours_err > 0, f"{what}: bit-exact with float32: the bfloat16 path did not run"
            assert ours_err <= BF16_RTOL * np.abs(want).max(), f"{what}: max |err| {ours_err:.4f}"
            assert ours_err <= BF16_VS_PEFT * their_err, (
                f"{what}: max |err| {ours_err:.4f} against PEFT-bf16's {their_err:.4f}")


def test_a_slot_layout_prepared_off_the_engine_thread_writes_the_same_pool(tiny_models, tiny_adapters):
    """prepare_slot_layout (the loader's urgent workers) lays out what LoRASlots.load would: the
    pools come out the same, bit for bit, and the prepared layout is taken once (a second write
    of the same host copy lays it out again; a layout for another table width is not used)."""
    from multilora.adapters.pool import adapter_slot_arrays, prepare_slot_layout, take_slot_layout
    kind = REWRITE_KIND
    cfg, _ = load_weights(tiny_models[kind], mesh=MESH)
    lcfg = LoRAConfig(max_loras_per_batch=2, max_lora_rank=32)
    made = [LoRASlots(cfg, lcfg, jnp.float32, MESH, jit_writer=jit_slot_writer) for _ in range(2)]
    for slot, name, pages in ((1, "c_mlp_r16", [7, 3]), (2, "a_all_r8", [5])):
        plain = load_adapter(name, tiny_adapters[(kind, name)], cfg, 32)
        ready = load_adapter(name, tiny_adapters[(kind, name)], cfg, 32)
        prepare_slot_layout(ready, cfg, lcfg.table_width)
        made[0].load(slot, page_rows(pages), plain)
        made[1].load(slot, page_rows(pages), ready)
        assert ready.slot_layout is None  # taken by the write
    for field in vars(made[0].weights):
        np.testing.assert_array_equal(np.asarray(getattr(made[0].weights, field)),
                                      np.asarray(getattr(made[1].weights, field)), err_msg=field)
    adapter = load_adapter("a_all_r8", tiny_adapters[(kind, "a_all_r8")], cfg, 32)
    prepare_slot_layout(adapter, cfg, 32)
    # laid out at its own rank's width (one page), not the table's 32
    assert adapter.slot_layout is not None and adapter.slot_layout[0] == 8
    assert adapter.slot_layout[1].qkv_a_LUD.shape[1] == 3 * 8
    want = adapter_slot_arrays(adapter, cfg, 16)
    got = take_slot_layout(adapter, cfg, 16)   # prepared for width 8: laid out again for 16
    for field in vars(want):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)


def test_write_widths_track_the_adapters_rank():
    """An adapter is laid out and written at the least compiled width that holds its rank
    (whole pages, doubling, then the table's width), never at the table's width by default."""
    from multilora.adapters.pool import write_width, write_widths
    assert write_widths(8) == (8,)
    assert write_widths(32) == (8, 16, 32)
    assert write_widths(24) == (8, 16, 24)
    assert write_widths(128) == (8, 16, 32, 64, 128)
    assert [write_width(r, 32) for r in (1, 4, 8, 9, 16, 17, 32)] == [8, 8, 8, 16, 16, 32, 32]
    assert write_width(20, 24) == 24
    with pytest.raises(ValueError, match="rank 33 needs 40 rows, more than the table's 32"):
        write_width(33, 32)


def test_a_prepared_layout_counts_in_the_host_tier_until_its_write_takes_it(tiny_models, tiny_adapters):
    """The host tier's byte budget counts what a copy holds: its modules and, while it waits for
    its slot write, the layout prepared for it; the write takes the layout and the engine counts
    the copy again (registry.recount_host), so the bytes go back to the modules'."""
    from multilora.adapters.pool import adapter_slot_arrays, prepare_slot_layout, take_slot_layout, write_width
    from multilora.adapters.registry import AdapterRegistry
    kind = REWRITE_KIND
    cfg, _ = load_weights(tiny_models[kind], mesh=MESH)
    path = tiny_adapters[(kind, "c_mlp_r16")]
    adapter = load_adapter("c", path, cfg, 32)
    modules = sum(a.nbytes + b.nbytes for a, b in adapter.modules.values())
    assert adapter.nbytes == modules
    prepare_slot_layout(adapter, cfg, 32)
    width = write_width(adapter.rank, 32)  # rank 16: 16 rows, not the table's 32
    assert width == 16 and adapter.slot_layout[0] == width
    layout = adapter_slot_arrays(adapter, cfg, width)
    layout_bytes = sum(getattr(layout, f).nbytes for f in vars(layout) if getattr(layout, f) is not None)
    assert layout_bytes > 0 and adapter.nbytes == modules + layout_bytes
    reg = AdapterRegistry(2, None, lambda name, p: load_adapter(name, p, cfg, 32))
    reg.register("c", path, adapter=adapter)
    assert reg.host_bytes == modules + layout_bytes
    take_slot_layout(adapter, cfg, width)
    assert reg.host_bytes == modules + layout_bytes  # counted as put, until recounted
    reg.recount_host("c")
    assert reg.host_bytes == modules
    reg.unregister("c")
    assert reg.host_bytes == 0


# qwen3: q/k norms, a window on one layer; kv_write: how the heads-major cache takes the new rows
# (the other ways, "pages" and "pallas-rows", are checked against the row scatter in tests/test_kv_write.py)
@pytest.mark.parametrize("kind,kv_write", [("llama", "rows"), ("qwen3", "rows"), ("qwen3", "pallas-pages")])
def test_heads_major_cache_steps_match_the_default_layout(tiny_models, kind, kv_write):
    """A cache made heads-major (llama.KV_HEADS_MAJOR, a TPU's; the CPU can hold that layout too)
    and a step compiled with its formats in and out: the layout survives the step, and logits and
    cache equal the default layout's over a mixed step and the decode step after it (to 1e-5 at
    float32: XLA's CPU fuses the two differently, so sums may round in another order; on a TPU
    v5e, bf16, the two were bit-equal: benchmarks/log/25-2026-12-05-tpu-v5e-kv-heads-major.md).
    Each way of writing the step's K/V rows into the heads-major cache (llama.KV_WRITES) gives the
    same."""
    cfg, weights = load_weights(tiny_models[kind], mesh=MESH)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    lengths = [n for n, _ in MIXED]
    pages = _page_lists(5, [n + 1 for n in lengths])
    first = [SeqChunk(t[:-1], 0, p, 0) for t, p in zip(MIXED_TOKENS, pages)]
    first[0] = SeqChunk([MIXED_TOKENS[0][0]], 0, pages[0], 0)  # one decode row beside prefill chunks
    then = [SeqChunk([t[-1]], len(c.token_ids), p, 0) for t, c, p in zip(MIXED_TOKENS, first, pages)]
    batches = [build_batch([c[i] for i in decode_first(c)], num_tokens=64, num_pages=STEP_PAGES, num_logits=64,
                           page_size=PAGE_SIZE) for c in (first, then)]
    outs = {}
    # (heads-major, Pallas attention): the TPU's path is (True, True), here in Pallas's interpreter,
    # which hands back the default layout whatever format is asked (the layout is a TPU's concern,
    # compiled there), so that step is compiled without the cache's formats. Interpreted, it costs
    # ~30 s on two cores: run beside the Pallas K/V writes only (the kernel itself is checked
    # against its definition in tests/test_attention_pallas.py)
    # (True, True, f): the same with f kv heads a 128-lane row (multilora.model.kv_lanes). XLA's
    # heads-major attention (True, False) runs beside the XLA row writes only (the Pallas writes
    # are held to them in tests/test_kv_write.py)
    pack = kv_lanes.lane_pack(cfg.head_dim)
    layouts = ((False, False, 1),) + (
        ((True, True, 1), (True, True, pack)) if kv_write.startswith("pallas") else ((True, False, 1),))
    for hm, pa, f in layouts:
        kv = make_kv_cache(cfg, NUM_PAGES, PAGE_SIZE, jnp.float32, one, hm, lane_pack=f)
        assert is_heads_major(kv.k_LPpKH) == hm
        interpreted = pa or (hm and kv_write.startswith("pallas"))  # likewise the Pallas K/V writes
        formats = {} if interpreted else dict(out_shardings=(one, kv_cache_formats(KVCache(one, one), hm)))
        fwd = jax.jit(forward, static_argnames=("cfg", "backend", "kv_heads_major", "pallas_attention", "kv_write"),
                      donate_argnames=("kv",), **formats)
        logits = []
        for batch in batches:
            lg, kv = fwd(weights, None, kv, batch, cfg=cfg, kv_heads_major=hm, pallas_attention=pa, kv_write=kv_write)
            assert is_heads_major(kv.k_LPpKH) == hm or interpreted
            logits.append(np.asarray(lg))
        # a packed cache's rows unpacked to (L, P, p, K, H), its padding heads zeros
        k, v = (np.asarray(c).reshape(c.shape[:3] + (-1, cfg.head_dim)) for c in (kv.k_LPpKH, kv.v_LPpKH))
        assert not np.any(k[:, :, :, cfg.num_kv_heads:]) and not np.any(v[:, :, :, cfg.num_kv_heads:])
        outs[hm, pa, f] = logits, k[:, :, :, :cfg.num_kv_heads], v[:, :, :, :cfg.num_kv_heads]
    for key in layouts[1:]:  # each against the default layout; the Pallas attention's sums in another order
        tol = 1e-4 if key[1] else 1e-5
        for got, want in zip(jax.tree.leaves(outs[key]), jax.tree.leaves(outs[False, False, 1])):
            np.testing.assert_allclose(got, want, atol=tol, rtol=0, err_msg=str(key))
    assert np.abs(outs[False, False, 1][1]).max() > 0  # the steps wrote the cache
    # heads-major pages are counted at H padded to a TPU's 128 lanes
    assert kv_page_bytes(cfg, 16, jnp.bfloat16, True) == -(-cfg.head_dim // 128) * 128 // cfg.head_dim * \
        kv_page_bytes(cfg, 16, jnp.bfloat16, False)
    # ... and packed, at the groups' rows of 128 lanes (qwen3: 2 kv heads of 32 in one group of 4)
    assert kv_page_bytes(cfg, 16, jnp.bfloat16, True, pack) == 2 * cfg.num_layers * 16 * 128 * 2 * \
        kv_lanes.groups(cfg.num_kv_heads, pack)
