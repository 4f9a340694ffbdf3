"""`multilora serve`: its flags (the engine's, then the server's), and the process around the
server: logging, the demo adapters, the engine, a follower's loop on processes other than 0, and
uvicorn until SIGTERM (multilora.server.app.serve)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from multilora.cli.args import add_distributed_args, add_engine_args, build_engine, parse_lora_modules
from multilora.server.app import DEFAULT_MAX_BODY_BYTES, build_app, serve
from multilora.server.reasoning import REASONING_PARSERS
from multilora.server.service import TOOL_PARSER_CHOICES, check_generation_config, check_served_names
from multilora.server.async_engine import AsyncEngine
from multilora.server.heap import freeze_startup_heap

log = logging.getLogger("multilora.server")


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `multilora serve`: engine budgets, then the server's own."""
    add_engine_args(parser.add_argument_group("model, adapters and engine budgets"))
    parser.add_argument("--no-demo-adapters", action="store_true",
                        help="with the embedded default model and no --lora-modules, do not serve the "
                             "demo adapters 'shout' and 'signoff' (served by default then)")
    parser.add_argument("--compile-all-first", action="store_true",
                        help="compile every step shape before serving (default: serve once the shapes of a "
                             "first short request are compiled, and compile the rest in the background; "
                             "GET /health reports how far)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $MULTILORA_API_KEY, else no key)")
    g.add_argument("--lora-root", default=None,
                   help="folder of adapter folders: /v1/load_lora_adapter may load from it, and a request "
                        "whose model names a folder in it is loaded on first use")
    g.add_argument("--allow-any-lora-path", action="store_true",
                   help="without --lora-root, let /v1/load_lora_adapter load from any path (trusted clients only)")
    g.add_argument("--max-queue", type=int, default=512,
                   help="requests that may wait for a place in the batch; more get 503")
    g.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for running requests before aborting them")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="what the server logs")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the base model's names in requests (vLLM's flag): the first is the one "
                        "/v1/models lists and responses name (default: the model folder's name, its "
                        "path also taken; for the embedded default also its Hugging Face id)")
    add_chat_args(g)
    add_distributed_args(parser)
    return parser


def add_chat_args(g) -> None:
    """Tool calls and reasoning on /v1/chat/completions (vLLM's option names)."""
    g.add_argument("--tool-call-parser", default="auto", choices=TOOL_PARSER_CHOICES,
                   help="the syntax tool calls are read in (tool_choice auto) and forced in (required, "
                        "a named function): auto (default) takes the chat template's own (llama3_json "
                        "for Llama 3.1's, else hermes, also for templates without a tool format); none: "
                        "calls are not read, and tool_choice \"auto\" is refused")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice auto is on whenever a "
                        "--tool-call-parser is (by default)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="the defaults of a request's unset temperature, top_p, top_k and "
                        "repetition_penalty, as vLLM's flag: auto, the model's generation_config.json; "
                        "vllm, OpenAI's (1, 1, off, 1); or a folder's generation_config.json")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) in place of the model's "
                        "own, as vLLM's flag (an adapter folder's own template still wins for its requests)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split <think>...</think> into message.reasoning_content (default: no split)")


def engine_from_args(args):
    warmup = True if getattr(args, "compile_all_first", True) else "background"
    return build_engine(args, warmup=warmup)


def with_demo_adapters(args) -> argparse.Namespace:
    """args, plus the demo adapters (shout, signoff) as --lora-modules when the embedded default
    model is served with no adapters named and --no-demo-adapters is not given."""
    if (args.model or args.lora_modules or getattr(args, "no_demo_adapters", False)
            or getattr(args, "max_loras_per_batch", 1) == 0):
        return args
    from multilora.demo_adapters import demo_lora_modules
    demos = demo_lora_modules()
    if not demos:
        return args
    print(f"multilora: serving the demo adapters {', '.join(demos)} (name one as the request's "
          "\"model\"; --no-demo-adapters turns them off)", flush=True)
    return argparse.Namespace(**{**vars(args), "lora_modules": [f"{n}={p}" for n, p in demos.items()]})


