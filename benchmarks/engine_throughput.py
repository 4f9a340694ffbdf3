"""Generated tokens per second: 64 requests (prompt ~48 tokens, 64 new tokens, greedy,
ignore_eos) on a random-weight model of SmolLM2-135M's shape (or --model's), over 0 / 1 / 8 / 64 adapters
(rank 16, all seven projections), through multilora's Engine and through transformers + PEFT's
mixed-batch generate(..., adapter_names=...). Ratios come from one run.

    python benchmarks/engine_throughput.py [--adapters 0 1 8 64] [--peft] [--json out.json]
    python benchmarks/engine_throughput.py --model llama-3.2-1b --adapters 0 8 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks.common import (SHAPES, fixed_prompts, machine_info, make_random_adapters,  # noqa: E402
                               make_random_model, save_json)


MAX_NUM_SEQS, MAX_MODEL_LEN, PAGE_SIZE = 64, 128, 16  # the engine's settings below


def workload_buckets(n_requests: int, max_tokens_step: int = 512):
    """The shapes this workload uses (64 prompts of ~48 tokens, 64 new): a benchmark on a slow
    compiler (GPU) compiles just these instead of the full default set. Steps (decode rows,
    prefill chunks or both) of up to n_requests tokens, or of 128 / 256 / max_tokens_step, over
    at least 64 pages (every page of 8 sequences of this workload fits in 64)."""
    import dataclasses

    from multilora.engine.runner import Buckets
    full = Buckets.make(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=max_tokens_step,
                        max_model_len=MAX_MODEL_LEN, page_size=PAGE_SIZE,
                        num_pages=MAX_NUM_SEQS * -(-MAX_MODEL_LEN // PAGE_SIZE) + 1)
    seqs = tuple(b for b in (8, 16, 32, 64, 128) if b < n_requests) + (n_requests,)
    tokens = tuple(sorted({t for t in seqs + (128, 256) if t < max_tokens_step} | {max_tokens_step}))
    return dataclasses.replace(full, tokens=tokens, pages=tuple(x for x in full.pages if x >= 64))


def build_engine(model_dir, adapters, backend, max_loras, dtype="float32", fixed_buckets=False, quantization=None,
                 async_scheduling=None, warmup=True, num_prompts=64):
    """multilora's Engine over these adapters (named a0, a1, ...); its start-up seconds."""
    from multilora import Engine
    k = len(adapters)
    t0 = time.time()
    eng = Engine(str(model_dir), {f"a{i}": str(p) for i, p in enumerate(adapters)},
                 max_loras_per_batch=max(1, min(k, max_loras)) if k else 0,
                 max_lora_rank=16, lora_backend=backend, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=512,
                 max_model_len=MAX_MODEL_LEN, page_size=PAGE_SIZE, dtype=dtype, quantization=quantization,
                 buckets=workload_buckets(num_prompts) if fixed_buckets else None,
                 async_scheduling=async_scheduling, warmup=warmup)
    return eng, time.time() - t0


WARM_RUNS = 3   # untimed runs of the workload at most, before an on-first-use engine's timed runs


def measure(eng, k, prompts, new_tokens, repeats=1, warm_run=False, backend="auto", dtype="float32",
            quantization=None) -> dict:
    """Generated tokens / s of the workload with its requests spread over the engine's first k
    adapters: the median of `repeats` timed runs, after an untimed touch of 4 requests (an engine
    warmed up at start) or untimed runs of the whole workload until one compiles nothing (warm_run:
    an engine that compiles on first use compiles what the workload uses there, as
    sglang_jax_driver.py's offline run does; the first run's prompts are new to the prefix cache
    and the later runs' cached, so their steps differ and a second run compiles their shapes; at
    most WARM_RUNS), their seconds recorded as warm_run_s (the whole workload's, summed) or
    touch_s (the 4 requests)."""
    from multilora import SamplingParams
    names = [f"a{i % k}" if k else None for i in range(len(prompts))]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    n = len(prompts) if warm_run else 4
    warm_runs, warm_compiles = [], []
    for _ in range(WARM_RUNS if warm_run else 1):
        c0, t0 = eng.runner.compiles, time.time()
        eng.generate(prompts[:n], params, lora=names[:n])
        warm_runs.append(time.time() - t0)
        warm_compiles.append(eng.runner.compiles - c0)
        if warm_compiles[-1] == 0:
            break
    warm_s = sum(warm_runs)
    runs, compiled = [], []  # timed runs (their median) and the shapes each compiled: an engine
    # that compiles on first use may still meet a step shape its untimed runs did not (batches follow timing)
    for _ in range(max(1, repeats)):
        c0, t0 = eng.runner.compiles, time.time()
        outs = eng.generate(prompts, params, lora=names)
        runs.append(time.time() - t0)
        compiled.append(eng.runner.compiles - c0)
    secs = statistics.median(runs)
    toks = sum(len(o.token_ids) for o in outs)
    return dict(system="multilora", adapters=k, slots=eng.lora_cfg.max_loras_per_batch if eng.slots else 0,
                backend=backend, dtype=dtype, quantization=quantization, async_scheduling=eng.async_scheduling,
                projections=eng.projection_mode, tokens=toks, seconds=secs, run_seconds=runs, run_compiles=compiled,
                tok_per_s=toks / secs, warm_run_s=warm_s if warm_run else None,
                warm_runs=dict(seconds=warm_runs, compiles=warm_compiles) if warm_run else None,
                touch_s=None if warm_run else warm_s, steps=dict(eng.stats),
                compiles_after_warmup=eng.runner.compiles_after_warmup)


