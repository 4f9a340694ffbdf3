"""Writing a step's K/V rows into the heads-major cache: by whole pages in XLA
(multilora.model.attention.write_kv_pages) and in Pallas (multilora.kernels.kv_write_pallas,
pages and rows), each against write_kv's row scatter, which is the reference. Cases: decode rows
on pages out of order, prefill chunks over page boundaries, two sequences' slots on one page,
tokens of one page not adjacent, padding tokens on the trash page. On the CPU (CI) the kernels
run in Pallas's TPU interpreter; on a TPU the same tests run them compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multilora.kernels.kv_write_pallas import write_pages, write_rows
from multilora.model.attention import kv_page_writes, max_pages_written, write_kv, write_kv_pages

ON_TPU = jax.default_backend() == "tpu"
P, L, K, H = 24, 3, 2, 64


def _slots(case: str, p: int, rng) -> tuple[np.ndarray, int]:
    """Slot mappings (page * p + offset) and the number of sequences, padded with trash slots (0)."""
    if case == "decode":            # one row each on pages out of order, mid-page
        pages = rng.permutation(np.arange(1, P))[:9]
        slots = pages * p + rng.integers(0, p, 9)
        return np.concatenate([slots, np.zeros(3, np.int64)]), 9
    if case == "prefill":           # runs over page boundaries, from mid-page starts
        runs = [(3, 5, 2 * p + 3), (7, 2, p - 1), (11, 0, 3 * p)]   # (first page, offset, length)
        slots = [np.arange(pg * p + off, pg * p + off + n) for pg, off, n in runs]
        return np.concatenate(slots + [np.zeros(5, np.int64)]), 3
    if case == "shared":            # two sequences on one page; one sequence's page slots not adjacent
        a = np.array([5 * p + 0, 5 * p + 1])
        b = np.array([5 * p + 2, 5 * p + 3, 6 * p])
        c = np.array([9 * p + 7])
        return np.concatenate([a, c, b, [5 * p + 4]]), 4
    raise ValueError(case)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case,p", [("decode", 16), ("prefill", 16), ("prefill", 8), ("shared", 8)])
def test_page_and_row_writes_match_the_row_scatter(case, p, dtype):
    rng = np.random.default_rng(7)
    slots, num_seqs = _slots(case, p, rng)
    t = len(slots)
    slot_T = jnp.asarray(slots, jnp.int32)
    k_cache = jnp.asarray(rng.standard_normal((L, P, K, p, H)), dtype)
    v_cache = jnp.asarray(rng.standard_normal((L, P, K, p, H)), dtype)
    k_new = jnp.asarray(rng.standard_normal((t, K, H)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((t, K, H)), jnp.float32)
    real = slots != 0                                    # trash-page writes are unspecified
    keep = np.ones((L, P, K, p, H), bool)
    keep[:, 0] = False
    layer = jnp.int32(1)
    want_k = write_kv(k_cache, layer, slot_T, k_new, heads_major=True)
    want_v = write_kv(v_cache, layer, slot_T, v_new, heads_major=True)
    u = max_pages_written(t, num_seqs, p)
    page_U, n, src_Up = kv_page_writes(slot_T, p, u)
    assert int(n) == len(set((slots // p).tolist()))
    assert set(np.asarray(page_U).tolist()) == set((slots // p).tolist())
    got = {
        "xla pages": (write_kv_pages(k_cache, layer, page_U, n, src_Up, k_new),
                      write_kv_pages(v_cache, layer, page_U, n, src_Up, v_new)),
        "pallas pages": jax.jit(write_pages, static_argnames="interpret")(
            k_cache, v_cache, layer, page_U, n, src_Up, k_new, v_new, interpret=not ON_TPU),
    }
    # Mosaic (JAX 0.10.2, v5e) takes no DMA to one row of a bfloat16 (p, H) tile, whose rows come
    # in packed pairs: the row kernel is measured and tested in float32 there
    if not (ON_TPU and dtype == "bfloat16"):
        got["pallas rows"] = jax.jit(write_rows, static_argnames="interpret")(
            k_cache, v_cache, layer, slot_T, k_new, v_new, interpret=not ON_TPU)
    assert real.any()
    for name, (gk, gv) in got.items():
        for g, w in ((gk, want_k), (gv, want_v)):
            np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32))[keep],
                                          np.asarray(w.astype(jnp.float32))[keep], err_msg=name)


def test_kv_page_writes_groups_slots_by_page():
    p = 4
    slots = jnp.asarray([9, 3, 8, 10, 0, 0], jnp.int32)   # page 2 slots 1,0,2; page 0 slot 3; trash twice
    page_U, n, src_Up = kv_page_writes(slots, p, 5)
    assert int(n) == 2
    np.testing.assert_array_equal(np.asarray(page_U), [0, 2, 2, 2, 2])
    src = np.asarray(src_Up)
    assert src[0, 3] == 1 and src[0, 0] in (4, 5) and src[0, 1] == src[0, 2] == -1
    np.testing.assert_array_equal(src[1], [2, 0, 3, -1])
    assert (src[2:] == -1).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_page_slot_rows_one_hot_equals_the_gather_and_keeps_nan_to_its_token(dtype, monkeypatch):
    from multilora.kernels import kv_write_pallas
    rng = np.random.default_rng(3)
    t, p = 10, 4
    new = rng.standard_normal((t, K, H)).astype(np.float32)
    new[6, 1, 5] = np.nan                       # token 6's row: its own slot only
    new_TKH = jnp.asarray(new, dtype)
    src = np.full((5, p), -1, np.int32)
    src[0, :3] = [4, 5, 6]
    src[1] = [0, 1, 2, 3]
    src[3, 2] = 9
    src_Up = jnp.asarray(src)
    one_hot = np.asarray(kv_write_pallas.page_slot_rows(new_TKH, src_Up, jnp.float32))
    monkeypatch.setattr(kv_write_pallas, "ONE_HOT_MAX_TOKENS", 0)
    gather = np.asarray(kv_write_pallas.page_slot_rows(new_TKH, src_Up, jnp.float32))
    written = (src >= 0)[:, None, :, None] & np.ones((1, K, 1, H), bool)
    nan_slot = np.zeros_like(written)
    nan_slot[0, 1, 2, 5] = True
    ok = written & ~nan_slot
    np.testing.assert_array_equal(one_hot[ok], gather[ok])
    assert np.isfinite(one_hot[~nan_slot]).all(), "a NaN reached another token's slots"
    assert np.isnan(gather[nan_slot]).all()
