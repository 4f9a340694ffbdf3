"""Where a step's time goes on an accelerator: forward_step's decode step (64 rows x ~80 cached
tokens) and prefill step (512 tokens), SmolLM2-135M's shape, random bf16 weights, no LoRA, with
parts of the attention replaced (decode attention, prefill attention, the K/V writes, all three:
zeros or the cache unchanged) and timed (medians of 7); for the unchanged steps, the copies of
>= 1 MB in the compiled HLO and a JAX profiler trace summed by XLA op (device ops only).

    OUT=dir python benchmarks/decode_ablation.py            # on the device (MULTILORA_NATIVE=0)
    OUT=dir SMALL=1 JAX_PLATFORMS=cpu python benchmarks/decode_ablation.py   # 2 layers: a try-out

Writes $OUT/prof.json and each step's optimized HLO. The KV cache is made in the device's default
layout (as before llama.KV_HEADS_MAJOR): this is the profile that found the in-loop cache copies.
"""
import collections, glob, gzip, inspect, json, os, re, statistics, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import jax, jax.numpy as jnp, numpy as np
from benchmarks.common import SMOLLM2_135M
from benchmarks.forward_step import random_weights, workload_chunks, prefill_chunks, pow2_pages
from benchmarks.hlo_copies import large_copies
from multilora.config import ModelConfig
from multilora.engine.batching import build_batch, pages_needed
from multilora.model import llama
from multilora.model.llama import forward, init_kv_cache

OUT = Path(os.environ.get("OUT", "/tmp/prof-out"))
OUT.mkdir(parents=True, exist_ok=True)
small = os.environ.get("SMALL")
cfg_d = dict(SMOLLM2_135M)
if small:
    cfg_d.update(num_hidden_layers=2, vocab_size=1024)
cfg = ModelConfig.from_hf_dict(cfg_d)
dt = jnp.bfloat16
w = jax.tree.map(lambda a: a.astype(dt), random_weights(cfg))
rng = np.random.default_rng(0)

def case(mode):
    if mode == "decode":
        chunks, t = workload_chunks("decode", 64, 80, 16, 0, rng), 64
    else:
        chunks, t = prefill_chunks(512, 16, 0, rng, first_page=1), 512
    x = pow2_pages(sum(pages_needed(c, 16) for c in chunks))
    batch = build_batch(chunks, num_tokens=t, num_pages=x, num_logits=min(t, 64), page_size=16)
    npages = 1 + max(max(c.block_table) for c in chunks)
    return batch, npages

orig = dict(decode_attention=llama.decode_attention, prefill_attention=llama.prefill_attention, write_kv=llama.write_kv)
zeros_att = lambda q, *a, **k: jnp.zeros_like(q)
variants = {
    "base": {},
    "no_decode_attn": dict(decode_attention=zeros_att),
    "no_prefill_attn": dict(prefill_attention=zeros_att),
    "no_write_kv": dict(write_kv=lambda c, *a: c),
    "no_attn_at_all": dict(decode_attention=zeros_att, prefill_attention=zeros_att, write_kv=lambda c, *a: c),
}

def timed(fn, args, kv, reps=7):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); logits, kv = fn(*args, kv); logits.block_until_ready(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts, kv

res = {}
for mode in (["decode", "prefill"]):
    batch, npages = case(mode)
    for name, patch in variants.items():
        if mode == "prefill" and name not in ("base",):
            continue
        for k, v in orig.items():
            setattr(llama, k, patch.get(k, v))
        fwd = jax.jit(lambda w, b, kv: forward(w, None, kv, b, cfg=cfg, backend="bgmv"), donate_argnums=(2,))
        kv = init_kv_cache(cfg, npages, 16, dt)
        t0 = time.perf_counter(); lg, kv = fwd(w, batch, kv); lg.block_until_ready(); comp = time.perf_counter() - t0
        med, ts, kv = timed(lambda *a: fwd(*a), (w, batch), kv)
        res[f"{mode}/{name}"] = dict(median_ms=1e3 * med, times_ms=[1e3 * t for t in ts], compile_s=comp)
        print(f"{mode:8} {name:18} {1e3*med:8.2f} ms  (compile {comp:.1f}s)", flush=True)
        if name == "base":
            hlo = fwd.lower(w, batch, kv).compile().as_text()
            (OUT / f"{mode}_base.hlo.txt").write_text(hlo)
            for c in large_copies(hlo, 1 << 20):
                print(f"   copy {c['mb']:7.1f} MB {c['dtype']}{c['shape']} {c['frm']} -> {c['to']} in {c['computation']}")
            # profile
            folder = OUT / f"trace_{mode}"
            jax.profiler.start_trace(str(folder), create_perfetto_trace=True)
            for _ in range(3):
                lg, kv = fwd(w, batch, kv); lg.block_until_ready()
            jax.profiler.stop_trace()
            origin = {m.group(1): m.group(2) for m in re.finditer(r"^\s*(?:ROOT )?%?(\S+) = .*?op_name=\"([^\"]+)\"", hlo, re.M)}
            files = sorted(glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True))
            if not files:
                print("   no trace"); continue
            tr = json.load(gzip.open(files[-1]))
            pname = {e["pid"]: e["args"]["name"] for e in tr["traceEvents"] if e.get("ph") == "M" and e.get("name") == "process_name"}
            tname = {(e["pid"], e["tid"]): e["args"]["name"] for e in tr["traceEvents"] if e.get("ph") == "M" and e.get("name") == "thread_name"}
            by = collections.Counter(); cnt = collections.Counter(); threads = collections.Counter()
            for e in tr["traceEvents"]:
                if e.get("ph") != "X": continue
                p = pname.get(e["pid"], ""); th = tname.get((e["pid"], e.get("tid")), "")
                threads[(p, th)] += e["dur"]
                if "TPU" in p and "XLA Ops" in th:
                    by[e["name"]] += e["dur"] / 1e3 / 3; cnt[e["name"]] += 1
            print("   trace threads:", [(k, round(v / 3e3, 2)) for k, v in threads.most_common(8)])
            tot = sum(by.values())
            print(f"   device op time per step {tot:.2f} ms; top ops:")
            top = []
            for n, ms in by.most_common(25):
                o = origin.get(n, "?")
                top.append(dict(name=n, ms=ms, calls=cnt[n] / 3, origin=o))
                print(f"   {ms:8.3f} ms x{cnt[n]/3:5.0f}  {n:28} {o[-110:]}")
            res[f"{mode}/{name}"]["top_ops"] = top
            res[f"{mode}/{name}"]["device_op_ms"] = tot
json.dump(res, open(OUT / "prof.json", "w"), indent=1)
