"""Attention over the paged KV cache, for packed prefill tokens and for decode.

The cache of one layer is k_PpKH: P pages of p slots. A token's K/V is first written at its
slot_mapping entry (page * p + offset); attention then reads whole pages through block tables.
A step mixes both kinds of sequence in one packed batch over one flat list of the step's pages:
sequences with one token this step (decode rows, listed first) go through decode_attention, a
softmax over page segments; longer chunks (prefill) go through prefill_attention, blocks of
packed query tokens walking only the pages their own sequences hold (an online softmax).
Legend: T tokens, B sequences, C pages per sequence, p page size, K kv heads, G = N/K, H head dim;
prefill's loop: J query blocks of M rows, Y keys per iteration.
On a TPU the XLA path takes the cache as k_LPKpH (heads_major, multilora.model.llama.KV_HEADS_MAJOR):
the same values, in the order the cache has in memory there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from multilora import kernels
from multilora.kernels.kv_write_pallas import page_slot_rows

MASKED = -1e30  # finite, so padding rows with no visible key stay NaN-free


def write_kv(cache_LPpKH: jax.Array, layer: jax.Array, slot_mapping_T: jax.Array,
             new_TKH: jax.Array, heads_major: bool = False) -> jax.Array:
    """The step's new K (or V) rows written at their slots. heads_major: the cache comes as
    cache_LPKpH (see `read_pages`), written one (token, head) row of H at a time: a write of
    (K, H) windows, strided in that order, made XLA convert the whole cache inside the loop."""
    page_size = cache_LPpKH.shape[3 if heads_major else 2]
    page_T, off_T = slot_mapping_T // page_size, slot_mapping_T % page_size
    if heads_major:
        head_K = jnp.arange(cache_LPpKH.shape[2])
        return cache_LPpKH.at[layer, page_T[:, None], head_K[None, :], off_T[:, None]].set(
            new_TKH.astype(cache_LPpKH.dtype))
    return cache_LPpKH.at[layer, page_T, off_T].set(new_TKH.astype(cache_LPpKH.dtype))


def max_pages_written(num_tokens: int, num_seqs: int, page_size: int) -> int:
    """A static bound on the distinct pages a step's writes touch: a sequence's n new slots are
    one run, over at most n // p + 2 pages; padding tokens all write the trash page."""
    return min(num_tokens, num_tokens // page_size + 2 * num_seqs + 1)


def kv_page_writes(slot_mapping_T: jax.Array, page_size: int, max_pages: int):
    """The step's K/V writes grouped by page, once per step (every layer writes the same slots):
    page_U the distinct pages written, in ascending order, the entries past the last repeating
    it; how many pages; and src_Up the token that writes each slot of those pages (-1: none).
    Any arrangement of slots is allowed (tokens of one page need not be adjacent)."""
    page_T = slot_mapping_T // page_size
    order_T = jnp.argsort(page_T, stable=True)
    sorted_T = page_T[order_T]
    new_T = jnp.concatenate([jnp.ones((1,), bool), sorted_T[1:] != sorted_T[:-1]])
    u_T = jnp.cumsum(new_T.astype(jnp.int32)) - 1
    num_pages = u_T[-1] + 1
    page_U = jnp.zeros((max_pages,), jnp.int32).at[u_T].set(sorted_T.astype(jnp.int32), mode="drop")
    page_U = jnp.where(jnp.arange(max_pages) < num_pages, page_U, page_U[jnp.maximum(num_pages - 1, 0)])
    src_Up = jnp.full((max_pages, page_size), -1, jnp.int32).at[u_T, (slot_mapping_T % page_size)[order_T]].set(
        order_T.astype(jnp.int32), mode="drop")
    return page_U, num_pages, src_Up


def write_kv_pages(cache_LPKpH: jax.Array, layer: jax.Array, page_U: jax.Array, num_pages: jax.Array,
                   src_Up: jax.Array, new_TKH: jax.Array) -> jax.Array:
    """write_kv for a heads-major cache, by whole pages (kv_page_writes): each page written is
    read, its written slots replaced, and put back; one scatter of U pages of (K, p, H), not
    T x K rows of H (XLA's scatter costs per update, not per byte, on a TPU)."""
    l, num_cache_pages = cache_LPKpH.shape[:2]
    flat = cache_LPKpH.reshape((l * num_cache_pages,) + cache_LPKpH.shape[2:])
    idx_U = layer * num_cache_pages + page_U
    old_UKpH = jnp.take(flat, idx_U, axis=0, mode="clip")
    new_UKpH = page_slot_rows(new_TKH, src_Up, cache_LPKpH.dtype)
    merged = jnp.where((src_Up >= 0)[:, None, :, None], new_UKpH, old_UKpH)
    idx_U = jnp.where(jnp.arange(page_U.shape[0]) < num_pages, idx_U, l * num_cache_pages)  # repeats dropped
    return flat.at[idx_U].set(merged, mode="drop").reshape(cache_LPKpH.shape)


def read_pages(cache_LPpKH: jax.Array, layer, pages: jax.Array, heads_major: bool = False) -> jax.Array:
    """cache[layer, pages] (pages' shape + (p, K, H)) as one gather from the whole cache (layers and pages
    flattened, a free reshape): indexing [layer, pages] lets XLA slice the layer out first, a copy
    of that layer's entire cache on every layer of every step.

    heads_major: the cache comes as cache_LPKpH, the (L, P, p, K, H) cache swapped to the order its
    memory has on a TPU (multilora.model.llama.KV_HEADS_MAJOR); only the gathered pages are swapped
    back. Read and written in the order that memory has (and written a row of H at a time:
    `write_kv`), the layer loop works on the cache in place: read (L, P, p, K, H) there, XLA
    converted the whole cache between layouts inside the loop, four copies of the cache per layer
    (a 64-row decode step 59.2 ms, 8.4 ms heads-major;
    benchmarks/log/25-2026-12-05-tpu-v5e-kv-heads-major.md)."""
    l, num_pages = cache_LPpKH.shape[:2]
    flat = cache_LPpKH.reshape((l * num_pages,) + cache_LPpKH.shape[2:])
    pages = jnp.take(flat, layer * num_pages + pages, axis=0, mode="clip")
    return jnp.swapaxes(pages, -3, -2) if heads_major else pages  # (..., K, p, H) -> (..., p, K, H)


def _softmax_attend(scores, v, out_spec, scale):
    probs = jax.nn.softmax(scores.astype(jnp.float32) * scale, axis=-1)
    return jnp.einsum(out_spec, probs.astype(v.dtype), v)


def softcap_logits(x, cap: float):
    """cap * tanh(x / cap): Gemma 2's soft cap on attention scores and on final logits."""
    return cap * jnp.tanh(x / cap)


def _scaled_scores(s, head_dim: int, logit_softcap: float | None):
    s = s * head_dim ** -0.5
    return s if logit_softcap is None else softcap_logits(s, logit_softcap)


def _window_ok(key_pos, query_pos, sliding_window):
    if sliding_window is None:
        return True
    return key_pos > query_pos - sliding_window


QUERY_BLOCK = 64       # query rows per block of the prefill loop
KEYS_PER_ITER = 256    # keys each query block scores per loop iteration


def prefill_attention(q_TNH, k_LPpKH, v_LPpKH, layer, kv_pages_X, kv_page_seq_X, seq_idx_T,
                      positions_T, sliding_window: int | None = None, native: bool = False,
                      heads_major: bool = False, logit_softcap: float | None = None):
    """Packed tokens against the step's pages (the flat list kv_pages_X, each sequence's pages
    one run, in order, tagged by kv_page_seq_X); a token sees the keys of its own sequence at
    positions <= its own. native=True: the same through multilora's CPU kernel, which walks
    each block of a sequence's tokens over its pages in place (float32 caches, one CPU device).
    heads_major: the caches come as k_LPKpH, v_LPKpH (see `read_pages`). logit_softcap: the scaled
    scores soft-capped (softcap_logits; Gemma 2), by XLA only.

    Queries go in blocks (J) of QUERY_BLOCK rows (M); block j needs only the page range from its
    first sequence's first page to the last page any of its tokens sees, a range the loop walks
    in chunks of KEYS_PER_ITER keys (Y) with an online softmax. The trip count is the largest range
    of the step (dynamic), so a step of short prompts scores each block against a few pages,
    not against every page of the step, and a long-context chunk costs what causality asks."""
    if native and logit_softcap is not None:
        raise ValueError("multilora's CPU attention kernels do not soft-cap scores: native=False")
    if native:
        return kernels.prefill_attention(q_TNH, k_LPpKH, v_LPpKH, layer, kv_pages_X, kv_page_seq_X, seq_idx_T,
                                         positions_T, sliding_window).astype(q_TNH.dtype)
    t, n, h = q_TNH.shape
    kvh, p = (k_LPpKH.shape[2], k_LPpKH.shape[3]) if heads_major else (k_LPpKH.shape[3], k_LPpKH.shape[2])
    x = kv_pages_X.shape[0]
    g = n // kvh
    mq = min(QUERY_BLOCK, t)
    nb = -(-t // mq)
    pad = nb * mq - t
    q_JMKGH = jnp.pad(q_TNH, ((0, pad), (0, 0), (0, 0))).reshape(nb, mq, kvh, g, h)
    seq_JM = jnp.pad(seq_idx_T, (0, pad), constant_values=-1).reshape(nb, mq)
    pos_JM = jnp.pad(positions_T, (0, pad)).reshape(nb, mq)

    # Each token's sequence's first page in X (kv_page_seq_X ascends: runs in sequence order,
    # padding pages last); padding tokens (sequence -1) own no page and need none.
    seq_start_JM = jnp.searchsorted(kv_page_seq_X, seq_JM, side="left", method="compare_all").astype(jnp.int32)
    real_JM = seq_JM >= 0
    need_end_JM = jnp.where(real_JM, seq_start_JM + pos_JM // p + 1, 0)
    blk_end_J = jnp.max(need_end_JM, axis=1)
    blk_start_J = jnp.min(jnp.where(real_JM, seq_start_JM, x), axis=1)
    kc = max(1, min(x, KEYS_PER_ITER // p))  # pages per iteration
    iters = jnp.max(jnp.maximum(blk_end_J - blk_start_J, 0) + kc - 1) // kc
    key_pos_Xp = kv_page_pos_of(kv_page_seq_X, p).reshape(x, p)

    def body(j, carry):
        m_JMKG, l_JMKG, acc_JMKGH = carry
        page_i_JC = blk_start_J[:, None] + j * kc + jnp.arange(kc)[None, :]
        in_range_JC = page_i_JC < blk_end_J[:, None]
        page_i_JC = jnp.clip(page_i_JC, 0, x - 1)
        pages_JC = jnp.take(kv_pages_X, page_i_JC)
        key_seq_JY = jnp.repeat(jnp.take(kv_page_seq_X, page_i_JC), p, axis=1)
        in_range_JY = jnp.repeat(in_range_JC, p, axis=1)
        key_pos_JY = jnp.take(key_pos_Xp, page_i_JC, axis=0).reshape(nb, kc * p)
        k_JYKH = read_pages(k_LPpKH, layer, pages_JC, heads_major).reshape(nb, kc * p, kvh, h)
        v_JYKH = read_pages(v_LPpKH, layer, pages_JC, heads_major).reshape(nb, kc * p, kvh, h)
        visible_JMY = (in_range_JY[:, None, :] & (key_seq_JY[:, None, :] == seq_JM[:, :, None])
                       & (key_pos_JY[:, None, :] <= pos_JM[:, :, None])
                       & _window_ok(key_pos_JY[:, None, :], pos_JM[:, :, None], sliding_window))
        vis = visible_JMY[:, :, None, None, :]
        s = jnp.einsum("jmkgh,jykh->jmkgy", q_JMKGH, k_JYKH, preferred_element_type=jnp.float32)
        s = jnp.where(vis, _scaled_scores(s, h, logit_softcap), MASKED)
        m_new = jnp.maximum(m_JMKG, jnp.max(s, axis=-1))
        probs = jnp.where(vis, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m_JMKG - m_new)
        l_new = alpha * l_JMKG + jnp.sum(probs, axis=-1)
        pv = jnp.einsum("jmkgy,jykh->jmkgh", probs.astype(v_JYKH.dtype), v_JYKH,
                        preferred_element_type=jnp.float32)
        return m_new, l_new, alpha[..., None] * acc_JMKGH + pv

    init = (jnp.full((nb, mq, kvh, g), MASKED, jnp.float32), jnp.zeros((nb, mq, kvh, g), jnp.float32),
            jnp.zeros((nb, mq, kvh, g, h), jnp.float32))
    _, l_JMKG, acc_JMKGH = jax.lax.fori_loop(0, iters, body, init)
    out = acc_JMKGH / jnp.where(l_JMKG == 0, 1.0, l_JMKG)[..., None]
    return out.reshape(nb * mq, n, h)[:t].astype(q_TNH.dtype)


def kv_page_pos_of(kv_page_seq_X, page_size):
    """Position of every key slot: pages of one sequence are listed consecutively and in order,
    so a page's index within its sequence's run gives its first position."""
    x = kv_page_seq_X.shape[0]
    idx_X = jnp.arange(x)
    new_run = jnp.concatenate([jnp.array([True]), kv_page_seq_X[1:] != kv_page_seq_X[:-1]])
    run_start_X = jax.lax.cummax(jnp.where(new_run, idx_X, 0), axis=0)
    page_in_seq_X = idx_X - run_start_X
    return (page_in_seq_X[:, None] * page_size + jnp.arange(page_size)[None, :]).reshape(-1)


def decode_attention(q_TNH, k_LPpKH, v_LPpKH, layer, kv_pages_X, kv_page_seq_X, positions_T,
                     num_decode, sliding_window: int | None = None, native: bool = False,
                     heads_major: bool = False, logit_softcap: float | None = None):
    """Single-token sequences of a mixed step: rows 0..num_decode-1 are sequences 0..num_decode-1,
    one query each. Every page of the step's flat page list is scored against the one query of
    its sequence (pages of longer chunks and padding pages against nothing), and the pages of a
    sequence are combined with a softmax over segments: the work is the step's pages, not
    sequences x the longest sequence, and no per-sequence block table is padded.
    Rows from num_decode on get zeros (the prefill kernel computes them).
    native=True: the same through multilora's CPU kernel (multilora/kernels/attention_kernels.cc),
    which reads each row's pages in place instead of gathering them (float32 caches, one CPU
    device; see `native_attention_usable`). heads_major: the caches come as k_LPKpH, v_LPKpH
    (see `read_pages`). logit_softcap: as prefill_attention's."""
    if native and logit_softcap is not None:
        raise ValueError("multilora's CPU attention kernels do not soft-cap scores: native=False")
    if native:
        return kernels.decode_attention(q_TNH, k_LPpKH, v_LPpKH, layer, kv_pages_X, kv_page_seq_X, positions_T,
                                        num_decode, sliding_window).astype(q_TNH.dtype)
    t, n, h = q_TNH.shape
    kvh, p = (k_LPpKH.shape[2], k_LPpKH.shape[3]) if heads_major else (k_LPpKH.shape[3], k_LPpKH.shape[2])
    x = kv_pages_X.shape[0]
    g = n // kvh
    is_dec_X = kv_page_seq_X < num_decode
    row_X = jnp.where(is_dec_X, kv_page_seq_X, t)            # t: no query (dropped by segment ops)
    q_XKGH = jnp.take(q_TNH, jnp.minimum(row_X, t - 1), axis=0, mode="clip").reshape(x, kvh, g, h)
    k_XpKH = read_pages(k_LPpKH, layer, kv_pages_X, heads_major)
    v_XpKH = read_pages(v_LPpKH, layer, kv_pages_X, heads_major)
    key_pos_Xp = kv_page_pos_of(kv_page_seq_X, p).reshape(x, p)
    q_pos_X = jnp.take(positions_T, jnp.minimum(row_X, t - 1), mode="clip")
    visible_Xp = (is_dec_X[:, None] & (key_pos_Xp <= q_pos_X[:, None])
                  & _window_ok(key_pos_Xp, q_pos_X[:, None], sliding_window))
    s_XKGp = jnp.einsum("xkgh,xpkh->xkgp", q_XKGH, k_XpKH, preferred_element_type=jnp.float32)
    s_XKGp = jnp.where(visible_Xp[:, None, None, :], _scaled_scores(s_XKGp, h, logit_softcap), MASKED)
    seg = dict(num_segments=t + 1, indices_are_sorted=True)
    m_TKG = jax.ops.segment_max(jnp.max(s_XKGp, axis=-1), row_X, **seg)
    m_XKG = jnp.take(m_TKG, row_X, axis=0, mode="clip")
    e_XKGp = jnp.where(visible_Xp[:, None, None, :], jnp.exp(s_XKGp - m_XKG[..., None]), 0.0)
    l_TKG = jax.ops.segment_sum(jnp.sum(e_XKGp, axis=-1), row_X, **seg)
    pv_XKGH = jnp.einsum("xkgp,xpkh->xkgh", e_XKGp.astype(v_XpKH.dtype), v_XpKH,
                         preferred_element_type=jnp.float32)
    acc_TKGH = jax.ops.segment_sum(pv_XKGH, row_X, **seg)
    out = acc_TKGH[:t] / jnp.where(l_TKG[:t] == 0, 1.0, l_TKG[:t])[..., None]
    return out.reshape(t, n, h).astype(q_TNH.dtype)


def native_attention_usable(cache) -> bool:
    """Whether decode_attention(native=True) can serve this cache: float32, on one CPU device,
    with multilora's CPU kernels built (MULTILORA_NATIVE=0 turns them off)."""
    devices = cache.sharding.device_set
    return (cache.dtype == jnp.float32 and len(devices) == 1 and next(iter(devices)).platform == "cpu"
            and kernels.available())
