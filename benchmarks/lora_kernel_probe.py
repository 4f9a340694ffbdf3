"""The Pallas LoRA kernel alone at the model shapes' calls, one call kind at a time: each case
compiled, run once, then timed (median of --repeats), every step printed as it happens, so that a
crash or a hang names its case (log 33: whole steps with the fused kernel crashed on the chip
and the cause was not found). Separate calls (lora_delta per output) beside one call for a
stacked A pool's outputs (lora_deltas), rank-16 adapters, bf16.

    python3 benchmarks/lora_kernel_probe.py --model llama-3.2-1b --tokens 64 --adapters 64
    JAX_PLATFORMS=cpu python3 benchmarks/lora_kernel_probe.py --quick   # the interpreter, tiny shapes
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

from benchmarks.common import SHAPES  # noqa: E402
from multilora.adapters.pool import slot_major_rows  # noqa: E402
from multilora.config import ModelConfig  # noqa: E402
from multilora.kernels.lora_pallas import lora_delta, lora_deltas  # noqa: E402
from multilora.lora.batch import make_lora_batch_info  # noqa: E402


def log(msg):
    print(msg, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--adapters", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--calls", nargs="+", default=["qkv", "gate_up", "o", "down"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny shapes in the interpreter (a CPU check)")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_hf_dict(SHAPES[args.model])
    interpret = jax.default_backend() != "tpu"
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim
    if args.quick:
        d, f, q, kv = 128, 256, 128, 128
        args.tokens, args.adapters, args.repeats = [16], [4], 2
    kinds = {"qkv": (d, (q, kv, kv)), "gate_up": (d, (f, f)), "o": (q, (d,)), "down": (f, (d,))}
    rank, layers = 16, 2
    key = iter(jax.random.split(jax.random.PRNGKey(0), 64))
    for name in args.calls:
        d_in, outs = kinds[name]
        for k in args.adapters:
            s = k + 1
            rows = slot_major_rows(s, rank)
            a = (0.02 * jax.random.normal(next(key), (layers, len(outs) * s * rank, d_in))).astype(jnp.bfloat16)
            bs = [(0.02 * jax.random.normal(next(key), (layers, s * rank, o))).astype(jnp.bfloat16) for o in outs]
            for t in args.tokens:
                rng = np.random.default_rng(t + k)
                slot_T = rng.integers(0, s, t).astype(np.int32)
                info = make_lora_batch_info(slot_T, np.full(s, 2.0, np.float32), np.full(s, rank, np.int32), rows,
                                            max_grouped=min(64, max(k, 1)))
                x = (jax.random.normal(next(key), (t, d_in))).astype(jnp.bfloat16)
                args_ = (x, a, bs, jnp.int32(1), info.step_slots_A, info.local_T, rows, np.full(s, 2.0, np.float32))
                ways = {
                    "separate": lambda *z: tuple(lora_delta(z[0], z[1], b, z[3], *z[4:], a_block=i, a_blocks=len(outs),
                                                            interpret=interpret) for i, b in enumerate(z[2])),
                    "one call": lambda *z: lora_deltas(*z, a_blocks=len(outs), interpret=interpret),
                }
                got = {}
                for way, fn in ways.items():
                    what = f"{args.model} {name} T={t} adapters={k} {way}"
                    log(f"# compiling {what} ...")
                    t0 = time.perf_counter()
                    exe = jax.jit(fn).lower(*args_).compile()
                    log(f"# compiled {what}: {time.perf_counter() - t0:.1f} s; its first run ...")
                    t0 = time.perf_counter()
                    got[way] = jax.block_until_ready(exe(*args_))
                    log(f"# ran {what} once: {time.perf_counter() - t0:.3f} s")
                    times = []
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        jax.block_until_ready(exe(*args_))
                        times.append(time.perf_counter() - t0)
                    log(f"{what}: median {1e6 * statistics.median(times):.1f} us")
                diff = max(float(jnp.max(jnp.abs(u.astype(jnp.float32) - v.astype(jnp.float32))))
                           for u, v in zip(got["separate"], got["one call"]))
                log(f"{args.model} {name} T={t} adapters={k}: max |separate - one call| {diff:.3g}")


if __name__ == "__main__":
    main()
