"""multilora's packed bfloat16 GEMM alone (multilora/kernels/gemm_kernels.cc), the way a decode
step calls it: T rows times one layer of an (L, K, N) stack read in place, the L layers in one
loop (each layer's weights streamed from memory, as in a step), on the best ISA this CPU has (or
--isa). Shapes are T x K -> N x L; the defaults are SmolLM2-135M's seven projections' four shapes
and its LM head at 64 rows. Prints the best of --repeats loops in GFLOP/s, beside XLA's own
float32 1024^3 matmul measured in the same process.

    python benchmarks/gemm_cpu.py                          # both cores, as a step runs
    python benchmarks/gemm_cpu.py --one-core               # one core, no thread pool: the kernel's own rate
    python benchmarks/gemm_cpu.py --shapes 64x576x1536x30 40x576x49152x1 --rows 40
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = ["64x576x576x30", "64x576x192x30", "64x576x1536x30", "64x1536x576x30", "64x576x49152x1"]
ONE_CORE_ENV = "MULTILORA_GEMM_CPU_ONE_CORE"


def best_seconds(fn, repeats: int) -> float:
    fn().block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn().block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="TxKxNxL each")
    ap.add_argument("--rows", type=int, default=None, help="live rows (the rest a bucket's padding)")
    ap.add_argument("--isa", default=None)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--one-core", action="store_true", help="pinned to one core, XLA's thread pool off")
    args = ap.parse_args()
    if args.one_core and not os.environ.get(ONE_CORE_ENV):
        env = dict(os.environ, **{ONE_CORE_ENV: "1"})
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
        core = str(sorted(os.sched_getaffinity(0))[-1])
        raise SystemExit(subprocess.call(["taskset", "-c", core, sys.executable, *sys.argv], env=env))

    import jax
    import jax.numpy as jnp
    import numpy as np

    from multilora import kernels
    if not kernels.bf16_gemm_isas():
        raise SystemExit(f"multilora's bf16 GEMM does not run here: {kernels.unavailable_reason() or 'no ISA'}")
    isa = args.isa or kernels.bf16_gemm_isa()
    rng = np.random.default_rng(0)
    a = jnp.ones((1024, 1024), jnp.float32)
    square = jax.jit(lambda a: a @ a)
    peak = 2 * 1024 ** 3 / best_seconds(lambda: square(a), 20) / 1e9
    print(f"{isa}, {'one core' if args.one_core else f'{os.cpu_count()} cores'}; "
          f"XLA's float32 1024^3 matmul: {peak:.1f} GFLOP/s")
    for shape in args.shapes:
        t, k, n, layers = map(int, shape.split("x"))
        rows = t if args.rows is None else min(args.rows, t)
        w = kernels.pack_bf16(rng.standard_normal((layers, k, n), np.float32) * 0.05)
        x = jnp.asarray(rng.standard_normal((t, k), np.float32))

        @jax.jit
        def loop(x, w):
            def body(layer, acc):
                return acc + kernels.gemm_bf16(x, w, layer, n, isa, rows)[:, 0].sum()
            return jax.lax.fori_loop(0, layers, body, jnp.float32(0))

        s = best_seconds(lambda: loop(x, w), args.repeats)
        gflops = 2 * rows * k * n * layers / s / 1e9
        print(f"{shape:>16s} rows {rows:3d}: {1e3 * s / layers:7.3f} ms a layer, {gflops:6.1f} GFLOP/s, "
              f"{100 * gflops / peak:5.1f} % of XLA's", flush=True)


if __name__ == "__main__":
    main()