def run_multilora(model_dir, adapters, prompts, new_tokens, backend, max_loras, dtype="float32",
                  fixed_buckets=False, quantization=None, async_scheduling=None, repeats=1):
    """One engine for these adapters, warmed up at start, measured, dropped."""
    eng, init_s = build_engine(model_dir, adapters, backend, max_loras, dtype, fixed_buckets, quantization,
                               async_scheduling, num_prompts=len(prompts))
    res = measure(eng, len(adapters), prompts, new_tokens, repeats, backend=backend, dtype=dtype,
                  quantization=quantization)
    res["init_s"] = init_s
    del eng
    gc.collect()
    return res


def run_on_first_use(model_dir, adapters, counts, prompts, new_tokens, backend, max_loras, dtype, quantization,
                     async_scheduling, repeats):
    """sglang_jax_driver.py's offline method: no compile at start-up; an engine without LoRA for 0
    adapters, one engine over max(counts) adapters for every other count (rows spread over its
    first k); before each count's timed runs, one untimed run of the workload compiles its shapes.
    Yields each count's result as it is measured."""
    for group in ([0] if 0 in counts else [], [k for k in counts if k]):
        if not group:
            continue
        eng, init_s = build_engine(model_dir, adapters[:max(group)], backend, max_loras, dtype,
                                   quantization=quantization, async_scheduling=async_scheduling, warmup=False)
        for k in group:
            r = measure(eng, k, prompts, new_tokens, repeats, warm_run=True, backend=backend, dtype=dtype,
                        quantization=quantization)
            r.update(init_s=init_s, warmup="on first use")
            yield r
        del eng
        gc.collect()


