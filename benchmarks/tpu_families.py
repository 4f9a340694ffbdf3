"""Every supported family on another device (issue 40: "the TPU path checked on a TPU chip"): tiny
random checkpoints of each family in tests/reference.py's TINY_CONFIGS, a PEFT adapter on every
projection (rank 8), base and adapter rows in one batch, through multilora's Engine on this
process's default device, against transformers + PEFT's greedy tokens recorded on the CPU.

    python benchmarks/tpu_families.py record --dir .tpu-families     # CPU, the test dependencies
    python benchmarks/tpu_families.py check --dir .tpu-families --dtype float32 --json OUT.json

`record` (torch, transformers, peft: the test extras) writes each family's model and adapter under
--dir/<family>/ and PEFT's greedy tokens with, at each generated position, the log-probability
PEFT gives its own token (refs.json). `check` (no torch: the TPU machine) reports per family:
free-running, how many leading tokens equal PEFT's; teacher-forced (PEFT's whole sequence as the
prompt, prompt_logprobs=1), the share of PEFT's tokens that are this device's top-1, and the
largest difference between the two log-probabilities of PEFT's token. It exits 1 where a share is below
--min-agree. The folder is a few MB: it travels to the chip with the device tool's `carry`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NEW = 8
PROMPT_LENS = (5, 23, 14)   # the longer ones run past the tiny configs' sliding windows (5)
LORAS = [None, "a", "a"]


def record(args) -> int:
    import numpy as np
    import torch

    from tests import reference
    root = Path(args.dir)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in PROMPT_LENS]
    families = {}
    for kind in args.families or reference.TINY_CONFIGS:
        t0 = time.perf_counter()
        model = reference.make_tiny_model(root / kind / "model", kind, seed=3)
        adapter = reference.make_adapter(model, root / kind / "adapter", seed=4, r=8, lora_alpha=16,
                                         target_modules=reference.ALL)
        cases = []
        for ids, lora in zip(prompts, LORAS):
            toks = reference.peft_greedy(model, adapter if lora else None, ids, NEW)
            logits = torch.from_numpy(reference.peft_logits(model, adapter if lora else None, ids + toks))
            logp = torch.log_softmax(logits.double(), -1)
            chosen = [float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(toks)]
            cases.append(dict(adapter=lora, prompt_ids=ids, tokens=toks, token_logprobs=chosen))
        families[kind] = dict(config=reference.TINY_CONFIGS[kind], cases=cases)
        print(f"{kind}: recorded in {time.perf_counter() - t0:.1f} s", flush=True)
    (root / "refs.json").write_text(json.dumps(dict(new_tokens=NEW, reference="transformers+peft cpu float32",
                                                    families=families), indent=1))
    return 0


def check_family(folder: Path, fam: dict, dtype: str) -> dict:
    from multilora.engine.engine import Engine
    from multilora.engine.request import SamplingParams
    eng = Engine(str(folder / "model"), {"a": str(folder / "adapter")}, max_loras_per_batch=2, max_lora_rank=16,
                 max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, page_size=8, dtype=dtype,
                 projection_dtype="float32" if dtype == "float32" else "auto", warmup=False)
    cases = fam["cases"]
    loras = [c["adapter"] for c in cases]
    free = eng.generate([c["prompt_ids"] for c in cases],
                        SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True), loras)
    forced = eng.generate([c["prompt_ids"] + c["tokens"] for c in cases],
                          SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), loras)
    lead, agree, total, worst = [], 0, 0, 0.0
    for c, f, t in zip(cases, free, forced):
        want, n = c["tokens"], len(c["prompt_ids"])
        lead.append(next((i for i, (x, y) in enumerate(zip(f.token_ids, want)) if x != y), len(want)))
        for i, w in enumerate(want):
            lp = t.prompt_logprobs[n + i]  # PEFT's token at this position, as this device scores it
            total += 1
            agree += lp.top[0][0] == w
            worst = max(worst, abs(lp.logprob - c["token_logprobs"][i]))
    return dict(leading_equal=lead, exact=all(x == NEW for x in lead), forced_agree=agree, forced_total=total,
                forced_share=agree / total, max_abs_logprob_diff=worst)


def check(args) -> int:
    import jax
    root = Path(args.dir)
    refs = json.loads((root / "refs.json").read_text())
    report, ok = {}, True
    print(f"device {jax.devices()[0]}, dtype {args.dtype}", flush=True)

    def save(done: bool) -> None:  # after every family: a run cut short keeps what it checked
        if args.json:
            Path(args.json).write_text(json.dumps(dict(
                device=str(jax.devices()[0]), dtype=args.dtype, reference=refs["reference"],
                min_agree=args.min_agree, passed=bool(ok) if done else None, families=report), indent=1))

    for kind, fam in refs["families"].items():
        if args.families and kind not in args.families:
            continue
        t0 = time.perf_counter()
        try:
            r = check_family(root / kind, fam, args.dtype)
        except Exception as e:  # noqa: BLE001 - one family's failure is reported, the others still run
            r = dict(error=f"{type(e).__name__}: {e}", forced_share=0.0)
        r["seconds"] = round(time.perf_counter() - t0, 1)
        report[kind] = r
        ok &= r["forced_share"] >= args.min_agree
        print(f"{kind}: " + (r["error"] if "error" in r else
              f"free-running leading equal {r['leading_equal']} (of {NEW}), teacher-forced top-1 "
              f"{r['forced_agree']}/{r['forced_total']}, max |logprob diff| {r['max_abs_logprob_diff']:.2e}")
              + f" ({r['seconds']} s)", flush=True)
        save(done=False)
    save(done=True)
    print("PASS" if ok else f"FAIL: a family below {args.min_agree} teacher-forced agreement (or an error)")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("record", "check"):
        p = sub.add_parser(name)
        p.add_argument("--dir", required=True)
        p.add_argument("--families", nargs="*", default=None, help="default: every family")
        if name == "check":
            p.add_argument("--dtype", default="float32")
            p.add_argument("--min-agree", type=float, default=0.95)
            p.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    return {"record": record, "check": check}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
