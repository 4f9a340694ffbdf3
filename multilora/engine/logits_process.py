"""Per-row logits processing on the device, before sampling: logit_bias (min_tokens rides on it
as -inf on the stop tokens), then repetition, frequency and presence penalties, in vLLM's order.

    logits = process_logits(logits_QV, hist_QH, is_output_QH, bias_ids_QK, bias_QK,
                            presence_Q, frequency_Q, repetition_Q)

hist_QH holds each row's prompt and output token ids (padding: V, dropped), is_output_QH marks
the output ones: presence and frequency penalties count output tokens only (OpenAI's and vLLM's
definition), the repetition penalty every token seen (prompt included, as in transformers and
vLLM: a positive logit is divided by it, a negative one multiplied). Rows with neutral values
come out unchanged. A pure function; the runner jits it for the rows that need it, shapes
bucketed (see runner.history_buckets). Legend: Q rows, V vocab, H history tokens, K bias entries.
"""

from __future__ import annotations

import jax.numpy as jnp

MAX_BIAS_ENTRIES = 512  # logit_bias entries per row (OpenAI allows 300), plus min_tokens' stop ids


def process_logits(logits_QV, hist_QH, is_output_QH, bias_ids_QK, bias_QK, presence_Q, frequency_Q,
                   repetition_Q):
    q, v = logits_QV.shape
    rows_Q1 = jnp.arange(q)[:, None]
    logits_QV = logits_QV.at[rows_Q1, bias_ids_QK].add(bias_QK, mode="drop")
    out_counts_QV = jnp.zeros((q, v), jnp.float32).at[rows_Q1, hist_QH].add(is_output_QH, mode="drop")
    seen_QV = jnp.zeros((q, v), jnp.bool_).at[rows_Q1, hist_QH].set(True, mode="drop")
    rep_Q1 = repetition_Q[:, None]
    logits_QV = jnp.where(seen_QV, jnp.where(logits_QV > 0, logits_QV / rep_Q1, logits_QV * rep_Q1), logits_QV)
    logits_QV = logits_QV - frequency_Q[:, None] * out_counts_QV
    return logits_QV - presence_Q[:, None] * (out_counts_QV > 0)


def apply_token_bitmask(logits_QV, bitmask_QW):
    """Structured output: a token whose bit is 0 in its row's mask gets -inf (bit t of word
    t // 32; multilora.engine.structured builds the masks). Rows of all ones pass unchanged."""
    v = logits_QV.shape[-1]
    ids_V = jnp.arange(v)
    bits_QV = (bitmask_QW[:, ids_V // 32] >> (ids_V % 32)) & 1
    return jnp.where(bits_QV != 0, logits_QV, -jnp.inf)
