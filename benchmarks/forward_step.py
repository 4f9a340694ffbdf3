"""One model step, timed alone: the serving workload's decode step (B single-token sequences of
~C cached tokens) and prefill step (T packed tokens of ~48-token prompts), and optionally a mixed
step (those decode rows beside prefill chunks filling the rest of T), on SmolLM2-135M's shape with
random weights, with no adapters and with S-1 adapters in S slots, per LoRA backend. Every step
is the engine's one step kind: T tokens over X pages in all, X by default the power of two the
runner's buckets would pick. Medians of interleaved runs, so variants of one invocation share the
machine's noise.

    python benchmarks/forward_step.py                       # decode 64 x 80 tokens, prefill 512
    python benchmarks/forward_step.py --modes decode prefill mixed
    python benchmarks/forward_step.py --json benchmarks/results/forward_step.json
    python benchmarks/forward_step.py --trace /tmp/fs-trace   # + where each step's time goes
    python benchmarks/forward_step.py --kv-layouts default heads-major --cache-pages 3000   # a TPU's KV layouts

--trace records each case with the JAX profiler (a Perfetto trace per case) and sums the XLA
ops' durations by kind (matmuls, the attention's KV gathers, per-layer weight slices, ...),
naming each fused op by the jnp operation it came from (read from the compiled HLO). The sums
are op time over both cores, so they add up to more than the wall time; read them as shares.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import faulthandler
import glob
import gzip
import itertools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import SHAPES, machine_info, save_json  # noqa: E402
from benchmarks.serving import measure_peak_flops, step_flops  # noqa: E402
from multilora.config import ModelConfig  # noqa: E402
from multilora.engine.batching import SeqChunk, build_batch, pages_needed  # noqa: E402
from multilora.model.precision import kv_cache_dtype  # noqa: E402
from multilora.adapters.pool import (blocks_of, lora_feature_dims, rows_major, slot_major_pool,  # noqa: E402
                                 slot_major_rows)
from multilora.model.llama import (KV_WRITES, KVCache, LayerWeights, LoRAWeights, Weights, forward_packed,  # noqa: E402
                                   embedding_rows_major, init_kv_cache, kv_cache_formats, kv_heads_major_on, kv_write_mode, make_kv_cache,
                                   split_layers)
from multilora.model import kv_lanes  # noqa: E402
from multilora.model.packing import pack  # noqa: E402


class PackedStep:
    """A jitted forward_packed called with a Batch of numpy arrays, packed on each call with no
    token fed from an earlier step (the host's share of a step, as in the runner)."""

    def __init__(self, jitted):
        self.jitted = jitted
        self.fed = {}   # rows -> a device array of zeros (the runner's no-feed input: on the device once)

    def _args(self, batch):
        t, q = np.shape(batch.token_ids_T)[0], np.shape(batch.logits_idx_Q)[0]
        spec, buf = pack((batch, np.full(t, -1, np.int32)))
        if q not in self.fed:
            self.fed[q] = jax.device_put(np.zeros(q, np.int32))
        return buf, self.fed[q], spec

    def __call__(self, weights, lora, kv, batch, **kw):
        buf, fed, spec = self._args(batch)
        return self.jitted(weights, lora, kv, buf, fed, spec=spec, **kw)

    def lower(self, weights, lora, kv, batch, **kw):
        buf, fed, spec = self._args(batch)
        return self.jitted.lower(weights, lora, kv, buf, fed, spec=spec, **kw)

    def compiled(self, weights, lora, kv, batch, **kw):
        """Compiled now (nothing run): a callable of (weights, lora, kv, batch) for this case, so
        that a compile and a first run are timed apart (a slow compile and a step that does not
        finish look alike otherwise)."""
        exe = self.lower(weights, lora, kv, batch, **kw).compile()

        def run(weights, lora, kv, batch, **_):
            buf, fed, _ = self._args(batch)
            return exe(weights, lora, kv, buf, fed)
        return run


PIPELINED_STEPS = 10


def random_weights(cfg, seed=0, dtype=jnp.float32, int8: bool = False, on_host: bool = True):
    """Base weights of the config's shape (their values do not change the step's time), made
    in `dtype`; int8: the projections as random int8 with per-column scales
    (projections.QuantInt8, the engine's quantization='int8'), made without a float copy, so an
    8B shape fits one 16 GB chip. An untied config gets its own LM head. on_host: the float
    matrices drawn by numpy (on a TPU v5e, jax.random.normal compiled for tens of seconds a
    shape: a 1B process spent over 85 s before its first step, benchmarks/log/40); False: by
    jax.random (for tracing, e.g. under jax.eval_shape)."""
    from multilora.model.projections import QuantInt8
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16))
    rng = np.random.default_rng(seed)
    L, d, f, q, kv = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim

    def normal(shape):
        if not on_host:
            return (0.02 * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)
        a = rng.standard_normal(shape, dtype=np.float32)
        a *= 0.02
        return jnp.asarray(a).astype(dtype)

    def w(*shape):
        return normal(shape) if not int8 or len(shape) == 2 else w8(*shape)

    def w8(*shape):
        if on_host:   # the whole (L, K, N) stack in int8 on the host, one copy to the device
            vals = jnp.asarray(rng.integers(-127, 127, size=shape, dtype=np.int8))
        else:  # a layer at a time: randint's uint32 bits of a whole stack would not fit a chip at 8B
            vals = jnp.stack([jax.random.randint(k, shape[1:], -127, 127, jnp.int8)
                              for k in jax.random.split(next(keys), shape[0])])
        return QuantInt8(vals, jnp.full((shape[0], shape[2]), 0.02 / 73, jnp.float32))
    ones = lambda *shape: jnp.ones(shape, dtype)  # noqa: E731
    layers = LayerWeights(attn_norm_LD=ones(L, d), wq_LDO=w(L, d, q), wk_LDO=w(L, d, kv),
                          wv_LDO=w(L, d, kv), wo_LOD=w(L, q, d), mlp_norm_LD=ones(L, d),
                          w_gate_LDF=w(L, d, f), w_up_LDF=w(L, d, f), w_down_LFD=w(L, f, d))
    head = None if cfg.tie_word_embeddings else w(d, cfg.vocab_size)
    return Weights(embed_VD=w(cfg.vocab_size, d), layers=layers, final_norm_D=ones(d), lm_head_DV=head)


