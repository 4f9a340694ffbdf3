"""`multilora serve | serve-ray | generate | convert-default`: the command line. Every command's
flags and process code live in this package (args: the engine's flags <-> EngineConfig; serve;
serve_ray); the packages below it take configs and objects, not argparse namespaces."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from multilora.cli.args import add_distributed_args, add_engine_args, build_engine


def cmd_generate(args) -> int:
    from multilora.engine.request import SamplingParams
    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [json.loads(line)["prompt"] if line.lstrip().startswith("{") else line.rstrip("\n")
                        for line in f if line.strip()]
    if not prompts:
        raise SystemExit("give at least one --prompt or a --prompts-file")
    # the shapes its prompts meet, compiled as they come: one short prompt took 9 + 1.3 s against
    # 22 s for every shape first (a server's warm-up); several processes compile all first
    engine = build_engine(args, warmup=getattr(args, "num_processes", 1) > 1)
    if not engine.is_leader:  # several processes: process 0 drives, this one mirrors its steps
        engine.follow()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # at once: process 0 exits right after (Engine.follow's last barrier)
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
    from multilora.default_model import default_model_dir
    print(default_model_dir())
    return 0


class DefaultsOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each option's default once: "(default: X)" after its text, unless the text
    says its default already, and not for options that have none (None, an off switch, an empty
    list)."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        said = "default:" in text.lower() or "by default" in text.lower()
        if said or d is None or d is False or d == [] or d is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """`multilora`'s parser, every command's flags."""
    parser = argparse.ArgumentParser(prog="multilora", description="serve many LoRA adapters over one base model")
    sub = parser.add_subparsers(dest="cmd", required=True)
    fmt = DefaultsOnceFormatter  # --help shows every default, once

    p_serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=fmt)
    from multilora.cli.serve import add_serve_args
    add_serve_args(p_serve)

    p_ray = sub.add_parser("serve-ray", formatter_class=fmt,
                           help="data-parallel replicas behind one endpoint on Ray Serve (needs multilora[ray])")
    from multilora.cli.serve_ray import add_ray_serve_args
    add_ray_serve_args(p_ray)

    p_gen = sub.add_parser("generate", help="offline batch generation", formatter_class=fmt)
    add_engine_args(p_gen)
    add_distributed_args(p_gen)
    p_gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p_gen.add_argument("--prompts-file", help="one prompt per line (or JSON lines with a 'prompt' field)")
    p_gen.add_argument("--lora", default=None, help="adapter name for every prompt (default: base model)")
    p_gen.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p_gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt at most")
    p_gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p_gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off)")
    p_gen.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens (-1: off)")
    p_gen.add_argument("--seed-request", type=int, default=None, help="every prompt's sampling seed")
    p_gen.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens whatever the EOS token says")
    p_gen.add_argument("--json", action="store_true", help="print one JSON object per output")

    sub.add_parser("convert-default", help="fetch and convert the embedded default model, print its folder")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(logging, getattr(args, "log_level", "info").upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", force=True)
    if args.cmd == "serve":
        from multilora.cli.serve import run_serve
        return run_serve(args) or 0
    if args.cmd == "serve-ray":
        from multilora.cli.serve_ray import run_serve_ray
        return run_serve_ray(args) or 0
    if args.cmd == "generate":
        return cmd_generate(args)
    return cmd_convert_default(args)


if __name__ == "__main__":
    sys.exit(main())
