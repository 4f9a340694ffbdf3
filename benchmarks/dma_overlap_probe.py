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
against "one" (what a copy's issue costs the scalar core). Where both run, two more forms: the
buffer's halves as two arrays (whether one array written by copies and read by the math orders
them), and the math on another block (whether reading what the copies bring orders them).

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


def _kernel(pages_ref, x_ref, pool_hbm, out_ref, *scratch, rows: int, copies: str, reps: int, steps: int,
            buffers: str):
    """pages_ref (SMEM): each step's page numbers (steps x rows / 16); x_ref (T, D); pool_hbm the
    pool (U, D) in HBM; out_ref (T, R) float32: the products' sum (zeros without math). scratch:
    the double buffer (one (2, R, D) array, or two (R, D) arrays where buffers == "two"), the DMA
    semaphores, the accumulator, and (probe_call's operand "other") an (R, D) block the math reads
    instead of the buffer (the copies' bytes then never feed the math)."""
    if buffers == "two":
        buf0, buf1, sem, acc, *other = scratch
    else:
        buf, sem, acc, *other = scratch
    s = pl.program_id(0)
    slot = s % 2
    per_step = rows // PAGE_ROWS

    def on_half(half, fn):
        """fn(the buffer's half `half`, a ref of (R, D)), `half` a traced 0 or 1."""
        if buffers == "two":
            pl.when(half == 0)(lambda: fn(buf0))
            pl.when(half == 1)(lambda: fn(buf1))
        else:
            fn(buf.at[half])

    def issue(step, to, act):
        def go(dst):
            if copies == "one":
                row = pl.multiple_of(pages_ref[step * per_step] * PAGE_ROWS, PAGE_ROWS)
                act(pltpu.make_async_copy(pool_hbm.at[pl.ds(row, rows)], dst, sem.at[to]))
                return
            for p in range(per_step):
                row = pl.multiple_of(pages_ref[step * per_step + p] * PAGE_ROWS, PAGE_ROWS)
                act(pltpu.make_async_copy(pool_hbm.at[pl.ds(row, PAGE_ROWS)], dst.at[pl.ds(p * PAGE_ROWS, PAGE_ROWS)],
                                          sem.at[to]))
        on_half(to, go)

    @pl.when(s == 0)
    def _():
        acc[...] = jnp.zeros_like(acc)
        for o in other:
            o[...] = jnp.ones_like(o)
        if copies != "none":
            issue(0, 0, lambda cp: cp.start())

    if copies != "none":
        @pl.when(s + 1 < steps)
        def _():
            issue(s + 1, 1 - slot, lambda cp: cp.start())

        # one wait for the buffer's bytes (the semaphore counts them, whichever copies brought them)
        on_half(slot, lambda ref: pltpu.make_async_copy(ref, ref, sem.at[slot]).wait())

    def math(ref):
        x = x_ref[...]
        for _ in range(reps):
            acc[...] += jax.lax.dot_general(x, ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    if reps:
        if other:
            math(other[0])
        else:
            on_half(slot, math)

    @pl.when(s == steps - 1)
    def _():
        out_ref[...] = acc[...]


def probe_call(x_TD, pool_UD, pages, *, rows: int, copies: str, reps: int, steps: int, interpret: bool,
               buffers: str = "one", operand: str = "buffer"):
    t, d = x_TD.shape
    kernel = functools.partial(_kernel, rows=rows, copies=copies, reps=reps, steps=steps, buffers=buffers)
    halves = ([pltpu.VMEM((rows, d), pool_UD.dtype)] * 2 if buffers == "two"
              else [pltpu.VMEM((2, rows, d), pool_UD.dtype)])
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(steps,),
        in_specs=[pl.BlockSpec((t, d), lambda s, *_: (0, 0)), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((t, rows), lambda s, *_: (0, 0)),
        scratch_shapes=halves + [pltpu.SemaphoreType.DMA((2,)), pltpu.VMEM((t, rows), jnp.float32)]
        + ([pltpu.VMEM((rows, d), pool_UD.dtype)] if operand == "other" else []),
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


def cases(reps_list, first_rows: bool):
    """(copies, reps, buffers, operand): every copy kind x math weight in one (2, R, D) buffer read
    by the math, then with copies and math both: the halves as two arrays, and the math reading
    another block (no copy's bytes feed it)."""
    for copies in ("none", "one", "pages"):
        for reps in [0] + list(reps_list):
            if copies != "none" or reps or first_rows:
                yield copies, reps, "one", "buffer"
    for copies in ("one", "pages"):
        for reps in reps_list:
            yield copies, reps, "two", "buffer"
            yield copies, reps, "one", "other"


def time_case(args, x, pool, rows, copies, reps, buffers, operand, interpret) -> dict:
    d = x.shape[1]
    pages = jnp.asarray(page_table(np.random.default_rng(rows), args.pool_rows // PAGE_ROWS, args.steps, rows, copies))
    call = functools.partial(probe_call, rows=rows, copies=copies, reps=reps, steps=args.steps, interpret=interpret,
                             buffers=buffers, operand=operand)
    n = args.calls * args.loops
    what = f"D={d} rows={rows} copies={copies:5s} reps={reps} buffers={buffers} math on {operand}"
    if args.quick and copies != "none" and reps and operand == "buffer":   # the probe's own kernel, checked
        got = call(x, pool, pages)
        want = probe_reference(x, pool, pages, rows=rows, reps=reps, steps=args.steps)
        err = float(jnp.max(jnp.abs(got - want)))
        if err > 1e-2 * max(1.0, float(jnp.max(jnp.abs(want)))):
            raise SystemExit(f"{what}: max |kernel - reference| {err:.3g}")
        print(f"# {what}: matches the reference (max |err| {err:.2g})", flush=True)

    def loop(x, pool, pages):
        return jax.lax.fori_loop(0, n, lambda i, a: a + call(x, pool, pages)[0, 0], jnp.float32(0))
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
    n_copies = 0 if copies == "none" else args.steps * (1 if copies == "one" else rows // PAGE_ROWS)
    print(f"{what}: {us:8.2f} us a call ({n_copies} copies, {kb:.0f} KB)", flush=True)
    return dict(d=d, rows=rows, copies=copies, reps=reps, buffers=buffers, operand=operand, us_a_call=us,
                kb_a_call=kb, copies_a_call=n_copies, compile_s=compile_s)


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
            for case in cases(args.reps, rows == args.rows[0]):
                rows_out.append(time_case(args, x, pool, rows, *case, interpret=interpret))
                if args.json:   # as it goes: a cut run keeps what it measured
                    Path(args.json).write_text(json.dumps(dict(device=jax.devices()[0].device_kind, args=vars(args),
                                                               rows=rows_out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
