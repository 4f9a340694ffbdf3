"""The projection matrices in bfloat16 (multilora.model.projections): the packed GEMM's tile
layout, the kernel against a plain-jnp bfloat16 product, and how projection_dtype resolves.
Whole-model parity in bfloat16 against PEFT: tests/test_model_parity.py::test_bf16_projections_*."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from multilora import kernels
from multilora.config import EngineConfig
from multilora.model import projections

ISAS = kernels.bf16_gemm_isas()     # what the packed GEMM runs here: amx, avx512-bf16, avx2, none
PACKED = bool(ISAS)
needs_packed = pytest.mark.skipif(not PACKED, reason="multilora's bf16 GEMM does not run here (no AMX-BF16, "
                                                     "AVX512-BF16 or AVX2 + FMA, or the kernels are not built)")


def _unpack(w_LJIRC, k, n):
    """The (L, K, N) matrices back from pack_bf16's layout, by its definition, element by element."""
    w = np.asarray(w_LJIRC.astype(jnp.float32))
    L, J, I = w.shape[:3]
    out = np.zeros((L, I * 32, J * 16), np.float32)
    for j in range(J):
        for i in range(I):
            for r in range(16):
                for c in range(16):
                    for e in range(2):
                        out[:, 32 * i + 2 * r + e, 16 * j + c] = w[:, j, i, r, 2 * c + e]
    assert not out[:, k:, :].any() and not out[:, :, n:].any(), "padding past K or N must be zeros"
    return out[:, :k, :n]


