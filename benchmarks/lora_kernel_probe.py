"""The Pallas LoRA kernel alone at the model shapes' calls, one call kind at a time, timed on the
device: one jitted loop over the model's layers (each iteration the kernel at that layer, as a
step's scan calls it), its median wall time divided by the layers, so a call's host dispatch is
paid once per loop, not per call. Each case is compiled, run once, then timed, every step printed
as it happens (a crash or a hang names its case). Separate calls (lora_delta per output) beside
one call for a stacked A pool's outputs (lora_deltas), rank-16 adapters, bf16; --chunks sweeps
the adapters per chunk (MULTILORA_LORA_CHUNK_ADAPTERS; 0: the kernel's own pick). --contiguous
gives the step consecutive slots, whose pages are one run of the pool (MULTILORA_LORA_CHUNK_COPY=1
then reads a chunk in one copy a pool). --dims replaces the model's widths (whether widths of
whole 128-lane tiles copy and multiply faster than SmolLM2's 576 and 192).

    python3 benchmarks/lora_kernel_probe.py --model llama-3.2-1b --tokens 64 --adapters 64 --chunks 0 16
    JAX_PLATFORMS=cpu python3 benchmarks/lora_kernel_probe.py --quick   # the interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import os
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
from multilora.kernels.lora_pallas import CHUNK_ENV, lora_delta, lora_deltas  # noqa: E402
from multilora.lora.batch import make_lora_batch_info  # noqa: E402


def log(msg):
    print(msg, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--adapters", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--calls", nargs="+", default=["qkv", "gate_up", "o", "down"])
    ap.add_argument("--chunks", type=int, nargs="+", default=[0], help="adapters per chunk (0: the kernel's pick)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--loops", type=int, default=10,
                    help="passes over the layers in one dispatch (its host cost spread over them all)")
    ap.add_argument("--ways", nargs="+", default=["separate", "one call"], choices=["separate", "one call"])
    ap.add_argument("--contiguous", action="store_true",
                    help="the step's adapters consecutive slots (their pages one run of the pool) instead of drawn at random")
    ap.add_argument("--dims", default=None, metavar="D,F,Q,KV",
                    help="the model's hidden, intermediate, query and kv widths in place of --model's (its layers"
                         " kept): e.g. SmolLM2's 576,1536,576,192 beside 640,1536,640,256, whole 128-lane tiles")
    ap.add_argument("--quick", action="store_true", help="tiny shapes in the interpreter (a CPU check)")
    args = ap.parse_args(argv)
    cfg = ModelConfig.from_hf_dict(SHAPES[args.model])
    interpret = jax.default_backend() != "tpu"
    d, f, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim
    if args.dims:
        try:
            d, f, q, kv = (int(v) for v in args.dims.split(","))
        except ValueError:
            ap.error(f"--dims {args.dims!r}: expected four integers D,F,Q,KV")
    label = args.model + (f"[{d},{f},{q},{kv}]" if args.dims else "")
    if args.quick:
        d, f, q, kv = 128, 256, 128, 128
        args.tokens, args.adapters, args.repeats = [16], [4], 2
    kinds = {"qkv": (d, (q, kv, kv)), "gate_up": (d, (f, f)), "o": (q, (d,)), "down": (f, (d,))}
    rank, layers = 16, (2 if args.quick else cfg.num_layers)
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
                slot_T = (1 + np.arange(t) % k if args.contiguous else rng.integers(0, s, t)).astype(np.int32)
                info = make_lora_batch_info(slot_T, np.full(s, 2.0, np.float32), np.full(s, rank, np.int32), rows,
                                            max_grouped=min(64, max(k, 1)))
                x = (jax.random.normal(next(key), (t, d_in))).astype(jnp.bfloat16)
                args_ = (x, a, bs, info.step_slots_A, info.local_T, rows, np.full(s, 2.0, np.float32))

                def separate(x, a, bs, layer, *z):
                    return tuple(lora_delta(x, a, b, layer, *z, a_block=i, a_blocks=len(outs), interpret=interpret)
                                 for i, b in enumerate(bs))

                def one_call(x, a, bs, layer, *z):
                    return lora_deltas(x, a, bs, layer, *z, a_blocks=len(outs), interpret=interpret)

                for chunk in args.chunks:
                    os.environ[CHUNK_ENV] = str(chunk) if chunk else ""
                    jax.clear_caches()  # the knob is read at trace time
                    got = {}
                    for way, fn in {"separate": separate, "one call": one_call}.items():
                        if way not in args.ways:
                            continue
                        what = f"{label} {name} T={t} adapters={k} chunk={chunk or 'auto'} {way}"
                        log(f"# compiling {what} ...")
                        t0 = time.perf_counter()
                        exe = jax.jit(lambda *z, fn=fn: over_layers(fn, layers, *z, loops=args.loops)).lower(
                            *args_).compile()
                        log(f"# compiled {what}: {time.perf_counter() - t0:.1f} s; its first run ...")
                        t0 = time.perf_counter()
                        got[way] = jax.block_until_ready(exe(*args_))
                        log(f"# ran {what} once: {time.perf_counter() - t0:.3f} s")
                        times = []
                        for _ in range(args.repeats):
                            t0 = time.perf_counter()
                            jax.block_until_ready(exe(*args_))
                            times.append(time.perf_counter() - t0)
                        calls = layers * args.loops
                        log(f"{what}: {1e6 * statistics.median(times) / calls:.1f} us a layer "
                            f"({calls} calls in {1e3 * statistics.median(times):.2f} ms)")
                    if len(got) < 2:
                        continue
                    diff = max(float(jnp.max(jnp.abs(u.astype(jnp.float32) - v.astype(jnp.float32))))
                               for u, v in zip(got["separate"], got["one call"]))
                    log(f"{label} {name} T={t} adapters={k} chunk={chunk or 'auto'}: "
                        f"max |separate - one call| {diff:.3g}")


def over_layers(fn, layers, x, a, bs, *z, loops: int = 1):
    """fn at every layer of the pools in turn (a loop, as a step's scan over its layers), `loops`
    times over, each call's outputs summed, so that every call's result is used and one dispatch
    runs them all."""
    def body(i, acc):
        return tuple(s + y.astype(jnp.float32) for s, y in zip(acc, fn(x, a, bs, i % layers, *z)))
    zeros = tuple(jnp.zeros((x.shape[0], b.shape[2]), jnp.float32) for b in bs)
    return jax.lax.fori_loop(0, layers * loops, body, zeros)


if __name__ == "__main__":
    main()
