"""sampler.sample against numpy: greedy, top-k, top-p (kept sets and the empirical distribution),
per-request seeds independent of the batch, and logprobs."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from multilora.engine.sampler import NUM_LOGPROBS, sample

SAMPLE = jax.jit(sample, static_argnames=("mode", "logprobs"))


def run(logits, temperature=1.0, top_k=-1, top_p=1.0, seed=0, step=0, mode="sample", logprobs=False):
    b = logits.shape[0]

    def col(v, dtype):
        return np.broadcast_to(np.asarray(v, dtype), (b,)).copy()

    tokens, lp = SAMPLE(np.asarray(logits, np.float32), col(temperature, np.float32), col(top_k, np.int32),
                        col(top_p, np.float32), col(seed, np.uint32), col(step, np.int32),
                        mode=mode, logprobs=logprobs)
    return np.asarray(tokens), (None if lp is None else tuple(np.asarray(a) for a in lp))


def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def np_kept(logits_v, temperature, top_k=-1, top_p=1.0):
    """Tokens a top-k / top-p sampler may draw, vLLM's order: keep the top_k most probable,
    renormalise, then keep the smallest most-probable prefix whose mass reaches top_p."""
    probs = np_softmax(logits_v / temperature)
    order = np.argsort(-probs, kind="stable")
    if top_k > 0:
        order = order[:top_k]
    p = probs[order] / probs[order].sum()
    cum_before = np.cumsum(p) - p
    return set(order[cum_before < top_p].tolist())


@pytest.fixture(scope="module")
def logits():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((64, 32)) * 3).astype(np.float32)


def test_greedy_is_argmax(logits):
    want = logits.argmax(-1)
    tokens, _ = run(logits, mode="greedy", temperature=0.0)
    np.testing.assert_array_equal(tokens, want)
    # in sample mode, temperature-0 rows still take the argmax, beside sampled rows
    temp = np.where(np.arange(64) % 2 == 0, 0.0, 1.0)
    tokens, _ = run(logits, temperature=temp, seed=np.arange(64))
    np.testing.assert_array_equal(tokens[::2], want[::2])


def test_top_k_1_is_argmax(logits):
    for seed in range(3):
        tokens, _ = run(logits, temperature=1.5, top_k=1, seed=np.arange(64) + 100 * seed)
        np.testing.assert_array_equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 0.5), (0.7, -1, 0.9), (2.0, -1, 0.3),
                                                     (1.0, 5, 1.0), (1.3, 4, 0.8)])
def test_draws_lie_in_the_kept_set(temperature, top_k, top_p):
    rng = np.random.default_rng(1)
    v = 32
    row = (rng.standard_normal(v) * 2).astype(np.float32)
    n = 1024
    tokens, _ = run(np.tile(row, (n, 1)), temperature=temperature, top_k=top_k, top_p=top_p,
                    seed=np.arange(n), step=3)
    kept = np_kept(row, temperature, top_k, top_p)
    drawn = set(tokens.tolist())
    assert drawn <= kept, f"drew {sorted(drawn - kept)} outside the kept set {sorted(kept)}"
    # and the filter is not too strict: every kept token with real mass shows up
    probs = np_softmax(row / temperature)
    likely = {t for t in kept if probs[t] / probs[list(kept)].sum() > 0.02}
    assert likely <= drawn


def test_empirical_distribution_matches_numpy():
    logits_v = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -3.0], np.float32)
    temperature, top_p = 0.8, 0.9
    n = 8192
    tokens, _ = run(np.tile(logits_v, (n, 1)), temperature=temperature, top_p=top_p,
                    seed=np.arange(n) * 7 + 1, step=0)
    kept = sorted(np_kept(logits_v, temperature, top_p=top_p))
    probs = np_softmax(logits_v / temperature)
    want = np.zeros_like(probs)
    want[kept] = probs[kept] / probs[kept].sum()
    got = np.bincount(tokens, minlength=len(logits_v)) / n
    np.testing.assert_allclose(got, want, atol=0.03)
    # without filtering: plain tempered softmax
    tokens, _ = run(np.tile(logits_v, (n, 1)), temperature=1.5, seed=np.arange(n) + 5, step=2)
    got = np.bincount(tokens, minlength=len(logits_v)) / n
    np.testing.assert_allclose(got, np_softmax(logits_v / 1.5), atol=0.03)


def test_same_seed_and_step_give_the_same_token_whatever_the_batch():
    rng = np.random.default_rng(2)
    v = 32
    mine = (rng.standard_normal(v)).astype(np.float32)
    results = []
    for trial in range(4):
        b = 64
        others = (rng.standard_normal((b, v)) * 3).astype(np.float32)
        pos = int(rng.integers(0, b))
        others[pos] = mine
        seeds = rng.integers(0, 2**31, b)
        steps = rng.integers(0, 50, b)
        temps = rng.uniform(0.0, 2.0, b)
        seeds[pos], steps[pos], temps[pos] = 123, 7, 1.0
        tokens, _ = run(others, temperature=temps, seed=seeds, step=steps)
        results.append(int(tokens[pos]))
    assert len(set(results)) == 1
    # the step moves the key: over many steps a flat distribution gives several different tokens
    flat = np.zeros((64, v), np.float32)
    tokens, _ = run(flat, temperature=1.0, seed=123, step=np.arange(64))
    assert len(set(tokens.tolist())) > 10
    tokens2, _ = run(flat, temperature=1.0, seed=123, step=np.arange(64))
    np.testing.assert_array_equal(tokens, tokens2)
    tokens3, _ = run(flat, temperature=1.0, seed=124, step=np.arange(64))
    assert (tokens3 != tokens).any()


@pytest.mark.parametrize("mode", ["greedy", "sample"])
def test_logprobs_match_log_softmax(logits, mode):
    tokens, (chosen, top_ids, top_vals) = run(logits, temperature=0.0 if mode == "greedy" else 0.9,
                                              seed=np.arange(64), mode=mode, logprobs=True)
    x = logits.astype(np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    np.testing.assert_allclose(chosen, logp[np.arange(64), tokens], rtol=1e-5, atol=1e-5)
    assert top_ids.shape == top_vals.shape == (64, NUM_LOGPROBS)
    want_ids = np.argsort(-logp, axis=-1, kind="stable")[:, :NUM_LOGPROBS]
    np.testing.assert_array_equal(top_ids, want_ids)
    np.testing.assert_allclose(top_vals, np.take_along_axis(logp, want_ids, -1), rtol=1e-5, atol=1e-5)
    assert (np.diff(top_vals, axis=-1) <= 0).all()
