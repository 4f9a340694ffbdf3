"""How long `multilora serve` takes to answer its first request: cold (an empty user cache: the
default model fetched and converted, the CPU kernels built, every shape compiled) and warm (the
same caches again).

    python benchmarks/start_up.py                      # one cold start, then one warm start
    python benchmarks/start_up.py --warm-runs 3 --json benchmarks/results/start_up.json
    python benchmarks/start_up.py --serve-args="--compile-all-first"   # every shape before serving
    python benchmarks/start_up.py --register-adapters 256   # Engine() with 256 adapters registered

Each start runs `python -m multilora serve` (what the `multilora` command runs) in a subprocess
whose caches live in a fresh folder: $XDG_CACHE_HOME points there, so the user cache
(multilora's converted model, kernels and JAX's compilation cache) and pip's download cache start
empty; $MULTILORA_CACHE, $MULTILORA_COMPILATION_CACHE and $MULTILORA_GGUF are unset unless
--gguf names a local .gguf (no download then). A start's clock begins at the process's launch;
from then on the harness asks GET /health until the server listens and sends one chat
completion (the base model, greedy, 16 tokens) at once: "first answer" is when it came back.
Then it waits for /health to report the background warm-up done ("all compiled"), so that the
warm start after it finds every shape in the cache, and stops the server with SIGTERM.

Phases come from the server's own log lines, timed by when they reached this harness: the
model's fetch and conversion, the kernels' build, the first shapes, listening, all compiled.
While it runs it prints the elapsed time and the server's latest line.

--register-adapters K: the older measurement this file held, what registering K adapters at
start costs (Engine(default model, K adapters, warmup=False): wall time and peak RSS); the
adapters are those benchmarks/serving.py makes under ~/.cache/multilora/bench.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# (phase, pattern over a log line, what its first group is)
PHASES = [
    ("fetch_s", re.compile(r"default model ready in .* \(fetch ([\d.]+)s"), "seconds"),
    ("convert_s", re.compile(r"default model ready in .* convert ([\d.]+)s\)"), "seconds"),
    ("kernels_build_s", re.compile(r"built .*libmultilora_kernels\.so in ([\d.]+) s"), "seconds"),
    ("first_shapes_s", re.compile(r"compiled \d+ shapes for the first requests in ([\d.]+)s"), "seconds"),
    ("all_shapes_before_serving_s", re.compile(r"compiled \d+ step shapes in ([\d.]+)s"), "seconds"),
    ("background_warmup_s", re.compile(r"warm-up done: all \d+ shapes compiled, ([\d.]+)s after"), "seconds"),
]
# (mark, pattern): the time since launch at which the line arrived
MARKS = [
    ("model_ready_at", re.compile(r"default model ready in")),
    ("engine_built_at", re.compile(r"multilora\.engine: LoRA:|multilora\.engine: projections:")),
    ("listening_at", re.compile(r"multilora: serving on http")),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, timeout: float = 600.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, json.loads(r.read() or b"null")


class Server:
    """`python -m multilora serve` with its log read line by line (split at \\r too: progress
    bars) on a thread, each line kept with the seconds since launch it arrived at."""

    def __init__(self, env: dict, port: int, serve_args: list[str], log_path: Path):
        self.cmd = [sys.executable, "-m", "multilora", "serve", "--port", str(port), *serve_args]
        self.lines: list[tuple[float, str]] = []
        self.log = open(log_path, "w")
        self.log.write(" ".join(self.cmd) + "\n\n")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(HERE.parent), start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        buf = b""
        for chunk in iter(lambda: self.proc.stdout.read1(4096), b""):
            buf += chunk
            *done, buf = re.split(rb"[\r\n]", buf)
            for raw in done:
                line = raw.decode(errors="replace").strip()
                if line:
                    self.lines.append((time.perf_counter() - self.t0, line))
                    self.log.write(f"[{self.lines[-1][0]:7.2f}] {line}\n")
        self.log.flush()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def last_line(self) -> str:
        return self.lines[-1][1] if self.lines else ""

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.reader.join(10)
        self.log.close()
        return self.proc.returncode


def start_once(label: str, env: dict, serve_args: list[str], log_path: Path, timeout: float,
               wait_warm: bool, prompt: str) -> dict:
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    srv = Server(env, port, serve_args, log_path)
    out: dict = {"start": label}
    last_print = 0.0

    def show(state: str) -> None:
        nonlocal last_print
        if time.perf_counter() - last_print >= 2.0:
            last_print = time.perf_counter()
            print(f"  [{label} {srv.elapsed():6.1f}s] {state}: {srv.last_line()[:110]}", flush=True)

    try:
        while True:  # until it listens
            if srv.proc.poll() is not None:
                raise RuntimeError(f"{label}: exited with rc={srv.proc.returncode}; log {log_path}")
            if srv.elapsed() > timeout:
                raise RuntimeError(f"{label}: not listening after {timeout:.0f}s; log {log_path}")
            try:
                status, health = http("GET", root + "/health", timeout=5)
                if status == 200:
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            show("starting")
            time.sleep(0.2)
        out["health_at"] = round(srv.elapsed(), 2)
        _, models = http("GET", root + "/v1/models", timeout=60)
        model = models["data"][0]["id"]
        _, answer = http("POST", root + "/v1/chat/completions", dict(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0),
            timeout=timeout)
        out["first_answer_s"] = round(srv.elapsed(), 2)
        out["answer"] = answer["choices"][0]["message"]["content"]
        print(f"  [{label} {out['first_answer_s']:6.1f}s] first answer: {out['answer']!r}", flush=True)
        if wait_warm:
            while True:
                _, health = http("GET", root + "/health", timeout=30)
                w = (health or {}).get("warmup") or {}
                if w.get("done") or srv.elapsed() > timeout:
                    break
                show(f"compiling {w.get('compiled')}/{w.get('total')}")
                time.sleep(1.0)
            out["all_compiled_at"] = round(srv.elapsed(), 2) if w.get("done") else None
            out["shapes"] = w.get("total")
    finally:
        rc = srv.stop()  # uvicorn ends a server it stopped on SIGTERM by raising that signal again
        out["exit"] = "SIGTERM" if rc == -signal.SIGTERM else rc
    for name, pat, _ in PHASES:
        for _, line in srv.lines:
            m = pat.search(line)
            if m:
                out[name] = float(m.group(1))
    for name, pat in MARKS:
        hit = next((t for t, line in srv.lines if pat.search(line)), None)
        if hit is not None:
            out[name] = round(hit, 2)
    out["log"] = str(log_path)
    return out


def machine() -> dict:
    from benchmarks.common import machine_info
    return machine_info()


def run_starts(args) -> None:
    folder = Path(args.cache_dir or tempfile.mkdtemp(prefix="multilora-start-up-"))
    if folder.exists() and any(folder.iterdir()) and not args.keep_cache:
        raise SystemExit(f"{folder} is not empty: name a new or empty folder, or add --keep-cache for warm starts")
    folder.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MULTILORA_CACHE", "MULTILORA_COMPILATION_CACHE", "MULTILORA_GGUF")}
    env.update(XDG_CACHE_HOME=str(folder / "cache"), PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE")
    if args.gguf:
        env["MULTILORA_GGUF"] = str(Path(args.gguf).resolve())
    serve_args = shlex.split(args.serve_args)
    load = os.getloadavg()
    print(f"caches under {folder / 'cache'}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"multilora serve {' '.join(serve_args)}", flush=True)
    results = []
    labels = (["cold"] if not args.keep_cache else []) + [f"warm{i + 1}" if args.warm_runs > 1 else "warm"
                                                          for i in range(args.warm_runs)]
    for label in labels:
        before = [round(x, 2) for x in os.getloadavg()]  # the machine may be shared: say how busy it was
        r = start_once(label, env, serve_args, folder / f"{label}.log", args.timeout,
                       wait_warm=not args.no_wait_warm, prompt=args.prompt)
        r["load_average_before"], r["load_average_after"] = before, [round(x, 2) for x in os.getloadavg()]
        results.append(r)
    report = {"command": "python -m multilora serve " + " ".join(serve_args), "cache": str(folder / "cache"),
              "machine": machine(), "starts": results}
    print()
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    if not args.keep_cache and args.cache_dir is None:
        shutil.rmtree(folder, ignore_errors=True)


def table(results: list[dict]) -> str:
    cols = [("start", "start"), ("first answer s", "first_answer_s"), ("listening at", "listening_at"),
            ("fetch", "fetch_s"), ("convert", "convert_s"), ("kernels build", "kernels_build_s"),
            ("engine built at", "engine_built_at"), ("first shapes", "first_shapes_s"),
            ("all compiled at", "all_compiled_at"), ("exit", "exit"), ("load before", "load_average_before")]

    def cell(r, k):
        v = r.get(k)
        if isinstance(v, list):  # a load average: the last minute's
            v = v[0]
        return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))
    head = "| " + " | ".join(c for c, _ in cols) + " |"
    rule = "|" + "|".join("---" if k == "start" else "---:" for _, k in cols) + "|"
    return "\n".join([head, rule] + ["| " + " | ".join(cell(r, k) for _, k in cols) + " |" for r in results])


def register_adapters(k: int) -> None:
    """Registering K adapters at start: Engine(default model, K adapters, warmup=False)."""
    import resource
    root = Path.home() / ".cache/multilora/bench/serving-adapters-r16"
    from multilora import Engine
    from multilora.default_model import default_model_dir
    mods = {f"a{i}": str(root / f"adapter_{i:04d}") for i in range(k)}
    missing = [p for p in mods.values() if not Path(p, "adapter_model.safetensors").is_file()]
    if missing:
        raise SystemExit(f"{len(missing)} of the {k} adapters are missing under {root}: "
                         f"run benchmarks/serving.py --adapters {k} once")
    t = time.perf_counter()
    eng = Engine(str(default_model_dir()), mods, warmup=False)
    secs = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"K={k} init {secs:.1f} s, peak RSS {rss:.2f} GB, host copies {eng.registry.num_host_copies}")


def main(argv=None) -> None:
    from multilora.cli import DefaultsOnceFormatter
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsOnceFormatter)
    p.add_argument("--warm-runs", type=int, default=1, help="warm starts after the cold one")
    p.add_argument("--serve-args", default="",
                   help='more flags for `multilora serve`, as one string (--serve-args="--compile-all-first")')
    p.add_argument("--cache-dir", default=None,
                   help="the folder the starts' caches live in (default: a new temporary folder, removed after)")
    p.add_argument("--keep-cache", action="store_true",
                   help="with --cache-dir: keep what it holds, and run warm starts only")
    p.add_argument("--gguf", default=None,
                   help="a local SmolLM2-135M-Instruct.Q4_1.gguf ($MULTILORA_GGUF) instead of the download")
    p.add_argument("--no-wait-warm", action="store_true",
                   help="stop each server at its first answer instead of once /health reports every shape compiled")
    p.add_argument("--prompt", default="What is the capital of France?", help="the first request's message")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a start may take at most")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--register-adapters", type=int, default=None, metavar="K",
                   help="measure registering K adapters at start instead (see above)")
    args = p.parse_args(argv)
    if args.register_adapters is not None:
        register_adapters(args.register_adapters)
        return
    run_starts(args)


if __name__ == "__main__":
    main()
