"""The per-token Pallas decode attention (multilora.kernels.attention_decode_pallas) against the
plain all-keys reference and the block kernel, on decode-only steps: ragged positions, pages out of
order and interleaved between sequences, padding tokens, GQA groups that are not a sublane tile,
sliding windows, a token whose keys span several chunks. On the CPU (CI) it runs in Pallas's TPU
interpreter; on a TPU the same tests run it compiled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multilora.kernels.attention_decode_pallas import (decode_only, decode_plan, paged_decode_attention,
                                                       sublane_rows)
from multilora.kernels.attention_pallas import paged_attention, paged_attention_reference
from tests.test_attention import _decode_case

ON_TPU = jax.default_backend() == "tpu"


def _run(q, k, v, layer, b, window):
    plan = decode_plan(b.kv_page_seq_X, b.seq_idx_T, b.positions_T, k.shape[3], window)
    return jax.jit(paged_decode_attention, static_argnames=("interpret",))(
        q, k, v, jnp.int32(layer), b.kv_pages_X, plan, interpret=not ON_TPU)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("decode_pos,page_size,num_tokens,num_pages,n,kvh,window", [
    ([0, 15, 16, 36, 4], 16, 8, 16, 4, 2, None),                  # padding tokens, G = 2
    ([11, 3, 49, 80, 22], 16, 8, 32, 9, 3, 20),                    # G = 3 (SmolLM2's), a window
    ([300, 7, 129], 16, 4, 32, 8, 2, None),                        # 19 pages: three chunks of 8
    ([100, 130, 5], 128, 4, 8, 4, 1, None),                        # 128-token pages: a page a chunk
])
def test_decode_kernel_matches_the_reference_and_the_block_kernel(decode_pos, page_size, num_tokens, num_pages,
                                                                  n, kvh, window, dtype):
    rng = np.random.default_rng(len(decode_pos) * 17 + page_size)
    h = 64
    q, k, v, b, _ = _decode_case(rng, decode_pos, [], page_size, num_tokens, num_pages, n, kvh, h)
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    k_hm, v_hm = jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3)   # (L, P, K, p, H)
    layer = 1
    got = np.asarray(_run(q, k_hm, v_hm, layer, b, window).astype(jnp.float32))
    ref = np.asarray(paged_attention_reference(q, k_hm, v_hm, layer, b.kv_pages_X, b.kv_page_seq_X, b.seq_idx_T,
                                               b.positions_T, window).astype(jnp.float32))
    block = np.asarray(paged_attention(q, k_hm, v_hm, jnp.int32(layer), b.kv_pages_X, b.kv_page_seq_X,
                                       b.seq_idx_T, b.positions_T, window, interpret=not ON_TPU
                                       ).astype(jnp.float32))
    tol = 3e-2 if dtype == "bfloat16" else (2e-3 if ON_TPU else 2e-5)
    padding = np.asarray(b.seq_idx_T) < 0
    assert padding.any() == (num_tokens > len(decode_pos))
    assert np.all(got[padding] == 0.0), "padding tokens got attention"
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, atol=tol, rtol=tol)
    np.testing.assert_allclose(got, block, atol=tol, rtol=tol)


def test_decode_only_and_the_plan():
    """decode_only: no sequence with two tokens in the step; the plan reads each token's own
    pages, in chunks, and no page for a padding token."""
    rng = np.random.default_rng(0)
    q, k, v, b, _ = _decode_case(rng, [3, 40, 17], [], 16, 4, 8, 2, 1, 8)
    assert bool(decode_only(b.seq_idx_T))
    lo, hi, first, end, n_chunks, base = decode_plan(b.kv_page_seq_X, b.seq_idx_T, b.positions_T, 16)
    assert np.asarray(end - first)[:3].tolist() == [1, 3, 2]          # pages of 16 up to each position
    assert int(end[3]) <= int(first[3])                                # the padding token reads none
    assert np.asarray(n_chunks).tolist() == [1, 1, 1, 1]               # chunks of 8 pages, at least one
    assert np.asarray(base).tolist() == [0, 1, 2, 3]
    _, _, _, mixed, _ = _decode_case(rng, [3], [(5, 0)], 16, 8, 8, 2, 1, 8)
    assert not bool(decode_only(mixed.seq_idx_T))
    assert bool(decode_only(jnp.asarray([0, 1, 2, -1, -1], jnp.int32)))


def test_sublane_rows():
    assert sublane_rows(jnp.float32) == 8 and sublane_rows(jnp.bfloat16) == 16
