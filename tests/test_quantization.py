"""The weight-only int8 base (EngineConfig.quantization="int8", multilora.model.projections):
the quantization's error bound, its logits against the float32 model's on tiny checkpoints,
and its agreement with the float32 path on the embedded SmolLM2 (teacher-forced greedy tokens
over a text, and a tolerance on the logits), the engine serving it with an adapter, and the
options refused.

Stated agreement (the embedded model, this text): top-1 tokens agree on at least 95 % of
positions, and logits differ by at most 4 % of the float32 logits' range (measured on this
text: 97.8 % and 2.7 % with per-column scales, XLA's "int8"; 97.8 % and 2.2 % group-wise,
multilora's "int8-packed", the CPU's default where its kernels run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multilora import kernels
from multilora.config import EngineConfig
from multilora.engine.batching import SeqChunk, build_batch
from multilora.model import projections
from multilora.model.llama import forward, init_kv_cache
from multilora.model.loader import load_weights

TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is "
        "the capital of Germany. One, two, three, four, five, six, seven, eight, nine, ten.")


def test_quantize_int8_keeps_each_weight_within_half_a_step():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 48, 40)).astype(np.float32) * rng.uniform(0.01, 3.0, (1, 1, 40)).astype(np.float32)
    w[1, :, 7] = 0.0                                        # an all-zero column
    qw = projections.quantize_int8(jnp.asarray(w))
    q, scale = np.asarray(qw.q_LKN), np.asarray(qw.scale_LN)
    assert q.dtype == np.int8 and scale.shape == (2, 40) and np.abs(q).max() == 127
    np.testing.assert_allclose(scale[0], np.abs(w[0]).max(axis=0) / 127, rtol=1e-6)
    assert scale[1, 7] == 1.0 and (q[1, :, 7] == 0).all()
    err = np.abs(w - q.astype(np.float32) * scale[:, None, :])
    assert (err <= scale[:, None, :] / 2 * (1 + 1e-5)).all()
    x = rng.standard_normal((5, 48)).astype(np.float32)
    one = projections.QuantInt8(qw.q_LKN[0], qw.scale_LN[0])
    np.testing.assert_allclose(np.asarray(one.matmul(jnp.asarray(x))), x @ (q[0] * scale[0]), rtol=1e-5, atol=1e-5)


def _all_logits(cfg, weights, ids: list[int]) -> np.ndarray:
    t = 1 << (len(ids) - 1).bit_length()
    pages = list(range(1, 1 + -(-len(ids) // 16)))
    batch = build_batch([SeqChunk(ids, 0, pages, 0)], num_tokens=t, num_pages=max(4, len(pages)),
                        num_logits=t, page_size=16, all_logits=True)
    kv = init_kv_cache(cfg, len(pages) + 1, 16, jnp.float32)
    logits, _ = jax.jit(forward, static_argnames="cfg")(weights, None, kv, batch, cfg=cfg)
    return np.asarray(logits)[:len(ids)]


# the int8 modes: per-column scales through XLA (an accelerator's), and where multilora's kernels
# run, group-wise (Q8_0) packed for gemm_q8
MODES = ["int8"] + (["int8-packed"] if kernels.q8_gemm_available() else [])
needs_q8 = pytest.mark.skipif(not kernels.q8_gemm_available(), reason="gemm_q8 needs the CPU kernels with AVX2 + FMA")


@needs_q8
@pytest.mark.parametrize("t,k,n", [(1, 64, 32), (2, 70, 50), (3, 96, 17), (7, 576, 192), (13, 300, 40)])
def test_gemm_q8_is_the_product_with_the_dequantized_weights(t, k, n):
    """gemm_q8 against a plain product with q * s (kernels.dequantize_q8), K and N not whole
    blocks, rows past `rows` zeros and the live rows' bits unchanged by them; every weight within
    half its group's step of the float one."""
    rng = np.random.default_rng(t * k + n)
    w = rng.standard_normal((2, k, n)).astype(np.float32) * rng.uniform(0.01, 3.0, (1, 1, n)).astype(np.float32)
    w[1, :32, 3 % n] = 0.0                                   # an all-zero group
    q, s = kernels.quantize_q8(jnp.asarray(w))
    deq = np.asarray(kernels.dequantize_q8(q, s))[:, :k]
    assert np.all(np.abs(deq - w) <= np.repeat(np.asarray(s), 32, axis=1)[:, :k] / 2 * (1 + 1e-5))
    assert np.asarray(s)[1, 0, 3 % n] == 1.0
    qp, sp = kernels.pack_q8(q, s)
    x = rng.standard_normal((t, k)).astype(np.float32)
    y = np.asarray(kernels.gemm_q8(jnp.asarray(x), qp, sp, 1, n))
    np.testing.assert_allclose(y, x @ deq[1], rtol=1e-5, atol=1e-5 * np.abs(x @ deq[1]).max())
    part = np.asarray(kernels.gemm_q8(jnp.asarray(x), qp, sp, 1, n, rows=t // 2))
    assert (part[t // 2:] == 0).all() and np.array_equal(part[:t // 2], y[:t // 2])
    with pytest.raises(Exception, match="operand shapes disagree"):
        jax.block_until_ready(kernels.gemm_q8(jnp.asarray(x), qp, sp[:, :, :1], 0, n))  # one group short


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_int8_logits_follow_float32_on_tiny_models(tiny_models, kind, mode):
    cfg, weights = load_weights(tiny_models[kind])
    q = projections.convert(weights, mode)
    kind_of = projections.QuantInt8 if mode == "int8" else projections.PackedQ8
    assert isinstance(q.layers.wq_LDO, kind_of) and q.layers.wq_LDO.__dict__[
        "q_LKN" if mode == "int8" else "q_LJKC"].dtype == jnp.int8
    assert q.embed_VD.dtype == jnp.float32  # the embedding keeps its dtype (the head too, but packed)
    ids = list(np.random.default_rng(1).integers(3, cfg.vocab_size, 40))
    want, got = _all_logits(cfg, weights, ids), _all_logits(cfg, q, ids)
    span = want.max() - want.min()
    assert np.abs(got - want).max() <= 0.03 * span
    assert 0 < np.abs(got - want).max()  # quantized for real


@pytest.mark.parametrize("mode", MODES)
def test_int8_agrees_with_float32_on_the_embedded_model(mode):
    from transformers import AutoTokenizer

    from multilora import default_model
    model_dir = default_model.default_model_dir()
    ids = AutoTokenizer.from_pretrained(model_dir)(TEXT).input_ids
    cfg, weights = load_weights(model_dir)
    want = _all_logits(cfg, weights, ids)
    got = _all_logits(cfg, projections.convert(weights, mode), ids)
    agree = float(np.mean(want.argmax(-1) == got.argmax(-1)))
    assert agree >= 0.95, f"top-1 agreement {agree:.3f}"
    assert np.abs(got - want).max() <= 0.04 * (want.max() - want.min())
    print(f"{mode}: top-1 agreement {agree:.3f}, max |logit delta| {np.abs(got - want).max() / (want.max() - want.min()):.4f} of the range")


def test_engine_serves_an_int8_base_with_adapters(tiny_models, tiny_adapters):
    from multilora import Engine, SamplingParams
    eng = Engine(str(tiny_models["llama"]), {"a": str(tiny_adapters[("llama", "a_all_r8")])}, quantization="int8",
                 max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, num_pages=32, max_loras_per_batch=2,
                 warmup=False)
    assert eng.projection_mode == MODES[-1] == eng.precision.projections
    outs = eng.generate([[5, 6, 7, 8], [5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0),
                        lora=[None, "a"])
    assert all(len(o.token_ids) == 6 for o in outs)
    assert outs[0].token_ids != outs[1].token_ids  # the adapter changes the answer


def test_int8_options_refused_clearly():
    with pytest.raises(ValueError, match="quantization must be None or 'int8'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="leave projection_dtype auto"):
        EngineConfig(quantization="int8", projection_dtype="bfloat16")
