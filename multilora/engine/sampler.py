"""Token sampling on the device: greedy, temperature, top-k and top-p, with per-request seeds.

A request's random key is fold_in(PRNGKey(seed), number of tokens it has generated), so the same
seed gives the same tokens whatever else shares the batch. Pure functions; the runner jits them.
Legend: B rows, V vocab, K top-k candidates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NUM_LOGPROBS = 20  # top-n logprobs computed when any row asks (n <= 20, as OpenAI allows)


def _filtered_logits(logits_BV, temperature_B, top_k_B, top_p_B):
    v = logits_BV.shape[-1]
    scaled = logits_BV / jnp.maximum(temperature_B, 1e-6)[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, v), v)
    kth_B = jnp.take_along_axis(sorted_desc, (k_B - 1)[:, None], axis=-1)
    # top-p over the top-k survivors, renormalised (vLLM's order: top-k, then top-p)
    in_top_k = jnp.arange(v)[None, :] < k_B[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    # keep the smallest prefix whose mass reaches top_p (the top token always stays)
    keep_sorted = cum_before < top_p_B[:, None]
    cutoff_B = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(kth_B, cutoff_B)
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def sample(logits_BV, temperature_B, top_k_B, top_p_B, seed_B, step_B, *, mode: str,
           logprobs: bool):
    """mode "greedy": argmax for every row. mode "sample": temperature 0 rows still take the
    argmax; the others sample from their filtered, tempered distribution."""
    logits_BV = logits_BV.astype(jnp.float32)
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    if mode == "greedy":
        tokens_B = greedy_B
    else:
        masked = _filtered_logits(logits_BV, temperature_B, top_k_B, top_p_B)

        def draw(row_logits, seed, step):
            key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
            return jax.random.categorical(key, row_logits)

        drawn_B = jax.vmap(draw)(masked, seed_B, step_B).astype(jnp.int32)
        tokens_B = jnp.where(temperature_B == 0.0, greedy_B, drawn_B)
    if not logprobs:
        return tokens_B, None
    logp_BV = jax.nn.log_softmax(logits_BV, axis=-1)
    chosen_B = jnp.take_along_axis(logp_BV, tokens_B[:, None], axis=-1)[:, 0]
    top_vals, top_ids = jax.lax.top_k(logp_BV, NUM_LOGPROBS)
    return tokens_B, (chosen_B, top_ids.astype(jnp.int32), top_vals)
