"""Greedy tokens of the embedded model (SmolLM2-135M-Instruct) on another device and dtype against
the CPU's float32 path, base model and demo adapters (`shout`, `signoff`) in one batch (issue 37:
"greedy tokens on the chip agree with the CPU float32 path within a stated bf16 tolerance").

    python benchmarks/tpu_agreement.py record --json benchmarks/results/agreement_cpu_f32.json    # CPU, float32
    python benchmarks/tpu_agreement.py split --gguf PATH --parts DIR        # the GGUF in parts of 48 MB
    python benchmarks/tpu_agreement.py check --ref benchmarks/results/agreement_cpu_f32.json \\
        --gguf PATH --dtype bfloat16 --json OUT.json                          # the other device

`record` runs chat prompts greedily (32 new tokens) through the Engine at float32 on the CPU and
keeps each prompt's token ids and its tokens. `check` runs the same prompt ids on this process's
default device at --dtype and reports, per adapter: free-running, how many leading tokens equal
the CPU's (bf16 rounding flips a near-tie now and then, after which the two texts differ); teacher
forced (the CPU's whole sequence as the prompt, prompt_logprobs=1), the share of the CPU's tokens
that are this device's top-1 at their position. It exits 1 where a share is below --min-agree.
The chip has no network and carries at most 64 MiB a call: `split` cuts the model's GGUF (94 MB)
into parts that travel in separate calls of one warm lease (each copied to /tmp there) and are
joined on the machine; `check --gguf` converts it with multilora.default_model, as a first start
does (the `gguf` package travels as a wheel; benchmarks/tpu_steps.sh's part `agree`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "Summarize the plot of Romeo and Juliet.",
]
ADAPTERS = (None, "shout", "signoff")
NEW_TOKENS = 32


def _engine(model_dir: str, dtype: str):
    from multilora.demo_adapters import demo_lora_modules
    from multilora.engine.engine import Engine
    # float32 is the exact path (no bf16 projections, which `auto` takes on AVX512-BF16 or AMX CPUs)
    proj = "float32" if dtype == "float32" else "auto"
    # no warm-up: only the few shapes these batches land on compile (on a TPU v5e the whole
    # warm-up with adapters took longer than a 250 s limit: benchmarks/log/35)
    return Engine(model_dir, demo_lora_modules(), dtype=dtype, projection_dtype=proj, max_num_seqs=32,
                  kv_cache_memory_gb=0.5, warmup=False)


def _log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)


def _cases(engine=None, ref=None):
    """(adapter, prompt ids) for every prompt x adapter, from the engine's chat template or the record."""
    if ref is not None:
        return [(c["adapter"], c["prompt_ids"]) for c in ref["cases"]]
    tok = engine.tokenizer
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    return [(a, p) for a in ADAPTERS for p in ids]


def record(args) -> int:
    from multilora.default_model import default_model_dir
    from multilora.engine.request import SamplingParams
    eng = _engine(str(default_model_dir()), "float32")
    cases = _cases(eng)
    outs = eng.generate([p for _, p in cases], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                              ignore_eos=True), [a for a, _ in cases])
    data = dict(dtype="float32", device="cpu", new_tokens=NEW_TOKENS,
                cases=[dict(adapter=a, prompt_ids=list(map(int, p)), tokens=list(map(int, o.token_ids)))
                       for (a, p), o in zip(cases, outs)])
    Path(args.json).write_text(json.dumps(data))
    print(f"recorded {len(cases)} cases -> {args.json}")
    return 0


def split(args) -> int:
    data = Path(args.gguf).read_bytes()
    out = Path(args.parts)
    out.mkdir(parents=True, exist_ok=True)
    size = 48 * 1000 * 1000  # with the working tree, under a call's 64 MiB (tried: log 35)
    for i in range(0, len(data), size):
        (out / f"model.gguf.part{i // size}").write_bytes(data[i:i + size])
    print(f"{-(-len(data) // size)} parts in {out}")
    return 0


def check(args) -> int:
    import jax

    from multilora.default_model import convert_gguf_to_hf, is_converted
    from multilora.engine.request import SamplingParams
    t0 = time.perf_counter()
    ref = json.loads(Path(args.ref).read_text())
    folder = Path(args.model_dir)
    if not is_converted(folder):
        convert_gguf_to_hf(Path(args.gguf), folder)
    _log(f"model in {folder}; starting the engine ({args.dtype}, {jax.devices()[0]})", t0)
    eng = _engine(str(folder), args.dtype)
    eng.runner.compiler.before_compile = lambda what, key: _log(f"compiling {what} {key}", t0)
    cases = _cases(ref=ref)
    want = [c["tokens"] for c in ref["cases"]]
    _log(f"engine up; {len(cases)} prompts free-running, {NEW_TOKENS} greedy tokens each", t0)
    free = eng.generate([p for _, p in cases], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                              ignore_eos=True), [a for a, _ in cases])
    _log("free-running done; the CPU's sequences teacher-forced (prompt_logprobs=1)", t0)
    forced = eng.generate([p + w for (_, p), w in zip(cases, want)],
                          SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), [a for a, _ in cases])
    _log("teacher-forced done", t0)
    report, ok = {}, True
    for (a, p), w, f, t in zip(cases, want, free, forced):
        lead = next((i for i, (x, y) in enumerate(zip(f.token_ids, w)) if x != y), len(w))
        tops = [t.prompt_logprobs[len(p) + i].top[0][0] for i in range(len(w))]
        r = report.setdefault(str(a), dict(cases=0, leading_equal=[], forced_agree=0, forced_total=0))
        r["cases"] += 1
        r["leading_equal"].append(lead)
        r["forced_agree"] += sum(x == y for x, y in zip(tops, w))
        r["forced_total"] += len(w)
    for name, r in report.items():
        r["forced_share"] = r["forced_agree"] / r["forced_total"]
        ok &= r["forced_share"] >= args.min_agree
        print(f"adapter {name}: teacher-forced top-1 agreement {r['forced_share']:.3f} "
              f"({r['forced_agree']}/{r['forced_total']}), leading equal tokens {r['leading_equal']}")
    result = dict(device=str(jax.devices()[0]), dtype=args.dtype, reference=ref["device"] + "/" + ref["dtype"],
                  min_agree=args.min_agree, passed=bool(ok), adapters=report)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print("PASS" if ok else f"FAIL: a teacher-forced agreement below {args.min_agree}")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--json", required=True)
    s = sub.add_parser("split")
    s.add_argument("--gguf", required=True)
    s.add_argument("--parts", required=True)
    c = sub.add_parser("check")
    c.add_argument("--ref", required=True)
    c.add_argument("--gguf", default=None, help="the model's GGUF, converted into --model-dir if not there yet")
    c.add_argument("--model-dir", default="/tmp/smollm2")
    c.add_argument("--dtype", default="bfloat16")
    c.add_argument("--min-agree", type=float, default=0.95)
    c.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    return {"record": record, "split": split, "check": check}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
