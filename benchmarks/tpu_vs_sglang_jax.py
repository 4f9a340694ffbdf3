"""multilora beside sglang-jax (cddbf6f1) on one chip, issue 37's figures at both of its shapes
(SmolLM2-135M; Llama-3.2-1B: hidden 2048, 16 layers, 32 / 8 heads), dummy bf16 weights, 0 / 8 / 64
rank-16 adapters on all seven projections:

  decode   one step of 64 rows x ~80 cached tokens (SmolLM2) / 256 (1B), median ms
  prefill  one step of 480 tokens (10 prompts x 48, a 512-token step), median ms
  offline  64 requests x 64 new tokens (prompts ~48), tokens per second

multilora's side is benchmarks/forward_step.py (--dtypes bfloat16) and engine_throughput.py
(--dtype bfloat16 --warmup on-first-use: each engine's offline figures are taken the same way,
after an untimed run of the workload that compiles what it uses, 8 and 64 adapters from one
engine); sglang-jax's is benchmarks/sglang_jax_driver.py (needs
`source benchmarks/sglang_jax_setup.sh` first). Each engine's work runs in one process per shape,
one after another (the chip holds one program at a time). Step figures compare multilora's forward
with sglang-jax's forward (ForwardBatch + model_runner.forward, up to the logits); sglang-jax's
whole step (LoRA batch preparation and sampling too) is in the table beside it.

On the TPU machine (device tool, carry [".whl-sgl", ".sgl-src"], both made here by
benchmarks/sglang_jax_prepare.sh), each engine in its own command, since one command may run 10
minutes; every process writes its JSON into $OUT as it goes, so a cut run still returns its cases:

    set -o pipefail; export PYTHONUNBUFFERED=1; source benchmarks/sglang_jax_setup.sh && \
      timeout 590 python3 benchmarks/tpu_vs_sglang_jax.py --engines sglang-jax --timeout 285 \
      --json $OUT/sglang_jax.json 2>&1 | tee $OUT/sglang_jax.log
    # multilora: its offline run needs safetensors, tokenizers and jinja2 from the machine's index
    set -o pipefail; export PYTHONUNBUFFERED=1 MULTILORA_NATIVE=0; PIP_CONFIG_FILE=/dev/null python3 -m pip \
      install --isolated -q --no-deps --only-binary=:all: --index-url file:///opt/pypi/simple --target /tmp/site \
      safetensors tokenizers jinja2 markupsafe && export PYTHONPATH=$PYTHONPATH:/tmp/site && \
      timeout 590 python3 benchmarks/tpu_vs_sglang_jax.py --engines multilora --models smollm2-135m \
      --timeout 290 --json $OUT/multilora_small.json 2>&1 | tee $OUT/multilora_small.log
    # (the same with --models llama-3.2-1b --json $OUT/multilora_1b.json)
    # then, anywhere: one table and one JSON from all of them
    python3 benchmarks/tpu_vs_sglang_jax.py --merge multilora_small.json multilora_1b.json sglang_jax.json \
        --json benchmarks/results/tpu_vs_sglang_jax.json

CPU smoke run of every code path (2-layer models, few rows, short runs):
    JAX_PLATFORMS=cpu python3 benchmarks/tpu_vs_sglang_jax.py --quick --json /tmp/vs.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.sglang_jax_driver import DEFAULT_DECODE_CTX  # noqa: E402

MODELS = ["smollm2-135m", "llama-3.2-1b"]
FIGURES = ["decode", "prefill", "offline"]


def run(cmd: list[str], raw: Path, timeout: int) -> dict | None:
    """One benchmark process; its JSON (partial if it was cut short), or None."""
    print(f"\n$ {' '.join(cmd)}", flush=True)
    t = time.perf_counter()
    try:
        rc = subprocess.run(cmd, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    print(f"# exit {rc} after {time.perf_counter() - t:.0f} s", flush=True)
    return json.loads(raw.read_text()) if raw.is_file() else None


def multilora_runs(args, model: str, raw_dir: Path) -> dict:
    """forward_step.py for the step figures, engine_throughput.py for offline."""
    out, py = {}, sys.executable
    modes = [m for m in ("decode", "prefill") if m in args.parts]
    if modes:
        raw = raw_dir / f"multilora_steps_{model}.json"
        cmd = [py, str(HERE / "forward_step.py"), "--model", model, "--dtypes", "bfloat16", "--modes", *modes,
               "--adapters", *map(str, args.adapters), "--decode-ctx", str(DEFAULT_DECODE_CTX[model]),
               "--prefill-tokens", "512", "--repeats", str(args.repeats), "--json", str(raw)]
        if args.quick:
            cmd += ["--decode-seqs", "8", "--prefill-tokens", "64"]
        out["steps"] = run(cmd, raw, args.timeout)
    if "offline" in args.parts:
        raw = raw_dir / f"multilora_offline_{model}.json"
        cmd = [py, str(HERE / "engine_throughput.py"), "--model", model, "--adapters", *map(str, args.adapters),
               "--dtype", "bfloat16", "--workdir", str(args.workdir / "multilora"), "--json", str(raw),
               # sglang_jax_driver.py's method: shapes compiled on first use in untimed runs of the
               # workload, one engine for every adapter count > 0 (a start-up that compiles every
               # bucket with the LoRA kernel took over 300 s on a v5e: log 37); as many timed runs
               # as sglang-jax's (3 made the medians compiling runs: log 47)
               "--warmup", "on-first-use", "--repeats", str(args.repeats)]
        if args.quick:
            cmd += ["--requests", "4", "--new-tokens", "8"]
        out["offline"] = run(cmd, raw, args.timeout)
    return out


def sglang_runs(args, model: str, raw_dir: Path) -> dict:
    raw = raw_dir / f"sglang_jax_{model}.json"
    cmd = [sys.executable, str(HERE / "sglang_jax_driver.py"), "--model", model, "--adapters", *map(str, args.adapters),
           "--parts", *args.parts, "--repeats", str(args.repeats), "--workdir", str(args.workdir / "sglang-jax"),
           "--json", str(raw)]
    if args.quick:
        cmd += ["--quick", "--layers", "2", "--context-length", "128", "--page-size", "16"]
    return {"all": run(cmd, raw, args.timeout)}


def figures(engine: str, model: str, raw: dict) -> list[dict]:
    """(figure, adapters) -> value rows from one engine's raw JSONs."""
    rows = []
    if engine == "multilora":
        for r in (raw.get("steps") or {}).get("rows", []):
            rows.append(dict(figure=r["mode"], adapters=r["adapters"], ms=1e3 * r["median_s"],
                             note=f"{r['backend']}, {r['attention']} attention"))
        for r in (raw.get("offline") or {}).get("results", []):
            if r.get("system") == "multilora":
                rows.append(dict(figure="offline", adapters=r["adapters"], tok_per_s=r["tok_per_s"]))
    else:
        for r in (raw.get("all") or {}).get("results", []):
            if r["kind"] == "step":
                rows.append(dict(figure=r["mode"], adapters=r["adapters"], ms=1e3 * r["forward_median_s"],
                                 step_ms=1e3 * r["step_median_s"], note=f"{r['slots']} slots" if r["lora"] else "no LoRA"))
            else:
                rows.append(dict(figure="offline", adapters=r["adapters"], tok_per_s=r["tok_per_s"]))
    for r in rows:
        r.update(engine=engine, model=model)
    # forward_step.py may list one (mode, adapters) under several variants: keep the first
    seen, kept = set(), []
    for r in rows:
        key = (r["figure"], r["adapters"])
        if key not in seen:
            seen.add(key)
            kept.append(r)
    return kept