def random_lora(cfg, num_slots, rank, seed=1, dtype=jnp.float32):
    """Random adapters in slots 1..S-1, each at `rank`, as pools in `dtype` read through
    slot_major_rows. One layer's pool is drawn, laid out and cast on the host, then repeated over
    the layers on the device (their values do not change a step's time): the chip holds each pool
    once, in its own dtype, and the host draws 1/L of it (a Llama-3.1-8B shape's 64 adapters are
    5.4 GB at bf16: their float32 stacks did not fit on the chip beside its int8 weights, and
    drawing all of them on the host took over two minutes)."""
    rng = np.random.default_rng(seed)
    out = {}
    for field, width in lora_feature_dims(cfg).items():
        b = blocks_of(field)
        # drawn on the host: on a TPU v5e, jax.random.normal at these shapes took 30-60 s a pool to
        # compile (benchmarks/log/35), longer than the step's own compile
        w = rng.standard_normal((num_slots, b * rank, width), np.float32)
        w *= 0.02
        w[0] = 0.0  # slot 0 stays zero
        layer = jnp.asarray(slot_major_pool(w, b).astype(jnp.dtype(dtype)))
        out[field] = jax.jit(lambda a: jnp.broadcast_to(a, (cfg.num_layers, *a.shape)))(layer)
    return LoRAWeights(**out)


