"""The KV cache heads-major (multilora.model.llama.KV_HEADS_MAJOR, a TPU's) against the device's
default layout, on one device: the same step (SmolLM2-135M's shape, random weights, no LoRA) over
the same random cache contents, compiled each way with the cache's formats in and out, and
compared: logits and the written cache (bit-equal or not, max |diff|), then timed (medians of 7).
The default layout's step is the path every earlier measurement took.

    python benchmarks/kv_layout_outputs.py                                  # bf16; 64 decode rows,
    MODES="decode prefill mixed" NPAGES="0 3000" python benchmarks/kv_layout_outputs.py   # 512 prefill
    OUT=dir SMALL=1 JAX_PLATFORMS=cpu python benchmarks/kv_layout_outputs.py   # 2 layers: a CPU try-out

NPAGES: cache pages (0: as many as the step's sequences hold). Writes $OUT/heads_major.json.
"""
import os, statistics, sys, time, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import jax, jax.numpy as jnp, numpy as np
from benchmarks.common import SMOLLM2_135M
from benchmarks.forward_step import random_weights, workload_chunks, prefill_chunks, pow2_pages
from benchmarks.hlo_copies import large_copies
from multilora.config import ModelConfig
from multilora.engine.batching import build_batch, pages_needed
from multilora.model.llama import forward, KVCache, kv_cache_formats, make_kv_cache, is_heads_major

OUT = Path(os.environ.get("OUT", "/tmp/kv-layout-out")); OUT.mkdir(parents=True, exist_ok=True)
cfg_d = dict(SMOLLM2_135M)
if os.environ.get("SMALL"):
    cfg_d.update(num_hidden_layers=2, vocab_size=1024)
cfg = ModelConfig.from_hf_dict(cfg_d)
dt = jnp.dtype(os.environ.get("DT", "bfloat16"))
one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
w = jax.tree.map(lambda a: a.astype(dt), random_weights(cfg))
rng = np.random.default_rng(0)
res = {}
for npages_env in os.environ.get("NPAGES", "0").split():
    for mode in os.environ.get("MODES", "decode prefill mixed").split():
        if mode == "decode":
            chunks, t = workload_chunks("decode", 64, 80, 16, 0, rng), 64
        elif mode == "prefill":
            chunks, t = prefill_chunks(512, 16, 0, rng, first_page=1), 512
        else:
            chunks = workload_chunks("decode", 64, 80, 16, 0, rng)
            chunks += prefill_chunks(512 - 64, 16, 0, rng, first_page=1 + sum(c.num_pages for c in chunks))
            t = 512
        x = pow2_pages(sum(pages_needed(c, 16) for c in chunks))
        batch = build_batch(chunks, num_tokens=t, num_pages=x, num_logits=min(t, max(64, len(chunks))), page_size=16)
        npages = int(npages_env) or 1 + max(max(c.block_table) for c in chunks)
        shape = (cfg.num_layers, npages, 16, cfg.num_kv_heads, cfg.head_dim)
        host = [np.asarray(jax.random.normal(jax.random.PRNGKey(i), shape, jnp.float32).astype(dt)) for i in (7, 8)]
        outs = {}
        for hm in (False, True):
            fmts = kv_cache_formats(KVCache(one, one), hm)
            kv = make_kv_cache(cfg, npages, 16, dt, one, hm)
            assert is_heads_major(kv.k_LPpKH) or not hm, kv.k_LPpKH.format
            kv = KVCache(*(jax.device_put(h, f) for h, f in zip(host, (fmts.k_LPpKH, fmts.v_LPpKH))))
            fwd = jax.jit(forward, static_argnames=("cfg", "backend", "native_attention", "kv_heads_major"),
                          donate_argnames=("kv",), out_shardings=(one, fmts))
            t0 = time.perf_counter()
            comp = fwd.lower(w, None, kv, batch, cfg=cfg, backend="bgmv", kv_heads_major=hm).compile()
            ctime = time.perf_counter() - t0
            copies = large_copies(comp.as_text(), 1 << 20)
            lg, kv = comp(w, None, kv, batch)
            first = np.asarray(lg).astype(np.float32)
            kk, vv = np.asarray(kv.k_LPpKH), np.asarray(kv.v_LPpKH)
            assert is_heads_major(kv.k_LPpKH) or not hm
            ts = []
            for _ in range(7):
                t0 = time.perf_counter(); lg, kv = comp(w, None, kv, batch); lg.block_until_ready(); ts.append(time.perf_counter() - t0)
            med = statistics.median(ts)
            outs[hm] = (first, kk, vv)
            key = f"{mode}/pages={npages}/{'heads_major' if hm else 'default'}"
            res[key] = dict(median_ms=1e3 * med, times_ms=[1e3 * t for t in ts], compile_s=ctime,
                            kv_bytes_on_device=kv.k_LPpKH.addressable_shards[0].data.on_device_size_in_bytes(),
                            kv_bytes_logical=kv.k_LPpKH.nbytes,
                            copies=[f"{c['mb']:.1f} MB {c['dtype']}{c['shape']} {c['frm']} -> {c['to']} in {c['computation'][:30]}" for c in copies])
            print(f"{key:40} {1e3*med:8.2f} ms  copies>=1MB {len(copies)} ({sum(c['mb'] for c in copies):.0f} MB) "
                  f"kv {res[key]['kv_bytes_on_device']/2**20:.1f} MB on device", flush=True)
            for c in res[key]["copies"]:
                print("     ", c)
            del kv
        (l0, k0, v0), (l1, k1, v1) = outs[False], outs[True]
        cmp = dict(max_abs_logit_diff=float(np.max(np.abs(l0 - l1))), max_abs_logit=float(np.max(np.abs(l0))),
                   logits_equal=bool(np.array_equal(l0, l1)), k_equal=bool(np.array_equal(k0, k1)),
                   v_equal=bool(np.array_equal(v0, v1)),
                   argmax_equal=bool(np.array_equal(l0.argmax(-1), l1.argmax(-1))))
        res[f"{mode}/pages={npages}/compare"] = cmp
        print("   compare:", cmp, flush=True)
json.dump(res, open(OUT / "heads_major.json", "w"), indent=1)
