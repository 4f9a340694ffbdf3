"""LoRA backends against a plain numpy per-token loop, on random shapes and slot mixes.

The loop is the definition: for token t in slot s != 0, y_t = ((x_t @ A[s].T) * scaling[s]) @ B[s].T;
tokens in slot 0 (no adapter) get exactly zero. The definition reads slot-major arrays (S, R, X),
zero past each slot's rank; the backends read them as LoRASlots lays them out: a pool of rank
rows, each slot's rows scattered through it in random order (the row table), row 0 zero, and
rows that no slot names holding NaN (one read would show). A separate test points slot 0 at
junk rows: base rows must never read them.
"""

from __future__ import annotations

import zlib

import jax
import numpy as np
import pytest

from multilora import kernels
from multilora.lora.backend import BACKENDS, get_backend
from multilora.lora.batch import NO_ADAPTER, make_lora_batch_info, sgmv_tile_rows

# `native` needs a C++ compiler (built on first use); where there is none it is left out here and
# its own tests below skip, saying why.
BACKEND_NAMES = tuple(n for n in BACKENDS if n != "native" or kernels.available())

# (T, D, O, S, R): T=1; T off the sgmv tile (8 rows up to 64 tokens, 32 up to 512); T > 64;
# S=2 (one adapter slot); more slots than tokens.
SHAPES = [
    (1, 16, 24, 3, 4),
    (13, 32, 48, 5, 8),
    (100, 24, 40, 4, 16),
    (37, 8, 12, 2, 4),
    (5, 16, 8, 9, 4),
    (100, 1024, 1024, 33, 4),  # many slots, wide: sgmv's loop over used tiles
]
PATTERNS = ("random", "one_slot", "all_base", "every_slot", "sorted_desc")


# --- the numpy definition --------------------------------------------------------------------

def np_shrink(x_TD, a_SRD, scalings_S, slot_T):
    h = np.zeros((x_TD.shape[0], a_SRD.shape[1]), np.float64)
    for t, s in enumerate(slot_T):
        if s != NO_ADAPTER:
            h[t] = (x_TD[t].astype(np.float64) @ a_SRD[s].T.astype(np.float64)) * scalings_S[s]
    return h


def np_expand(h_TR, b_SRO, slot_T):
    y = np.zeros((h_TR.shape[0], b_SRO.shape[2]), np.float64)
    for t, s in enumerate(slot_T):
        if s != NO_ADAPTER:
            y[t] = h_TR[t].astype(np.float64) @ b_SRO[s].astype(np.float64)
    return y


def np_lora(x_TD, a_SRD, b_SRO, scalings_S, slot_T):
    return np_expand(np_shrink(x_TD, a_SRD, scalings_S, slot_T), b_SRO, slot_T)


def np_stacked(x_TD, a_SRD, bs, scalings_S, slot_T):
    r = a_SRD.shape[1] // len(bs)
    return [np_lora(x_TD, a_SRD[:, i * r:(i + 1) * r], b, scalings_S, slot_T) for i, b in enumerate(bs)]


# --- random inputs ---------------------------------------------------------------------------

def make_slots(rng, pattern, t, s):
    if pattern == "all_base":
        return np.zeros(t, np.int32)
    if pattern == "one_slot":
        return np.full(t, rng.integers(1, s), np.int32)
    if pattern == "every_slot":  # every slot (0 included) at least once when t allows, random order
        base = np.arange(t) % s
        return rng.permutation(base).astype(np.int32)
    if pattern == "sorted_desc":
        return np.sort(rng.integers(0, s, t))[::-1].astype(np.int32)
    return rng.integers(0, s, t).astype(np.int32)


def make_ranks(rng, s, r):
    ranks = rng.integers(1, r + 1, s).astype(np.int32)
    ranks[NO_ADAPTER] = 0
    ranks[-1] = r  # one slot at full rank
    return ranks


def make_a(rng, s, r, d, ranks, blocks=1):
    """A (S, blocks*R, D): rows past each slot's rank inside every block are zero; slot 0 zero."""
    a = rng.standard_normal((s, blocks * r, d)).astype(np.float32)
    for i in range(s):
        for blk in range(blocks):
            a[i, blk * r + ranks[i]:(blk + 1) * r] = 0.0
    a[NO_ADAPTER] = 0.0
    return a


def make_b(rng, s, o, r, ranks):
    """B (S, R, O): rows past each slot's rank are zero; slot 0 zero."""
    b = rng.standard_normal((s, r, o)).astype(np.float32)
    for i in range(s):
        b[i, ranks[i]:] = 0.0
    b[NO_ADAPTER] = 0.0
    return b


def make_scalings(rng, s):
    sc = rng.uniform(0.25, 2.0, s).astype(np.float32)
    sc[NO_ADAPTER] = 0.0
    return sc


