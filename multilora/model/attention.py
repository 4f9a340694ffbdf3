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


def prefill_attention(q_TNH, k_LPpKH, v_LPpKH, layer, block_tables_BC, seq_idx_T, positions_T,
                      context_lens_B, sliding_window: int | None = None):
    t, n, h = q_TNH.shape
    kvh = k_LPpKH.shape[3]
    b, c = block_tables_BC.shape
    p = k_LPpKH.shape[2]
    k_XKH = k_LPpKH[layer, block_tables_BC].reshape(b * c * p, kvh, h)  # X = B*C*p keys
    v_XKH = v_LPpKH[layer, block_tables_BC].reshape(b * c * p, kvh, h)
    key_seq_X = jnp.repeat(jnp.arange(b), c * p)
    key_pos_X = jnp.tile(jnp.arange(c * p), b)
    visible_TX = ((key_seq_X[None, :] == seq_idx_T[:, None])
                  & (key_pos_X[None, :] <= positions_T[:, None])
                  & (key_pos_X[None, :] < context_lens_B[key_seq_X][None, :])
                  & _window_ok(key_pos_X[None, :], positions_T[:, None], sliding_window))
    q_TKGH = q_TNH.reshape(t, kvh, n // kvh, h)
    scores = jnp.einsum("tkgh,xkh->tkgx", q_TKGH, k_XKH, preferred_element_type=jnp.float32)
    scores = jnp.where(visible_TX[:, None, None, :], scores * h ** -0.5, MASKED)
    out = _softmax_attend(scores, v_XKH, "tkgx,xkh->tkgh", 1.0)
    return out.reshape(t, n, h)


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
