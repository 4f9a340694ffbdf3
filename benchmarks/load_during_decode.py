"""Loading adapters while streams decode: does a run-time load stall the running streams?

32 requests decode on multilora's offline Engine (its defaults; the embedded default model; 8
rank-16 adapters registered at start, drawn round-robin). Every inter-token time is timed (a step and the work the loop does before it). After a quiet
phase, adapters are loaded (8 folders, under new names) one after another the way the server loads them
(`Engine.read_adapter_async`: disk read, validation and hash on the engine's low-priority loader
thread, paced by the steps; then `load_lora_adapter(..., adapter=)` between two steps; the
start-up heap frozen as the server freezes it), while the streams keep
decoding. Reports the step time (= the streams' inter-token time) p50 / p99 in the quiet phase
and in the loading phase, in alternating blocks of one run.

    python benchmarks/load_during_decode.py [--streams 32] [--loads 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks.common import fixed_prompts, machine_info, make_random_adapters, save_json  # noqa: E402

CACHE = Path(os.path.expanduser("~/.cache/multilora/bench"))


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8, help="registered at start, used by the streams")
    ap.add_argument("--loads", type=int, default=24, help="adapter loads at most, during the loading blocks")
    ap.add_argument("--phase-steps", type=int, default=60, help="steps in each phase, all blocks together")
    ap.add_argument("--blocks", type=int, default=6, help="quiet and loading blocks, alternating")
    ap.add_argument("--adapter-dir", default=str(CACHE / "serving-adapters-r16"))
    ap.add_argument("--no-freeze", action="store_true",
                    help="leave the start-up heap in full garbage collections (the server freezes it)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from multilora import Engine, SamplingParams
    from multilora.default_model import default_model_dir
    model = Path(default_model_dir())
    pool = make_random_adapters(model, Path(args.adapter_dir), args.adapters + 8)
    running, extra = pool[:args.adapters], pool[args.adapters:]
    eng = Engine(str(model), {f"a{i}": str(p) for i, p in enumerate(running)})
    if not args.no_freeze:  # as the server does once it is up (multilora.server.heap)
        from multilora.server.heap import freeze_startup_heap
        freeze_startup_heap()
    prompts = fixed_prompts(args.streams, 48, eng.cfg.vocab_size)
    steps_needed = 2 * args.phase_steps + 40
    params = SamplingParams(max_tokens=steps_needed, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(p, params, f"a{i % args.adapters}" if args.adapters else None)
    while any(not r.output_token_ids for r in list(eng._requests.values())):  # every prefill done
        eng.step()

    # Quiet and loading blocks alternate, so that both phases see the machine's drift alike.
    quiet, loading, load_secs = [], [], []
    todo = [(f"new{i}", extra[i % len(extra)]) for i in range(args.loads)]
    fut = None
    for block in range(2 * args.blocks):
        loads_on = block % 2 == 1
        for _ in range(args.phase_steps // args.blocks):
            t0 = time.perf_counter()   # an inter-token time: the work between steps and the step
            if fut is not None and fut.done():   # between two steps, as the server does
                eng.load_lora_adapter(name, str(path), adapter=fut.result())
                load_secs.append(time.perf_counter() - started)
                fut = None
            if loads_on and fut is None and todo:
                name, path = todo.pop(0)
                started = time.perf_counter()
                fut = eng.read_adapter_async(name, str(path))   # the server's path
            eng.step()
            (loading if loads_on else quiet).append(time.perf_counter() - t0)
    row = dict(streams=args.streams, adapters=args.adapters, loads_done=len(load_secs),
               load_s_median=statistics.median(load_secs) if load_secs else None,
               quiet_ms=dict(p50=1e3 * pct(quiet, 50), p99=1e3 * pct(quiet, 99)),
               loading_ms=dict(p50=1e3 * pct(loading, 50), p99=1e3 * pct(loading, 99)))
    row["p99_ratio"] = row["loading_ms"]["p99"] / row["quiet_ms"]["p99"]
    row["p50_ratio"] = row["loading_ms"]["p50"] / row["quiet_ms"]["p50"]
    print(f"{args.streams} streams decoding; {len(load_secs)} adapters loaded during the loading phase "
          f"(each {row['load_s_median'] or 0:.2f} s from request to registered, median)")
    print(f"step (inter-token) ms   quiet p50 {row['quiet_ms']['p50']:.1f} p99 {row['quiet_ms']['p99']:.1f}   "
          f"loading p50 {row['loading_ms']['p50']:.1f} p99 {row['loading_ms']['p99']:.1f}   "
          f"ratio p50 {row['p50_ratio']:.2f} p99 {row['p99_ratio']:.2f}")
    if args.json:
        save_json(args.json, dict(machine=machine_info(), args=vars(args), result=row,
                                  quiet_s=quiet, loading_s=loading))


if __name__ == "__main__":
    main()