def run_peft(model_dir, adapters, prompts, new_tokens, batch, device="cpu"):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    k = len(adapters)
    if k:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapters[0], adapter_name="a0")
        for i, p in enumerate(adapters[1:], start=1):
            model.load_adapter(p, adapter_name=f"a{i}")
    model.eval().to(device)
    names = [f"a{i % k}" for i in range(len(prompts))] if k else None
    toks = 0
    t0 = time.time()
    for s in range(0, len(prompts), batch):
        chunk = prompts[s:s + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        kw = dict(adapter_names=names[s:s + batch]) if k else {}
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kw)
        toks += (out.shape[1] - width) * len(chunk)
    secs = time.time() - t0
    import peft
    import transformers
    return dict(system="transformers+peft", adapters=k, batch=batch, device=device, tokens=toks, seconds=secs,
                tok_per_s=toks / secs, versions=dict(torch=torch.__version__,
                                                     transformers=transformers.__version__,
                                                     peft=peft.__version__))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES),
                    help="the random-weight model's shape")
    ap.add_argument("--adapters", type=int, nargs="*", default=[0, 1, 8, 64])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--max-loras-per-batch", type=int, default=64)
    ap.add_argument("--peft", action="store_true", help="also run transformers + PEFT")
    ap.add_argument("--peft-batch", type=int, default=16)
    ap.add_argument("--peft-device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None, choices=["int8"], help="the engine's quantization (int8 base)")
    ap.add_argument("--fixed-buckets", action="store_true",
                    help="compile only this workload's shapes (for slow compilers, e.g. GPU)")
    ap.add_argument("--async-scheduling", nargs="+", default=["auto"], choices=["auto", "on", "off"],
                    help="the engine's async_scheduling (auto: on with an accelerator); several: each in turn")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs of the workload (their median)")
    ap.add_argument("--warmup", default="all", choices=["all", "on-first-use"],
                    help="all: each adapter count's own engine compiles every step shape at start (the Engine's "
                         "default); on-first-use: sglang_jax_driver.py's offline method (no compile at start, one "
                         "engine over max(--adapters) adapters for every count > 0, an untimed run of the "
                         "workload before each count's timed runs)")
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/multilora/bench"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.warmup == "on-first-use":  # what that method does not do, refused rather than dropped
        if args.fixed_buckets or args.peft or len(args.async_scheduling) > 1:
            ap.error("--warmup on-first-use takes one --async-scheduling value and neither --fixed-buckets "
                     "(it compiles only what the workload uses anyway) nor --peft (run those with --warmup all)")
    work = Path(args.workdir)
    small = args.model == "smollm2-135m"  # its folders keep their earlier names
    # the 1B shape's weights in float16: 2.5 GB to write rather than 5 (the engine casts them)
    model_dir = make_random_model(work / f"{args.model}-random", SHAPES[args.model],
                                  dtype="float32" if small else "float16")
    adapters = make_random_adapters(model_dir, work / ("adapters" if small else f"adapters-{args.model}"),
                                    max(args.adapters))
    prompts = fixed_prompts(args.requests, args.prompt_len, 49152)
    results = []
    modes = {"auto": None, "on": True, "off": False}
    if args.warmup == "on-first-use":
        for r in run_on_first_use(model_dir, adapters, args.adapters, prompts, args.new_tokens, args.backend,
                                  args.max_loras_per_batch, args.dtype, args.quantization,
                                  modes[args.async_scheduling[0]], args.repeats):
            print(f"multilora  adapters={r['adapters']:3d} ({r['projections']}, {r['slots']} slots, compiled on "
                  f"first use): {r['tok_per_s']:7.1f} tok/s (median of "
                  f"{', '.join(f'{x:.2f}' for x in r['run_seconds'])} s, shapes compiled in each "
                  f"{r['run_compiles']}; start {r['init_s']:.1f} s, untimed runs "
                  f"{', '.join(f'{x:.1f}' for x in r['warm_runs']['seconds'])} s compiling "
                  f"{r['warm_runs']['compiles']})", flush=True)
            results.append(r)
            if args.json:
                save_json(args.json, dict(machine=machine_info(), args=vars(args), results=results))
    for k in (args.adapters if args.warmup == "all" else []):
        for a in args.async_scheduling:
            r = run_multilora(model_dir, adapters[:k], prompts, args.new_tokens, args.backend,
                              args.max_loras_per_batch, args.dtype, args.fixed_buckets, args.quantization,
                              modes[a], args.repeats)
            print(f"multilora  adapters={k:3d} ({r['projections']}, async {r['async_scheduling']}): "
                  f"{r['tok_per_s']:7.1f} tok/s ({r['seconds']:.1f}s)", flush=True)
            results.append(r)
            if args.json:  # as it goes: a run cut short keeps what it measured
                save_json(args.json, dict(machine=machine_info(), args=vars(args), results=results))
        if args.peft:
            r = run_peft(model_dir, adapters[:k], prompts, args.new_tokens, args.peft_batch,
                         args.peft_device)
            print(f"peft       adapters={k:3d}: {r['tok_per_s']:7.1f} tok/s ({r['seconds']:.1f}s)", flush=True)
            results.append(r)
    base = next((r["tok_per_s"] for r in results if r["system"] == "multilora" and r["adapters"] == 0), None)
    print("\n| adapters | multilora tok/s | vs no-adapter | PEFT tok/s | multilora / PEFT |")
    print("|---:|---:|---:|---:|---:|")
    for k in args.adapters:
        m = next(r for r in results if r["system"] == "multilora" and r["adapters"] == k)
        p = next((r for r in results if r["system"] != "multilora" and r["adapters"] == k), None)
        print(f"| {k} | {m['tok_per_s']:.1f} | {m['tok_per_s'] / base:.2f}x | "
              + (f"{p['tok_per_s']:.1f} | {m['tok_per_s'] / p['tok_per_s']:.1f}x |" if p else "- | - |")
              if base else "")
    if args.json:
        save_json(args.json, dict(machine=machine_info(), args=vars(args), results=results))


if __name__ == "__main__":
    main()