@pytest.mark.parametrize("k,n", [(64, 96), (48, 24), (100, 70)])
def test_pack_bf16_layout(k, n):
    w = jnp.asarray(np.random.default_rng(k).standard_normal((2, k, n)), jnp.float32)
    packed = kernels.pack_bf16(w)
    assert packed.dtype == jnp.bfloat16
    assert packed.shape == (2, 2 * -(-n // 32), -(-k // 32), 16, 32)
    np.testing.assert_array_equal(_unpack(packed, k, n), np.asarray(w.astype(jnp.bfloat16).astype(jnp.float32)))


@needs_packed
@pytest.mark.parametrize("isa", [i for i in ISAS if i != "avx2"])
@pytest.mark.parametrize("t,k,n", [(1, 64, 96), (17, 48, 24), (40, 100, 70), (64, 576, 192), (70, 128, 544),
                                   (7, 32, 64), (13, 96, 160)])
def test_gemm_bf16_matches_jnp(t, k, n, isa):
    """x rounded to bfloat16 times layer l of the stack, float32 sums: the same as jnp's bf16 dot
    (up to the order of the float32 sums), for every layer, shapes off the tile sizes included."""
    rng = np.random.default_rng(t + k + n)
    w = jnp.asarray(rng.standard_normal((3, k, n)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)
    packed = kernels.pack_bf16(w)
    run = jax.jit(lambda x, p, l: kernels.gemm_bf16(x, p, l, n, isa))
    for layer in range(3):
        got = np.asarray(run(x, packed, jnp.int32(layer)))
        want = np.asarray(jnp.dot(x.astype(jnp.bfloat16), w[layer].astype(jnp.bfloat16),
                                  preferred_element_type=jnp.float32))
        assert got.shape == (t, n)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * np.abs(want).max())
    # the float32 product differs by bfloat16's rounding: the kernel did not run in float32
    f32 = np.asarray(jnp.dot(x, w[2]))
    assert np.abs(got - f32).max() > 1e-4 * np.abs(f32).max()


@pytest.mark.skipif("avx2" not in ISAS, reason="multilora's bf16 GEMM has no AVX2 + FMA path here")
@pytest.mark.parametrize("t,k,n", [(1, 64, 96), (17, 48, 24), (40, 100, 70), (64, 576, 192), (70, 128, 544),
                                   (7, 33, 64), (13, 96, 160), (6, 600, 16), (12, 1536, 40)])
def test_gemm_bf16_avx2_is_the_float32_product_on_bf16_rounded_weights(t, k, n):
    """The AVX2 + FMA path (what a CPU without AVX512-BF16 runs, forced here by its isa): x stays
    float32 and the packed bfloat16 weights are widened exactly, so the result is numpy's float32
    product of x and the bf16-rounded weights, computed in float64 here, within float32
    summation error (2^-20 of sum |x w| per element). Shapes off the tiles (5 rows, 16 columns,
    odd K, K past one pass of 256 rows), every layer of the stack."""
    rng = np.random.default_rng(t * k + n)
    w = jnp.asarray(rng.standard_normal((3, k, n)), jnp.float32)
    x = rng.standard_normal((t, k)).astype(np.float32)
    packed = kernels.pack_bf16(w)
    w_bf16 = np.asarray(w.astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    run = jax.jit(lambda x, p, l: kernels.gemm_bf16(x, p, l, n, "avx2"))
    for layer in range(3):
        got = np.asarray(run(x, packed, jnp.int32(layer)))
        want = x.astype(np.float64) @ w_bf16[layer]
        bound = 2.0 ** -20 * (np.abs(x).astype(np.float64) @ np.abs(w_bf16[layer]))
        assert got.shape == (t, n) and got.dtype == np.float32
        assert (np.abs(got - want) <= bound).all(), f"layer {layer}: max excess {np.max(np.abs(got - want) - bound)}"
    # x was not rounded to bfloat16 (the AVX512-BF16 path's numbers are further off)
    bf16_x = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64) @ w_bf16[2]
    assert np.abs(bf16_x - want).max() > 100 * np.abs(got - want).max()


@needs_packed
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("t,k,n", [(64, 576, 192), (40, 100, 70), (33, 64, 96)])
def test_gemm_bf16_leaves_the_padding_rows_out(t, k, n, isa):
    """rows=r (traced): x's rows from r on are a bucket's padding. Rows before r are the same
    bits as the whole product's (whatever the rows after them hold), rows from r on are zeros
    (even where x holds NaN there); r past T or below 0 clamps to T or 0."""
    rng = np.random.default_rng(t + n)
    packed = kernels.pack_bf16(jnp.asarray(rng.standard_normal((2, k, n)), jnp.float32))
    x = rng.standard_normal((t, k)).astype(np.float32)
    run = jax.jit(lambda x, l, r: kernels.gemm_bf16(x, packed, l, n, isa, r))
    full = np.asarray(kernels.gemm_bf16(x, packed, jnp.int32(1), n, isa))
    for r in (0, 1, 5, t // 2 + 3, t - 1):
        x_pad = x.copy()
        x_pad[r:] = np.nan
        got = np.asarray(run(x_pad, jnp.int32(1), jnp.int32(r)))
        np.testing.assert_array_equal(got[:r], full[:r])
        assert not got[r:].any(), f"rows from {r} on must be zeros"
    np.testing.assert_array_equal(np.asarray(run(x, jnp.int32(1), jnp.int32(t + 7))), full)
    assert not np.asarray(run(x, jnp.int32(1), jnp.int32(-3))).any()


@needs_packed
@pytest.mark.parametrize("isa", ISAS)
def test_gemm_bf16_rejects_mismatched_shapes(isa):
    packed = kernels.pack_bf16(jnp.ones((1, 64, 32), jnp.float32))
    with pytest.raises(Exception, match="operand shapes disagree"):
        jax.block_until_ready(kernels.gemm_bf16(jnp.ones((4, 96), jnp.float32), packed, jnp.int32(0), 32, isa))


def test_gemm_bf16_refuses_an_unknown_isa():
    packed = kernels.pack_bf16(jnp.ones((1, 64, 32), jnp.float32))
    with pytest.raises(ValueError, match="gemm_bf16 runs on one of avx2, avx512-bf16, amx, not 'sse4'"):
        kernels.gemm_bf16(jnp.ones((4, 64), jnp.float32), packed, jnp.int32(0), 32, "sse4")


@pytest.mark.skipif(kernels.bf16_gemm_isa() != "avx512-bf16", reason="a CPU with AVX512-BF16 and no AMX")
def test_gemm_bf16_without_amx_says_so():
    packed = kernels.pack_bf16(jnp.ones((1, 64, 32), jnp.float32))
    with pytest.raises(Exception, match="multilora gemm bf16: built without AMX-BF16"):
        jax.block_until_ready(kernels.gemm_bf16(jnp.ones((4, 64), jnp.float32), packed, jnp.int32(0), 32, "amx"))


def test_resolve(monkeypatch):
    like = jnp.zeros(4)
    monkeypatch.delenv(projections.AUTO_ENV, raising=False)
    assert projections.resolve("float32", jnp.float32, like) == "float32"
    assert projections.resolve("bfloat16", jnp.float32, like) == ("bfloat16-packed" if PACKED else "bfloat16")
    auto_bf16 = kernels.bf16_gemm_isa() in projections.AUTO_BF16_ISAS
    assert projections.resolve("auto", jnp.float32, like) == ("bfloat16-packed" if auto_bf16 else "float32")
    assert projections.resolve("auto", jnp.bfloat16, like) == ("bfloat16-packed" if PACKED else "bfloat16")
    # an explicit dtype is what projection_dtype auto means, whatever the CPU
    assert projections.resolve("auto", jnp.float32, like, implied="float32") == "float32"
    assert projections.resolve("auto", jnp.bfloat16, like, implied="bfloat16") == (
        "bfloat16-packed" if PACKED else "bfloat16")
    assert projections.resolve("auto", jnp.float16, like, implied="float16") == "float16"
    assert projections.resolve("bfloat16", jnp.float32, like, implied="float32") != "float32"  # the expert's knob
    monkeypatch.setenv(projections.AUTO_ENV, "float32")
    assert projections.resolve("auto", jnp.float32, like) == "float32"
    assert projections.resolve("bfloat16", jnp.float32, like) != "float32"  # the env var sets auto only
    monkeypatch.setenv(projections.AUTO_ENV, "bfloat16")
    assert projections.resolve("auto", jnp.float32, like, implied="float32") == "float32"  # and not an explicit dtype
    monkeypatch.setenv(projections.AUTO_ENV, "int8")
    with pytest.raises(ValueError, match="MULTILORA_PROJECTION_DTYPE='int8': choose one of float32, bfloat16"):
        projections.resolve("auto", jnp.float32, like)
    with pytest.raises(ValueError, match="unknown projection_dtype 'fp8'; choose one of auto, float32, bfloat16"):
        projections.resolve("fp8", jnp.float32, like)
    with pytest.raises(ValueError, match="projection_dtype must be auto, float32 or bfloat16, got 'half'"):
        EngineConfig(projection_dtype="half")


def test_lora_pool_dtype_follows_packed_projections_else_the_engines_unless_given():
    assert projections.lora_pool_dtype("auto", jnp.float32) == jnp.float32  # see its docstring
    for isa in ("avx512-bf16", "amx"):
        assert projections.lora_pool_dtype("auto", jnp.float32, "bfloat16-packed", isa=isa) == jnp.bfloat16
        assert projections.lora_pool_dtype("auto", jnp.float32, "bfloat16-packed", "native", isa) == jnp.bfloat16
    # AVX2 widens bf16 rows slower than it reads float32 ones: float32 pools beside packed projections
    assert projections.lora_pool_dtype("auto", jnp.float32, "bfloat16-packed", isa="avx2") == jnp.float32
    here = jnp.bfloat16 if kernels.bf16_gemm_isa() in projections.AUTO_BF16_POOL_ISAS else jnp.float32
    assert projections.lora_pool_dtype("auto", jnp.float32, "bfloat16-packed") == here
    assert projections.lora_pool_dtype("auto", jnp.float32, "bfloat16-packed", "bgmv") == jnp.float32  # XLA reads
    assert projections.lora_pool_dtype("auto", jnp.float32, "bfloat16") == jnp.float32  # no in-place writer
    assert projections.lora_pool_dtype("auto", jnp.float32, "float32") == jnp.float32
    assert projections.lora_pool_dtype("float32", jnp.float32, "bfloat16-packed") == jnp.float32
    assert projections.lora_pool_dtype("auto", jnp.bfloat16) == jnp.bfloat16
    assert projections.lora_pool_dtype("auto", jnp.float16) == jnp.float16
    assert projections.lora_pool_dtype("float32", jnp.bfloat16) == jnp.float32
    assert projections.lora_pool_dtype("bfloat16", jnp.float32) == jnp.bfloat16
    with pytest.raises(ValueError, match="unknown lora_dtype 'int8'; choose one of auto, float32, bfloat16"):
        projections.lora_pool_dtype("int8", jnp.float32)
    with pytest.raises(ValueError, match="lora_dtype must be auto, float32 or bfloat16, got 'half'"):
        EngineConfig(lora_dtype="half")


@pytest.mark.skipif("avx2" not in ISAS, reason="multilora's bf16 GEMM has no AVX2 + FMA path here")
def test_resolve_on_the_avx2_path(monkeypatch):
    """Held to AVX2 + FMA ($MULTILORA_KERNEL_ISA, as on a CPU without AVX512-BF16): bfloat16
    projections are packed for the AVX2 kernel and auto takes them (AUTO_BF16_ISAS: measured
    faster than float32 there) unless MULTILORA_PROJECTION_DTYPE says float32; auto pools stay
    float32 beside them (AUTO_BF16_POOL_ISAS). An unknown ISA is an error naming the choices."""
    like = jnp.zeros(4)
    monkeypatch.delenv(projections.AUTO_ENV, raising=False)
    monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    assert kernels.bf16_gemm_isa() == "avx2" and kernels.bf16_gemm_isas() == ("avx2",)
    assert projections.resolve("bfloat16", jnp.float32, like) == "bfloat16-packed"
    assert projections.resolve("auto", jnp.float32, like) == "bfloat16-packed"
    assert projections.auto_dtype("avx2", jnp.float32) == "bfloat16"
    assert projections.auto_dtype("avx512-bf16", jnp.float32) == "bfloat16"
    assert projections.auto_dtype("", jnp.float32) == "float32"
    assert projections.lora_pool_dtype("auto", jnp.float32, "bfloat16-packed") == jnp.float32
    monkeypatch.setenv(projections.AUTO_ENV, "float32")
    assert projections.resolve("auto", jnp.float32, like) == "float32"
    monkeypatch.setenv(kernels.ISA_ENV, "sse4")
    with pytest.raises(ValueError, match="MULTILORA_KERNEL_ISA='sse4': choose one of avx2, avx512-bf16, amx"):
        projections.resolve("bfloat16", jnp.float32, like)


def test_describe_warns_about_half_precision_dtypes_on_the_cpu():
    """The engine's log line about its arithmetic: a warning that names the faster setting where
    the activations are bfloat16 or float16 on a CPU, plain information otherwise."""
    import logging

    from multilora.model.precision import Precision
    on_cpu = jnp.zeros((4, 4), jnp.float32)
    for dtype in ("bfloat16", "float16"):
        level, msg = projections.describe(Precision(dtype, dtype, "bfloat16", "float32", dtype), on_cpu)
        assert level == logging.WARNING
        assert f"{dtype} activations" in msg and "use dtype auto" in msg
    level, msg = projections.describe(Precision("auto", "float32", "bfloat16-packed", "float32", "bfloat16"), on_cpu)
    assert level == logging.INFO and msg == ("dtype auto: activations float32, projections bfloat16-packed, "
                                             "KV cache float32, adapter pool bfloat16")
