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
