"""Prefill attention (query blocks walking their own sequences' pages with an online softmax)
against the plain formulation: every token against every page of the step, masked; and decode
attention (a softmax over page segments) against each single-token sequence's query scored
against its own keys, gathered through its block table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multilora.engine.batching import SeqChunk, build_batch, decode_first, pages_needed
from multilora import kernels
from multilora.model import attention
from multilora.model.attention import MASKED, decode_attention, kv_page_pos_of, prefill_attention


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
    chunks = [chunks[i] for i in decode_first(chunks)]  # single-token chunks first
    batch = build_batch(chunks, num_tokens=num_tokens, num_pages=num_pages,
                        num_logits=len(lens) + 2, page_size=page_size)
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
@pytest.mark.parametrize("native", [False, pytest.param(True, id="native", marks=pytest.mark.skipif(
    not kernels.available(), reason="native kernels unavailable"))])
def test_prefill_blocks_match_all_pages(lens, starts, page_size, num_tokens, num_pages, window, native):
    rng = np.random.default_rng(sum(lens) + page_size)
    q, k, v, b = _case(rng, lens, starts, page_size, num_tokens, num_pages)
    args = (q, k, v, 1, b.kv_pages_X, b.kv_page_seq_X, b.seq_idx_T, b.positions_T, window)
    want = np.asarray(all_pages_attention(*args))
    got = np.asarray(jax.jit(prefill_attention, static_argnums=(8, 9))(*args, native))
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


# --- decode attention --------------------------------------------------------------------------

def plain_decode_attention(q_TNH, k_LPpKH, v_LPpKH, layer, chunks, page_size, sliding_window=None):
    """Each single-token chunk's query (row b of the step, chunks decode-first) against its own
    sequence's keys at positions <= its own, read through its block table: a masked softmax in
    float64. Rows of the other chunks and padding rows are zero."""
    q = np.asarray(q_TNH, np.float64)
    k_all, v_all = np.asarray(k_LPpKH, np.float64)[layer], np.asarray(v_LPpKH, np.float64)[layer]
    t, n, h = q.shape
    kvh = k_all.shape[2]
    g = n // kvh
    out = np.zeros((t, n, h))
    for b, c in enumerate(chunks):
        if len(c.token_ids) != 1:
            break  # decode rows are the leading single-token chunks
        pos = c.start_pos
        key_pos = np.arange(pos + 1)
        pages = np.asarray(c.block_table)[key_pos // page_size]
        k_YKH, v_YKH = k_all[pages, key_pos % page_size], v_all[pages, key_pos % page_size]
        visible = np.ones(pos + 1, bool)
        if sliding_window is not None:
            visible &= key_pos > pos - sliding_window
        for head in range(n):
            kh = head // g
            s = k_YKH[:, kh] @ q[b, head] * h ** -0.5
            s = np.where(visible, s, -np.inf)
            w = np.exp(s - s.max())
            out[b, head] = (w / w.sum()) @ v_YKH[:, kh]
    return out


def _decode_case(rng, decode_pos, prefill, page_size, num_tokens, num_pages, n, kvh, h=8, layers=2):
    """Decode chunks (one token at each position of decode_pos), then prefill chunks
    ((length, start) pairs), every sequence's pages drawn from one shuffled free list, so the
    sequences' pages interleave and none is contiguous or in order."""
    need = [-(-(p + 1) // page_size) for p in decode_pos] + [-(-(s + ln) // page_size) for ln, s in prefill]
    total_pages = sum(need) + 5
    free = list(rng.permutation(np.arange(1, total_pages)))  # page 0: padding only
    tables = []
    for m in need:
        extra = int(rng.integers(0, 2))  # a block table may hold more pages than the step needs
        tables.append([int(x) for x in free[:m + extra]])
        del free[:m + extra]
    chunks = [SeqChunk([7], p, tables[i], 0) for i, p in enumerate(decode_pos)]
    chunks += [SeqChunk(list(range(ln)), s, tables[len(decode_pos) + i], 0)
               for i, (ln, s) in enumerate(prefill)]
    assert decode_first(chunks) == list(range(len(chunks)))
    batch = build_batch(chunks, num_tokens=num_tokens, num_pages=num_pages,
                        num_logits=len(chunks), page_size=page_size)
    k = rng.standard_normal((layers, total_pages, page_size, kvh, h)).astype(np.float32)
    v = rng.standard_normal((layers, total_pages, page_size, kvh, h)).astype(np.float32)
    q = rng.standard_normal((num_tokens, n, h)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), batch, chunks


# Decode attention by XLA's gathers and by multilora's CPU kernel (reads the pages in place).
IMPLS = [pytest.param(False, id="xla"),
         pytest.param(True, id="native", marks=pytest.mark.skipif(
             not kernels.available(), reason=f"native kernels unavailable: {kernels.unavailable_reason()}"))]


# decode_pos: each decode sequence's position (its length - 1); prefill: (length, start) chunks.
@pytest.mark.parametrize("native", IMPLS)
@pytest.mark.parametrize("decode_pos,prefill,page_size,num_tokens,num_pages,n,kvh,window,h", [
    # lengths 1, 16 (an exact multiple of the page size), 17, 37, 5; two prefill chunks after them
    ([0, 15, 16, 36, 4], [(9, 0), (6, 11)], 8, 32, 32, 4, 2, None, 8),
    # the same with a sliding window shorter than most of the sequences
    ([0, 15, 16, 36, 4], [(9, 0), (6, 11)], 8, 32, 32, 4, 2, 6, 8),
    # page size 4: lengths 12 and 4 (multiples), 1, 23, 50; GQA 3:1; a window of one page + 1
    ([11, 3, 0, 22, 49], [(13, 2)], 4, 64, 48, 6, 2, 5, 8),
    # decode only, single kv head, many padding pages and tokens
    ([63, 0, 31, 7], [], 16, 16, 16, 4, 1, None, 8),
    # one decode row beside a long prefill chunk behind a long cache; kv heads = heads
    ([40], [(30, 100)], 16, 64, 16, 2, 2, None, 8),
    # no decode rows at all: every row zero
    ([], [(5, 0), (8, 3)], 4, 16, 8, 4, 2, None, 8),
    # a head dim that is no multiple of the kernel's 8 lanes; GQA 4:1; 9 keys (one past a lane block)
    ([8, 20, 2], [(4, 0)], 4, 16, 16, 8, 2, None, 12),
    # long rows (hundreds of keys, as in serving) at the real head dim 64, SmolLM2's 9:3 heads
    ([300, 511, 77], [], 16, 8, 64, 9, 3, None, 64),
])
def test_decode_matches_plain(decode_pos, prefill, page_size, num_tokens, num_pages, n, kvh, window, h, native):
    rng = np.random.default_rng(len(decode_pos) * 100 + page_size + (window or 0) + h)
    q, k, v, b, chunks = _decode_case(rng, decode_pos, prefill, page_size, num_tokens, num_pages, n, kvh, h)
    assert int(b.num_decode) == len(decode_pos)
    used_pages = int(np.sum(np.asarray(b.kv_page_seq_X) < len(chunks)))
    assert used_pages < num_pages, "the case should carry padding pages"
    layer = 1
    got = np.asarray(jax.jit(decode_attention, static_argnums=(8, 9))(
        q, k, v, layer, b.kv_pages_X, b.kv_page_seq_X, b.positions_T, b.num_decode, window, native))
    want = plain_decode_attention(q, k, v, layer, chunks, page_size, window)
    assert got.shape == q.shape and np.isfinite(got).all()
    nd = len(decode_pos)
    np.testing.assert_allclose(got[:nd], want[:nd], atol=2e-5, rtol=0)
    # Prefill rows and padding rows come back zero (the prefill kernel computes the former).
    np.testing.assert_array_equal(got[nd:], 0.0)


@pytest.mark.parametrize("native", IMPLS)
def test_decode_ignores_other_sequences_pages(native):
    """A decode row's output depends on its own pages only: rewriting every other page of the
    cache (other sequences', padding page 0, unused ones) leaves it unchanged."""
    rng = np.random.default_rng(7)
    q, k, v, b, chunks = _decode_case(rng, [9, 2, 20], [(12, 0)], 4, 32, 24, 4, 2)
    args = (b.kv_pages_X, b.kv_page_seq_X, b.positions_T, b.num_decode)
    before = np.asarray(decode_attention(q, k, v, 0, *args, native=native))
    own = set(chunks[0].block_table[:pages_needed(chunks[0], 4)])
    others = np.array([p for p in range(k.shape[1]) if p not in own])
    k2 = k.at[:, others].set(100.0 * rng.standard_normal(k[:, others].shape).astype(np.float32))
    v2 = v.at[:, others].set(100.0 * rng.standard_normal(v[:, others].shape).astype(np.float32))
    after = np.asarray(decode_attention(q, k2, v2, 0, *args, native=native))
    np.testing.assert_allclose(after[0], before[0], atol=2e-5, rtol=0)


@pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")
def test_native_decode_refuses_bad_shapes_and_other_caches():
    """The kernel checks its operands (a K/V pair of different shapes is an error, not a wild
    read), and the runner only picks it for a float32 cache on one CPU device."""
    rng = np.random.default_rng(3)
    q, k, v, b, _ = _decode_case(rng, [5, 9], [], 4, 8, 8, 4, 2)
    args = (b.kv_pages_X, b.kv_page_seq_X, b.positions_T, b.num_decode)
    with pytest.raises(Exception, match="operand shapes disagree"):
        np.asarray(kernels.decode_attention(q, k, v[:, :-1], 0, *args))
    with pytest.raises(Exception, match="prefill attention: operand shapes disagree"):
        np.asarray(kernels.prefill_attention(q, k, v[:, :-1], 0, b.kv_pages_X, b.kv_page_seq_X, b.seq_idx_T,
                                             b.positions_T))
    with pytest.raises(Exception, match="prefill attention: operand shapes disagree"):  # seq_idx too short
        np.asarray(kernels.prefill_attention(q, k, v, 0, b.kv_pages_X, b.kv_page_seq_X, b.seq_idx_T[:-1],
                                             b.positions_T))
    assert attention.native_attention_usable(k)
    assert not attention.native_attention_usable(k.astype(jnp.bfloat16))


@pytest.mark.parametrize("window", [None, 6])
def test_heads_major_cache_reads_and_writes_the_same_values(window):
    """The TPU's heads-major path (multilora.model.llama.KV_HEADS_MAJOR): the cache handed in as
    k_LPKpH (the same values, axes swapped) is written at the same slots and attended to with
    the same results as the (L, P, p, K, H) path, bit for bit, decode rows and prefill chunks."""
    rng = np.random.default_rng(3)
    q, k, v, b, chunks = _decode_case(rng, [0, 15, 16, 36, 4], [(9, 0), (6, 11)], 8, 32, 32, 6, 3)
    layer = 1
    new_TKH = jnp.asarray(rng.standard_normal((q.shape[0], k.shape[3], k.shape[4])).astype(np.float32))
    swap = lambda a: jnp.swapaxes(a, 2, 3)  # noqa: E731
    for hm, (kk, vv) in ((False, (k, v)), (True, (swap(k), swap(v)))):
        kk = attention.write_kv(kk, layer, b.slot_mapping_T, new_TKH, hm)
        vv = attention.write_kv(vv, layer, b.slot_mapping_T, 2 * new_TKH, hm)
        dec = decode_attention(q, kk, vv, layer, b.kv_pages_X, b.kv_page_seq_X, b.positions_T, b.num_decode,
                               window, False, hm)
        pre = prefill_attention(q, kk, vv, layer, b.kv_pages_X, b.kv_page_seq_X, b.seq_idx_T, b.positions_T,
                                window, False, hm)
        if hm:
            np.testing.assert_array_equal(np.asarray(swap(kk)), want_k)
            np.testing.assert_array_equal(np.asarray(swap(vv)), want_v)
            np.testing.assert_array_equal(np.asarray(dec), want_dec)
            np.testing.assert_array_equal(np.asarray(pre), want_pre)
        else:
            want_k, want_v, want_dec, want_pre = (np.asarray(a) for a in (kk, vv, dec, pre))
            assert not np.array_equal(want_k, np.asarray(k))  # the write did write
