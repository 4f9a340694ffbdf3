"""Attention over the paged KV cache, for packed prefill tokens and for decode.

The cache of one layer is k_PpKH: P pages of p slots. A token's K/V is first written at its
slot_mapping entry (page * p + offset); attention then reads whole pages through block tables.
Prefill: every token scores against the pages of all B sequences of the step, masked to its own
sequence and causal positions (B is small in a prefill step). Decode: one token per sequence,
each gathers only its own pages.
Legend: T tokens, B sequences, C pages per sequence, p page size, K kv heads, G = N/K, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASKED = -1e30  # finite, so padding rows with no visible key stay NaN-free


def write_kv(cache_LPpKH: jax.Array, layer: jax.Array, slot_mapping_T: jax.Array,
             new_TKH: jax.Array) -> jax.Array:
    page_size = cache_LPpKH.shape[2]
    page_T, off_T = slot_mapping_T // page_size, slot_mapping_T % page_size
    return cache_LPpKH.at[layer, page_T, off_T].set(new_TKH.astype(cache_LPpKH.dtype))


def _softmax_attend(scores, v, out_spec, scale):
    probs = jax.nn.softmax(scores.astype(jnp.float32) * scale, axis=-1)
    return jnp.einsum(out_spec, probs.astype(v.dtype), v)


def _window_ok(key_pos, query_pos, sliding_window):
    if sliding_window is None:
        return True
    return key_pos > query_pos - sliding_window


def prefill_attention(q_TNH, k_LPpKH, v_LPpKH, layer, kv_pages_X, kv_page_seq_X, seq_idx_T,
                      positions_T, sliding_window: int | None = None):
    """Packed tokens against the flat list of the step's pages (X pages, each tagged with its
    sequence); a token sees the keys of its own sequence at positions <= its own."""
    t, n, h = q_TNH.shape
    kvh, p = k_LPpKH.shape[3], k_LPpKH.shape[2]
    x = kv_pages_X.shape[0]
    k_YKH = k_LPpKH[layer, kv_pages_X].reshape(x * p, kvh, h)  # Y = X*p keys
    v_YKH = v_LPpKH[layer, kv_pages_X].reshape(x * p, kvh, h)
    key_seq_Y = jnp.repeat(kv_page_seq_X, p)
    key_pos_Y = kv_page_pos_of(kv_page_seq_X, p)
    visible_TY = ((key_seq_Y[None, :] == seq_idx_T[:, None])
                  & (key_pos_Y[None, :] <= positions_T[:, None])
                  & _window_ok(key_pos_Y[None, :], positions_T[:, None], sliding_window))
    q_TKGH = q_TNH.reshape(t, kvh, n // kvh, h)
    scores = jnp.einsum("tkgh,ykh->tkgy", q_TKGH, k_YKH, preferred_element_type=jnp.float32)
    scores = jnp.where(visible_TY[:, None, None, :], scores * h ** -0.5, MASKED)
    out = _softmax_attend(scores, v_YKH, "tkgy,ykh->tkgh", 1.0)
    return out.reshape(t, n, h)


def kv_page_pos_of(kv_page_seq_X, page_size):
    """Position of every key slot: pages of one sequence are listed consecutively and in order,
    so a page's index within its sequence's run gives its first position."""
    x = kv_page_seq_X.shape[0]
    idx_X = jnp.arange(x)
    new_run = jnp.concatenate([jnp.array([True]), kv_page_seq_X[1:] != kv_page_seq_X[:-1]])
    run_start_X = jax.lax.cummax(jnp.where(new_run, idx_X, 0), axis=0)
    page_in_seq_X = idx_X - run_start_X
    return (page_in_seq_X[:, None] * page_size + jnp.arange(page_size)[None, :]).reshape(-1)


def decode_attention(q_BNH, k_LPpKH, v_LPpKH, layer, block_tables_BC, context_lens_B,
                     sliding_window: int | None = None):
    b, n, h = q_BNH.shape
    kvh = k_LPpKH.shape[3]
    c, p = block_tables_BC.shape[1], k_LPpKH.shape[2]
    k_BXKH = k_LPpKH[layer, block_tables_BC].reshape(b, c * p, kvh, h)
    v_BXKH = v_LPpKH[layer, block_tables_BC].reshape(b, c * p, kvh, h)
    key_pos_X = jnp.arange(c * p)
    query_pos_B = context_lens_B - 1
    visible_BX = ((key_pos_X[None, :] < context_lens_B[:, None])
                  & _window_ok(key_pos_X[None, :], query_pos_B[:, None], sliding_window))
    q_BKGH = q_BNH.reshape(b, kvh, n // kvh, h)
    scores = jnp.einsum("bkgh,bxkh->bkgx", q_BKGH, k_BXKH, preferred_element_type=jnp.float32)
    scores = jnp.where(visible_BX[:, None, None, :], scores * h ** -0.5, MASKED)
    out = _softmax_attend(scores, v_BXKH, "bkgx,bxkh->bkgh", 1.0)
    return out.reshape(b, n, h)
