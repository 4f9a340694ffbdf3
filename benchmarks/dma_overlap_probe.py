"""Whether a Pallas TPU kernel's copies run under its math, in the LoRA kernel's shape (log 48:
in the LoRA kernel they do not; log 49: fewer, larger copies helped at 64 adapters).

A kernel of the LoRA kernel's form and nothing else: a grid of `--steps` steps (a call's chunks),
each starting the next step's copies from a pool in HBM into the other half of a double buffer,
waiting for its own (one wait for the buffer's bytes) and multiplying a (T, D) block by the
buffer's (R, D) rows `--reps` times. The copies are one copy of R rows a step ("one"), R / 16
copies of 16 rows from pages spread over the pool ("pages", as the LoRA kernel's adapters), or
none; the math is `--reps` products or none. Every combination is timed over `--loops` x
`--calls` calls in one dispatch (medians of `--repeats`), us a call. Read: "both" against the
larger of "copies alone" and "math alone" (overlapped) or their sum (serialised); "pages"
against "one" (what a copy's issue costs the scalar core).

    python3 benchmarks/dma_overlap_probe.py --dims 576 2048 --rows 512 --reps 1 4   # on a TPU
    JAX_PLATFORMS=cpu python3 benchmarks/dma_overlap_probe.py --quick               # the interpreter
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

PAGE_ROWS = 16


def _kernel(pages_ref, x_ref, pool_hbm, out_ref, buf, sem, acc, *, rows: int, copies: str, reps: int,
            steps: int):
    """pages_ref (SMEM): each step's page numbers (steps x rows / 16); x_ref (T, D); pool_hbm the
    pool (U, D) in HBM; out_ref (T, R) float32: the products' sum (zeros without math)."""
    s = pl.program_id(0)
    slot = s % 2
    per_step = rows // PAGE_ROWS

    def issue(step, to, act):
        if copies == "one":
            row = pl.multiple_of(pages_ref[step * per_step] * PAGE_ROWS, PAGE_ROWS)
            act(pltpu.make_async_copy(pool_hbm.at[pl.ds(row, rows)], buf.at[to], sem.at[to]))
            return
        for p in range(per_step):
            row = pl.multiple_of(pages_ref[step * per_step + p] * PAGE_ROWS, PAGE_ROWS)
            act(pltpu.make_async_copy(pool_hbm.at[pl.ds(row, PAGE_ROWS)],
                                      buf.at[to, pl.ds(p * PAGE_ROWS, PAGE_ROWS)], sem.at[to]))

    @pl.when(s == 0)
    def _():
        acc[...] = jnp.zeros_like(acc)
        if copies != "none":
            issue(0, 0, lambda cp: cp.start())

    if copies != "none":
        @pl.when(s + 1 < steps)
        def _():
            issue(s + 1, 1 - slot, lambda cp: cp.start())

        # one wait for the buffer's bytes (the semaphore counts them, whichever copies brought them)
        pltpu.make_async_copy(buf.at[slot], buf.at[slot], sem.at[slot]).wait()

    x = x_ref[...]
    for _ in range(reps):
        acc[...] += jax.lax.dot_general(x, buf[slot], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when(s == steps - 1)
    def _():
        out_ref[...] = acc[...]


def probe_call(x_TD, pool_UD, pages, *, rows: int, copies: str, reps: int, steps: int, interpret: bool):
    t, d = x_TD.shape
    kernel = functools.partial(_kernel, rows=rows, copies=copies, reps=reps, steps=steps)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(steps,),
        in_specs=[pl.BlockSpec((t, d), lambda s, *_: (0, 0)), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((t, rows), lambda s, *_: (0, 0)),
        scratch_shapes=[pltpu.VMEM((2, rows, d), pool_UD.dtype), pltpu.SemaphoreType.DMA((2,)),
                        pltpu.VMEM((t, rows), jnp.float32)],
    )
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((t, rows), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=64 * 1024 * 1024),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(pages, x_TD, pool_UD)


def page_table(rng, pool_pages: int, steps: int, rows: int, copies: str) -> np.ndarray:
    """Each step's pages: a run of consecutive pages for "one" (its first page read), pages drawn
    without repeats from the whole pool for "pages" (the LoRA kernel's adapters, anywhere)."""
    per_step = rows // PAGE_ROWS
    if copies == "one":
        firsts = rng.integers(0, pool_pages - per_step + 1, steps)
        return (firsts[:, None] + np.arange(per_step)[None, :]).reshape(-1).astype(np.int32)
    return rng.permutation(pool_pages)[:steps * per_step].astype(np.int32)


def probe_reference(x_TD, pool_UD, pages, *, rows: int, reps: int, steps: int):
    """probe_call's output in plain jnp: reps x the sum over steps of x against the step's rows."""
    rows_SRD = pool_UD.reshape(-1, PAGE_ROWS, pool_UD.shape[1])[pages.reshape(steps, -1)].reshape(steps, rows, -1)
    xf = x_TD.astype(jnp.float32)
    return reps * jnp.einsum("td,srd->tr", xf, rows_SRD.astype(jnp.float32))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, nargs="+", default=[576, 2048], help="the pool's row width (a model's hidden)")
    ap.add_argument("--rows", type=int, nargs="+", default=[512], help="rows a step copies (a multiple of 16)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8, help="grid steps a call (a call's chunks)")
    ap.add_argument("--reps", type=int, nargs="+", default=[1, 4], help="products a step (the math's weight)")
    ap.add_argument("--pool-rows", type=int, default=65 * 16 * 30, help="the pool's rows (65 slots x 30 layers)")
    ap.add_argument("--calls", type=int, default=30, help="calls a loop (a step's layers)")
    ap.add_argument("--loops", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="tiny shapes in the interpreter (a CPU check)")
    args = ap.parse_args(argv)
    if args.quick:
        args.dims, args.rows, args.tokens, args.steps, args.reps = [128], [32], 8, 3, [1]
        args.pool_rows, args.calls, args.loops, args.repeats = 256, 2, 1, 2
    if any(r % PAGE_ROWS for r in args.rows):
        ap.error(f"--rows {args.rows}: each must be a multiple of {PAGE_ROWS}")
    interpret = jax.default_backend() != "tpu"
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    rows_out = []
    for d in args.dims:
        key = jax.random.PRNGKey(d)
        pool = (0.02 * jax.random.normal(key, (args.pool_rows, d))).astype(jnp.bfloat16)
        x = jax.random.normal(jax.random.fold_in(key, 1), (args.tokens, d)).astype(jnp.bfloat16)
        for rows in args.rows:
            for copies in ("none", "one", "pages"):
                for reps in [0] + list(args.reps):
                    if copies == "none" and reps == 0 and rows != args.rows[0]:
                        continue
                    pages = jnp.asarray(page_table(np.random.default_rng(rows), args.pool_rows // PAGE_ROWS,
                                                   args.steps, rows, copies))
                    call = functools.partial(probe_call, rows=rows, copies=copies, reps=reps, steps=args.steps,
                                             interpret=interpret)
                    n = args.calls * args.loops

                    def loop(x, pool, pages, call=call, n=n):
                        return jax.lax.fori_loop(0, n, lambda i, a: a + call(x, pool, pages)[0, 0],
                                                 jnp.float32(0))
                    if args.quick and copies != "none" and reps:   # the probe's own kernel, checked
                        got = call(x, pool, pages)
                        want = probe_reference(x, pool, pages, rows=rows, reps=reps, steps=args.steps)
                        err = float(jnp.max(jnp.abs(got - want)))
                        if err > 1e-2 * max(1.0, float(jnp.max(jnp.abs(want)))):
                            raise SystemExit(f"copies={copies} reps={reps}: max |kernel - reference| {err:.3g}")
                        print(f"# copies={copies} reps={reps}: matches the reference (max |err| {err:.2g})", flush=True)
                    t0 = time.perf_counter()
                    exe = jax.jit(loop).lower(x, pool, pages).compile()
                    jax.block_until_ready(exe(x, pool, pages))
                    compile_s = time.perf_counter() - t0
                    times = []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        jax.block_until_ready(exe(x, pool, pages))
                        times.append(time.perf_counter() - t0)
                    us = 1e6 * statistics.median(times) / n
                    kb = 2 * rows * d * args.steps / 1024 if copies != "none" else 0
                    row = dict(d=d, rows=rows, copies=copies, reps=reps, us_a_call=us, kb_a_call=kb,
                               copies_a_call=0 if copies == "none" else args.steps * (1 if copies == "one" else rows // PAGE_ROWS),
                               compile_s=compile_s)
                    rows_out.append(row)
                    print(f"D={d} rows={rows} copies={copies:5s} reps={reps}: {us:8.2f} us a call "
                          f"({row['copies_a_call']} copies, {kb:.0f} KB)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=jax.devices()[0].device_kind, args=vars(args),
                                                   rows=rows_out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
