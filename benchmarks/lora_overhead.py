"""What LoRA costs the base path, in rounds that interleave the cases so that they share the
machine's noise: serving.py's workload (64 prompts of ~48 tokens, 64 new tokens, greedy,
ignore_eos, SmolLM2-135M-Instruct, rank-16 adapters on all seven projections) through two
multilora Engines built once with their defaults:

  off        an Engine with LoRA disabled (no adapter registered)
  on-unused  an Engine with K adapters registered, serving base-model requests only
  on-8       the same Engine, each request on one of 8 adapters (round-robin)
  on-K       the same Engine, each request on one of the K adapters (uniform draw, serving.py's)

Each round runs every case once (after one untimed warm-up round, so the adapters the cases use
are resident: loading is load_during_decode.py's subject). The table gives each case's median
tok/s and its median ratio to `off` over the rounds (the ratio taken within each round).

    python benchmarks/lora_overhead.py --rounds 5 --json benchmarks/results/lora_overhead.json
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

from benchmarks.common import fixed_prompts, machine_info, save_json  # noqa: E402
from benchmarks.serving import CACHE, assign_adapters, ensure_adapters, model_dir  # noqa: E402


def timed(eng, prompts, lora, new_tokens) -> float:
    from multilora import SamplingParams
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params, lora=lora)
    secs = time.perf_counter() - t0
    return sum(len(o.token_ids) for o in outs) / secs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=64, help="K: adapters registered on the LoRA engine")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from multilora import Engine
    model = model_dir()
    import json
    cfg = json.loads((model / "config.json").read_text())
    k = args.adapters
    adapters = ensure_adapters(model, CACHE / "serving-adapters-r16", k)
    prompts = fixed_prompts(args.requests, args.prompt_len, cfg["vocab_size"])
    off = Engine(str(model))
    on = Engine(str(model), {f"a{i}": str(p) for i, p in enumerate(adapters)})
    print(f"projections {on.projection_mode}; adapter pool {on.lora_dtype.name}; "
          f"slots {on.lora_cfg.max_loras_per_batch}", flush=True)
    eight = [f"a{i % 8}" for i in range(args.requests)]
    drawn = [f"a{i}" for i in assign_adapters(args.requests, k, "uniform")]
    cases = {"off": (off, None), "on-unused": (on, None), "on-8": (on, eight), f"on-{k}": (on, drawn)}
    for eng, lora in cases.values():  # warm-up: every path touched, the used adapters resident
        timed(eng, prompts, lora, args.new_tokens)
    runs = {c: [] for c in cases}
    for rnd in range(args.rounds):
        for c, (eng, lora) in cases.items():
            gc.collect()
            runs[c].append(timed(eng, prompts, lora, args.new_tokens))
        print(f"round {rnd + 1}: " + ", ".join(f"{c} {v[-1]:.1f}" for c, v in runs.items()), flush=True)
    rows = []
    print("| case | median tok/s | min | max | median ratio to off |")
    print("|---|---:|---:|---:|---:|")
    for c, v in runs.items():
        ratio = statistics.median(x / o for x, o in zip(v, runs["off"]))
        rows.append(dict(case=c, tok_per_s=v, median=statistics.median(v), ratio_to_off=ratio))
        print(f"| {c} | {statistics.median(v):.1f} | {min(v):.1f} | {max(v):.1f} | {ratio:.2f}x |")
    if args.json:
        save_json(args.json, dict(machine=machine_info(), args=vars(args), projections=on.projection_mode,
                                  lora_dtype=on.lora_dtype.name, slots=on.lora_cfg.max_loras_per_batch,
                                  results=rows))


if __name__ == "__main__":
    main()