def workload_chunks(mode, n_seqs, ctx, page_size, num_adapters, rng, prompt=48, first_page=1):
    chunks, page = [], first_page
    for i in range(n_seqs):
        start = ctx - 1 if mode == "decode" else 0
        n = 1 if mode == "decode" else prompt
        pages = -(-(start + n) // page_size)
        slot = 0 if num_adapters == 0 else 1 + int(rng.integers(num_adapters))
        chunks.append(SeqChunk(list(rng.integers(0, 32000, n)), start, list(range(page, page + pages)), slot))
        page += pages
    return chunks


def prefill_chunks(budget, page_size, num_adapters, rng, first_page):
    """~48-token prompts filling `budget` tokens, each on its own pages from first_page on."""
    chunks, toks = [], 0
    while toks + 48 <= budget:
        chunks += workload_chunks("prefill", 1, 0, page_size, num_adapters, rng,
                                  first_page=first_page + sum(c.num_pages for c in chunks))
        toks += 48
    return chunks


def pow2_pages(need: int) -> int:
    """The runner's pages bucket for a step of `need` pages (powers of two from 4)."""
    return max(4, 1 << max(need - 1, 0).bit_length())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES),
                    help="the model's shape (random weights)")
    ap.add_argument("--decode-seqs", type=int, default=64)
    ap.add_argument("--decode-ctx", type=int, default=80, help="tokens in each sequence's cache")
    ap.add_argument("--decode-pages", type=int, default=None,
                    help="the decode step's pages in all (default: the power of two its pages need)")
    ap.add_argument("--prefill-tokens", type=int, default=512,
                    help="tokens of the prefill step (and of the mixed step, its decode rows included)")
    ap.add_argument("--prefill-pages", type=int, default=None,
                    help="the prefill (and mixed) step's pages in all (default: the power of two they need)")
    ap.add_argument("--max-num-seqs", type=int, default=64,
                    help="logits rows per step: min(tokens, this), as in the engine")
    ap.add_argument("--adapters", type=int, nargs="+", default=[0, 8])
    ap.add_argument("--backends", nargs="+", default=["auto"])
    ap.add_argument("--modes", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill", "mixed"])
    ap.add_argument("--slots", type=int, default=None,
                    help="adapter slots in the pool (default: as many as adapters used); rows use the first K")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16,
                    help="tokens a KV page holds (the engine's default; 128 measured slower on a v5e: log 40)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--roofline", action="store_true",
                    help="XLA's float32 matmul peak measured before each round of repeats; each decode case's "
                         "FLOPs at that round's peak over its step time (serving.py's %% of the roofline, for the "
                         "step alone; medians of the rounds' ratios)")
    ap.add_argument("--attention", nargs="+", default=["auto"], choices=["auto", "xla", "native"],
                    help="decode attention: XLA's gathers or multilora's CPU kernel (auto: the kernel "
                         "where it is built, as the runner does)")
    ap.add_argument("--layers", nargs="+", default=["stacked"], choices=["stacked", "split"],
                    help="the base weights stacked along L (the engine's layout, run under lax.scan, which "
                         "copies each layer's weights out) or one array per layer and weight (split: the "
                         "layers unrolled, nothing copied, a compile ~5x as long)")
    ap.add_argument("--lora-dtypes", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"],
                    help="the adapter pool's dtype (auto: as the engine's lora_dtype=auto, the case's dtype); "
                         "several: side by side")
    ap.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16", "bf16-weights", "bf16-packed", "bf16-amx", "int8",
                             "int8-packed", "int4-packed"],
                    help="the base weights', adapters' and KV cache's dtype (bfloat16: XLA's attention); "
                         "bf16-weights: the projection matrices in bfloat16 (XLA's dot), all else float32; "
                         "bf16-packed: the same through multilora's bf16 GEMM (AMX, AVX512-BF16 or AVX2 + FMA, "
                         "the best here unless $MULTILORA_KERNEL_ISA caps it), with the "
                         "LM head (projection_dtype=bfloat16 there); bf16-amx: its "
                         "earlier name; int8: the projections int8 with per-column scales (quantization=int8), "
                         "activations, adapters and cache bfloat16; int8-packed / int4-packed: quantization int8 / "
                         "int4 on a CPU (GGUF Q8_0 / Q4_0 arithmetic through multilora's gemm_q8 / gemm_q4)")
    ap.add_argument("--cache-pages", type=int, default=None,
                    help="pages in the KV cache (default: as many as the case's sequences hold; an engine's "
                         "cache, sized by memory, holds many more)")
    ap.add_argument("--kv-layouts", nargs="+", default=["auto"], choices=["auto", "default", "heads-major"],
                    help="the KV cache's layout: the device's default, or heads-major (multilora.model.llama."
                         "KV_HEADS_MAJOR; auto: as the engine makes it, heads-major on a TPU); several: side by "
                         "side (heads-major cases are labelled ',kvhm')")
    ap.add_argument("--pallas-attention", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                    help="heads-major caches: attend through the Pallas kernel (on) or XLA's gathers (off); "
                         "auto: as the engine, the kernel on a TPU; several: side by side (',pa' cases)")
    ap.add_argument("--kv-writes", nargs="+", default=[None], choices=list(KV_WRITES),
                    help="heads-major caches: how the step's K/V rows are written (multilora.model.llama."
                         "KV_WRITES; default: as the engine, kv_write_mode()); several: side by side")
    ap.add_argument("--trace", type=Path, default=None, metavar="DIR",
                    help="profile each case and print its op time by kind")
    args = ap.parse_args(argv)
    args.kv_writes = [kw or kv_write_mode() for kw in args.kv_writes]
    if os.environ.get("MULTILORA_STACKS_AFTER_S"):  # a slow or stuck run says where it is (stderr)
        faulthandler.dump_traceback_later(float(os.environ["MULTILORA_STACKS_AFTER_S"]))

    from multilora.lora.backend import SWITCH, choose_backend, get_backend, grouped_cap, native_usable
    from multilora.model import projections
    cfg = ModelConfig.from_hf_dict(SHAPES[args.model])
    stacked = random_weights(cfg) if set(args.dtypes) - {"int8"} else None  # int8-packed / int4-packed: from these
    layouts = {}
    short = {"float32": "f32", "bfloat16": "bf16", "bf16-weights": "bf16w", "bf16-packed": "packed", "int8": "int8",
             "int8-packed": "q8", "int4-packed": "q4"}
    from multilora import kernels
    for asked in dict.fromkeys("bf16-packed" if d == "bf16-amx" else d for d in args.dtypes):
        if asked == "bf16-packed":
            if not projections.packed_usable(stacked.embed_VD):
                raise SystemExit("--dtypes bf16-packed: multilora's bf16 GEMM does not run on this machine")
            print(f"bf16-packed runs on {kernels.bf16_gemm_isa()}")
            w, dt = projections.convert(stacked, "bfloat16-packed"), "float32"
        elif asked == "bf16-weights":  # the projection matrices only; activations, adapters, cache f32
            lw, dt = stacked.layers, "float32"
            w = dataclasses.replace(stacked, layers=dataclasses.replace(lw, **{
                f.name: getattr(lw, f.name).astype(jnp.bfloat16) for f in dataclasses.fields(lw)
                if f.name.startswith("w")}))
        elif asked in ("int8-packed", "int4-packed"):  # quantization int8 / int4 on a CPU: multilora's gemm_quant
            if not projections.packed_usable(stacked.embed_VD) or not kernels.quant_gemm_available():
                raise SystemExit(f"--dtypes {asked}: multilora's quantized GEMM does not run on this machine")
            w, dt = projections.convert(stacked, asked), "float32"
        elif asked == "int8":  # quantization='int8' under bfloat16 activations, adapters and cache
            w, dt = random_weights(cfg, dtype=jnp.bfloat16, int8=True), "bfloat16"
        else:
            dt = asked
            w = jax.tree.map(lambda a, dt=dt: a.astype(dt), stacked)
        w = embedding_rows_major(w)   # as the engine's loader places it
        platform = jax.devices()[0].platform
        kv_hms = dict.fromkeys(kv_heads_major_on(platform) if k == "auto" else k == "heads-major"
                               for k in args.kv_layouts)
        for lay in args.layers:
            for ld in args.lora_dtypes:
                ldt = projections.lora_pool_dtype(ld, dt, "bfloat16-packed" if asked == "bf16-packed" else dt).name
                suffix = "" if ld == args.lora_dtypes[0] else f"+{short[ldt]}"  # adapters' pool dtype
                for hm in kv_hms:
                    pas = dict.fromkeys((platform == "tpu" if a == "auto" else a == "on") and hm
                                        for a in args.pallas_attention) if hm else {False: None}
                    for pa, kw in itertools.product(pas, args.kv_writes if hm else ["rows"]):
                        kvs = (",kvhm" if hm else "") + (",pa" if pa else "") + (f",{kw}" if len(args.kv_writes) > 1 else "")
                        lanes = kv_lanes.lane_pack_for(cfg, platform) if pa else 1
                        kvs += f",{lanes}heads/row" if lanes > 1 else ""
                        layouts[f"{lay}/{short[asked]}{kvs}{suffix}"] = (split_layers(w) if lay == "split" else w,
                                                                          dt, ldt, hm, pa, kw)
    page_size = args.page_size
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    # heads-major: the cache returned in the format it came in (as the runner), so every step reads it in place
    # as the runner: the batch packed into one buffer, one host -> device copy a step
    fwds = {hm: PackedStep(jax.jit(forward_packed, static_argnames=("spec", "cfg", "backend", "native_attention",
                                                                   "kv_heads_major", "pallas_attention", "kv_write"),
                                   donate_argnames=("kv",),
                                   **(dict(out_shardings=(one, kv_cache_formats(KVCache(one, one), True))) if hm else {})))
            for hm in (False, True)}
    from multilora import kernels
    natives = sorted({a == "native" or (a == "auto" and kernels.available()) for a in args.attention})
    rng = np.random.default_rng(0)
    cases = []
    for mode in args.modes:
        for k in args.adapters:
            for nat in natives:
                for lay, (_, dt, _, hm, _, _) in layouts.items():
                    # the attention kernel reads float32 (L, P, p, K, H) caches (a CPU's for every dtype)
                    on = nat and kv_cache_dtype(dt, jax.devices()[0].platform) == np.float32 and not hm
                    if k == 0 and "+" in lay:
                        continue  # the pool's dtype does not matter without adapters
                    for be in (["-"] if k == 0 else args.backends):
                        cases.append((mode, k, be, on, lay))
                    if k == 0 and args.slots:
                        cases.append((mode, 0, "auto", on, lay))  # LoRA on (a pool of --slots), no row uses it
    cases = list(dict.fromkeys(cases))
    state, pools = {}, {}
    for mode, k, be, nat, lay in cases:
        weights, dtype, lora_dtype, hm, pa, kw = layouts[lay]
        s = max(k, args.slots or 0) + 1
        if mode == "decode":
            chunks = workload_chunks(mode, args.decode_seqs, args.decode_ctx, page_size, k, rng)
            t, x = args.decode_seqs, args.decode_pages
        elif mode == "prefill":
            chunks = prefill_chunks(args.prefill_tokens, page_size, k, rng, first_page=1)
            t, x = args.prefill_tokens, args.prefill_pages
        else:  # decode rows first, then prefill chunks on the pages after theirs; a step holds at
            # most max_num_seqs sequences, so decode rows give way to the prompts (as the engine's
            # scheduler admits prompts only beside fewer running sequences)
            rows = min(args.decode_seqs, args.max_num_seqs - (args.prefill_tokens - args.decode_seqs) // 48)
            while rows > 0 and rows + (args.prefill_tokens - rows) // 48 > args.max_num_seqs:
                rows -= 1
            if rows != args.decode_seqs:
                print(f"# mixed: {rows} decode rows (not {args.decode_seqs}) beside "
                      f"{(args.prefill_tokens - rows) // 48} prompts: at most {args.max_num_seqs} sequences a step")
            chunks = workload_chunks("decode", rows, args.decode_ctx, page_size, k, rng)
            chunks += prefill_chunks(args.prefill_tokens - rows, page_size, k, rng,
                                     first_page=1 + sum(c.num_pages for c in chunks))
            t, x = args.prefill_tokens, args.prefill_pages
        need = sum(pages_needed(c, page_size) for c in chunks)
        x = x or pow2_pages(need)
        scal = np.full(s, 2.0, np.float32)
        scal[0] = 0
        ranks = np.full(s, args.rank, np.int32)
        ranks[0] = 0
        lora = None
        backend = "bgmv"
        prepare = None
        if be != "-":
            if (s, lora_dtype) not in pools:  # one pool per size and dtype, shared by the cases
                # rows-major, as the engine keeps its pools (multilora.lora.pool.POOL_LAYOUT)
                pools[(s, lora_dtype)] = rows_major(random_lora(cfg, s, args.rank, dtype=lora_dtype))
            lora = pools[(s, lora_dtype)]
            # As the runner: a step of at most max_num_seqs tokens counts as a decode shape.
            backend = choose_backend(be, t, t <= args.max_num_seqs, s,
                                     be == "auto" and native_usable(jnp.dtype(lora_dtype), jax.devices()[:1]),
                                     jax.devices()[0].platform)
            lora_be = get_backend(backend.split(SWITCH)[0])
            cap = grouped_cap(t) if SWITCH in backend else args.max_num_seqs  # as the runner
            table = slot_major_rows(s, args.rank)
            prepare = lambda slot_T: lora_be.prepare_lora_batch(slot_T, scal, ranks, table, cap)  # noqa: E731
        batch = build_batch(chunks, num_tokens=t, num_pages=x, num_logits=min(t, args.max_num_seqs),
                            page_size=page_size, prepare_lora=prepare)
        num_cache_pages = max(1 + max(max(c.block_table) for c in chunks), args.cache_pages or 0)
        # kv heads a cache row as an engine would make them ($MULTILORA_KV_LANE_PACK, Pallas attention only)
        lanes = kv_lanes.lane_pack_for(cfg, jax.devices()[0].platform) if pa else 1
        kv_dtype = kv_cache_dtype(dtype, jax.devices()[0].platform)   # as an engine makes it
        kv = (make_kv_cache(cfg, num_cache_pages, page_size, kv_dtype, one, True, lane_pack=lanes) if hm
              else init_kv_cache(cfg, num_cache_pages, page_size, kv_dtype))
        fwd = fwds[hm]
        what = f"{mode} {k} adapters {backend} {'pallas' if pa else 'xla'} attention {lay}"
        print(f"# compiling {what} ...", flush=True)
        t0 = time.perf_counter()
        run = fwd.compiled(weights, lora, kv, batch, cfg=cfg, backend=backend, native_attention=nat,
                           kv_heads_major=hm, pallas_attention=pa, kv_write=kw)
        compile_s = time.perf_counter() - t0
        print(f"# compiled {what}: {compile_s:.1f} s; its first step ...", flush=True)
        t0 = time.perf_counter()
        logits, kv = run(weights, lora, kv, batch)
        logits.block_until_ready()
        first_s = time.perf_counter() - t0
        print(f"# ran {what} once: {first_s:.2f} s", flush=True)
        state[(mode, k, be, nat, lay)] = dict(weights=weights, batch=batch, lora=lora, kv=kv, backend=backend,
                                              native=nat, hm=hm, pa=pa, kw=kw, fwd=run, jit=fwd, times=[],
                                              tokens=t, pages=x, compile_s=compile_s, first_step_s=first_s)
    peaks = []  # --roofline: the matmul peak measured just before each round
    for _ in range(args.repeats):
        if args.roofline:
            peaks.append(measure_peak_flops("float32", seconds=0.5))
        for key, st in state.items():
            t0 = time.perf_counter()
            logits, st["kv"] = st["fwd"](st["weights"], st["lora"], st["kv"], st["batch"], cfg=cfg,
                                         backend=st["backend"], native_attention=st["native"], kv_heads_major=st["hm"],
                                         pallas_attention=st["pa"], kv_write=st["kw"])
            logits.block_until_ready()
            st["times"].append(time.perf_counter() - t0)
    # Back to back: steps dispatched without waiting for the one before (as the engine's async
    # scheduling runs them), blocked on once at the end: what a step costs when its host work and
    # launch hide behind the step before it.
    for st in state.values():
        t0 = time.perf_counter()
        for _ in range(PIPELINED_STEPS):
            logits, st["kv"] = st["fwd"](st["weights"], st["lora"], st["kv"], st["batch"], cfg=cfg,
                                         backend=st["backend"], native_attention=st["native"], kv_heads_major=st["hm"],
                                         pallas_attention=st["pa"], kv_write=st["kw"])
        logits.block_until_ready()
        st["pipelined_s"] = (time.perf_counter() - t0) / PIPELINED_STEPS
        packs = []  # the host's share alone: the batch packed and on the device, nothing run
        for _ in range(PIPELINED_STEPS):
            t0 = time.perf_counter()
            jax.block_until_ready(st["jit"]._args(st["batch"])[:2])
            packs.append(time.perf_counter() - t0)
        st["pack_s"] = statistics.median(packs)
    rows = []
    # "vs 0": against the no-adapter case of the same mode, attention and layer layout
    base = {(m, nat, lay): statistics.median(st["times"])
            for (m, k, be, nat, lay), st in state.items() if be == "-"}
    print(f"{'mode':8} {'T':>5} {'X':>5} {'attention':>9} {'layers':>18} {'adapters':>8} {'backend':>8} "
          f"{'median ms':>10} {'vs 0':>6} {'compile s':>9} {'back to back ms':>15} {'pack ms':>7}")
    for (mode, k, be, nat, lay), st in state.items():
        med = statistics.median(st["times"])
        key = (mode, nat, lay.split("+")[0])
        rel = med / base[key] if key in base else float("nan")
        att = "native" if nat else ("pallas" if st["pa"] else "xla")
        print(f"{mode:8} {st['tokens']:>5} {st['pages']:>5} {att:>9} {lay:>18} {k:>8} {st['backend']:>8} "
              f"{1e3 * med:10.2f} {rel:6.2f} {st['compile_s']:9.1f} {1e3 * st['pipelined_s']:15.2f} "
              f"{1e3 * st['pack_s']:7.2f}")
        if peaks and mode == "decode":
            flops = step_flops(SHAPES[args.model], st["tokens"], args.decode_ctx, st["tokens"] if k else 0)
            st["pct_of_roofline"] = 100 * statistics.median(flops / p / t for p, t in zip(peaks, st["times"]))
            print(f"{'':8} {flops / 1e9:.1f} GFLOP a step at a matmul peak of {statistics.median(peaks) / 1e9:.0f} "
                  f"GFLOP/s (median of {len(peaks)}): {st['pct_of_roofline']:.0f} % of the roofline")
        rows.append(dict(mode=mode, tokens=st["tokens"], pages=st["pages"], adapters=k, backend=st["backend"],
                         attention=att, layers=lay, kv_layout="heads-major" if st["hm"] else "default", asked=be, median_s=med, times=st["times"], vs_no_adapter=rel,
                         compile_s=st["compile_s"], first_step_s=st["first_step_s"],
                         back_to_back_s=st["pipelined_s"], pack_s=st["pack_s"],
                         **({"pct_of_roofline": st["pct_of_roofline"]} if "pct_of_roofline" in st else {})))
    if args.trace:
        for (mode, k, be, nat, lay), st, row in zip(state.keys(), state.values(), rows):
            row["op_ms_by_kind"] = trace_case(args.trace / f"{mode}_k{k}_{st['backend']}_{row['attention']}_{lay}",
                                              st["jit"], st["weights"], st, cfg)
            print(f"\n{mode}, {k} adapters, {st['backend']}, {row['attention']} attention, {lay} layers: "
                  f"op time per step by kind "
                  f"(both cores; wall {1e3 * row['median_s']:.0f} ms)")
            total = sum(row["op_ms_by_kind"].values())
            for kind, ms in list(row["op_ms_by_kind"].items())[:25]:
                print(f"  {ms:8.1f} ms {100 * ms / total:5.1f} %  {kind}")
    if args.json:
        save_json(args.json, dict(machine=machine_info(), args={k: str(v) for k, v in vars(args).items()},
                                  rows=rows, **({"matmul_peaks_GFLOPs": [p / 1e9 for p in peaks]} if peaks else {})))


def trace_case(folder: Path, fwd, weights, st, cfg, steps: int = 3) -> dict[str, float]:
    """Op self time per step (ms) by kind: XLA op name family + the jnp op it was made from (an
    op's time less the ops nested in it on the same line of the trace, so a loop's own line is
    its overhead, not its body). Also writes the compiled HLO and the top ops by their full jnp
    path (with counts per step) into `folder`."""
    kw = dict(cfg=cfg, backend=st["backend"], native_attention=st["native"], kv_heads_major=st["hm"],
              pallas_attention=st["pa"], kv_write=st["kw"])
    hlo = fwd.lower(weights, st["lora"], st["kv"], st["batch"], **kw).compile().as_text()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "step.hlo.txt").write_text(hlo)
    jax.profiler.start_trace(str(folder), create_perfetto_trace=True)
    for _ in range(steps):
        logits, st["kv"] = fwd(weights, st["lora"], st["kv"], st["batch"], **kw)
        logits.block_until_ready()
    jax.profiler.stop_trace()
    trace = json.load(gzip.open(sorted(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True))[-1]))
    origin = {m.group(1): m.group(2) for m in re.finditer(r"^\s*%(\S+) = .*?op_name=\"([^\"]+)\"", hlo, re.M)}
    events = sorted((ev for ev in trace["traceEvents"] if ev.get("ph") == "X" and ev.get("name", "") in origin),
                    key=lambda ev: (ev.get("pid"), ev.get("tid"), ev["ts"], -ev["dur"]))
    self_us = [ev["dur"] for ev in events]
    stack: list[int] = []
    for i, ev in enumerate(events):   # subtract each op's time from the op it is nested in
        while stack and (events[stack[-1]].get("pid"), events[stack[-1]].get("tid")) == (ev.get("pid"), ev.get("tid")) \
                and ev["ts"] >= events[stack[-1]]["ts"] + events[stack[-1]]["dur"]:
            stack.pop()
        if stack and (events[stack[-1]].get("pid"), events[stack[-1]].get("tid")) != (ev.get("pid"), ev.get("tid")):
            stack = []
        if stack:
            self_us[stack[-1]] -= ev["dur"]
        stack.append(i)
    by_kind: collections.Counter = collections.Counter()
    by_path: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for ev, us in zip(events, self_us):
        name = ev["name"]
        family = "matmul" if name.startswith("ynn_fusion") else re.sub(r"\.\d+$", "", name)
        by_kind[f"{family}: {origin[name].rsplit('/', 1)[-1]}"] += us / 1e3 / steps
        path = re.sub(r"^jit\(\w+\)/", "", origin[name])
        by_path[path] += us / 1e3 / steps
        count[path] += 1 / steps
    with open(folder / "top_ops.txt", "w") as f:
        for path, ms in by_path.most_common(40):
            f.write(f"{ms:8.3f} ms {count[path]:6.0f}x  {path[-150:]}\n")
        f.write(gap_report(trace["traceEvents"], events, self_us, origin, steps))
    return dict(by_kind.most_common())