def table(rows: list[dict]) -> str:
    """One markdown table: each (model, figure, adapters) with both engines and their ratio
    (step time multilora / sglang-jax, lower is better; offline throughput multilora / sglang-jax,
    higher is better)."""
    by = {(r["model"], r["figure"], r["adapters"], r["engine"]): r for r in rows}
    keys = sorted({k[:3] for k in by}, key=lambda k: (MODELS.index(k[0]) if k[0] in MODELS else 9,
                                                      FIGURES.index(k[1]), k[2]))
    out = ["| model | figure | adapters | multilora | sglang-jax forward | sglang-jax step | multilora / sglang-jax |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for model, fig, k in keys:
        m, s = by.get((model, fig, k, "multilora")), by.get((model, fig, k, "sglang-jax"))
        unit, field = ("tok/s", "tok_per_s") if fig == "offline" else ("ms", "ms")
        mv, sv = (m or {}).get(field), (s or {}).get(field)
        step = f"{s['step_ms']:.2f} ms" if s and "step_ms" in s else "-"
        ratio = f"{mv / sv:.2f}" if mv and sv else "-"
        out.append(f"| {model} | {fig} | {k} | {f'{mv:.2f} {unit}' if mv else '-'} | "
                   f"{f'{sv:.2f} {unit}' if sv else '-'} | {step} | {ratio} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=["sglang-jax", "multilora"], choices=["sglang-jax", "multilora"])
    ap.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--adapters", type=int, nargs="+", default=[0, 8, 64])
    ap.add_argument("--parts", nargs="+", default=FIGURES, choices=FIGURES)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--timeout", type=int, default=540, help="seconds per benchmark process")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--raw-dir", type=Path, default=None, help="each process's own JSON (default: beside --json)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/vs-bench"), help="random models and adapters")
    ap.add_argument("--merge", type=Path, nargs="*", default=None,
                    help="earlier outputs of this script to combine (nothing is run)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: reduced shapes and counts")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.adapters = 2, [0, 2]
        args.models = args.models[:1]

    rows, runs = [], []
    if args.merge is not None:
        for f in args.merge:
            d = json.loads(f.read_text())
            rows += d["rows"]
            runs += d.get("runs", [])
    else:
        raw_dir = args.raw_dir or (args.json.parent if args.json else Path("/tmp/vs-raw"))
        raw_dir.mkdir(parents=True, exist_ok=True)
        for engine in args.engines:
            for model in args.models:
                raw = (sglang_runs if engine == "sglang-jax" else multilora_runs)(args, model, raw_dir)
                rows += figures(engine, model, raw)
                runs.append(dict(engine=engine, model=model, raw=raw))
    print("\n" + table(rows))
    if args.json:
        args.json.write_text(json.dumps(dict(argv=sys.argv, cwd=os.getcwd(), rows=rows, runs=runs), indent=2))


if __name__ == "__main__":
    main()