def served_model_names(args) -> "list[str] | None":
    """--served-model-name; for the embedded default model without it, its name and Hugging Face
    id (a client written for the hub's name works unchanged); None: the model folder's names."""
    if args.served_model_name is not None:
        return list(args.served_model_name)
    if args.model is None:
        from multilora.default_model import DEFAULT_MODEL_NAME, DEFAULT_MODEL_REPO
        return [DEFAULT_MODEL_NAME, DEFAULT_MODEL_REPO]
    return None


def chat_template_of(args) -> "str | None":
    """--chat-template's text: a file's contents, or the argument itself where it is a template
    (holds `{{` or `{%`); SystemExit naming the argument otherwise (vLLM's rule)."""
    value = getattr(args, "chat_template", None)
    if value is None:
        return None
    path = Path(value)
    try:
        text = path.read_text() if path.is_file() else None
    except OSError as e:
        raise SystemExit(f"error: --chat-template {value!r} cannot be read ({e})") from None
    if text is None and not ("{{" in value or "{%" in value):
        raise SystemExit(f"error: --chat-template {value!r} is neither a file nor a Jinja template")
    text = value if text is None else text
    from multilora.engine.tokenizer import template_has_tools
    try:
        template_has_tools(text)   # compiled now: a broken template fails the start, not each request
    except Exception as e:         # jinja2's TemplateSyntaxError
        raise SystemExit(f"error: --chat-template does not compile as Jinja ({e})") from None
    return text


def run_serve(args) -> int:
    # force: `multilora serve` configured logging before parsing reached here; --log-level rules
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    args = with_demo_adapters(args)
    if args.lora_root and not Path(args.lora_root).is_dir():
        raise SystemExit(f"--lora-root {args.lora_root!r} is not a folder")
    if args.max_queue < 0:
        raise SystemExit("--max-queue must be >= 0")
    api_key = args.api_key or os.environ.get("MULTILORA_API_KEY") or None
    names, template = served_model_names(args), chat_template_of(args)
    try:   # before the engine: a bad option costs no model load
        if names is not None:
            check_served_names(names, list(parse_lora_modules(args.lora_modules)))
        check_generation_config(args.generation_config)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    engine = engine_from_args(args)
    if not engine.is_leader:
        return follow(engine)
    aengine = AsyncEngine(engine, max_queue=args.max_queue)
    app = build_app(aengine, api_key=api_key, lora_root=args.lora_root, max_body_bytes=args.max_body_bytes,
                    allow_any_lora_path=args.allow_any_lora_path, drain_timeout=args.drain_timeout,
                    tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                    served_model_names=names, chat_template=template, generation_config=args.generation_config)
    freeze_startup_heap()  # full collections then skip the start-up heap (multilora.server.heap)
    if engine.num_processes > 1:  # a process gone: stop serving (with one, a dead engine thread is a 503)
        def _stop(message: str) -> None:
            log.error("the engine stopped (%s): the server shuts down", message)
            app.state.stop_server()
        aengine.on_death = _stop
        # uvicorn re-raises the SIGTERM/SIGINT it caught once it has stopped; with the default
        # handlers that kills this process before jax.distributed's shutdown, where the followers
        # wait for it
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
    serve(app, args.host, args.port, args.drain_timeout, args.log_level)
    engine.runner.stop_warmup()  # not at interpreter exit in the middle of a compile
    if engine.num_processes > 1 and aengine.death is not None:
        print(f"multilora: the server stopped: {aengine.death}", file=sys.stderr, flush=True)
        os._exit(1)  # not jax.distributed's shutdown barrier: a process is gone
    return 0


def follow(engine) -> int:
    """`multilora serve` on a process other than 0: mirror process 0's steps until it stops."""
    import jax
    print(f"multilora: process {jax.process_index()} of {engine.num_processes} follows process 0, "
          "which serves HTTP", flush=True)
    try:
        engine.follow()
    except Exception as e:  # noqa: BLE001 - a collective with a process that is gone
        log.debug("follow() failed", exc_info=True)
        print(f"multilora: process {jax.process_index()} stops: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        os._exit(1)
    print(f"multilora: process {jax.process_index()}: process 0 has stopped; done", flush=True)
    sys.stderr.flush()
    os._exit(0)  # at once (Engine.follow's last barrier): process 0 exits right after


def main(argv: "list[str] | None" = None) -> int:
    parser = add_serve_args(argparse.ArgumentParser(prog="multilora-serve"))
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
