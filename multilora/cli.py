"""`multilora serve | generate | convert-default`: the command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def parse_lora_modules(items) -> dict[str, str]:
    out = {}
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-modules expects name=path, got {item!r}")
        out[name] = path
    return out


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH")
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--max-loaded-loras", type=int, default=None)
    p.add_argument("--lora-backend", default="auto", choices=["auto", "bgmv", "sgmv", "dense", "reference"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-prefill-seqs", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices to split the model over (with several processes: all of them)")
    p.add_argument("--seed", type=int, default=0)


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several processes (hosts); see docs/distributed.md")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="process 0's address for jax.distributed (same on every process)")
    g.add_argument("--num-processes", type=int, default=1)
    g.add_argument("--process-id", type=int, default=0,
                   help="this process's index; 0 takes the requests and prints the outputs")


def distributed_kwargs(args) -> dict | None:
    if getattr(args, "coordinator_address", None) is None and getattr(args, "num_processes", 1) <= 1:
        return None
    return dict(coordinator_address=args.coordinator_address, num_processes=args.num_processes,
                process_id=args.process_id)


def engine_kwargs(args) -> dict:
    return dict(model=args.model, lora_modules=parse_lora_modules(args.lora_modules),
                max_loras_per_batch=args.max_loras_per_batch, max_lora_rank=args.max_lora_rank,
                max_loaded_loras=args.max_loaded_loras, lora_backend=args.lora_backend,
                dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_prefill_seqs=args.max_prefill_seqs, page_size=args.page_size,
                num_pages=args.num_pages, kv_cache_memory_gb=args.kv_cache_memory_gb,
                max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size,
                seed=args.seed, distributed=distributed_kwargs(args))


def cmd_generate(args) -> int:
    from multilora.engine.engine import Engine
    from multilora.engine.request import SamplingParams
    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [json.loads(line)["prompt"] if line.lstrip().startswith("{") else line.rstrip("\n")
                        for line in f if line.strip()]
    if not prompts:
        raise SystemExit("give at least one --prompt or a --prompts-file")
    engine = Engine(progress=True, **engine_kwargs(args))
    if not engine.is_leader:  # several processes: process 0 drives, this one mirrors its steps
        engine.follow()
        return 0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed_request, ignore_eos=args.ignore_eos)
    if args.chat:
        tok = engine.tokenizer
        if tok is None:
            raise SystemExit("--chat needs a tokenizer in the model folder")
        prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    try:
        outs = engine.generate(prompts, params, lora=args.lora, progress=True)
    finally:
        engine.stop_followers()
    for o in outs:
        if args.json:
            print(json.dumps(dict(text=o.text, token_ids=o.token_ids, finish_reason=o.finish_reason, lora=o.lora)))
        else:
            print(f"--- [{o.lora or 'base'}] ({o.finish_reason})\n{o.text}")
    return 0


def cmd_convert_default(args) -> int:
    from multilora.model.gguf_default import default_model_dir
    print(default_model_dir())
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="multilora", description="serve many LoRA adapters over one base model")
    sub = parser.add_subparsers(dest="cmd", required=True)

    p_serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from multilora.server.app import add_serve_args
    add_serve_args(p_serve)

    p_gen = sub.add_parser("generate", help="offline batch generation")
    add_engine_args(p_gen)
    add_distributed_args(p_gen)
    p_gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p_gen.add_argument("--prompts-file", help="one prompt per line (or JSON lines with a 'prompt' field)")
    p_gen.add_argument("--lora", default=None, help="adapter name for every prompt (default: base model)")
    p_gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p_gen.add_argument("--max-tokens", type=int, default=64)
    p_gen.add_argument("--temperature", type=float, default=0.0)
    p_gen.add_argument("--top-p", type=float, default=1.0)
    p_gen.add_argument("--top-k", type=int, default=-1)
    p_gen.add_argument("--seed-request", type=int, default=None)
    p_gen.add_argument("--ignore-eos", action="store_true")
    p_gen.add_argument("--json", action="store_true", help="print one JSON object per output")

    sub.add_parser("convert-default", help="fetch and convert the embedded default model, print its folder")

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.cmd == "serve":
        from multilora.server.app import run_serve
        return run_serve(args) or 0
    if args.cmd == "generate":
        return cmd_generate(args)
    return cmd_convert_default(args)


if __name__ == "__main__":
    sys.exit(main())
