"""multilora's CPU decode attention alone (multilora/kernels/attention_kernels.cc), the way a
decode step calls it: SmolLM2-135M's heads (9 query, 3 kv, head_dim 64), float32 cache, ROWS
decode rows of CTX cached tokens each, the 30 layers in one scan. Pages are spread at random over a
cache of every row's pages (as a serving cache holds them), or, with --shared-pages, every row
reads the same pages (they stay in the CPU's caches: the kernel's arithmetic alone).

    python benchmarks/attention_cpu.py --rows 64 --ctx 80 [--shared-pages] [--json out.json]

Prints the median and best of --repeats calls, and the KV bytes read per second.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAYERS, KV_HEADS, HEADS, HEAD_DIM, PAGE = 30, 3, 9, 64, 16


def run(rows: int, ctx: int, shared_pages: bool, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from multilora import kernels
    if not kernels.available():
        raise SystemExit(f"multilora's CPU kernels are not available: {kernels.unavailable_reason()}")
    per = -(-ctx // PAGE)
    pages_total = rows * per + 8
    rng = np.random.default_rng(0)
    shape = (LAYERS, pages_total, PAGE, KV_HEADS, HEAD_DIM)
    k_cache = jnp.asarray(rng.standard_normal(shape, np.float32))
    v_cache = jnp.asarray(rng.standard_normal(shape, np.float32))
    order = rng.permutation(np.arange(1, pages_total))[:rows * per].astype(np.int32)
    if shared_pages:
        order = np.tile(order[:per], rows)
    pages = jnp.asarray(order)
    page_seq = jnp.asarray(np.repeat(np.arange(rows), per).astype(np.int32))
    positions = jnp.asarray((ctx - 1 - rng.integers(0, 8, rows)).astype(np.int32))
    q = jnp.asarray(rng.standard_normal((rows, HEADS, HEAD_DIM), np.float32))

    @jax.jit
    def step(q, k_cache, v_cache):
        def layer(carry, i):
            out = kernels.decode_attention(carry, k_cache, v_cache, i, pages, page_seq, positions, rows)
            return carry + 1e-3 * out, None
        return jax.lax.scan(layer, q, jnp.arange(LAYERS))[0]

    step(q, k_cache, v_cache).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(q, k_cache, v_cache).block_until_ready()
        times.append(time.perf_counter() - t0)
    kv_bytes = rows * int(np.mean(np.asarray(positions)) + 1) * KV_HEADS * HEAD_DIM * 4 * 2 * LAYERS
    med = statistics.median(times)
    return dict(rows=rows, ctx=ctx, shared_pages=shared_pages, median_ms=1e3 * med, best_ms=1e3 * min(times),
                kv_bytes=kv_bytes, kv_GBps=kv_bytes / med / 1e9)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=80)
    ap.add_argument("--shared-pages", action="store_true")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    r = run(args.rows, args.ctx, args.shared_pages, args.repeats)
    print(f"{r['rows']} rows x {r['ctx']} keys, {'shared' if r['shared_pages'] else 'random'} pages: "
          f"median {r['median_ms']:.2f} ms, best {r['best_ms']:.2f} ms; KV {r['kv_bytes'] / 1e6:.0f} MB read "
          f"at {r['kv_GBps']:.1f} GB/s")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
