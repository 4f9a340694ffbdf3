"""`multilora serve-ray`: the flags of `multilora serve` plus the replicas', RayServeConfig from
them, and the process that deploys the application on Ray Serve (multilora.server.ray) until
SIGINT/SIGTERM. `serve run multilora.cli.serve_ray:build key=value ...` builds the same
application from Serve's own command line. Ray is imported lazily."""

from __future__ import annotations

import argparse
import logging
import os

from multilora.server.ray.config import DIRECTORY_NAMESPACE, RayServeConfig
from multilora.server.ray.ingress import build_application


def config_from_args(args) -> RayServeConfig:
    """RayServeConfig from `multilora serve-ray`'s parsed flags."""
    from multilora.cli.args import engine_kwargs
    from multilora.cli.serve import with_demo_adapters
    args = with_demo_adapters(args)
    if args.lora_root and not os.path.isdir(args.lora_root):
        raise SystemExit(f"--lora-root {args.lora_root!r} is not a folder")
    kw = engine_kwargs(args)
    if kw.pop("distributed", None):
        raise SystemExit("serve-ray runs one engine per replica: --coordinator-address/--num-processes "
                         "do not apply")
    # served names and the generation config: checked by RayServeConfig (a SystemExit below)
    from multilora.cli.serve import chat_template_of, served_model_names
    names, template = served_model_names(args), chat_template_of(args)
    if kw["model"] is None:  # fetched and converted once, here, not by R replicas at once
        from multilora.default_model import default_model_dir
        kw["model"] = str(default_model_dir())
    kw["model"] = os.path.abspath(kw["model"])
    kw["lora_modules"] = {n: os.path.abspath(p) for n, p in kw["lora_modules"].items()}
    try:
        return RayServeConfig(
            engine_kwargs=kw, num_replicas=args.num_replicas, max_adapters_per_replica=args.max_adapters_per_replica,
            max_ongoing_requests=args.max_ongoing_requests, replica_cpus=args.replica_cpus,
            replica_gpus=args.replica_gpus,
            api_key=args.api_key or os.environ.get("MULTILORA_API_KEY") or None, lora_root=args.lora_root,
            allow_any_lora_path=args.allow_any_lora_path, max_body_bytes=args.max_body_bytes,
            max_queue=args.max_queue, drain_timeout=args.drain_timeout, app_name=args.app_name,
            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
            served_model_names=names, chat_template=template,
            generation_config=args.generation_config)
    except ValueError as e:
        raise SystemExit(str(e))


def add_ray_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`multilora serve-ray`: the flags of `multilora serve`, then the replicas'."""
    from multilora.cli.serve import add_serve_args
    add_serve_args(parser)
    g = parser.add_argument_group("Ray Serve replicas (see docs/ray.md)")
    g.add_argument("--num-replicas", type=int, default=2, help="engines serving behind the endpoint")
    g.add_argument("--max-adapters-per-replica", type=int, default=8,
                   help="adapters each replica advertises to the router (serve.multiplexed's LRU): an "
                        "adapter's requests go to a replica that holds it")
    g.add_argument("--max-ongoing-requests", type=int, default=64,
                   help="requests a replica takes at once; more wait in Serve's router")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs each replica reserves")
    g.add_argument("--replica-gpus", type=float, default=0.0,
                   help="Ray GPUs each replica reserves (Ray gives it those devices only)")
    g.add_argument("--address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS, else start a local one)")
    g.add_argument("--app-name", default="multilora", help="the Serve application's name")
    return parser


def run_serve_ray(args) -> int:
    """`multilora serve-ray`: deploy on Ray Serve and serve until SIGINT/SIGTERM."""
    import signal
    import threading

    try:
        import ray
        from ray import serve
    except ImportError:
        raise SystemExit("serve-ray needs Ray Serve: pip install 'multilora[ray]'") from None
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    cfg = config_from_args(args)
    from multilora.server.ray.start import init_ray, start_serve
    # a local cluster's workers at niceness 0, not Ray's 15 (docs/ray.md, "On a busy host")
    init_ray(address=args.address, include_dashboard=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 p for p in [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             os.environ.get("PYTHONPATH", "")] if p)}})
    start_serve({"host": args.host, "port": args.port})  # waits out a proxy too slow to start
    serve.run(build_application(cfg), name=cfg.app_name, route_prefix="/")
    print(f"multilora: {cfg.num_replicas} replicas serving on http://{args.host}:{args.port}/v1", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete(cfg.app_name)
    try:
        ray.kill(ray.get_actor(cfg.directory_name, namespace=DIRECTORY_NAMESPACE))
    except ValueError:
        pass
    serve.shutdown()
    return 0


def build(args: dict):
    """`serve run multilora.cli.serve_ray:build model=DIR num-replicas=2 lora-modules="a=DIR b=DIR"`:
    the application from serve-ray's flags as key=value pairs (a flag without a value: "true")."""
    argv = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if str(value).lower() == "true":
            argv.append(flag)
        elif flag in ("--lora-modules", "--served-model-name"):
            argv += [flag, *str(value).split()]
        else:
            argv += [flag, str(value)]
    parsed = add_ray_serve_args(argparse.ArgumentParser(prog="multilora.cli.serve_ray:build")).parse_args(argv)
    return build_application(config_from_args(parsed))
