"""The Pallas LoRA kernel (multilora.kernels.lora_pallas) against a plain per-token definition.

On the CPU (CI) the kernel runs in Pallas's TPU interpreter, DMAs and semaphores included; on a
TPU the same tests run it compiled. Cases: ragged token counts, pages out of order in the pool
and adapters whose pages are one run (read in one copy),
base rows among adapter rows, mixed ranks, stacked A blocks, several layers read in place at a
traced layer, more step adapters than one chunk, tokens split over several tiles, float32 and
bfloat16 pools, and pool rows that no adapter names holding NaN (one read would show).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multilora.config import PAGE_ROWS
from multilora.kernels.lora_pallas import chunk_adapters, lora_delta, lora_delta_reference, lora_plan
from multilora.lora.batch import NO_ADAPTER, make_lora_batch_info, step_adapters

ON_TPU = jax.default_backend() == "tpu"


def paged_pool(rng, num_layers, blocks, slot_ranks, width, dtype, table_width, in_slot_order=False):
    """(pool (L, blocks*U, X), rows_SR, dense (L, blocks, S, R, X)): each slot's ceil(rank / 8)
    pages in the pool, an odd slot's as one run of consecutive pages (read in one copy), an even
    slot's at random pages, in no order (in_slot_order: every slot's one run, slot after slot, as
    a registry that hands pages lowest first lays out adapters loaded one after another); page 0
    zero, rows past a slot's rank zero, rows no slot names NaN."""
    s = len(slot_ranks)
    need = [-(-int(k) // PAGE_ROWS) for k in slot_ranks]
    n_runs = sum(n for i, n in enumerate(need) if i % 2 or in_slot_order)
    n_pages = 1 + sum(need) + 3
    n_pages += n_pages % 2                                   # whole 16-row tiles of a bf16 pool
    runs = iter(range(n_pages - n_runs, n_pages))           # the top pages, handed out in order
    free = list(rng.permutation(np.arange(1, n_pages - n_runs)))
    rows = np.tile(np.arange(table_width, dtype=np.int32) % PAGE_ROWS, (s, 1))
    for i, n in enumerate(need):
        for p in range(n):
            page = next(runs) if i % 2 or in_slot_order else free.pop()
            rows[i, PAGE_ROWS * p:PAGE_ROWS * (p + 1)] = page * PAGE_ROWS + np.arange(PAGE_ROWS)
    u = n_pages * PAGE_ROWS
    dense = rng.standard_normal((num_layers, blocks, s, table_width, width)).astype(np.float32)
    for i, k in enumerate(slot_ranks):
        dense[:, :, i, k:] = 0.0
    dense[:, :, NO_ADAPTER] = 0.0
    pool = np.full((num_layers, blocks, u, width), np.nan, np.float32)
    pool[:, :, :PAGE_ROWS] = 0.0
    for i, n in enumerate(need):
        for r in range(n * PAGE_ROWS):
            pool[:, :, rows[i, r]] = dense[:, :, i, r]
    pool = jnp.asarray(pool.reshape(num_layers, blocks * u, width)).astype(dtype)
    return pool, rows, np.asarray(jnp.asarray(dense).astype(dtype).astype(jnp.float32))


def b_pool_by_table(rng, num_layers, slot_ranks, rows, u, width, dtype):
    """(pool (L, U, O), dense (L, 1, S, R, O)): B laid out by A's row table, as the engine shares
    one table between a module's A and B; page 0 zero, rows no slot names NaN."""
    dense = rng.standard_normal((num_layers, 1, len(slot_ranks), rows.shape[1], width)).astype(np.float32)
    pool = np.full((num_layers, u, width), np.nan, np.float32)
    pool[:, :PAGE_ROWS] = 0.0
    for i, k in enumerate(slot_ranks):
        dense[:, :, i, k:] = 0.0
        for r in range(-(-k // PAGE_ROWS) * PAGE_ROWS):
            pool[:, rows[i, r]] = dense[:, 0, i, r]
    dense[:, :, NO_ADAPTER] = 0.0
    pool = jnp.asarray(pool).astype(dtype)
    return pool, np.asarray(jnp.asarray(dense).astype(dtype).astype(jnp.float32))


def np_delta(x_TD, a_dense, b_dense, layer, block, scalings_S, slot_T):
    """y_t = ((x_t @ A[s].T) * scaling[s]) @ B[s] for token t in slot s, zeros for slot 0."""
    y = np.zeros((x_TD.shape[0], b_dense.shape[-1]), np.float64)
    for t, s in enumerate(slot_T):
        if s != NO_ADAPTER:
            h = x_TD[t].astype(np.float64) @ a_dense[layer, block, s].T.astype(np.float64) * scalings_S[s]
            y[t] = h @ b_dense[layer, 0, s].astype(np.float64)
    return y


@pytest.fixture
def trace_time_knob(monkeypatch):
    """set(name, value): a knob the kernel reads when it is traced, with JAX's caches cleared
    before and after the test, so that no trace of one setting serves another (a cached trace
    would test the default again)."""
    used = []

    def set_(name, value):
        monkeypatch.setenv(name, value)
        jax.clear_caches()
        used.append(name)

    yield set_
    if used:
        monkeypatch.undo()
        jax.clear_caches()


CASES = [  # (T, D, O, slot ranks (slot 0 first), table width, max step adapters, token pattern)
    (1, 128, 256, [0, 16, 8], 16, 4, "random"),
    (13, 256, 128, [0, 8, 16, 16, 8], 16, 8, "random"),
    (64, 128, 384, [0] + [16] * 20, 16, 24, "random"),           # 3 chunks of 8 adapters
    (100, 128, 128, [0, 24, 8, 32, 16, 32], 32, 6, "prefill"),    # table of 32: chunks of 4
    (40, 256, 128, [0, 16, 16, 8], 16, 8, "all_base"),
    (30, 128, 128, [0, 24, 8, 16, 24, 8], 24, 6, "random"),       # a table of 3 pages: chunks of 4
]


def make_tokens(rng, pattern, t, s):
    if pattern == "all_base":
        return np.zeros(t, np.int32)
    if pattern == "prefill":  # runs of one adapter (sequences), base runs among them, a reuse
        cuts = np.sort(rng.choice(np.arange(1, t), size=5, replace=False))
        slots = rng.permutation(np.arange(s))[:6] % s
        slots[-1] = slots[1]
        return np.concatenate([np.full(n, sl, np.int32) for n, sl in zip(np.diff(np.r_[0, cuts, t]), slots)])
    return rng.integers(0, s, t).astype(np.int32)


# every case unrolled in float32, and in bfloat16 where a chunk's rows meet bf16's (16, 128) tiles in
# more than one way (several chunks; tables of 2 and 3 pages: chunks of an even number of adapters);
# the copies in a loop where a chunk holds several adapters of one page, or adapters of several pages
# (page by page where an adapter's pages are not consecutive). Each case is ~10 s in the interpreter.
SEVERAL = [c for c in CASES if c[0] == 64 or c[4] > 16]
KERNEL_CASES = ([(c, "float32", True) for c in CASES] + [(c, "bfloat16", True) for c in SEVERAL]
                + [(c, "float32", False) for c in SEVERAL])


@pytest.mark.parametrize("case,dtype,copy_loop", KERNEL_CASES, ids=lambda v: (
    f"T{v[0]}-D{v[1]}-O{v[2]}-S{len(v[3])}-R{v[4]}-{v[6]}" if isinstance(v, tuple) else str(v)))
def test_lora_delta_matches_the_per_token_definition(case, dtype, copy_loop, trace_time_knob):
    """A chunk's adapter copies in a loop (the default), and unrolled (MULTILORA_LORA_COPY_LOOP=0)."""
    from multilora.kernels.lora_pallas import COPY_LOOP_ENV
    trace_time_knob(COPY_LOOP_ENV, "1" if copy_loop else "0")
    t, d, o, ranks, width, max_adapters, pattern = case
    rng = np.random.default_rng(t * 7 + d)
    layers, blocks = 2, 3
    a_pool, rows, a_dense = paged_pool(rng, layers, blocks, ranks, d, dtype, width)
    b_pool, b_dense = b_pool_by_table(np.random.default_rng(1), layers, ranks, rows, a_pool.shape[1] // blocks,
                                      o, dtype)
    scalings = rng.uniform(0.25, 2.0, len(ranks)).astype(np.float32)
    scalings[NO_ADAPTER] = 0.0
    slot_T = make_tokens(rng, pattern, t, len(ranks))
    info = make_lora_batch_info(slot_T, scalings, np.asarray(ranks, np.int32), rows, max_grouped=max_adapters)
    x = jnp.asarray(rng.standard_normal((t, d)).astype(np.float32)).astype(dtype)
    x_np = np.asarray(x.astype(jnp.float32))
    tol = (2e-2 if dtype == "bfloat16" else (2e-3 if ON_TPU else 1e-4))
    run = jax.jit(lora_delta, static_argnames=("a_block", "a_blocks", "interpret", "tile_rows"))
    # the first layer's first block as one tile, the last layer's last block in tiles of 8 rows
    # (each call is a compile of the interpreted kernel: ~3 s)
    for layer, block, tiles in ((0, 0, (None,)), (layers - 1, blocks - 1, (8,))):
        for tile_rows in tiles:
            got = run(x, a_pool, b_pool, jnp.int32(layer), info.step_slots_A, info.local_T, rows,
                      scalings, a_block=block, a_blocks=blocks, interpret=not ON_TPU, tile_rows=tile_rows)
            got = np.asarray(jnp.asarray(got).astype(jnp.float32))
            want = np_delta(x_np, a_dense, b_dense, layer, block, scalings, slot_T)
            what = f"layer {layer} block {block} tile_rows {tile_rows}"
            assert np.isfinite(got).all(), f"{what}: read a row no adapter names"
            assert np.all(got[slot_T == NO_ADAPTER] == 0.0), f"{what}: base rows got a delta"
            scale = max(1.0, float(np.abs(want).max()))
            err = float(np.abs(got - want).max())
            assert err <= tol * scale, f"{what}: max |err| {err:.3e} > {tol * scale:.3e}"
        ref = lora_delta_reference(x, a_pool, b_pool, layer, info.step_slots_A, info.local_T, rows,
                                   scalings, block, blocks)
        assert np.allclose(np.asarray(ref.astype(jnp.float32)), want, atol=tol * scale)


def stacked_case(seed, ranks, t, outs, dtype, b_seed, max_grouped, d=128, layers=2):
    """A stacked A pool with len(outs) blocks of d columns and a B pool for each output, for the
    slots' ranks (table width 16), their scalings, t tokens over them at random, the batch info
    and x: (a_pool, rows, a_dense, [(b_pool, b_dense)], scalings, slot_T, info, x)."""
    rng = np.random.default_rng(seed)
    a_pool, rows, a_dense = paged_pool(rng, layers, len(outs), ranks, d, dtype, 16)
    u = a_pool.shape[1] // len(outs)
    bs = [b_pool_by_table(np.random.default_rng(b_seed + k), layers, ranks, rows, u, o, dtype)
          for k, o in enumerate(outs)]
    scalings = rng.uniform(0.25, 2.0, len(ranks)).astype(np.float32)
    scalings[NO_ADAPTER] = 0.0
    slot_T = make_tokens(rng, "random", t, len(ranks))
    info = make_lora_batch_info(slot_T, scalings, np.asarray(ranks, np.int32), rows, max_grouped=max_grouped)
    x = jnp.asarray(rng.standard_normal((t, d)).astype(np.float32)).astype(dtype)
    return a_pool, rows, a_dense, bs, scalings, slot_T, info, x


# (dtype, adapters a chunk (None: the kernel's pick), the call's A blocks (None: all, in order),
# a buffer's copies waited on at once, the zero page's copies from VMEM)
STACKED_CASES = [("float32", None, None, False, True), ("bfloat16", None, None, False, True),
                 ("bfloat16", 4, None, False, False), ("float32", 16, None, False, True),
                 ("float32", 4, (1, 2), False, True), ("float32", None, (2, 0), True, True),
                 ("float32", 4, None, True, False), ("bfloat16", None, (1, 2), True, True)]


@pytest.mark.parametrize("dtype,chunk,ids,one_wait,zero_local", STACKED_CASES)
def test_stacked_outputs_in_one_call_match_each_projection(dtype, chunk, ids, one_wait, zero_local,
                                                           trace_time_knob):
    """lora_deltas: q/k/v-like outputs of different widths from one stacked A pool in one call
    (its blocks in order, some, or out of order), over two token tiles and several chunks of
    adapters (the kernel's pick of adapters per chunk, and others through
    MULTILORA_LORA_CHUNK_ADAPTERS), waited on a copy at a time (MULTILORA_LORA_ONE_WAIT=0) or a
    buffer at once (pages out of order, page by page), the zero page copied from VMEM (the
    default) or from HBM (MULTILORA_LORA_ZERO_PAGE_LOCAL=0), against the per-token definition."""
    from multilora.kernels.lora_pallas import CHUNK_ENV, ONE_WAIT_ENV, ZERO_LOCAL_ENV, lora_deltas
    if chunk:
        trace_time_knob(CHUNK_ENV, str(chunk))
    trace_time_knob(ONE_WAIT_ENV, "1" if one_wait else "0")
    trace_time_knob(ZERO_LOCAL_ENV, "1" if zero_local else "0")
    t, outs = 40, (256, 128, 128)
    a_pool, rows, a_dense, bs, scalings, slot_T, info, x = stacked_case(11, [0] + [16, 8] * 9 + [16], t, outs, dtype,
                                                                        20, max_grouped=24)
    x_np = np.asarray(x.astype(jnp.float32))
    tol = 2e-2 if dtype == "bfloat16" else (2e-3 if ON_TPU else 1e-4)
    ids = ids or tuple(range(len(outs)))
    got = jax.jit(lora_deltas, static_argnames=("a_block_ids", "a_blocks", "interpret", "tile_rows"))(
        x, a_pool, [bs[k][0] for k in ids], jnp.int32(1), info.step_slots_A, info.local_T, rows, scalings,
        a_block_ids=ids, a_blocks=len(outs), interpret=not ON_TPU, tile_rows=16)
    assert len(got) == len(ids)
    for y, k in zip(got, ids):
        y = np.asarray(jnp.asarray(y).astype(jnp.float32))
        want = np_delta(x_np, a_dense, bs[k][1], 1, k, scalings, slot_T)
        assert y.shape == (t, outs[k]) and np.isfinite(y).all()
        assert np.all(y[slot_T == NO_ADAPTER] == 0.0)
        scale = max(1.0, float(np.abs(want).max()))
        assert float(np.abs(y - want).max()) <= tol * scale, f"output {k}"


@pytest.mark.parametrize("dtype,one_wait", [("float32", True), ("bfloat16", False)])
def test_zero_page_copies_come_from_vmem(dtype, one_wait, trace_time_knob):
    """MULTILORA_LORA_ZERO_PAGE_LOCAL (on unless "0"): the zero page's copies (padding entries: a
    step of 5 adapters in chunks of 8; pages past a rank-8 adapter's in a 16-wide table) come
    from zero blocks in VMEM. The pool's page 0 holds NaN here, so a read of it would show;
    against the per-token definition, over two token tiles."""
    from multilora.kernels.lora_pallas import ONE_WAIT_ENV, ZERO_LOCAL_ENV, lora_deltas
    trace_time_knob(ZERO_LOCAL_ENV, "1")
    trace_time_knob(ONE_WAIT_ENV, "1" if one_wait else "0")
    ranks, t, outs = [0, 16, 8, 16, 8, 16, 16], 24, (128, 256)
    a_pool, rows, a_dense, bs, scalings, _, _, x = stacked_case(23, ranks, t, outs, dtype, 50, max_grouped=8)
    u = a_pool.shape[1] // len(outs)
    a_np = np.array(a_pool.astype(jnp.float32))
    for blk in range(len(outs)):
        a_np[:, blk * u:blk * u + PAGE_ROWS] = np.nan
    a_pool = jnp.asarray(a_np).astype(dtype)
    b_pools = [jnp.asarray(np.asarray(b.astype(jnp.float32))).at[:, :PAGE_ROWS].set(np.nan).astype(dtype)
               for b, _ in bs]
    slot_T = np.random.default_rng(24).choice([0, 1, 2, 3, 4, 6], t).astype(np.int32)   # 5 adapters, two of rank 8
    info = make_lora_batch_info(slot_T, scalings, np.asarray(ranks, np.int32), rows, max_grouped=8)
    got = jax.jit(lora_deltas, static_argnames=("a_block_ids", "a_blocks", "interpret", "tile_rows"))(
        x, a_pool, b_pools, jnp.int32(1), info.step_slots_A, info.local_T, rows, scalings,
        a_blocks=len(outs), interpret=not ON_TPU, tile_rows=16)
    x_np = np.asarray(x.astype(jnp.float32))
    tol = 2e-2 if dtype == "bfloat16" else (2e-3 if ON_TPU else 1e-4)
    for k, y in enumerate(got):
        y = np.asarray(jnp.asarray(y).astype(jnp.float32))
        want = np_delta(x_np, a_dense, bs[k][1], 1, k, scalings, slot_T)
        assert np.isfinite(y).all(), f"output {k}: read the pool's zero page"
        assert np.all(y[slot_T == NO_ADAPTER] == 0.0)
        assert float(np.abs(y - want).max()) <= tol * max(1.0, float(np.abs(want).max())), f"output {k}"


def test_step_adapters_in_order_of_first_appearance():
    steps, local = step_adapters(np.array([0, 5, 3, 5, 0, 9, 3], np.int32), 4)
    assert steps.tolist() == [5, 3, 9, 0]
    assert local.tolist() == [4, 0, 1, 0, 4, 2, 1]
    steps, local = step_adapters(np.zeros(3, np.int32), 2)
    assert steps.tolist() == [0, 0] and local.tolist() == [2, 2, 2]


def test_chunks_fill_the_lanes():
    assert chunk_adapters(16) == 8 and chunk_adapters(8) == 16 and chunk_adapters(128) == 1
    assert chunk_adapters(256) == 1
    assert chunk_adapters(24) == 4 and chunk_adapters(40) == 2 and chunk_adapters(72) == 2  # whole (16, 128) tiles
    assert all(chunk_adapters(w) * w % 16 == 0 for w in range(8, 512, 8))
    # no more than the step's adapters (still whole tiles)
    assert chunk_adapters(16, 3) == 3 and chunk_adapters(16, 64) == 8 and chunk_adapters(24, 3) == 2


def test_pallas_backend_refuses_more_adapters_than_compiled_for():
    from multilora.lora.backend import get_backend
    be = get_backend("pallas")
    rows = np.tile(np.arange(8, dtype=np.int32), (5, 1))
    with pytest.raises(ValueError, match="more distinct adapters than the 2"):
        be.prepare_lora_batch(np.array([1, 2, 3, 4], np.int32), np.ones(5, np.float32),
                              np.full(5, 8, np.int32), rows, max_grouped=2)


def test_pallas_backend_shrink_and_expand_alone_never_read_slot_0():
    """The interface's separate run_lora_a_gemm / run_lora_b_gemm (dense's one-hot arithmetic over
    the step's adapters): padding entries of step_slots_A are slot 0, whose table here names rows
    of NaN; the results stay finite and match the per-token definition."""
    from multilora.lora.backend import get_backend
    from multilora.lora.backend.base import PoolLayer
    rng = np.random.default_rng(5)
    ranks = [0, 16, 8, 16]
    a_pool, rows, a_dense = paged_pool(rng, 1, 1, ranks, 64, "float32", 16)
    b_pool, b_dense = b_pool_by_table(rng, 1, ranks, rows, a_pool.shape[1], 48, "float32")
    spare = [r for r in range(PAGE_ROWS, a_pool.shape[1], PAGE_ROWS) if r not in set(rows.ravel())][0]
    rows[NO_ADAPTER] = spare + np.arange(16) % PAGE_ROWS   # slot 0 names a page of NaN
    scal = np.array([5.0, 0.5, 1.5, 2.0], np.float32)
    slot_T = np.array([0, 2, 2, 0, 1, 2, 0], np.int32)     # slot 3 unused: step_slots_A has padding
    be = get_backend("pallas")
    info = be.prepare_lora_batch(slot_T, scal, np.asarray(ranks, np.int32), rows, max_grouped=3)
    assert NO_ADAPTER in info.step_slots_A.tolist()
    x = rng.standard_normal((len(slot_T), 64)).astype(np.float32)
    a, b = PoolLayer(a_pool, jnp.int32(0)), PoolLayer(b_pool, jnp.int32(0))
    got = np.asarray(be.run_lora_b_gemm(be.run_lora_a_gemm(x, a, info), b, info))
    tol = 2e-2 if ON_TPU else 1e-4   # float32 products at a TPU's default precision: bfloat16 passes
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, np_delta(x, a_dense, b_dense, 0, 0, scal, slot_T), atol=tol, rtol=tol)


def test_copy_knobs_defaults_and_a_bad_value_named(monkeypatch):
    from multilora.kernels import lora_pallas as lp
    for env, on, default in ((lp.CHUNK_COPY_ENV, lp.chunk_copy_on, False), (lp.ONE_WAIT_ENV, lp.one_wait_on, True),
                             (lp.ZERO_LOCAL_ENV, lp.zero_local_on, True)):
        for value, want in ((None, default), ("", default), ("0", False), ("1", True)):
            if value is None:
                monkeypatch.delenv(env, raising=False)
            else:
                monkeypatch.setenv(env, value)
            assert on() is want
        monkeypatch.setenv(env, "yes")
        with pytest.raises(ValueError, match=rf"\${env}='yes': expected 0 or 1"):
            on()
        monkeypatch.delenv(env)


# (token tile rows (None: the whole step, whose adapters then go in order of pool page), slots the
# step's tokens use (a range: whole chunks are runs; every other slot: none is), a buffer's copies
# waited on at once)
CHUNK_COPY_CASES = [(None, "range", False), (None, "range", True), (8, "range", False), (None, "sparse", True),
                    (8, "sparse", True)]


@pytest.mark.parametrize("tiles,used,one_wait", CHUNK_COPY_CASES)
def test_a_chunk_whose_pages_are_one_run_comes_in_one_copy(tiles, used, one_wait, trace_time_knob):
    """MULTILORA_LORA_CHUNK_COPY=1: a chunk whose adapters' pages are one run of the pool is read
    in one copy a pool, others an adapter at a time; a step of one token tile orders its adapters
    by pool page (tokens in random order of adapters), one of several keeps their first
    appearance. The pool's rows no adapter names hold NaN: one read in would show. Against the
    per-token definition, q/k/v-like outputs from a stacked A pool."""
    from multilora.kernels.lora_pallas import CHUNK_COPY_ENV, ONE_WAIT_ENV, lora_deltas
    trace_time_knob(CHUNK_COPY_ENV, "1")
    trace_time_knob(ONE_WAIT_ENV, "1" if one_wait else "0")
    rng = np.random.default_rng(5)
    ranks = [0] + [16] * 20
    t, d, outs, layers = 40, 128, (128, 256, 128), 2
    a_pool, rows, a_dense = paged_pool(rng, layers, len(outs), ranks, d, "float32", 16, in_slot_order=True)
    u = a_pool.shape[1] // len(outs)
    bs = []
    for k, o in enumerate(outs):
        dense = np.random.default_rng(30 + k).standard_normal((layers, 1, len(ranks), 16, o)).astype(np.float32)
        dense[:, :, NO_ADAPTER] = 0.0
        pool = np.full((layers, u, o), np.nan, np.float32)
        pool[:, :PAGE_ROWS] = 0.0
        for i in range(1, len(ranks)):
            pool[:, rows[i]] = dense[:, 0, i]
        bs.append((jnp.asarray(pool), dense))
    used_slots = np.arange(3, 19) if used == "range" else np.arange(1, 21, 2)   # each twice or more, 8 base rows
    slot_T = rng.permutation(np.concatenate([np.resize(used_slots, t - 8), np.zeros(8, int)])).astype(np.int32)
    scalings = rng.uniform(0.25, 2.0, len(ranks)).astype(np.float32)
    scalings[NO_ADAPTER] = 0.0
    info = make_lora_batch_info(slot_T, scalings, np.asarray(ranks, np.int32), rows, max_grouped=24)
    # the plan's chunk flags (after the pages, 2 an entry, and the entries' runs): whole chunks
    # where one tile takes the adapters by pool page
    tm = tiles or t
    plan = lora_plan(info.step_slots_A, info.local_T, rows, scalings, (tm,))
    per_chunk = chunk_adapters(16, len(info.step_slots_A))
    n_chunks = -(-len(info.step_slots_A) // per_chunk)
    meta = np.asarray(plan["tiles"][tm]["meta"])
    flags = meta[n_chunks * per_chunk * 3:n_chunks * per_chunk * 3 + n_chunks]
    want_flags = 2 if (tiles, used) == (None, "range") else 0
    assert flags.sum() == want_flags and plan["chunk_runs"], flags
    x = jnp.asarray(rng.standard_normal((t, d)).astype(np.float32))
    x_np = np.asarray(x)
    got = jax.jit(lora_deltas, static_argnames=("a_block_ids", "a_blocks", "interpret", "tile_rows"))(
        x, a_pool, [b for b, _ in bs], jnp.int32(1), info.step_slots_A, info.local_T, rows, scalings,
        a_blocks=len(outs), interpret=not ON_TPU, tile_rows=tiles)
    tol = 2e-3 if ON_TPU else 1e-4
    for k, y in enumerate(got):
        y = np.asarray(y)
        want = np_delta(x_np, a_dense, bs[k][1], 1, k, scalings, slot_T)
        assert y.shape == (t, outs[k]) and np.isfinite(y).all()
        assert np.all(y[slot_T == NO_ADAPTER] == 0.0)
        assert float(np.abs(y - want).max()) <= tol * max(1.0, float(np.abs(want).max())), f"output {k}"


def test_by_pool_page_keeps_each_tokens_adapter():
    """The step's adapters reordered by first pool page (padding last): every token still names
    its own adapter's slot, base rows stay base rows."""
    from multilora.kernels.lora_pallas import by_pool_page
    rows = np.zeros((6, 16), np.int32)
    for slot, page in ((1, 9), (2, 3), (3, 5), (4, 1), (5, 7)):
        rows[slot] = page * PAGE_ROWS + np.arange(16)
    slot_T = np.array([3, 0, 5, 3, 1, 4, 0, 5], np.int32)
    steps, local = step_adapters(slot_T, 6)
    slots, local2 = by_pool_page(jnp.asarray(steps), jnp.asarray(local), jnp.asarray(rows))
    slots, local2 = np.asarray(slots), np.asarray(local2)
    assert list(slots) == [4, 3, 5, 1, 0, 0]
    has = local2 < 6
    assert np.array_equal(has, slot_T != NO_ADAPTER)
    assert np.array_equal(slots[local2[has]], slot_T[has])


def test_a_row_table_of_part_pages_is_refused_naming_its_width():
    """The kernel reads whole pages: a table of 12 rows an adapter is an error that says so (the
    backend sends such hand-made tables to the XLA arithmetic instead)."""
    rows = np.zeros((3, 12), np.int32)
    with pytest.raises(ValueError, match=r"row table's width 12 is not whole pages of 8"):
        lora_plan(jnp.asarray([1, 2], jnp.int32), jnp.asarray([0, 1, 2], jnp.int32), jnp.asarray(rows),
                  jnp.ones(3, jnp.float32), (8,))
