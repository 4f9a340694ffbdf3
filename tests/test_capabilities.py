"""What this machine can run, it runs: a capability whose tests would skip quietly (the native
kernels, the packed bf16 GEMM) fails here instead when the machine has what it needs. Other
tests skip, with the reason `-rs` prints, only where the machine lacks it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from multilora import kernels


def _native_disabled() -> bool:
    return os.environ.get(kernels.DISABLE_ENV, "1").lower() in ("0", "false", "no", "off")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_kernels_build_wherever_a_compiler_is():
    """The fallback is for machines without a compiler, not for a source that fails to build:
    one branch for CPUs without AMX once did not compile, and every kernel (attention, LoRA,
    bf16 GEMM) went unused there without a failing test."""
    if _native_disabled() or kernels.compiler() is None:
        pytest.skip("kernels disabled or no C++ compiler here")
    assert kernels.available(), kernels.unavailable_reason()


def test_the_packed_bf16_gemm_runs_wherever_the_cpu_has_bf16_instructions():
    """A CPU with AVX512-BF16 (or AMX-BF16, which comes with it) runs the packed GEMM: the bf16
    projections and their tests (test_projections.py) must not skip there."""
    flags = _cpu_flags()
    if not flags & {"avx512_bf16", "amx_bf16"}:
        pytest.skip("this CPU has neither AVX512-BF16 nor AMX-BF16")
    if _native_disabled() or kernels.compiler() is None:
        pytest.skip("kernels disabled or no C++ compiler here")
    assert kernels.bf16_gemm_isa() in ("avx512-bf16", "amx"), kernels.unavailable_reason()


def test_the_packed_bf16_gemm_runs_wherever_the_cpu_has_avx2_and_fma():
    """A CPU with AVX2 and FMA (every x86-64 server CPU of the last decade) runs the packed
    GEMM's AVX2 path at least: bfloat16 projections there must not fall back to XLA's bf16 dot."""
    flags = _cpu_flags()
    if not {"avx2", "fma"} <= flags:
        pytest.skip("this CPU lacks AVX2 or FMA")
    if _native_disabled() or kernels.compiler() is None:
        pytest.skip("kernels disabled or no C++ compiler here")
    assert "avx2" in kernels.built_isas() and kernels.bf16_gemm_isa(), kernels.unavailable_reason()


@pytest.mark.parametrize("flags,want", [
    ({"sse4_2", "avx"}, ""),
    ({"avx2"}, ""),                                                   # FMA too, or no path
    ({"avx2", "fma"}, "avx2"),                                        # AMD Zen 1-3, Intel Haswell on
    ({"avx2", "fma", "avx512f", "avx512bw"}, "avx2"),                 # Skylake-X: no bf16 dot products
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"}, "avx512-bf16"),   # Zen 4, Cooper Lake
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"}, "amx"),
])
def test_the_kernel_path_a_cpu_takes_by_its_flags(flags, want):
    """select_isa, what bf16_gemm_isa() asks of this CPU's flags: an AVX2 + FMA CPU without
    AVX512-BF16 takes the AVX2 path; a build without a path, or a cap, holds it lower."""
    assert kernels.select_isa(flags) == want
    full = set(kernels.ISA_CPU_FLAGS["amx"])
    assert kernels.select_isa(full, built=("avx2",)) == "avx2"
    assert kernels.select_isa(full, cap="avx2") == "avx2"
    assert kernels.select_isa(full, built=("avx2", "avx512-bf16"), cap="amx") == "avx512-bf16"
    with pytest.raises(ValueError, match="MULTILORA_KERNEL_ISA='avx3': choose one of avx2, avx512-bf16, amx"):
        kernels.select_isa(full, cap="avx3")


def test_an_avx2_only_build_runs_the_avx2_paths(tmp_path):
    """The kernels as a CPU without AVX-512 builds them (-march=x86-64-v3: AVX2 + FMA, no
    AVX512), run here: the build says it has the AVX2 path only, its GEMM is the float32 product
    on bf16-rounded weights, and its LoRA group call (16-lane vectors as two ymm halves there) on
    float32 and bfloat16 pools the float64 one on the pool's rows (within float32 summation
    error). Built at -O0 (seconds, not the real build's
    tens); registered under names of its own beside the native library's."""
    import ctypes
    import subprocess

    import jax
    import jax.numpy as jnp
    import numpy as np

    if _native_disabled() or kernels.compiler() is None or "avx2" not in _cpu_flags() or "fma" not in _cpu_flags():
        pytest.skip("kernels disabled, no C++ compiler, or no AVX2 + FMA here")
    so = tmp_path / "libavx2.so"
    flags = ["-O0", "-march=x86-64-v3", "-std=c++17", "-fPIC", "-w", f"-I{jax.ffi.include_dir()}",
             f"-I{kernels.HERE}"]
    sources = [str(kernels.HERE / n) for n in ("gemm_kernels.cc", "lora_kernels.cc")]
    done = subprocess.run([kernels.compiler(), *flags, "-shared", *sources, "-o", str(so)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lib = ctypes.cdll.LoadLibrary(str(so))
    assert lib.MultiloraKernelIsas() == 1                                  # avx2 alone
    for target, symbol in (("avx2_only_gemm_bf16", "MultiloraGemmBf16"), ("avx2_only_lora_apply", "MultiloraLoraApply")):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    rng = np.random.default_rng(3)
    t, k, n = 9, 77, 40
    w = rng.standard_normal((2, k, n)).astype(np.float32)
    x = rng.standard_normal((t, k)).astype(np.float32)
    w_bf16 = np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    got = jax.ffi.ffi_call("avx2_only_gemm_bf16", jax.ShapeDtypeStruct((t, n), jnp.float32))(
        x, kernels.pack_bf16(w), jnp.int32(1), jnp.int32(t), isa=np.int64(kernels.BF16_GEMM_ISAS.index("avx2")))
    want = x.astype(np.float64) @ w_bf16[1]
    assert (np.abs(np.asarray(got) - want) <= 2.0 ** -20 * (np.abs(x) @ np.abs(w_bf16[1]))).all()
    with pytest.raises(Exception, match="multilora gemm bf16: built without AVX512-BF16"):
        jax.block_until_ready(jax.ffi.ffi_call("avx2_only_gemm_bf16", jax.ShapeDtypeStruct((t, n), jnp.float32))(
            x, kernels.pack_bf16(w), jnp.int32(1), jnp.int32(t),
            isa=np.int64(kernels.BF16_GEMM_ISAS.index("avx512-bf16"))))
    # the group call, float32 and bf16 pools: slot 1 (rank 3, 6 tokens: items of 4 and 2) and slot
    # 2 (rank 1) over a pool of 5 rows, base rows between; D and O past whole vectors and blocks
    d, o = 72, 40
    a = rng.standard_normal((1, 5, d)).astype(np.float32)
    b = rng.standard_normal((1, 5, o)).astype(np.float32)
    rows_SR = np.array([[0, 0, 0, 0], [1, 2, 3, 0], [4, 0, 0, 0]], np.int32)
    ranks, scalings = np.array([0, 3, 1], np.int32), np.array([0.0, 0.5, 2.0], np.float32)
    slot_T = np.array([1, 0, 2, 1, 1, 2, 1, 0, 1, 1], np.int32)
    x = rng.standard_normal((len(slot_T), d)).astype(np.float32)
    for dtype in (jnp.float32, jnp.bfloat16):
        a_, b_ = (np.asarray(jnp.asarray(v).astype(dtype).astype(jnp.float32), np.float64) for v in (a, b))
        (y,) = jax.ffi.ffi_call("avx2_only_lora_apply", (jax.ShapeDtypeStruct((len(slot_T), o), jnp.float32),))(
            x, jnp.int32(0), slot_T, scalings, ranks, rows_SR, jnp.asarray(a).astype(dtype),
            jnp.asarray(b).astype(dtype), dot_bf16=np.int64(0))
        want = np.zeros((len(slot_T), o))
        for i, s in enumerate(slot_T):
            rows = rows_SR[s, :ranks[s]]
            want[i] = scalings[s] * (a_[0, rows] @ x[i].astype(np.float64)) @ b_[0, rows]
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=str(dtype))
