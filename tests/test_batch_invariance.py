"""A token's numbers do not depend on the step that computes it: how many rows share the step,
whether its sequence has one token this step (decode) or several (a prefill chunk, a speculative
verify chunk). Speculative decoding checks drafts in such larger steps and must pick the decode
steps' greedy tokens; with bfloat16 projections a last-bit difference anywhere is rounded up to
a bfloat16 step now and then, and tens of layers later can flip a near-tied greedy token.

Piece by piece (the pieces of a CPU step that sum over something): RMSNorm's sum of squares
against XLA's row reduce at every row count, multilora's decode and prefill attention kernels
(one routine, a fixed grid of key chunks), the packed bf16 GEMM; (the LoRA kernels' group call:
test_backends). Then the whole forward at the CPU's bf16 projections on a tiny Llama with
adapters: a position's hidden states and logits are the same bits as a decode step alone (T=4),
beside other rows, as a verify chunk alone or beside other chunks and a prefill, and inside one
whole prefill. (That one guards the whole; at the tiny model's width the bf16 roundings hide the
old last-bit differences, which the piece tests and test_speculative's embedded-model test catch.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multilora import kernels
from multilora.engine.batching import SeqChunk, build_batch
from multilora.model import llama
from multilora.model.layers import rms_norm, row_sum
from tests import reference

NATIVE = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable")


@pytest.mark.parametrize("d", [576, 64, 48, 100, 2048])
def test_rms_norm_gives_a_row_the_same_bits_at_every_row_count(d):
    rng = np.random.default_rng(d)
    x = jnp.asarray(rng.standard_normal((64, d)).astype(np.float32) * 3)
    w = jnp.asarray(rng.standard_normal(d).astype(np.float32))
    norm = jax.jit(lambda x, w: rms_norm(x, w, 1e-6))
    full = np.asarray(norm(x, w))
    for t in (1, 2, 3, 4, 5, 7, 8, 16, 33):
        np.testing.assert_array_equal(np.asarray(norm(x[:t], w)), full[:t], err_msg=f"{t} rows")
    x64 = np.asarray(x, np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * np.asarray(w, np.float64)
    np.testing.assert_allclose(full, want, rtol=2e-6, atol=2e-6)
    # the sum itself, odd widths carried along
    np.testing.assert_allclose(np.asarray(row_sum(x))[:, 0], x64.sum(-1), rtol=1e-5, atol=1e-4)
    assert row_sum(x[:, :1]).shape == (64, 1)


def _q_for(seq: int, pos: int, n: int, h: int) -> np.ndarray:
    """The query of sequence seq's token at pos: the same vector in whichever step computes it."""
    return np.random.default_rng(1000 * seq + pos).standard_normal((n, h)).astype(np.float32)


