"""Writing one step's K/V rows into a heads-major KV cache, every layer, each way
(multilora.model.llama.KV_WRITES) side by side in one process: XLA's row scatter (write_kv), XLA's
page scatter (write_kv_pages), and the Pallas kernels (multilora.kernels.kv_write_pallas).

A step here is only the writes: a loop over the model's layers, each writing the step's K and V
(the cache carried through the loop and donated, as in the model's step), plus the pages' plan
made once per step where the way has one. Workloads: decode (64 rows, each on its own page at a
random offset) and prefill (10 prompts x 48 tokens from page starts, padded to 512 tokens).
Shapes: SmolLM2-135M (30 layers, 3 kv heads) and Llama-3.2-1B (16 layers, 8 kv heads), head dim
64, pages of 16. Medians of --repeats runs, in milliseconds.

    python benchmarks/kv_write_probe.py --json out.json    # on a TPU; on the CPU it interprets
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from multilora.kernels.kv_write_pallas import write_pages, write_rows  # noqa: E402
from multilora.model.attention import kv_page_writes, max_pages_written, write_kv, write_kv_pages  # noqa: E402

SHAPES = {"smollm2-135m": (30, 3), "llama-3.2-1b": (16, 8)}   # layers, kv heads
HEAD_DIM, PAGE = 64, 16


def slots_for(mode: str, num_pages: int, rng) -> tuple[np.ndarray, int]:
    """(slot mapping, sequences) of a decode or prefill step; padding writes slot 0 (trash page)."""
    if mode == "decode":
        pages = rng.permutation(np.arange(1, num_pages))[:64]
        return pages * PAGE + rng.integers(0, PAGE, 64), 64
    slots = [np.arange(PAGE * (1 + 3 * i), PAGE * (1 + 3 * i) + 48) for i in range(10)]
    return np.concatenate(slots + [np.zeros(32, np.int64)]), 10


def step_fn(way: str, num_layers: int, num_seqs: int, interpret: bool):
    def step(k_cache, v_cache, slots_T, k_TKH, v_TKH):
        t = slots_T.shape[0]
        if way in ("pages", "pallas-pages"):
            plan = kv_page_writes(slots_T, PAGE, max_pages_written(t, num_seqs, PAGE))

        def body(i, kv):
            kc, vc = kv
            k, v = k_TKH * (i + 1).astype(k_TKH.dtype), v_TKH   # a layer's own rows
            if way == "rows":
                return write_kv(kc, i, slots_T, k, True), write_kv(vc, i, slots_T, v, True)
            if way == "pages":
                return write_kv_pages(kc, i, *plan, k), write_kv_pages(vc, i, *plan, v)
            if way == "pallas-pages":
                return write_pages(kc, vc, i, *plan, k, v, interpret=interpret)
            return write_rows(kc, vc, i, slots_T, k, v, interpret=interpret)
        return jax.lax.fori_loop(0, num_layers, body, (k_cache, v_cache))
    return jax.jit(step, donate_argnums=(0, 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--modes", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    ap.add_argument("--ways", nargs="+", default=["rows", "pages", "pallas-pages", "pallas-rows"])
    ap.add_argument("--cache-pages", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    interpret = jax.default_backend() != "tpu"
    rng = np.random.default_rng(0)
    rows, ref = [], {}
    for model in args.models:
        num_layers, kvh = SHAPES[model]
        for mode in args.modes:
            slots, seqs = slots_for(mode, args.cache_pages, rng)
            slots_T = jnp.asarray(slots, jnp.int32)
            k_TKH = jnp.asarray(rng.standard_normal((len(slots), kvh, HEAD_DIM)), jnp.bfloat16)
            v_TKH = jnp.asarray(rng.standard_normal((len(slots), kvh, HEAD_DIM)), jnp.bfloat16)
            shape = (num_layers, args.cache_pages, kvh, PAGE, HEAD_DIM)
            for way in args.ways:
                fn = step_fn(way, num_layers, seqs, interpret)
                kc, vc = jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)
                try:
                    t0 = time.perf_counter()
                    kc, vc = jax.block_until_ready(fn(kc, vc, slots_T, k_TKH, v_TKH))
                    compile_s = time.perf_counter() - t0
                except Exception as e:  # a way the chip's compiler refuses is reported, not fatal
                    print(f"{model} {mode} {way}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
                    rows.append(dict(model=model, mode=mode, way=way, error=f"{type(e).__name__}: {str(e)[:2000]}"))
                    continue
                check = np.asarray(kc[:, slots[0] // PAGE].astype(jnp.float32)).sum()
                key = (model, mode)
                ok = ref.setdefault(key, check) == check
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    kc, vc = jax.block_until_ready(fn(kc, vc, slots_T, k_TKH, v_TKH))
                    times.append(time.perf_counter() - t0)
                med = statistics.median(times) * 1e3
                rows.append(dict(model=model, mode=mode, way=way, tokens=len(slots), median_ms=med,
                                 times_ms=[x * 1e3 for x in times], compile_s=compile_s, same_as_first=bool(ok)))
                print(f"{model:14s} {mode:8s} {way:13s} T={len(slots):4d} {med:8.3f} ms  "
                      f"(compile {compile_s:5.1f} s{'' if ok else ', DIFFERS from the first way'})", flush=True)
                del kc, vc
    if args.json:
        args.json.write_text(json.dumps(dict(platform=jax.default_backend(), device=str(jax.devices()[0]),
                                             rows=rows), indent=1))


if __name__ == "__main__":
    main()
