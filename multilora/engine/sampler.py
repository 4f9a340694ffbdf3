"""Token sampling on the device: greedy, temperature, top-k and top-p, with per-request seeds.

A request's random key is fold_in(PRNGKey(seed), number of tokens it has generated), so the same
seed gives the same tokens whatever else shares the batch. Pure functions; the runner jits them.
Legend: B rows, V vocab, C candidates, N blocks of the vocabulary, K tokens in a block.

Written for XLA's CPU backend, where a full sort of the rows (the textbook top-p), a Gumbel draw
over the whole vocabulary and even `argmax` (a variadic reduce) are slow: 64 rows of a
49,152-token vocabulary took ~1 s, ~180 ms and ~15 ms of a step that otherwise takes ~70 ms.
Here the argmax goes by blocks (each block's max, the first block holding the row's, then the
first index in it); top-k and top-p are decided from each row's C largest logits (`lax.top_k`),
and only a step in which some row's kept set reaches past them searches each row's threshold by
bisection over the float values (32 passes of counts and sums, no sort); a step in which no row
cuts skips both; and a draw is one uniform number per row found in the running sums of the
row's probabilities, block sums first, then within one block (no scan over the row).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NUM_LOGPROBS = 20  # top-n logprobs computed when any row asks (n <= 20, as OpenAI allows)
CANDIDATES = 256   # top-k / top-p look at each row's this many largest logits first
BLOCK = 256        # the draw's running sums: per block of this many tokens, then within one


def _blocks(x_BV: jax.Array, fill) -> jax.Array:
    """(B, N, K): the rows cut into blocks of BLOCK tokens, the last padded with `fill`."""
    b, v = x_BV.shape
    n = -(-v // BLOCK)
    return jnp.pad(x_BV, ((0, 0), (0, n * BLOCK - v)), constant_values=fill).reshape(b, n, BLOCK)


def argmax_rows(x_BV: jax.Array) -> jax.Array:
    """The first index of each row's largest value (jnp.argmax's answer on NaN-free rows): the
    first block holding the row's largest value, then the first index in that block."""
    v = x_BV.shape[-1]
    x_BNK = _blocks(x_BV, -jnp.inf)
    blk_B = jnp.argmax(x_BNK.max(axis=-1), axis=-1)
    in_blk_B = jnp.argmax(jnp.take_along_axis(x_BNK, blk_B[:, None, None], axis=1)[:, 0], axis=-1)
    return jnp.minimum(blk_B * BLOCK + in_blk_B, v - 1).astype(jnp.int32)


def _top_k_of(top_k_B, v):
    """The top-k survivors per row: top_k where 0 < top_k < V, else V (no top-k cut)."""
    return jnp.where((top_k_B > 0) & (top_k_B < v), top_k_B, v)


def _float_key(x):
    """float32 -> int32 in the same order (the sign-magnitude bits made two's complement)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _key_float(key):
    bits = jnp.where(key < 0, key ^ 0x7FFFFFFF, key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _largest_key(holds, lo_B, hi_B):
    """Per row, the largest key t in [lo, hi] for which holds(t) (B,) is true, holds being
    monotone (true up to some t, false above) and true at lo: 32 halvings of the int32 range."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + ((lo | hi) & 1)  # ceil((lo + hi) / 2), no overflow
        ok = holds(mid) & (mid <= hi)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)
    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo_B, hi_B))
    return lo


def thresholds_searched(scaled_BV, top_k_B, top_p_B):
    """Each row's smallest kept value (vLLM's order: top-k, then top-p over the top-k survivors,
    renormalised; the top token always stays) for any k and p, without sorting: the k-th largest
    value is the largest t with at least k values >= t, and top-p's cut the largest t whose
    values >= t hold at least top_p of the survivors' mass."""
    v = scaled_BV.shape[-1]
    key_BV = _float_key(scaled_BV)
    lo_B, hi_B = key_BV.min(axis=-1), key_BV.max(axis=-1)
    k_B = _top_k_of(top_k_B, v)
    kth_B = jax.lax.cond(
        jnp.any(k_B < v),
        lambda: _key_float(_largest_key(lambda t: (key_BV >= t[:, None]).sum(axis=-1) >= k_B, lo_B, hi_B)),
        lambda: jnp.full(k_B.shape, -jnp.inf, jnp.float32))
    kth_B = jnp.where(k_B < v, kth_B, -jnp.inf)
    survives = scaled_BV >= kth_B[:, None]
    w_BV = jnp.where(survives, jnp.exp(scaled_BV - scaled_BV.max(axis=-1, keepdims=True)), 0.0)
    need_B = top_p_B * w_BV.sum(axis=-1)
    cut_B = _key_float(_largest_key(
        lambda t: jnp.where(key_BV >= t[:, None], w_BV, 0.0).sum(axis=-1) >= need_B, lo_B, hi_B))
    return jnp.where(top_p_B < 1.0, jnp.maximum(kth_B, cut_B), kth_B)


