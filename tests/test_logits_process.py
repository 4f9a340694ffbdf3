"""The logits processor (logit_bias, min_tokens' stop masks, repetition / frequency / presence
penalties) against a numpy reference of OpenAI's and vLLM's definitions, on random rows."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from multilora.engine.logits_process import process_logits
from multilora.engine.request import SamplingParams


def np_process(logits, token_ids, num_prompt, bias, presence, frequency, repetition):
    """One row, the definition: bias added; then every token seen (prompt or output) has its
    logit divided by `repetition` if positive, else multiplied; then minus frequency x (times
    output) and minus presence if output at least once."""
    out = logits.astype(np.float64).copy()
    for tok, b in bias:
        out[tok] += b
    seen = set(token_ids)
    for tok in seen:
        out[tok] = out[tok] / repetition if out[tok] > 0 else out[tok] * repetition
    counts = np.bincount(np.asarray(token_ids[num_prompt:], np.int64), minlength=len(out))
    return out - frequency * counts - presence * (counts > 0)


@pytest.mark.parametrize("seed", range(4))
def test_matches_the_numpy_definition_row_by_row(seed):
    rng = np.random.default_rng(seed)
    q, v, h, k = 6, 97, 32, 8
    logits = rng.standard_normal((q, v)).astype(np.float32) * 3
    hist = np.full((q, h), v, np.int32)
    is_out = np.zeros((q, h), np.float32)
    bias_ids = np.full((q, k), v, np.int32)
    bias = np.zeros((q, k), np.float32)
    presence, frequency = rng.uniform(-2, 2, q).astype(np.float32), rng.uniform(-2, 2, q).astype(np.float32)
    repetition = rng.uniform(0.5, 2.0, q).astype(np.float32)
    presence[0] = frequency[0] = 0.0
    repetition[0] = 1.0  # row 0: neutral, must come out unchanged
    want = []
    for i in range(q):
        n = int(rng.integers(1, h + 1))
        p = int(rng.integers(0, n + 1))
        ids = rng.integers(0, 12, n).astype(np.int32)  # a small id range: repeats are certain
        hist[i, :n], is_out[i, p:n] = ids, 1.0
        nb = int(rng.integers(0, k + 1))
        toks = rng.choice(v, nb, replace=False).astype(np.int32)
        vals = rng.uniform(-100, 100, nb).astype(np.float32)
        bias_ids[i, :nb], bias[i, :nb] = toks, vals
        if i == 0:
            bias_ids[i], bias[i] = v, 0.0
            want.append(logits[0].astype(np.float64))
            continue
        want.append(np_process(logits[i], ids.tolist(), p, list(zip(toks.tolist(), vals.tolist())),
                               presence[i], frequency[i], repetition[i]))
    got = np.asarray(jax.jit(process_logits)(logits, hist, is_out, bias_ids, bias, presence, frequency, repetition))
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-4)
    assert np.array_equal(got[0], logits[0])


def test_minus_infinity_bias_masks_a_token():
    logits = np.zeros((1, 8), np.float32)
    got = np.asarray(jax.jit(process_logits)(logits, np.full((1, 4), 8, np.int32), np.zeros((1, 4), np.float32),
                                    np.array([[2, 5, 8, 8]], np.int32), np.array([[-np.inf, -np.inf, 0, 0]], np.float32),
                                    np.zeros(1, np.float32), np.zeros(1, np.float32), np.full(1, 1.3, np.float32)))
    assert np.isneginf(got[0, [2, 5]]).all() and np.isfinite(np.delete(got[0], [2, 5])).all()


@pytest.mark.parametrize("kw, field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
    (dict(min_tokens=17), "min_tokens"),
])
def test_out_of_range_values_are_refused_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **kw)
