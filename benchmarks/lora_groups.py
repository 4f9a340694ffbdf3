"""The LoRA group calls of a decode step, alone: the four group calls a layer makes (q/k/v,
o, gate/up, down) through multilora's CPU kernel (`lora_apply`), in a scan over SmolLM2-135M's
30 layers, T tokens spread over K adapters (rank-16 on all seven projections, a bfloat16 pool),
without the base model around them: what a decode step pays for its adapters, free of the
GEMMs' and the attention's noise. Medians of interleaved runs (the K cases share the noise).

    python benchmarks/lora_groups.py                     # K = 0 1 8 40, 64 tokens
    python benchmarks/lora_groups.py --twice             # q/k/v and gate/up run twice in a row:
                                                         # the second call reads its rows from cache
    taskset -c 0 python benchmarks/lora_groups.py        # one core

K = 0 is the floor: the calls with no adapter row (the step then skips them; here they run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import SMOLLM2_135M  # noqa: E402
from benchmarks.forward_step import random_lora  # noqa: E402
from multilora import kernels  # noqa: E402
from multilora.config import ModelConfig  # noqa: E402
from multilora.adapters.pool import slot_major_rows  # noqa: E402


def make_step(twice: bool):
    @jax.jit
    def step(p, x_TD, slot_T, scal_S, ranks_S, rows_SR):
        meta = (slot_T, scal_S, ranks_S, rows_SR)

        def group(x, a, bs, layer):
            ys = kernels.lora_apply(x, a, bs, layer, *meta)
            if twice:  # the same rows again, now in cache (the input depends on the first call)
                ys = kernels.lora_apply(x + 1e-9 * ys[0].sum(), a, bs, layer, *meta)
            return ys

        def layer(x, l):
            q, k, v = group(x, p.qkv_a_LUD, (p.q_b_LUO, p.k_b_LUO, p.v_b_LUO), l)
            (o,) = kernels.lora_apply(q, p.o_a_LUO, (p.o_b_LUD,), l, *meta)
            g, u = group(x + o, p.gate_up_a_LUD, (p.gate_b_LUF, p.up_b_LUF), l)
            (d,) = kernels.lora_apply(g * u, p.down_a_LUF, (p.down_b_LUD,), l, *meta)
            return x + 1e-3 * (d + k.sum() + v.sum()), None
        return jax.lax.scan(layer, x_TD, jnp.arange(p.qkv_a_LUD.shape[0]))[0]
    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 8, 40])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--twice", action="store_true")
    ap.add_argument("--pool-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the adapters' pool (an AVX2 host's default is float32: multilora.model.projections.lora_pool_dtype)")
    args = ap.parse_args(argv)
    if not kernels.available():
        raise SystemExit(f"multilora's CPU kernels are not available: {kernels.unavailable_reason()}")
    cfg = ModelConfig.from_hf_dict(SMOLLM2_135M)
    step = make_step(args.twice)
    rng = np.random.default_rng(0)
    x = jax.random.normal(jax.random.PRNGKey(3), (args.tokens, cfg.hidden_size), jnp.float32)
    cases = {}
    for k in args.adapters:
        s = k + 1
        slot_T = (1 + rng.integers(k, size=args.tokens)) if k else np.zeros(args.tokens)
        meta = (jnp.asarray(slot_T, jnp.int32), jnp.full((s,), 2.0, jnp.float32),
                jnp.full((s,), args.rank, jnp.int32), jnp.asarray(slot_major_rows(s, args.rank)))
        p = random_lora(cfg, s, args.rank, dtype=jnp.dtype(args.pool_dtype))
        step(p, x, *meta).block_until_ready()
        cases[k] = (p, meta, [])
    for _ in range(args.repeats):
        for p, meta, times in cases.values():
            t0 = time.perf_counter()
            step(p, x, *meta).block_until_ready()
            times.append(time.perf_counter() - t0)
    # the rank-r products of the rows with an adapter: 2 r (inputs + outputs) multiply-adds a projection
    widths = sum(d + o for d, o in ((cfg.hidden_size, cfg.q_dim), (cfg.hidden_size, cfg.kv_dim),
                                    (cfg.hidden_size, cfg.kv_dim), (cfg.q_dim, cfg.hidden_size),
                                    (cfg.hidden_size, cfg.intermediate_size), (cfg.hidden_size, cfg.intermediate_size),
                                    (cfg.intermediate_size, cfg.hidden_size)))
    print(f"{'adapters':>8} {'distinct':>8} {'median ms':>10} {'min ms':>8} {'GFLOP/s':>8}")
    for k, (_, meta, times) in cases.items():
        distinct = len(set(np.asarray(meta[0]).tolist()) - {0})
        flops = 2 * args.rank * widths * cfg.num_layers * int((np.asarray(meta[0]) > 0).sum())
        med = statistics.median(times)
        print(f"{k:>8} {distinct:>8} {1e3 * med:10.2f} {1e3 * min(times):8.2f} {flops / med / 1e9:8.1f}")


if __name__ == "__main__":
    main()
