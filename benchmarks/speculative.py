"""Speculative decoding by n-gram lookup (issue 43): what it gains, and when it steps aside.

`streams` (the default): one request at a time on the embedded SmolLM2-135M-Instruct with the demo
adapters (the base model, `shout` and `signoff` in turn), greedy, on copy-heavy prompts (repeat,
quote, edit a given text, edit code) and on open questions, each prompt run without and with
speculation side by side in one process on one engine (the speculator switched off and on, so
both share the compiled shapes and the KV cache; the order alternates every repeat: the
machine's speed drifts). Reports tokens/s medians per kind, their ratio, the acceptance rate, and
checks that the greedy tokens are identical (also on one mixed batch of every prompt and adapter).

`step-cost`: a step's time for B decode rows of n tokens each (B 1..64, n 1..1+k), every row's
positions with logits as a drafted row has: the measurement behind the never-a-loss rule
(SpeculativeConfig.max_step_tokens).

    python benchmarks/speculative.py [--repeats 3] [--new-tokens 128] [--json out.json]
    python benchmarks/speculative.py --part step-cost [--json out.json]
    python benchmarks/speculative.py --model TARGET_DIR --draft-model DRAFT_DIR   # a draft model, base rows only
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks.common import machine_info, median, save_json  # noqa: E402

TEXT = ("The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night "
        "its keeper climbed the one hundred and twelve steps to light the lamp, and every morning he "
        "wrote the weather in a small blue notebook. Ships passing the point trusted its beam, and the "
        "village below grew around the harbour it protected.\n\nWhen the keeper retired, the lamp was "
        "replaced by an automatic light, and the notebooks were given to the town museum. Visitors can "
        "still read them today: short notes about storms, fog, calm seas and the birds that nested on "
        "the rocks each spring.")
CODE = ("def moving_average(values, window):\n    out = []\n    total = 0.0\n    for i, v in enumerate(values):\n"
        "        total += v\n        if i >= window:\n            total -= values[i - window]\n"
        "        if i >= window - 1:\n            out.append(total / window)\n    return out\n")
COPY = [
    f"Repeat the following text exactly, word for word:\n\n{TEXT}",
    f"Quote the second paragraph of this text word for word:\n\n{TEXT}",
    f"Rewrite this text, replacing the word 'keeper' with 'guardian' and changing nothing else:\n\n{TEXT}",
    f"Add a docstring to this Python function and return the whole function:\n\n{CODE}",
]
OPEN = [
    "What are the main causes of the seasons on Earth?",
    "Give me three ideas for a weekend trip with friends.",
    "Explain how a bicycle stays upright.",
    "Why do cats purr?",
]
ADAPTERS = (None, "shout", "signoff")


def one_stream(eng, prompt, params, lora):
    t0 = time.perf_counter()
    out = eng.generate(prompt, params, lora=lora)[0]
    return out, time.perf_counter() - t0


def streams(args):
    from multilora import Engine, SamplingParams
    from multilora.demo_adapters import demo_lora_modules
    spec = ({"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.k}
            if args.draft_model else
            {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
             "prompt_lookup_min": args.lookup_min})
    opts = dict(max_num_seqs=args.max_num_seqs) if args.max_num_seqs else {}
    adapters = ADAPTERS if args.model is None else (None,)  # the demo adapters are the embedded model's
    eng = Engine(args.model, demo_lora_modules() if args.model is None else {}, speculative_config=spec,
                 projection_dtype=args.projection_dtype, **opts)
    speculator = eng.speculator
    tok = eng.tokenizer
    prompts = {kind: [tok.encode_chat([{"role": "user", "content": p}]) for p in ps]
               for kind, ps in (("copy", COPY), ("open", OPEN))}
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0)
    jobs = [(kind, i, p, adapters[i % len(adapters)]) for kind, ps in prompts.items() for i, p in enumerate(ps)]
    eng.generate([p for _, _, p, _ in jobs[:2]], params, lora=[lo for *_, lo in jobs[:2]])  # warm paths
    runs = {(kind, i, mode): [] for kind, i, _, _ in jobs for mode in ("off", "on")}
    tokens, identical = {}, True
    for r in range(args.repeats):
        for kind, i, p, lora in jobs:
            order = ("off", "on") if (r + i) % 2 == 0 else ("on", "off")
            for mode in order:
                eng.speculator = speculator if mode == "on" else None
                before = dict(speculator.stats)
                out, secs = one_stream(eng, p, params, lora)
                drafted = speculator.stats["num_draft_tokens"] - before["num_draft_tokens"]
                accepted = speculator.stats["num_accepted_tokens"] - before["num_accepted_tokens"]
                runs[(kind, i, mode)].append(dict(tokens=len(out.token_ids), seconds=secs,
                                                  tok_per_s=len(out.token_ids) / secs,
                                                  drafted=drafted, accepted=accepted))
                prev = tokens.setdefault((kind, i), out.token_ids)
                identical &= prev == out.token_ids
    # one mixed batch: every prompt under every adapter at once, without and with
    everything = [(p, lo) for _, _, p, _ in jobs for lo in adapters]
    batch = {}
    for mode in ("off", "on"):
        eng.speculator = speculator if mode == "on" else None
        outs = eng.generate([p for p, _ in everything], params, lora=[lo for _, lo in everything])
        batch[mode] = [o.token_ids for o in outs]
    eng.speculator = speculator
    batch_identical = batch["off"] == batch["on"]
    differ = [dict(request=i, adapter=everything[i][1], first=next(
        (j for j, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))), tokens=len(x))
        for i, (x, y) in enumerate(zip(batch["off"], batch["on"])) if x != y]
    summary = {}
    print(f"one stream at a time, greedy, {args.new_tokens} new tokens at most, k={args.k}, "
          f"lookup {args.lookup_min}..{args.lookup_max}, {args.repeats} repeats")
    print("| prompts | tok/s without | tok/s with | speed-up | drafted | accepted |")
    print("|---|---|---|---|---|---|")
    for kind in prompts:
        med = {}
        for mode in ("off", "on"):
            # per prompt: its median tok/s; per kind: the median over its prompts
            med[mode] = median([median([x["tok_per_s"] for x in runs[(kind, i, mode)]])
                                for i in range(len(prompts[kind]))])
        drafted = sum(x["drafted"] for i in range(len(prompts[kind])) for x in runs[(kind, i, "on")])
        accepted = sum(x["accepted"] for i in range(len(prompts[kind])) for x in runs[(kind, i, "on")])
        ratios = [median([x["tok_per_s"] for x in runs[(kind, i, "on")]])
                  / median([x["tok_per_s"] for x in runs[(kind, i, "off")]]) for i in range(len(prompts[kind]))]
        summary[kind] = dict(tok_per_s_off=med["off"], tok_per_s_on=med["on"], speedup=med["on"] / med["off"],
                             per_prompt_speedup=ratios, drafted=drafted, accepted=accepted,
                             acceptance=accepted / drafted if drafted else None)
        print(f"| {kind} | {med['off']:.1f} | {med['on']:.1f} | {med['on'] / med['off']:.2f}x | {drafted} | "
              f"{accepted} ({100 * accepted / max(drafted, 1):.0f} %) |")
        print(f"  per prompt: {', '.join(f'{v:.2f}x' for v in ratios)}")
    print(f"projections: {eng.projection_mode}; greedy tokens identical one at a time: {identical}; in one "
          f"mixed batch of {len(everything)} requests: {batch_identical}"
          + (f" (differing: {differ})" if differ else "") + f"; compiles after warm-up: "
          f"{eng.runner.compiles_after_warmup}")
    if args.json:
        save_json(args.json, dict(machine=machine_info(), args=vars(args), summary=summary,
                                  identical=identical, batch_identical=batch_identical, batch_differ=differ,
                                  projections=eng.projection_mode,
                                  compiles_after_warmup=eng.runner.compiles_after_warmup,
                                  runs={"/".join(map(str, k)): v for k, v in runs.items()}))


def step_cost(args):
    import numpy as np

    from multilora import Engine
    from multilora.engine.batching import SeqChunk
    from multilora.engine.runner import SampleRow
    opts = dict(max_num_seqs=args.max_num_seqs) if args.max_num_seqs else {}
    eng = Engine(None, max_loras_per_batch=0, warmup=False, **opts)
    runner, pages = eng.runner, eng.pages
    q = eng.buckets.max_num_seqs
    context = 96
    rows_of = {}
    print("| rows B | tokens a row n | step tokens | ms a step | ms / (B=., n=1) |")
    print("|---|---|---|---|---|")
    for b in (1, 2, 4, 8, 16, 32, 64):
        if b > q:
            break
        tables = [pages.allocate(pages.pages_for(context + 1 + args.k)) for _ in range(b)]
        base = None
        for n in range(1, args.k + 2):
            if b * n > min(q, eng.buckets.tokens[-1]):
                break
            chunks = [SeqChunk(list(np.arange(3, 3 + n)), context, t, 0, n) for t in tables]
            rows = [SampleRow(temperature=0.0)] * b
            runner.execute(chunks, rows)  # compile (once per shape) and warm
            times = []
            for _ in range(args.step_repeats):
                t0 = time.perf_counter()
                runner.execute(chunks, rows)
                times.append(time.perf_counter() - t0)
            ms = 1e3 * median(times)
            base = base or ms
            rows_of[(b, n)] = ms
            print(f"| {b} | {n} | {b * n} | {ms:.1f} | {ms / base:.2f} |")
        for t in tables:
            pages.free(t)
    if args.json:
        save_json(args.json, dict(machine=machine_info(), args=vars(args),
                                  step_ms={f"{b}x{n}": v for (b, n), v in rows_of.items()}))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("streams", "step-cost"), default="streams")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--step-repeats", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="the engine's (default: its default)")
    ap.add_argument("--projection-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="the engine's (auto: bfloat16 where the CPU runs multilora's bf16 GEMM)")
    ap.add_argument("--model", default=None, help="the target's folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--draft-model", default=None,
                    help="a draft model's folder (method draft_model, same vocabulary) instead of the n-gram lookup")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    (streams if args.part == "streams" else step_cost)(args)


if __name__ == "__main__":
    main()
