"""Adapter-affinity routing on Ray Serve: a two-replica `multilora.server.ray_serve` deployment on
a local Ray cluster, a seeded Zipf workload of N completions over K adapters sent through the
ingress with C clients at a time, and the figure docs/ray.md quotes:

    of the requests for an adapter that some replica already held when the request was sent,
    the fraction that went to a replica holding it

Each response says which replica served it (x-multilora-replica), whether that replica held the
request's adapter when the request arrived (x-multilora-warm) and which adapters it held after
(x-multilora-held). A request counts as "for a warm adapter" when a response received before it
was sent showed the adapter held on some replica, or when it arrived warm. The same workload
runs twice: routed by adapter (Serve's model multiplexing) and, as the baseline, with no
multiplexed id (Serve's power-of-two choices on queue length alone).

    python benchmarks/ray_routing.py                           # SmolLM2-135M, 16 adapters, N=200
    python benchmarks/ray_routing.py --requests 400 --adapters 32 --concurrency 8 \
        --json benchmarks/results/ray_routing.json

The model is the embedded default (SmolLM2-135M-Instruct, converted once) unless --model says
otherwise; the adapters are random rank-16 PEFT folders under --workdir (made once).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks.common import fixed_prompts, machine_info, make_random_adapters, save_json  # noqa: E402

REPO = str(Path(__file__).resolve().parent.parent)


def zipf_draw(n: int, k: int, s: float, seed: int) -> list[int]:
    import numpy as np
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, k + 1) ** s
    return [int(i) for i in rng.choice(k, size=n, p=p / p.sum())]


def affinity(results: list[dict]) -> dict:
    """The routing figure over results in the order sent. Each result: adapter, replica, warm
    (bool), held (list), sent_after (how many responses had come back when it was sent; the
    held sets known then are those of responses[:sent_after] in arrival order)."""
    by_arrival = sorted(results, key=lambda r: r["arrived"])
    warm_somewhere = hits = 0
    for r in results:
        held: dict[str, set] = {}
        for seen in by_arrival[:r["sent_after"]]:
            held[seen["replica"]] = set(seen["held"])
        if r["warm"] or any(r["adapter"] in h for h in held.values()):
            warm_somewhere += 1
            hits += r["warm"]
    return dict(requests=len(results), warm_requests=warm_somewhere, warm_hits=hits,
                affinity=hits / warm_somewhere if warm_somewhere else float("nan"),
                arrived_warm=sum(r["warm"] for r in results))


def run_workload(url: str, names: list[str], prompts: list, draw: list[int], concurrency: int,
                 max_tokens: int) -> tuple[list[dict], float]:
    import httpx
    results: list[dict] = [None] * len(draw)
    lock = threading.Lock()
    arrived = [0]
    gate = threading.Semaphore(concurrency)

    def one(i: int, client) -> None:
        try:
            with lock:
                sent_after = arrived[0]
            t0 = time.perf_counter()
            r = client.post("/v1/completions", json=dict(model=names[draw[i]], prompt=prompts[i],
                                                         max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            r.raise_for_status()
            from multilora.server import ray_serve as RS
            with lock:
                arrived[0] += 1
                results[i] = dict(adapter=names[draw[i]], replica=r.headers[RS.REPLICA_HEADER],
                                  warm=r.headers.get(RS.WARM_HEADER) == "1",   # none for the base model
                                  held=RS.decode_names(r.headers.get(RS.HELD_HEADER, "")), sent_after=sent_after,
                                  arrived=arrived[0], latency_s=time.perf_counter() - t0)
        finally:
            gate.release()

    clients = [httpx.Client(base_url=url, timeout=600) for _ in range(concurrency)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        futs = []
        for i in range(len(draw)):   # in order: request i is sent once a client is free
            gate.acquire()
            futs.append(pool.submit(one, i, clients[i % concurrency]))
        for f in futs:
            f.result()
    wall = time.perf_counter() - t0
    for c in clients:
        c.close()
    return results, wall


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the adapter draw")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--max-adapters-per-replica", type=int, default=4)
    ap.add_argument("--routing", nargs="+", default=["adapter", "none"], choices=["adapter", "none"])
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/multilora/bench"))
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    import ray
    from ray import serve

    from multilora.server import ray_serve as RS
    if args.model is None:
        from multilora.default_model import default_model_dir
        args.model = str(default_model_dir())
    model = Path(args.model).resolve()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    lora_root = Path(args.workdir) / "smollm2-adapters-r16" if model.name.startswith("SmolLM2") \
        else Path(args.workdir) / f"{model.name}-adapters-r16"
    paths = make_random_adapters(model, lora_root, args.adapters)
    names = [p.name for p in paths]                       # loaded on first use from --lora-root
    prompts = fixed_prompts(args.requests, args.prompt_len, vocab, seed=args.seed)
    draw = zipf_draw(args.requests, args.adapters, args.zipf, args.seed)

    ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, logging_level="warning",
             log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": REPO, "OMP_WAIT_POLICY": "PASSIVE"}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    out = dict(machine=machine_info(), config=vars(args), runs={})
    try:
        for routing in args.routing:
            cfg = RS.RayServeConfig(
                engine_kwargs=dict(model=str(model), lora_modules={}, max_num_seqs=16, warmup=False,
                                   max_loaded_loras=args.max_adapters_per_replica * 2),
                num_replicas=args.replicas, max_adapters_per_replica=args.max_adapters_per_replica,
                replica_cpus=0.5, lora_root=str(lora_root), app_name=f"routing-{routing}",
                route_by_adapter=routing == "adapter")
            t0 = time.perf_counter()
            serve.run(RS.build_application(cfg), name=cfg.app_name, route_prefix="/")
            up = time.perf_counter() - t0
            url = f"http://127.0.0.1:{port}"
            # compile the shapes once per replica (not measured): base-model requests spread over both
            run_workload(url, [str(model)], prompts[:8], [0] * 8, args.concurrency, args.max_tokens)
            results, wall = run_workload(url, names, prompts, draw, args.concurrency, args.max_tokens)
            fig = affinity(results)
            lat = sorted(r["latency_s"] for r in results)
            fig.update(routing=routing, wall_s=round(wall, 2), start_up_s=round(up, 1),
                       requests_per_s=round(len(results) / wall, 2),
                       latency_p50_s=round(statistics.median(lat), 3),
                       latency_p99_s=round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
                       per_replica={r: sum(x["replica"] == r for x in results)
                                    for r in sorted({x["replica"] for x in results})})
            out["runs"][routing] = fig
            print(f"routing={routing:8s} {fig['warm_hits']}/{fig['warm_requests']} requests for warm adapters "
                  f"went to a replica holding them ({fig['affinity']:.1%}); {fig['requests'] - fig['warm_requests']} "
                  f"cold; {fig['requests_per_s']} req/s, p50 {fig['latency_p50_s']} s, p99 {fig['latency_p99_s']} s; "
                  f"per replica {list(fig['per_replica'].values())}", flush=True)
            serve.delete(cfg.app_name)
            ray.kill(ray.get_actor(cfg.directory_name, namespace=RS.DIRECTORY_NAMESPACE))
            if args.json:
                save_json(args.json, out)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
