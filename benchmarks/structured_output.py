"""What structured output costs: the offline 8-adapter workload (64 chat requests over 8 rank-16
adapters, greedy) on the embedded SmolLM2-135M-Instruct with the Engine's defaults, every row
free against every row constrained, in one process, the order reversed every other repeat
(the machine's speed drifts), medians of the per-repeat ratios.

Two constrained workloads:
- `long`: a JSON schema (an array of at least 64 short strings) that no row can finish inside
  --new-tokens, so constrained and free rows generate exactly the same number of tokens and the
  throughput ratio is the per-token cost of the masks;
- `object`: a realistic bounded object schema (rows stop when their JSON closes); every output
  is parsed and validated.

    python benchmarks/structured_output.py [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks.common import machine_info, make_random_adapters, median, save_json  # noqa: E402

LONG = {"type": "array", "minItems": 64, "items": {"type": "string", "maxLength": 12}}
OBJECT = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 24},
                         "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}}}


def timed(eng, prompts, params, names):
    t0 = time.time()
    steps0 = eng.stats["decode_steps"]
    outs = eng.generate(prompts, params, lora=names)
    secs = time.time() - t0
    toks = sum(len(o.token_ids) for o in outs)
    return outs, dict(tokens=toks, seconds=secs, tok_per_s=toks / secs,
                      decode_steps=eng.stats["decode_steps"] - steps0)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/multilora/bench"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import jsonschema

    from multilora import Engine, SamplingParams
    from multilora.engine.structured import StructuredOutput
    from multilora.default_model import default_model_dir
    model_dir = default_model_dir()
    adapters = make_random_adapters(model_dir, Path(args.workdir) / "smollm2-adapters-r16", args.adapters)
    eng = Engine(str(model_dir), {f"a{i}": str(p) for i, p in enumerate(adapters)})  # the defaults
    tok = eng.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": f"Describe person number {i} (name, age, city, "
                                                             "tags) as a JSON object."}])
               for i in range(args.requests)]
    names = [f"a{i % args.adapters}" for i in range(args.requests)]
    n = args.new_tokens
    free = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, structured=StructuredOutput.json_schema(LONG))
    obj = SamplingParams(max_tokens=n, temperature=0.0, structured=StructuredOutput.json_schema(OBJECT))
    eng.generate(prompts[:4], [free, long, obj, free], lora=names[:4])  # warm: grammars compiled, paths touched
    runs = {"free": [], "long": [], "object": []}
    order = [("free", free), ("long", long), ("object", obj)]
    for r in range(args.repeats):
        for kind, params in (order if r % 2 == 0 else order[::-1]):  # drift in speed cancels out
            outs, res = timed(eng, prompts, params, names)
            if kind == "long":
                assert all(len(o.token_ids) == n for o in outs), "a row of the long schema ended early"
            if kind == "object":
                valid = 0
                for o in outs:
                    if o.finish_reason == "stop":
                        jsonschema.validate(json.loads(o.text), OBJECT)
                        valid += 1
                res["valid_json"] = valid
            runs[kind].append(res)
            print(f"repeat {r} {kind:6s}: {res['tok_per_s']:6.1f} tok/s, {res['tokens']} tokens, "
                  f"{res['seconds']:.1f}s" + (f", {res['valid_json']}/{len(outs)} complete and valid"
                                             if kind == "object" else ""), flush=True)
    med = {k: median([x["tok_per_s"] for x in v]) for k, v in runs.items()}
    ratio_long = median([l["tok_per_s"] / f["tok_per_s"] for f, l in zip(runs["free"], runs["long"])])
    ratio_obj = median([o["tok_per_s"] / f["tok_per_s"] for f, o in zip(runs["free"], runs["object"])])
    print(f"\n| workload | tok/s (median of {args.repeats}) | vs free |")
    print("|---|---:|---:|")
    print(f"| free (no constraint) | {med['free']:.1f} | 1.00x |")
    print(f"| every row constrained, long schema (same tokens) | {med['long']:.1f} | {ratio_long:.2f}x |")
    print(f"| every row constrained, object schema | {med['object']:.1f} | {ratio_obj:.2f}x |")
    for kind in ("long", "object"):
        rs = sorted(x["tok_per_s"] / f["tok_per_s"] for f, x in zip(runs["free"], runs[kind]))
        print(f"{kind}: per-repeat ratios {', '.join(f'{v:.2f}' for v in rs)}")
    if args.json:
        save_json(args.json, dict(machine=machine_info(), args=vars(args), runs=runs,
                                  ratio_long=ratio_long, ratio_object=ratio_obj))


if __name__ == "__main__":
    main()
