"""Prefill attention (query blocks walking their own sequences' pages with an online softmax)
against the plain formulation: every token against every page of the step, masked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multilora.engine.batching import SeqChunk, build_batch
from multilora.model import attention
from multilora.model.attention import MASKED, kv_page_pos_of, prefill_attention


def all_pages_attention(q_TNH, k_LPpKH, v_LPpKH, layer, kv_pages_X, kv_page_seq_X, seq_idx_T,
                        positions_T, sliding_window=None):
    t, n, h = q_TNH.shape
    kvh, p = k_LPpKH.shape[3], k_LPpKH.shape[2]
    x = kv_pages_X.shape[0]
    k_YKH = k_LPpKH[layer, kv_pages_X].reshape(x * p, kvh, h)
    v_YKH = v_LPpKH[layer, kv_pages_X].reshape(x * p, kvh, h)
    key_seq_Y = jnp.repeat(kv_page_seq_X, p)
    key_pos_Y = kv_page_pos_of(kv_page_seq_X, p)
    visible = (key_seq_Y[None, :] == seq_idx_T[:, None]) & (key_pos_Y[None, :] <= positions_T[:, None])
    if sliding_window is not None:
        visible &= key_pos_Y[None, :] > positions_T[:, None] - sliding_window
    q = q_TNH.reshape(t, kvh, n // kvh, h)
    s = jnp.einsum("tkgh,ykh->tkgy", q, k_YKH) * h ** -0.5
    s = jnp.where(visible[:, None, None, :], s, MASKED)
    out = jnp.einsum("tkgy,ykh->tkgh", jax.nn.softmax(s, axis=-1), v_YKH).reshape(t, n, h)
    return jnp.where((seq_idx_T >= 0)[:, None, None], out, 0.0)


def _case(rng, lens, starts, page_size, num_tokens, num_pages, n=4, kvh=2, h=8, layers=2):
    chunks, page = [], 1
    for ln, st in zip(lens, starts):
        need = -(-(st + ln) // page_size)
        pages = list(rng.permutation(np.arange(page, page + need)))  # scattered, not in order
        chunks.append(SeqChunk(list(range(ln)), st, pages, 0))
        page += need
    total_pages = page + 2
    batch = build_batch(chunks, mode="prefill", num_tokens=num_tokens, num_seqs=len(lens) + 2,
                        num_pages=num_pages, page_size=page_size, scalings_S=np.zeros(1, np.float32),
                        ranks_S=np.zeros(1, np.int32))
    k = rng.standard_normal((layers, total_pages, page_size, kvh, h)).astype(np.float32)
    v = rng.standard_normal((layers, total_pages, page_size, kvh, h)).astype(np.float32)
    q = rng.standard_normal((num_tokens, n, h)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), batch


@pytest.mark.parametrize("lens,starts,page_size,num_tokens,num_pages,window", [
    ([48] * 10, [0] * 10, 16, 512, 48, None),           # the serving workload's prompts
    ([7, 30, 1, 19], [0, 0, 5, 3], 4, 64, 32, None),    # short, mid-sequence chunks
    ([100], [300], 16, 128, 32, None),                  # a chunk behind a long cache
    ([40, 100, 9], [0, 250, 17], 8, 160, 64, None),     # long context in the middle; T % 64 != 0
    ([33, 64], [0, 70], 16, 100, 16, 24),               # sliding window
    ([5], [0], 16, 16, 4, None),                        # tiny bucket, mostly padding
])
def test_prefill_blocks_match_all_pages(lens, starts, page_size, num_tokens, num_pages, window, monkeypatch):
    rng = np.random.default_rng(sum(lens) + page_size)
    q, k, v, b = _case(rng, lens, starts, page_size, num_tokens, num_pages)
    args = (q, k, v, 1, b.kv_pages_X, b.kv_page_seq_X, b.seq_idx_T, b.positions_T, window)
    want = np.asarray(all_pages_attention(*args))
    got = np.asarray(jax.jit(prefill_attention, static_argnums=8)(*args))
    real = np.asarray(b.seq_idx_T) >= 0
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[real], want[real], atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(got[~real], 0.0)


def test_prefill_loop_chunks_smaller_than_ranges(monkeypatch):
    """With one page per iteration every range takes several iterations: the online softmax
    across them must still match."""
    monkeypatch.setattr(attention, "KEYS_PER_ITER", 4)
    monkeypatch.setattr(attention, "QUERY_BLOCK", 16)
    rng = np.random.default_rng(3)
    q, k, v, b = _case(rng, [20, 45, 3], [0, 11, 60], 4, 96, 64)
    args = (q, k, v, 0, b.kv_pages_X, b.kv_page_seq_X, b.seq_idx_T, b.positions_T)
    real = np.asarray(b.seq_idx_T) >= 0
    np.testing.assert_allclose(np.asarray(prefill_attention(*args))[real],
                               np.asarray(all_pages_attention(*args))[real], atol=2e-5, rtol=1e-5)