def thresholds_from_candidates(scaled_BV, top_k_B, top_p_B):
    """The same thresholds from each row's C largest values, and per row whether those decide
    it: they do when the top-k survivors are all among them, or (no top-k cut) when their mass
    reaches top_p, so that the first token top-p drops is among them too."""
    v = scaled_BV.shape[-1]
    c = min(v, CANDIDATES)
    cand_BC, _ = jax.lax.top_k(scaled_BV, c)
    k_B = _top_k_of(top_k_B, v)
    by_k, by_p = k_B < v, top_p_B < 1.0
    in_k = jnp.arange(c)[None, :] < k_B[:, None]
    # the normaliser over the top-k survivors: the candidates hold them all, or there is no cut
    lse_B = jnp.where(k_B <= c, jax.nn.logsumexp(jnp.where(in_k, cand_BC, -jnp.inf), axis=-1),
                      jax.nn.logsumexp(scaled_BV, axis=-1))
    probs = jnp.where(in_k, jnp.exp(cand_BC - lse_B[:, None]), 0.0)
    cum = jnp.cumsum(probs, axis=-1)
    keep = (cum - probs < top_p_B[:, None]) & in_k
    cutoff_B = jnp.min(jnp.where(keep, cand_BC, jnp.inf), axis=-1)
    kth_B = jnp.take_along_axis(cand_BC, jnp.clip(k_B - 1, 0, c - 1)[:, None], axis=-1)[:, 0]
    threshold_B = jnp.where(by_k, kth_B, -jnp.inf)
    threshold_B = jnp.where(by_p, jnp.maximum(threshold_B, cutoff_B), threshold_B)
    decided_B = (~by_k | (k_B <= c)) & (~by_p | (k_B <= c) | (cum[:, -1] >= top_p_B))
    return threshold_B, decided_B


def thresholds(scaled_BV, top_k_B, top_p_B):
    """Each row's smallest value a draw may take (-inf: no cut): none in a step where no row
    cuts; from the candidates; or searched over whole rows in a step where the candidates do
    not decide every row."""
    v = scaled_BV.shape[-1]

    def cut():
        threshold_B, decided_B = thresholds_from_candidates(scaled_BV, top_k_B, top_p_B)
        return jax.lax.cond(jnp.all(decided_B), lambda: threshold_B,
                            lambda: thresholds_searched(scaled_BV, top_k_B, top_p_B))
    cuts = jnp.any((_top_k_of(top_k_B, v) < v) | (top_p_B < 1.0))
    return jax.lax.cond(cuts, cut, lambda: jnp.full(top_k_B.shape, -jnp.inf, jnp.float32))


def draw_rows(weights_BV: jax.Array, u_B: jax.Array) -> jax.Array:
    """Per row, index i with probability weights[i] / sum(weights) (weights >= 0, some > 0),
    given u uniform in [0, 1): the first index with weight whose running sum passes u times the
    total. The running sums go by blocks of BLOCK tokens, then within the block found."""
    v = weights_BV.shape[-1]
    w_BNK = _blocks(weights_BV, 0.0)

    def first_passing(w, cum, target):  # (B, X) each, target (B,): first index, else the last with weight
        x = w.shape[-1]
        idx = jnp.arange(x, dtype=jnp.int32)
        first = jnp.min(jnp.where((cum > target[:, None]) & (w > 0), idx, x), axis=-1)
        last = jnp.max(jnp.where(w > 0, idx, -1), axis=-1)
        return jnp.where(first < x, first, jnp.maximum(last, 0))

    block_BN = w_BNK.sum(axis=-1)
    cum_BN = jnp.cumsum(block_BN, axis=-1)
    target_B = u_B * cum_BN[:, -1]
    blk_B = first_passing(block_BN, cum_BN, target_B)
    before_B = jnp.take_along_axis(cum_BN - block_BN, blk_B[:, None], axis=-1)[:, 0]
    w_BK = jnp.take_along_axis(w_BNK, blk_B[:, None, None], axis=1)[:, 0]
    j_B = first_passing(w_BK, jnp.cumsum(w_BK, axis=-1), target_B - before_B)
    return jnp.minimum(blk_B * BLOCK + j_B, v - 1).astype(jnp.int32)


def sample(logits_BV, temperature_B, top_k_B, top_p_B, seed_B, step_B, *, mode: str,
           logprobs: bool, width: int = 0):
    """mode "greedy": argmax for every row. mode "sample": temperature 0 rows still take the
    argmax; the others sample from their filtered, tempered distribution. width: the tokens
    padded with zeros to this many rows (a fixed shape the next step can take them in)."""
    logits_BV = logits_BV.astype(jnp.float32)
    greedy_B = argmax_rows(logits_BV)
    if mode == "greedy":
        tokens_B = greedy_B
    else:
        scaled = logits_BV / jnp.maximum(temperature_B, 1e-6)[:, None]
        threshold_B = thresholds(scaled, top_k_B, top_p_B)
        top_B = jnp.max(scaled, axis=-1, keepdims=True)
        weights = jnp.where(scaled >= threshold_B[:, None], jnp.exp(scaled - top_B), 0.0)

        def uniform(seed, step):
            return jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(seed), step))

        drawn_B = draw_rows(weights, jax.vmap(uniform)(seed_B, step_B))
        tokens_B = jnp.where(temperature_B == 0.0, greedy_B, drawn_B)
    padded = jnp.pad(tokens_B, (0, max(width - tokens_B.shape[0], 0)))
    if not logprobs:
        return padded, None
    logp_BV = jax.nn.log_softmax(logits_BV, axis=-1)
    chosen_B = jnp.take_along_axis(logp_BV, tokens_B[:, None], axis=-1)[:, 0]
    top_vals, top_ids = jax.lax.top_k(logp_BV, NUM_LOGPROBS)
    return padded, (chosen_B, top_ids.astype(jnp.int32), top_vals)