def make_rows(rng, ranks, r, spare=3):
    """A row table (S, R) and the pool's rows per block. When R is whole pages (a multiple of 8,
    as LoRASlots keeps it): each slot's ceil(rank / 8) pages, aligned runs of 8 rows, at random
    pages of a pool of the pages needed, `spare` pages more and the zero page (rows 0..7), which
    the entries past a slot's pages name. Otherwise each rank row at a random row, entries past
    the rank naming row 0."""
    if r % 8 == 0:
        need = [-(-int(k) // 8) for k in ranks]
        n_pages = 1 + sum(need) + spare
        free = list(rng.permutation(np.arange(1, n_pages)))
        rows = np.tile(np.arange(r, dtype=np.int32) % 8, (len(ranks), 1))
        for i, n in enumerate(need):
            for p in range(n):
                rows[i, 8 * p:8 * p + 8] = free.pop() * 8 + np.arange(8)
        return rows, 8 * n_pages
    u = 1 + int(ranks.sum()) + spare
    free = list(rng.permutation(np.arange(1, u)))
    rows = np.zeros((len(ranks), r), np.int32)
    for i, k in enumerate(ranks):
        rows[i, :k] = [free.pop() for _ in range(k)]
    return rows, u


def page(w_SRX, rows_SR, u, blocks=1, fill=np.nan):
    """Slot-major (S, blocks*R, X) -> a pool (blocks*U, X) laid out by the row table: the zero
    page (or row) of each block zero, rows no slot names `fill`."""
    s, br, x = w_SRX.shape
    r = br // blocks
    zero = 8 if r % 8 == 0 else 1
    pool = np.full((blocks * u, x), fill, np.float32)
    for j in range(blocks):
        pool[j * u:j * u + zero] = 0.0
        for i in range(s):
            for k in range(r):
                if rows_SR[i, k] >= zero:
                    pool[j * u + rows_SR[i, k]] = w_SRX[i, j * r + k]
    return pool


def paged_inputs(rows_SR, u, a, b, qkv_a, qkv_b, gu_a, gu_b):
    """The slot-major weights of one test case as the backends take them (pools)."""
    return (page(a, rows_SR, u), page(b, rows_SR, u), page(qkv_a, rows_SR, u, 3),
            tuple(page(w, rows_SR, u) for w in qkv_b), page(gu_a, rows_SR, u, 2),
            tuple(page(w, rows_SR, u) for w in gu_b))


def assert_close(got, want, what):
    got = np.asarray(got)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    tol = 1e-5 * max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max()) if want.size else 0.0
    assert err <= tol, f"{what}: max |err| {err:.3e} > {tol:.3e}"


def _all_ops(backend):
    be = get_backend(backend)

    def run(x, a, b, h_in, base, qkv_a, qkv_b, gu_a, gu_b, info):
        return dict(shrink=be.run_lora_a_gemm(x, a, info),
                    lora=be.run_lora_b_gemm(be.run_lora_a_gemm(x, a, info), b, info),
                    one=be.run_lora(x, a, b, info),
                    expand=be.run_lora_b_gemm(h_in, b, info),
                    expand_base=be.run_lora_b_gemm(h_in, b, info, base),
                    qkv=be.run_qkv_lora(x, qkv_a, qkv_b, info),
                    gate_up=be.run_gate_up_lora(x, gu_a, gu_b, info),
                    # each added to a base output (sglang-jax's base_output)
                    one_base=be.run_lora(x, a, b, info, base),
                    qkv_base=be.run_qkv_lora(x, qkv_a, qkv_b, info, qkv_bases(base, qkv_b)),
                    gate_up_base=be.run_gate_up_lora(x, gu_a, gu_b, info, (base, -2 * base)))
    return run


def qkv_bases(base_TO, qkv_b):
    """Base outputs for q/k/v of their widths, cut from one (T, O) base."""
    return tuple(base_TO[:, :w.shape[-1]] for w in qkv_b)


# One jit per backend, jitted as the model uses the backends; shapes, not slot mixes, compile.
ALL_OPS = {name: jax.jit(_all_ops(name)) for name in BACKEND_NAMES}


# Pallas runs in its interpreter here (seconds a case): through the shapes with one token, more
# slots than tokens and more tokens than a tile; tests/test_lora_pallas.py checks its kernel alone
# on wider ones.
PALLAS_SHAPES = (SHAPES[0], SHAPES[1], SHAPES[2], SHAPES[4])
BACKEND_SHAPES = [(b, s) for b in BACKEND_NAMES for s in SHAPES if b != "pallas" or s in PALLAS_SHAPES]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("backend,shape", BACKEND_SHAPES,
                         ids=lambda v: v if isinstance(v, str) else "T%d-D%d-O%d-S%d-R%d" % v)
def test_backend_matches_numpy(backend, shape, pattern):
    t, d, o, s, r = shape
    rng = np.random.default_rng(zlib.crc32(repr((shape, pattern)).encode()))  # not hash(): salted
    slot_T = make_slots(rng, pattern, t, s)
    if pattern == "every_slot" and t >= s:
        assert set(slot_T.tolist()) == set(range(s))
    ranks = make_ranks(rng, s, r)
    scalings = make_scalings(rng, s)
    rows_SR, u = make_rows(rng, ranks, r)
    info = make_lora_batch_info(slot_T, scalings, ranks, rows_SR)
    x = rng.standard_normal((t, d)).astype(np.float32)
    a = make_a(rng, s, r, d, ranks)
    b = make_b(rng, s, o, r, ranks)
    # Expand alone from an arbitrary h: nonzero on base rows too, whose output must stay zero.
    h_in = rng.standard_normal((t, r)).astype(np.float32)
    base = rng.standard_normal((t, o)).astype(np.float32)
    qkv_a = make_a(rng, s, r, d, ranks, blocks=3)
    qkv_b = tuple(make_b(rng, s, oo, r, ranks) for oo in (o, o // 2 or 1, o // 2 or 1))  # GQA-like
    gu_a = make_a(rng, s, r, d, ranks, blocks=2)
    gu_b = (make_b(rng, s, o, r, ranks), make_b(rng, s, o, r, ranks))

    pa, pb, pqkv_a, pqkv_b, pgu_a, pgu_b = paged_inputs(rows_SR, u, a, b, qkv_a, qkv_b, gu_a, gu_b)
    got = ALL_OPS[backend](x, pa, pb, h_in, base, pqkv_a, pqkv_b, pgu_a, pgu_b, info)
    what = f"{backend} T={t} D={d} O={o} S={s} R={r} {pattern} slots={slot_T.tolist()[:16]}"
    assert_close(got["shrink"], np_shrink(x, a, scalings, slot_T), f"run_lora_a_gemm {what}")
    assert_close(got["lora"], np_lora(x, a, b, scalings, slot_T), f"shrink then expand {what}")
    assert_close(got["one"], np_lora(x, a, b, scalings, slot_T), f"run_lora {what}")
    assert_close(got["expand"], np_expand(h_in, b, slot_T), f"run_lora_b_gemm {what}")
    assert_close(got["expand_base"], base + np_expand(h_in, b, slot_T),
                 f"run_lora_b_gemm + base_output {what}")
    assert len(got["qkv"]) == 3 and len(got["gate_up"]) == 2
    for name, g, w in zip("qkv", got["qkv"], np_stacked(x, qkv_a, qkv_b, scalings, slot_T)):
        assert_close(g, w, f"run_qkv_lora[{name}] {what}")
    for name, g, w in zip(("gate", "up"), got["gate_up"], np_stacked(x, gu_a, gu_b, scalings, slot_T)):
        assert_close(g, w, f"run_gate_up_lora[{name}] {what}")
    assert_close(got["one_base"], base + np_lora(x, a, b, scalings, slot_T), f"run_lora + base_output {what}")
    for name, g, w, bo in zip("qkv", got["qkv_base"], np_stacked(x, qkv_a, qkv_b, scalings, slot_T),
                              qkv_bases(base, qkv_b)):
        assert_close(g, bo + w, f"run_qkv_lora[{name}] + base_outputs {what}")
    for name, g, w, bo in zip(("gate", "up"), got["gate_up_base"], np_stacked(x, gu_a, gu_b, scalings, slot_T),
                              (base, -2 * base)):
        assert_close(g, bo + w, f"run_gate_up_lora[{name}] + base_outputs {what}")


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_base_outputs_of_another_count_are_refused(backend):
    """run_qkv_lora with two base outputs for its three outputs: an error naming both counts."""
    t, d, o, s, r = SHAPES[0]
    rng = np.random.default_rng(3)
    slot_T = make_slots(rng, "random", t, s)
    ranks = make_ranks(rng, s, r)
    scalings = make_scalings(rng, s)
    rows_SR, u = make_rows(rng, ranks, r)
    info = make_lora_batch_info(slot_T, scalings, ranks, rows_SR)
    qkv_a = make_a(rng, s, r, d, ranks, blocks=3)
    qkv_b = tuple(make_b(rng, s, o, r, ranks) for _ in range(3))
    pa = page(qkv_a, rows_SR, u, 3)
    pbs = tuple(page(w, rows_SR, u) for w in qkv_b)
    base = np.zeros((t, o), np.float32)
    with pytest.raises(ValueError, match="2 base outputs for 3 LoRA outputs"):
        get_backend(backend).run_qkv_lora(rng.standard_normal((t, d)).astype(np.float32), pa, pbs, info,
                                          (base, base))


def test_shapes_cover_sgmv_tiles():
    """The shape list really exercises partial tiles and both tile sizes."""
    tiles = {sgmv_tile_rows(t, s) for t, _, _, s, _ in SHAPES}
    assert tiles >= {8, 32}
    assert any(t % sgmv_tile_rows(t, s) for t, _, _, s, _ in SHAPES)
    from multilora.lora.backend.sgmv import LOOP_MIN_WIDTH, _use_loop
    loop_shapes = [(t, d, s) for t, d, _, s, _ in SHAPES if d >= LOOP_MIN_WIDTH]
    assert any(_use_loop(make_lora_batch_info(np.zeros(t, np.int32), np.ones(s, np.float32),
                                              np.ones(s, np.int32), np.zeros((s, 4), np.int32)), t, d)
               for t, d, s in loop_shapes)


# --- slot range ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1, -7, 5, 6, 100])
def test_make_lora_batch_info_rejects_out_of_range_slots(bad):
    s = 5
    scalings, ranks = np.ones(s, np.float32), np.full(s, 4, np.int32)
    slot_T = np.array([0, 1, bad, 2], np.int32)
    with pytest.raises(ValueError, match="out of range"):
        make_lora_batch_info(slot_T, scalings, ranks, np.zeros((s, 4), np.int32))


def test_make_lora_batch_info_accepts_edge_slots():
    s = 5
    info = make_lora_batch_info(np.array([0, s - 1, 0, 1]), np.ones(s, np.float32), np.ones(s, np.int32),
                                np.zeros((s, 4), np.int32))
    assert np.asarray(info.slot_T).tolist() == [0, s - 1, 0, 1]


def test_make_lora_batch_info_rejects_a_row_table_for_other_slots():
    s = 5
    with pytest.raises(ValueError, match=r"rows_SR must be \(slots, max_rank\)"):
        make_lora_batch_info(np.zeros(3, np.int32), np.ones(s, np.float32), np.ones(s, np.int32),
                             np.zeros((s + 1, 4), np.int32))


# --- slot 0 is never read --------------------------------------------------------------------

JUNK_CASES = {
    # slot 0's table names rows of junk (a rank too); its scaling left at 0 as LoRASlots keeps it
    "junk_buffers": dict(scale0=0.0, nonfinite=False),
    # junk rows and a junk scaling for slot 0
    "junk_buffers_and_scaling": dict(scale0=3.0, nonfinite=False),
    # NaN/Inf in slot 0's rows: only a backend that never touches slot 0 for base rows stays clean
    "nonfinite_buffers": dict(scale0=0.0, nonfinite=True),
}


# The sentinel must never select a slot's weights (docs/design.md): base rows stay exactly zero
# whatever slot 0 holds.
@pytest.mark.parametrize("case", list(JUNK_CASES))
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_base_rows_never_read_slot_0(backend, case):
    scale0, nonfinite = JUNK_CASES[case]["scale0"], JUNK_CASES[case]["nonfinite"]
    t, d, o, s, r = 21, 16, 24, 4, 8
    rng = np.random.default_rng(7)
    slot_T = rng.permutation(np.arange(t) % s).astype(np.int32)
    ranks = make_ranks(rng, s, r)
    scalings = make_scalings(rng, s)
    x = rng.standard_normal((t, d)).astype(np.float32)
    a, b = make_a(rng, s, r, d, ranks), make_b(rng, s, o, r, ranks)
    h_in = rng.standard_normal((t, r)).astype(np.float32)
    base = rng.standard_normal((t, o)).astype(np.float32)
    qkv_a = make_a(rng, s, r, d, ranks, blocks=3)
    qkv_b = tuple(make_b(rng, s, o, r, ranks) for _ in range(3))
    gu_a = make_a(rng, s, r, d, ranks, blocks=2)
    gu_b = (make_b(rng, s, o, r, ranks), make_b(rng, s, o, r, ranks))
    want = dict(shrink=np_shrink(x, a, scalings, slot_T), lora=np_lora(x, a, b, scalings, slot_T),
                expand=np_expand(h_in, b, slot_T), expand_base=base + np_expand(h_in, b, slot_T),
                qkv=np_stacked(x, qkv_a, qkv_b, scalings, slot_T),
                gate_up=np_stacked(x, gu_a, gu_b, scalings, slot_T))

    # Now give slot 0 a rank and rows of junk; the expected outputs above are unchanged.
    scalings[NO_ADAPTER] = scale0
    ranks[NO_ADAPTER] = r
    rows_SR, u = make_rows(rng, ranks, r, spare=0)
    for arr in (a, b, qkv_a, *qkv_b, gu_a, *gu_b):
        arr[NO_ADAPTER] = rng.uniform(5.0, 10.0, arr.shape[1:])
        if nonfinite:
            arr[NO_ADAPTER].flat[::3] = np.nan
            arr[NO_ADAPTER].flat[1::3] = np.inf
    info = make_lora_batch_info(slot_T, scalings, ranks, rows_SR)
    pools = paged_inputs(rows_SR, u, a, b, qkv_a, qkv_b, gu_a, gu_b)
    got = ALL_OPS[backend](x, *pools[:2], h_in, base, *pools[2:], info)
    base_rows = slot_T == NO_ADAPTER
    for op in ("shrink", "lora", "expand", "qkv", "gate_up"):
        outs = got[op] if isinstance(got[op], tuple) else (got[op],)
        wants = want[op] if isinstance(want[op], list) else (want[op],)
        for k, (g, w) in enumerate(zip(outs, wants)):
            g = np.asarray(g)
            what = f"{backend} {op}[{k}] with junk in slot 0 ({case})"
            assert np.all(g[base_rows] == 0.0), f"{what}: base rows got {g[base_rows][0, :4]}"
            assert_close(g, w, what)
    assert_close(got["expand_base"], want["expand_base"], f"{backend} expand + base ({case})")


def test_auto_picks_per_shape():
    """`auto`'s rule per compiled shape (see choose_backend and benchmarks/log/01-2026-11-29-lora-op-micro-benchmark.md), and a clear error
    for an unknown name."""
    from multilora.lora.backend import choose_backend
    assert choose_backend("auto", 512, False, 9) == "sgmv"   # prefill: tiles
    assert choose_backend("auto", 64, True, 9) == "sgmv"     # 64 rows fill 8 adapters' tiles of 8
    assert choose_backend("auto", 32, True, 9) == "dense"    # half-full tiles; the pool is small
    assert choose_backend("auto", 64, True, 65) == "sgmv|bgmv"  # 64 slots: the step's adapters decide
    assert choose_backend("auto", 4, True, 65) == "bgmv"     # too few rows to fill a tile
    assert choose_backend("auto", 1, True, 9) == "bgmv"
    assert choose_backend("sgmv", 1, True, 9) == "sgmv"      # an explicit choice stands
    # a TPU: the Pallas kernel that reads the step's own adapters, whatever the pool's size
    assert choose_backend("auto", 64, True, 9, platform="tpu") == "pallas"
    assert choose_backend("auto", 512, False, 65, platform="tpu") == "pallas"
    assert choose_backend("auto", 64, True, 257, platform="tpu") == "pallas"
    assert choose_backend("auto", 64, True, None, platform="tpu") == "bgmv"  # no slots: no LoRA op
    assert choose_backend("bgmv", 64, True, 9, platform="tpu") == "bgmv"
    with pytest.raises(ValueError, match="choose one of auto, bgmv"):
        choose_backend("onehot", 64, True, 9)


def test_tiles_sized_for_a_steps_few_adapters_and_the_per_token_fallback():
    """make_lora_batch_info(..., max_grouped=N): a step with at most N distinct adapters gets
    tiles sized for N (not for the whole pool) and mode GROUPED; one with more gets empty tiles
    and mode PER_TOKEN; one without adapters NO_LORA. Either way the backend the mode names
    matches the numpy definition."""
    from multilora.lora.batch import GROUPED, NO_LORA, PER_TOKEN, sgmv_num_tiles
    t, d, o, s, r = 64, 32, 24, 65, 4
    rng = np.random.default_rng(3)
    ranks, scalings = make_ranks(rng, s, r), make_scalings(rng, s)
    x = rng.standard_normal((t, d)).astype(np.float32)
    a, b = make_a(rng, s, r, d, ranks), make_b(rng, s, o, r, ranks)
    rows_SR, u = make_rows(rng, ranks, r)
    pa, pb = page(a, rows_SR, u), page(b, rows_SR, u)
    few = rng.choice([0, 5, 17, 64], size=t).astype(np.int32)          # 3 adapters and base rows
    many = rng.integers(0, s, size=t).astype(np.int32)                  # ~40 adapters
    for slot_T, mode, name in ((few, GROUPED, "sgmv"), (many, PER_TOKEN, "bgmv")):
        info = make_lora_batch_info(slot_T, scalings, ranks, rows_SR, max_grouped=8)
        assert int(info.mode) == mode
        assert info.tile_slot_G.shape[0] == sgmv_num_tiles(t, 9)        # sized for 8 adapters, not 64
        if mode == PER_TOKEN:
            assert (info.tile_slot_G == NO_ADAPTER).all()
        be = get_backend(name)
        got = jax.jit(lambda x, a, b, info: be.run_lora_b_gemm(be.run_lora_a_gemm(x, a, info), b, info))(x, pa, pb, info)
        assert_close(np.asarray(got), np_lora(x, a, b, scalings, slot_T), f"{name} mode {mode}")
    assert int(make_lora_batch_info(np.zeros(t, np.int32), scalings, ranks, rows_SR, max_grouped=8).mode) == NO_LORA
    assert int(make_lora_batch_info(few, scalings, ranks, rows_SR).mode) == GROUPED  # no cap: every slot


# --- multilora's CPU kernels (native) ----------------------------------------------------------

def _native():
    from multilora import kernels
    if not kernels.available():
        pytest.skip(f"native kernels unavailable: {kernels.unavailable_reason()}")
    return get_backend("native")


def test_native_reads_the_pool_in_place_at_the_layer_and_stops_at_each_true_rank():
    """The kernel indexes a whole (L, blocks * U, X) pool at a traced layer (what forward hands
    it), finds each slot's rows through the row table, matches the numpy definition for that
    layer, and never reads a row that no slot names, nor a slot's rows past its rank: the pool's
    spare rows hold NaN, and slot 0 (the base rows) names rows of NaN with a full rank."""
    from multilora.lora.backend.native import PoolLayer
    be = _native()
    rng = np.random.default_rng(11)
    L, t, d, o, s, r, blocks = 3, 29, 40, 56, 7, 8, 3
    ranks, scalings = make_ranks(rng, s, r), make_scalings(rng, s)
    slot_T = make_slots(rng, "random", t, s)
    x = rng.standard_normal((t, d)).astype(np.float32)
    a_L = [make_a(rng, s, r, d, ranks, blocks) for _ in range(L)]
    bs_L = [[make_b(rng, s, o + 8 * i, r, ranks) for _ in range(L)] for i in range(blocks)]
    want = {layer: np_stacked(x, a_L[layer], [b[layer] for b in bs_L], scalings, slot_T) for layer in range(L)}
    ranks[NO_ADAPTER] = r  # the base slot names rows of NaN: never read for base rows
    for arr in (*a_L, *(b for bl in bs_L for b in bl)):
        arr[NO_ADAPTER] = np.nan
    rows_SR, u = make_rows(rng, ranks, r, spare=5)
    a_pool = np.stack([page(a, rows_SR, u, blocks) for a in a_L])
    b_pools = [np.stack([page(b, rows_SR, u) for b in bl]) for bl in bs_L]
    info = make_lora_batch_info(slot_T, scalings, ranks, rows_SR)
    run = jax.jit(lambda x, a, bs, layer, info: be.run_qkv_lora(
        x, PoolLayer(a, layer), tuple(PoolLayer(b, layer) for b in bs), info))
    for layer in range(L):
        got = run(x, a_pool, b_pools, np.int32(layer), info)
        for i, (g, w) in enumerate(zip(got, want[layer])):
            assert np.isfinite(np.asarray(g)).all(), f"layer {layer} block {i} read a spare row or slot 0"
            assert_close(g, w, f"native layer {layer} block {i}")


def test_auto_takes_native_for_decode_shapes_only_where_it_can_serve():
    from multilora.lora.backend import choose_backend
    assert choose_backend("auto", 64, True, 65, native=True) == "native"
    assert choose_backend("auto", 8, True, 9, native=True) == "native"
    assert choose_backend("auto", 512, False, 65, native=True) == "native"  # prefill too: no tile copies
    assert choose_backend("auto", 512, False, 65) == "sgmv"               # without the kernels: tiles
    assert choose_backend("auto", 64, True, 1, native=True) == "bgmv"     # no adapter slot at all
    assert choose_backend("bgmv", 64, True, 65, native=True) == "bgmv"    # an explicit choice stands
    from multilora.lora.backend import native_usable
    assert native_usable(jax.numpy.bfloat16, set(jax.devices()[:1]))      # float32 or bfloat16 pools
    assert not native_usable(jax.numpy.float16, set(jax.devices()[:1]))
    if len(jax.devices()) > 1:
        assert not native_usable(np.float32, set(jax.devices()[:2]))     # sharded slots: XLA backends


def test_native_disabled_or_without_a_compiler_is_a_clear_choice_not_a_failure(tmp_path):
    """MULTILORA_NATIVE=0 (or no C++ compiler): `auto` falls back to the XLA backends and naming
    `native` explicitly is refused with the reason."""
    import subprocess
    import sys
    code = ("from multilora import kernels\nfrom multilora.lora.backend import get_backend, native_usable\n"
            "import jax, numpy as np\n"
            "assert not kernels.available()\n"
            "assert not native_usable(np.float32, set(jax.devices()[:1]))\n"
            "from multilora.model.attention import native_attention_usable\n"
            "assert not native_attention_usable(jax.numpy.zeros((1, 2, 4, 1, 8)))\n"
            "try:\n    get_backend('native')\nexcept ValueError as e:\n    print('REFUSED', e)\n")
    for env in ({"MULTILORA_NATIVE": "0"}, {"CXX": "", "PATH": str(tmp_path), "MULTILORA_CACHE": str(tmp_path)}):
        import os
        full = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
        out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "REFUSED lora_backend 'native' is not available here" in out.stdout, out.stdout
        assert ("MULTILORA_NATIVE" in out.stdout) or ("no C++ compiler" in out.stdout), out.stdout


def _bf16(w):
    """float32 -> bfloat16 (as the pool stores it) -> float32: what the kernel multiplies by."""
    return np.asarray(jax.numpy.asarray(w).astype(jax.numpy.bfloat16).astype(jax.numpy.float32))


def _np_group_bf16(x_TD, a_SRD, bs, scalings_S, slot_T, dot_bf16: bool):
    """The group call on bf16 pools, by numpy: with the kernel's bf16 dot products (dot_bf16: the
    CPU has AVX512-BF16), x is rounded to bf16 for the shrink and h for each expand; otherwise
    both stay float32. Returns the results and, per result, the bound of what one-ulp flips of
    h's rounding (sums taken in another order round the other way) can move each output."""
    r = a_SRD.shape[1] // len(bs)
    xr = _bf16(x_TD) if dot_bf16 else x_TD
    out, slack = [], []
    for i, b in enumerate(bs):
        h = np_shrink(xr, a_SRD[:, i * r:(i + 1) * r], scalings_S, slot_T)
        hr = _bf16(h.astype(np.float32)).astype(np.float64) if dot_bf16 else h
        out.append(np_expand(hr, b, slot_T))
        slack.append(2.0 ** -8 * np_expand(np.abs(hr), np.abs(b), slot_T) if dot_bf16 else 0.0 * out[-1])
    return out, slack


@pytest.mark.parametrize("isa", ("best", "avx2"))
@pytest.mark.parametrize("pattern", ("random", "every_slot"))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T%d-D%d-O%d-S%d-R%d" % s)
def test_native_bfloat16_pools_match_numpy_on_the_rounded_weights(shape, pattern, isa, monkeypatch):
    """bfloat16 pools (lora_dtype=bfloat16): the standalone shrink widens the rows exactly and
    keeps x, h and the sums float32 (the float32 definition on the bf16-rounded weights, within
    float32 summation error). The group calls (run_lora, run_qkv_lora) multiply bf16 pairs where
    the CPU has AVX512-BF16: x rounded to bf16 for the shrink and h for the expand, sums float32,
    matched against numpy doing the same roundings (within float32 summation error, plus a
    one-ulp flip of h's rounding); spare rows of NaN are still never read. isa "avx2": the
    kernels held to what a CPU without AVX512-BF16 runs ($MULTILORA_KERNEL_ISA), the widened
    group call."""
    from multilora import kernels
    be = _native()
    if isa == "avx2":
        if "avx2" not in kernels.bf16_gemm_isas():
            pytest.skip("this CPU or build has no AVX2 + FMA path")
        monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    dot_bf16 = kernels.bf16_gemm_isa() in ("avx512-bf16", "amx")
    t, d, o, s, r = shape
    rng = np.random.default_rng(zlib.crc32(repr(("bf16", shape, pattern)).encode()))
    slot_T = make_slots(rng, pattern, t, s)
    ranks, scalings = make_ranks(rng, s, r), make_scalings(rng, s)
    rows_SR, u = make_rows(rng, ranks, r)
    info = make_lora_batch_info(slot_T, scalings, ranks, rows_SR)
    x = rng.standard_normal((t, d)).astype(np.float32)
    a, b = _bf16(make_a(rng, s, r, d, ranks)), _bf16(make_b(rng, s, o, r, ranks))
    qkv_a = _bf16(make_a(rng, s, r, d, ranks, blocks=3))
    qkv_b = tuple(_bf16(make_b(rng, s, oo, r, ranks)) for oo in (o, o // 2 or 1, o // 2 or 1))
    as_bf16 = lambda w: jax.numpy.asarray(w).astype(jax.numpy.bfloat16)  # noqa: E731
    pa, pb, pq = as_bf16(page(a, rows_SR, u)), as_bf16(page(b, rows_SR, u)), as_bf16(page(qkv_a, rows_SR, u, 3))
    pqb = tuple(as_bf16(page(w, rows_SR, u)) for w in qkv_b)
    run = jax.jit(lambda x, a, b, qa, qb, info: (be.run_lora(x, a, b, info), be.run_qkv_lora(x, qa, qb, info),
                                                 be.run_lora_a_gemm(x, a, info)))
    one, qkv, h = run(x, pa, pb, pq, pqb, info)
    what = f"bf16 pools T={t} D={d} O={o} S={s} R={r} {pattern}"
    assert_close(h, np_shrink(x, a, scalings, slot_T), f"run_lora_a_gemm {what}")
    (want,), (slack,) = _np_group_bf16(x, a, (b,), scalings, slot_T, dot_bf16)
    assert_close_slack(one, want, slack, f"run_lora {what}")
    for name, g, w, sl in zip("qkv", qkv, *_np_group_bf16(x, qkv_a, qkv_b, scalings, slot_T, dot_bf16)):
        assert_close_slack(g, w, sl, f"run_qkv_lora[{name}] {what}")


def assert_close_slack(got, want, slack, what):
    """assert_close, each element allowed `slack` more (a rounding that may go either way)."""
    got = np.asarray(got)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    tol = 1e-5 * max(1.0, float(np.abs(want).max())) + slack
    err = np.abs(got - want)
    assert (err <= tol).all(), f"{what}: max |err| - tol {float((err - tol).max()):.3e}"


@pytest.mark.parametrize("pool_dtype", ["float32", "bfloat16"])
def test_native_group_results_do_not_depend_on_the_batch(pool_dtype):
    """A token's LoRA delta through the group call is the same bits whatever else its step holds:
    alone, or beside 1 to 8 other tokens of its own adapter (one item of the kernel or several),
    other adapters' tokens and base rows. (Its shrink once summed with two accumulator chains
    when fewer than four tokens of a slot shared an item and one otherwise, so a greedy token could
    flip with the batch's composition. The float32 pool catches that on every run; through a
    bfloat16 pool h is rounded to bfloat16 before the expand, so a difference shows only where it
    crosses a rounding boundary.)"""
    from multilora import kernels
    _native()
    d, r, s = 1000, 16, 4                      # D not a multiple of 32 or 64: the tails too
    outs = (96, 48, 48)
    rng = np.random.default_rng(11)
    ranks, scalings = np.array([0, 16, 9, 16], np.int32), make_scalings(rng, s)
    rows_SR, u = make_rows(rng, ranks, r)
    qkv_a = make_a(rng, s, r, d, ranks, blocks=3)
    qkv_b = tuple(make_b(rng, s, o, r, ranks) for o in outs)
    dt = jax.numpy.bfloat16 if pool_dtype == "bfloat16" else jax.numpy.float32
    pa = jax.numpy.asarray(page(qkv_a, rows_SR, u, 3)[None]).astype(dt)
    pbs = tuple(jax.numpy.asarray(page(w, rows_SR, u)[None]).astype(dt) for w in qkv_b)
    meta = lambda slot_T: (jax.numpy.asarray(slot_T, np.int32), scalings, ranks, rows_SR)  # noqa: E731
    # magnitudes spread over 2^-10..2^10, so that the order of a sum shows in its last bits (bf16
    # products of values alike sum exactly in float32 whatever the order)
    spread = lambda shape: (rng.standard_normal(shape) * np.exp2(rng.integers(-10, 11, shape))).astype(np.float32)  # noqa: E731
    x = spread((1, d))
    alone = kernels.lora_apply(x, pa, pbs, 0, *meta([1]))
    for n in range(1, 10):                     # 1..9 tokens of slot 1, then others
        others = spread((n - 1 + 5, d))
        xs = np.concatenate([others[:2], x, others[2:]])
        slot_T = [2, 0, 1] + [1] * (n - 1) + [3, 0, 2]
        got = kernels.lora_apply(xs, pa, pbs, 0, *meta(slot_T))
        for g, a in zip(got, alone):
            np.testing.assert_array_equal(np.asarray(g)[2], np.asarray(a)[0], err_msg=f"{n} tokens of its slot")


def test_native_refuses_pools_of_other_dtypes_and_mismatched_groups():
    """A float16 pool, or a B pool whose rows disagree with A's, is an error naming the kernel,
    not a wrong result."""
    from multilora import kernels
    _native()
    t, d, o, s, r = 4, 16, 8, 3, 4
    slot_T = np.array([1, 2, 0, 1], np.int32)
    rows = np.arange(s * r, dtype=np.int32).reshape(s, r)
    args = (slot_T, np.ones(s, np.float32), np.full(s, r, np.int32), rows)
    x = np.ones((t, d), np.float32)
    with pytest.raises(Exception, match="float32 or bfloat16"):
        kernels.lora_apply(x, np.ones((1, s * r, d), np.float16), (np.ones((1, s * r, o), np.float16),),
                           np.int32(0), *args)[0].block_until_ready()
    with pytest.raises(Exception, match="disagrees"):
        kernels.lora_apply(x, np.ones((1, s * r, d), np.float32), (np.ones((1, s * r + 1, o), np.float32),),
                           np.int32(0), *args)[0].block_until_ready()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_pool_write_matches_xla_scatter_in_place(dtype):
    """kernels.pool_write writes exactly what XLA's scatter of the rounded rows writes (ties to
    even, NaN, inf, -0 and bfloat16's subnormals included), leaves every other row untouched,
    and with the pool donated writes into the pool's own buffer (aliased, no copy)."""
    import jax.numpy as jnp
    _native()
    rng = np.random.default_rng(3)
    L, U, X, R = 3, 40, 37, 6
    pool = jnp.asarray(rng.standard_normal((L, U, X)), dtype)
    rows = np.array([9, 2, 33, 0, 0, 17], np.int32)  # a repeated row gets the same value (zero page)
    new = rng.standard_normal((L, R, X)).astype(np.float32)
    new[:, 3:5] = 0.0
    new[0, 0, :6] = [np.nan, np.inf, -np.inf, -0.0, 1.0 + 2.0 ** -8, 1e-40]  # a tie, a subnormal
    new[1, 0, :2] = [1.0 + 3 * 2.0 ** -8, 3.0e38]                            # tie upward, near max
    want = np.asarray(pool.at[:, rows].set(jnp.asarray(new).astype(dtype)).astype(jnp.float32))
    got = kernels.pool_write(pool, jnp.asarray(rows), jnp.asarray(new))
    assert got.dtype == pool.dtype
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
    donated = jnp.array(pool)
    ptr = donated.unsafe_buffer_pointer()
    out = jax.jit(kernels.pool_write, donate_argnums=0)(donated, jnp.asarray(rows), jnp.asarray(new))
    assert out.unsafe_buffer_pointer() == ptr  # in place
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), want)
    # Rows already in the pool's dtype (host copies are read in it, rounded by ml_dtypes:
    # multilora.adapters.adapter) are copied as they are, and come out the same.
    import ml_dtypes
    host = new.astype(np.float32 if dtype == "float32" else ml_dtypes.bfloat16)
    got = kernels.pool_write(pool, jnp.asarray(rows), jnp.asarray(host))
    assert got.dtype == pool.dtype
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)


def test_native_pool_write_refuses_rows_outside_the_pool():
    import jax.numpy as jnp
    _native()
    pool = jnp.zeros((2, 8, 4), jnp.bfloat16)
    with pytest.raises(Exception, match="row 8 is outside the pool's 8 rows"):
        kernels.pool_write(pool, jnp.array([1, 8], jnp.int32), jnp.ones((2, 2, 4))).block_until_ready()
    with pytest.raises(Exception, match="shape does not match"):
        kernels.pool_write(pool, jnp.array([1], jnp.int32), jnp.ones((2, 2, 4))).block_until_ready()
    with pytest.raises(Exception, match="float32 or bfloat16"):
        kernels.pool_write(jnp.zeros((2, 8, 4), jnp.float16), jnp.array([1], jnp.int32),
                           jnp.ones((2, 1, 4))).block_until_ready()


def test_native_bf16_rounder_rounds_as_numpy_and_xla():
    """kernels.bf16_rounder (the loader's float32 -> bfloat16 conversion of adapter weights)
    gives the bits ml_dtypes' cast gives: ties to even, subnormals kept, Inf, -0, NaN stays NaN."""
    import ml_dtypes
    _native()
    rounder = kernels.bf16_rounder()
    assert rounder is not None
    rng = np.random.default_rng(11)
    src = (rng.standard_normal(10_001) * 10.0 ** rng.integers(-40, 38, 10_001)).astype(np.float32)
    src[:9] = [np.nan, np.inf, -np.inf, -0.0, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1e-40, 3.0e38, 3.4e38]
    dst = np.empty(src.shape, ml_dtypes.bfloat16)
    rounder(src.ctypes.data, dst.ctypes.data, src.size)
    want = src.astype(ml_dtypes.bfloat16)
    nan = np.isnan(src)
    assert np.isnan(dst[nan].astype(np.float32)).all()
    np.testing.assert_array_equal(dst[~nan].view(np.uint16), want[~nan].view(np.uint16))
