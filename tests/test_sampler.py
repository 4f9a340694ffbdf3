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
    assert_draws_in_kept_set(row, n, temperature, top_k, top_p, step=3)


def assert_draws_in_kept_set(row, n, temperature, top_k, top_p, step):
    """n draws of one row (n seeds) lie in numpy's kept set, and every kept token with real
    mass shows up (the filter is not too strict)."""
    tokens, _ = run(np.tile(row, (n, 1)), temperature=temperature, top_k=top_k, top_p=top_p,
                    seed=np.arange(n), step=step)
    kept = np_kept(row, temperature, top_k, top_p)
    drawn = set(tokens.tolist())
    assert drawn <= kept, f"drew {sorted(drawn - kept)} outside the kept set {sorted(kept)}"
    probs = np_softmax(row / temperature)
    likely = {t for t in kept if probs[t] / probs[list(kept)].sum() > 0.02}
    assert likely <= drawn
    return drawn, kept


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


# ---- a real vocabulary's width: the candidate path, its fallback to the sorted rows, the draw ----

from multilora.engine import sampler as S  # noqa: E402


def thresholds_sorted(scaled_BV, top_k_B, top_p_B):
    """The plain-jnp reference: each row sorted whole, top-k then top-p over the survivors."""
    import jax.numpy as jnp
    v = scaled_BV.shape[-1]
    sorted_desc = -jnp.sort(-scaled_BV, axis=-1)
    k_B = jnp.where((top_k_B > 0) & (top_k_B < v), top_k_B, v)
    kth_B = jnp.take_along_axis(sorted_desc, (k_B - 1)[:, None], axis=-1)[:, 0]
    in_top_k = jnp.arange(v)[None, :] < k_B[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs < top_p_B[:, None]) & in_top_k
    cutoff_B = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1)
    return jnp.where(top_p_B < 1.0, jnp.maximum(kth_B, cutoff_B), kth_B)


def test_argmax_rows_is_the_first_largest():
    rng = np.random.default_rng(3)
    x = rng.integers(0, 5, size=(16, 3000)).astype(np.float32)  # many ties for the max
    x[3, :] = -np.inf
    x[3, 17] = 0.0
    np.testing.assert_array_equal(np.asarray(jax.jit(S.argmax_rows)(x)), x.argmax(-1))


@pytest.mark.parametrize("v", [1000, 4096])
def test_candidate_thresholds_equal_the_sorted_ones_where_they_decide(v):
    rng = np.random.default_rng(v)
    b = 48
    scaled = (rng.standard_normal((b, v)) * rng.uniform(0.5, 6, (b, 1))).astype(np.float32)
    top_k = rng.choice([-1, 0, 1, 5, 50, S.CANDIDATES, S.CANDIDATES + 1, 700, v, v + 3], b).astype(np.int32)
    top_p = rng.choice([1.0, 0.99, 0.9, 0.5, 0.1], b).astype(np.float32)
    got, decided = jax.jit(S.thresholds_from_candidates)(scaled, top_k, top_p)
    want = np.asarray(jax.jit(thresholds_sorted)(scaled, top_k, top_p))
    got, decided = np.asarray(got), np.asarray(decided)
    assert decided.any() and not decided.all()  # both kinds of rows in this batch

    def kept(thr):  # what a threshold keeps (-inf and the row's minimum both keep every token)
        return scaled >= thr[:, None]
    np.testing.assert_array_equal(kept(got)[decided], kept(want)[decided])
    # top-k past the candidates is never decided by them; no cut at all always is
    k = np.where((top_k > 0) & (top_k < v), top_k, v)
    assert not decided[(k > S.CANDIDATES) & (k < v)].any()
    assert decided[(k == v) & (top_p >= 1.0)].all()
    # the search over whole rows keeps what the sorted rows keep, for every row; so do the
    # step's thresholds, whichever path ran
    searched = np.asarray(jax.jit(S.thresholds_searched)(scaled, top_k, top_p))
    np.testing.assert_array_equal(kept(searched), kept(want))
    np.testing.assert_array_equal(kept(np.asarray(jax.jit(S.thresholds)(scaled, top_k, top_p))), kept(want))
    # no row cuts: nothing is computed, nothing is cut
    none = np.asarray(jax.jit(S.thresholds)(scaled, np.full(b, -1, np.int32), np.ones(b, np.float32)))
    assert np.isneginf(none).all()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 0.9), (1.0, 400, 1.0), (0.8, 20, 0.7),
                                                     (1.0, -1, 1.0)])
def test_draws_lie_in_the_kept_set_of_a_wide_vocabulary(temperature, top_k, top_p):
    """A nearly flat row: top-p 0.9 keeps far more tokens than the candidates hold (the sorted
    fallback), top-k 400 too; top-k 20 with top-p 0.7 is decided by the candidates."""
    rng = np.random.default_rng(5)
    v = 3000
    row = (rng.standard_normal(v) * 0.3).astype(np.float32)
    n = 2048
    drawn, kept = assert_draws_in_kept_set(row, n, temperature, top_k, top_p, step=1)
    assert len(drawn) > min(len(kept), n) // 4  # spread over the kept set


def test_draw_rows_matches_the_weights():
    rng = np.random.default_rng(6)
    v = 700  # not a multiple of BLOCK: the last block is padded
    w = rng.uniform(0, 1, v).astype(np.float32) ** 4
    w[rng.choice(v, 300, replace=False)] = 0.0
    w[[0, 255, 256, 699]] = [0.0, 0.5, 0.0, 0.7]   # block edges
    n = 40000
    u = rng.uniform(0, 1, n).astype(np.float32)
    got = np.asarray(jax.jit(S.draw_rows)(np.tile(w, (n, 1)), u))
    assert (w[got] > 0).all(), "drew a token of weight zero"
    counts = np.bincount(got, minlength=v) / n
    np.testing.assert_allclose(counts, w / w.sum(), atol=4 * np.sqrt(w.max() / w.sum() / n))
    # u just below 1 and at 0: the last and the first token with weight
    edge = np.asarray(jax.jit(S.draw_rows)(np.tile(w, (2, 1)), np.array([0.0, np.nextafter(1, 0)], np.float32)))
    assert edge.tolist() == [int(np.flatnonzero(w)[0]), int(np.flatnonzero(w)[-1])]