def gap_report(all_events, op_events, self_us, origin, steps: int) -> str:
    """Where a step's device time goes outside every op: the compiled step's span on the device
    (its module's events) against the ops' summed self time, and the gaps between one op's end and
    the next op's start on the same line, by size, the largest named by the ops around them."""
    lines = [op_events[i] for i in range(len(op_events))]
    modules = [ev for ev in all_events if ev.get("ph") == "X" and str(ev.get("name", "")).startswith("jit_")
               and any(ev.get("pid") == o.get("pid") for o in lines[:1])]
    span_ms = sum(ev["dur"] for ev in modules) / 1e3 / steps if modules else float("nan")
    busy_ms = sum(self_us) / 1e3 / steps
    gaps = []
    for prev, ev in zip(lines, lines[1:]):
        if (prev.get("pid"), prev.get("tid")) != (ev.get("pid"), ev.get("tid")):
            continue
        gap = ev["ts"] - max(prev["ts"] + prev["dur"], prev["ts"])
        if 0 < gap < 5e4:   # within a step (a step's end to the next one's start is not a gap)
            gaps.append((gap, prev["name"], ev["name"]))
    out = [f"\nstep on the device: {span_ms:.3f} ms a step (its module events), ops' self time {busy_ms:.3f} ms\n"]
    for lo, hi in ((0, 2), (2, 10), (10, 100), (100, 1e9)):
        sel = [g for g, *_ in gaps if lo <= g < hi]
        out.append(f"gaps {lo:>4}-{hi:<10g} us: {len(sel) / steps:7.0f} a step, {sum(sel) / 1e3 / steps:7.3f} ms a step\n")
    for gap, a, b in sorted(gaps, reverse=True)[:12]:
        out.append(f"  {gap:8.1f} us after {origin.get(a, a)[-70:]}  before {origin.get(b, b)[-70:]}\n")
    return "".join(out)


if __name__ == "__main__":
    main()