@NATIVE
@pytest.mark.parametrize("page_size,window", [(16, None), (4, None), (16, 24), (8, 37)])
def test_native_decode_and_prefill_attention_agree_to_the_bit(page_size, window):
    """Each sequence's last token as a decode row (the decode kernel, rows beside it), and the same
    token as the last, the one before or the 16th before the last of a chunk of 2 to 40 tokens (the prefill
    kernel, in query blocks of 16, beside other chunks): the same bits. Positions below, at and
    past the kernels' 32-key chunks, hundreds of keys."""
    n, kvh, h = 9, 3, 64
    positions = [0, 5, 31, 32, 33, 77, 300]
    most_tail = 16
    rng = np.random.default_rng(page_size + (window or 0))
    need = [-(-(p + 1 + most_tail) // page_size) for p in positions]
    free = [int(x) for x in rng.permutation(np.arange(1, sum(need) + 3))]
    tables = [free[sum(need[:i]):sum(need[:i + 1])] for i in range(len(positions))]
    k = jnp.asarray(rng.standard_normal((2, sum(need) + 3, page_size, kvh, h)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal(k.shape).astype(np.float32))

    def run(kernel, chunks):
        """Each chunk's token ids are its sequence's index; its queries drawn by (sequence, position)."""
        b = build_batch(chunks, num_tokens=512, num_pages=160, num_logits=len(chunks), page_size=page_size)
        q = np.zeros((512, n, h), np.float32)
        t = 0
        for c in chunks:
            for j in range(len(c.token_ids)):
                q[t + j] = _q_for(c.token_ids[j], c.start_pos + j, n, h)
            t += len(c.token_ids)
        args = (jnp.asarray(q), k, v, 1, b.kv_pages_X, b.kv_page_seq_X)
        if kernel == "decode":
            return np.asarray(kernels.decode_attention(*args, b.positions_T, b.num_decode, window))
        return np.asarray(kernels.prefill_attention(*args, b.seq_idx_T, b.positions_T, window))

    want = run("decode", [SeqChunk([s], p, tables[s], 0) for s, p in enumerate(positions)])
    for length in (2, 5, 16, 17, 40):
        for tail in (0, 1, most_tail):  # the token is its chunk's last, or `tail` tokens before its end
            starts = [max(0, p + tail + 1 - length) for p in positions]
            chunks = [SeqChunk([s] * (p + tail + 1 - st), st, tables[s], 0)
                      for s, (p, st) in enumerate(zip(positions, starts)) if st <= p and p + tail > st]
            got = run("prefill", chunks)
            t = 0
            for c in chunks:
                s = c.token_ids[0]
                np.testing.assert_array_equal(got[t + positions[s] - c.start_pos], want[s],
                                              err_msg=f"sequence {s}, chunk of {length}, {tail} after")
                t += len(c.token_ids)


@pytest.mark.skipif(not kernels.bf16_gemm_isas(), reason="no bf16 GEMM kernel on this CPU")
@pytest.mark.parametrize("isa", kernels.bf16_gemm_isas())
def test_packed_bf16_gemm_gives_a_row_the_same_bits_at_every_row_count(isa):
    rng = np.random.default_rng(5)
    kd, nd = 576, 1536
    w = kernels.pack_bf16(jnp.asarray(rng.standard_normal((2, kd, nd)).astype(np.float32) * 0.05))
    x = jnp.asarray(rng.standard_normal((70, kd)).astype(np.float32))
    full = np.asarray(kernels.gemm_bf16(x, w, 1, nd, isa))
    for t in (1, 2, 5, 6, 7, 31, 32, 33):
        np.testing.assert_array_equal(np.asarray(kernels.gemm_bf16(x[:t], w, 1, nd, isa)), full[:t])


# --- the whole forward ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bf16_engine(tiny_models, tiny_adapters, tmp_path_factory):
    from multilora.engine.engine import Engine
    model_dir, dirs = reference.tokenized_llama(tiny_models, tiny_adapters, tmp_path_factory.mktemp("inv"),
                                                ("a_all_r8", "c_mlp_r16"))
    eng = Engine(str(model_dir), {k: str(v) for k, v in dirs.items()}, projection_dtype="bfloat16",
                 max_loras_per_batch=2, max_lora_rank=16, max_model_len=256, max_num_seqs=16,
                 max_num_batched_tokens=128, page_size=8, warmup=False)
    if eng.projection_mode != "bfloat16-packed" or not eng.runner.native_attention:
        pytest.skip(f"the CPU's bf16 path is not here (projections {eng.projection_mode}, native attention "
                    f"{eng.runner.native_attention})")
    eng.generate([[1, 2, 3]] * 2, None, lora=["a", "c"])  # both adapters into slots 1 and 2
    return eng


def test_a_positions_logits_are_the_same_bits_in_every_step_shape(bf16_engine):
    """Each of four sequences (base rows and two adapters) in turn: its next k positions' last
    hidden states and logits, computed k decode steps alone (T=4) and beside the other rows (T=8),
    as one verify chunk alone (T=16), beside a decode row and another chunk (T=32), beside a new
    prompt's prefill (T=128), and at the end of one whole prefill: the same bits every way."""
    eng = bf16_engine
    r, cfg, ps = eng.runner, eng.cfg, eng.runner.page_size
    step = jax.jit(lambda w, lo, kv, b, backend: llama.forward(w, lo, kv, b, cfg, backend=backend, hidden=True,
                                                               native_attention=r.native_attention),
                   static_argnames="backend")
    lora_w = r.lora.weights

    def run(kv, chunks, t, x, first, n, token=None):
        """(logits rows first..first+n-1, the hidden states of token rows token..token+n-1 (token:
        first where not given)), and the cache."""
        b = build_batch(chunks, num_tokens=t, num_pages=x, num_logits=r.buckets.logits_rows(t), page_size=ps,
                        prepare_lora=r.lora_batch_preparer(t))
        logits, kv, x_TD = step(r.weights, lora_w, kv, b, backend=r.backend_for(t))
        token = first if token is None else token
        return (np.asarray(logits)[first:first + n], np.asarray(x_TD)[token:token + n]), kv

    rng = np.random.default_rng(9)
    p, k, n = 45, 8, 4
    seqs = [rng.integers(1, 256, p + k).tolist() for _ in range(n)]
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(n)]
    slots = [1, 0, 2, 1]
    prompt = rng.integers(1, 256, 70).tolist()
    fresh = lambda: llama.init_kv_cache(cfg, 48, ps, jnp.float32)  # noqa: E731
    _, kv0 = run(fresh(), [SeqChunk(seqs[i][:p], 0, tables[i], slots[i]) for i in range(n)], 256, 32, 0, 0)
    copy = lambda: jax.tree.map(jnp.copy, kv0)  # noqa: E731
    stack = lambda rows: tuple(np.concatenate(part) for part in zip(*rows))  # noqa: E731
    for a in range(n):
        one = lambda j: SeqChunk([seqs[a][p + j]], p + j, tables[a], slots[a])  # noqa: E731
        verify = SeqChunk(seqs[a][p:p + k], p, tables[a], slots[a], num_logits=k)
        others = [i for i in range(n) if i != a]
        got = {}
        kv, rows = copy(), []
        for j in range(k):
            out, kv = run(kv, [one(j)], 4, 8, 0, 1)
            rows.append(out)
        got["decode alone"] = stack(rows)
        kv, rows = copy(), []
        for j in range(k):
            out, kv = run(kv, [one(j)] + [SeqChunk([seqs[i][p + j]], p + j, tables[i], slots[i]) for i in others],
                          8, 32, 0, 1)
            rows.append(out)
        got["decode beside 3 rows"] = stack(rows)
        got["verify alone"] = run(copy(), [verify], 16, 8, 0, k)[0]
        b, c = others[:2]
        mixed = [SeqChunk([seqs[b][p]], p, tables[b], slots[b]), verify,
                 SeqChunk(seqs[c][p:p + 3], p, tables[c], slots[c], num_logits=1)]
        got["verify beside a decode row and a chunk"] = run(copy(), mixed, 32, 32, 1, k)[0]
        beside = [SeqChunk([seqs[b][p]], p, tables[b], slots[b]), verify, SeqChunk(prompt, 0, list(range(33, 42)), 2)]
        got["verify beside a prefill"] = run(copy(), beside, 128, 32, 1, k)[0]
        got["one whole prefill"] = run(fresh(), [SeqChunk(seqs[a][:p + k], 0, tables[a], slots[a], num_logits=k)],
                                       64, 8, 0, k, token=p)[0]
        want_logits, want_hidden = got.pop("decode alone")
        assert np.isfinite(want_logits).all() and want_logits.std() > 0.1
        for name, (logits, hidden) in got.items():
            np.testing.assert_array_equal(hidden, want_hidden, err_msg=f"sequence {a}: {name}, hidden states")
            np.testing.assert_array_equal(logits, want_logits, err_msg=f"sequence {a}: {name}, logits")
