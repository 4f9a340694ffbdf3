"""sglang-jax's side of benchmarks/tpu_vs_sglang_jax.py: the same figures as multilora's
forward_step.py (one decode step, one prefill step) and engine_throughput.py (offline tokens per
second), measured inside sglang-jax (`sgl_jax`, pinned at cddbf6f1) on dummy weights of the same
shapes. One process does every part, so the chip is opened once and compiles are shared.

    bash benchmarks/sglang_jax_setup.sh && export PYTHONPATH=...   # (the script prints the line)
    python benchmarks/sglang_jax_driver.py --model smollm2-135m --adapters 0 8 64 \\
        --parts decode prefill offline --json /tmp/sgl.json
    JAX_PLATFORMS=cpu python benchmarks/sglang_jax_driver.py --layers 2 --quick   # a CPU smoke run

How sglang-jax is driven, and why:
  * Steps: its `bench_one_batch` is broken at this commit, so the driver does what its Scheduler
    does per step: Req -> ScheduleBatch.prepare_for_extend / prepare_for_decode ->
    get_model_worker_batch(the worker's padding buckets) -> ModelWorker.forward_batch_generation.
    'step' times that whole call (LoRA batch preparation, ForwardBatch, forward, sampling) up to
    the sampled ids; 'forward' times ForwardBatch + model_runner.forward up to the logits (the
    counterpart of forward_step.py, which times the model's forward alone). The same batch is
    re-run for every repeat, as forward_step.py does (it rewrites the same KV slots).
  * The decode rows' caches are filled by real prefill steps of the prefill part's shape (as many
    requests as fit in --prefill-tokens), merged into one running batch as the Scheduler merges.
  * Offline: sglang-jax's own Engine (enable_single_process: scheduler, tokenizer manager and
    detokenizer as threads of this process over ZMQ ipc sockets; the chip allows no TCP),
    skip_tokenizer_init (token ids in, token ids out, no tokenizer needed), the same 64 prompts as
    engine_throughput.py; one untimed run of the same workload compiles what it uses, then the
    timed run.
  * No adapter (0): an engine without LoRA, as a user serving no adapters runs it. 8 and 64
    adapters: one engine with LoRA on all seven projections and max(--adapters)+1 slots
    (sglang-jax reserves one for rows without adapter), rows spread over the first k adapters.
  * Each engine instance is dropped before the next is built: its device arrays are deleted (the
    worker's threads keep Python references alive) and a finished Engine's scheduler thread, which
    polls in a busy loop when idle, is stopped so it takes no GIL time from later parts.
  * No precompile at start-up (its full bucket sweep is what takes ~200 s with LoRA); each shape
    used is compiled on first use, before timing. A persistent compilation cache is on by default.

Partial results are written to --json after every case. Progress (with elapsed seconds) goes to
stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import SHAPES, fixed_prompts, make_random_adapters  # noqa: E402

T0 = time.perf_counter()
DEFAULT_DECODE_CTX = {"smollm2-135m": 80, "llama-3.2-1b": 256}  # as in issue 37's figures


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------- model and adapter folders


def write_model_folder(folder: Path, model: str, layers: int | None) -> Path:
    """A config.json of the shape alone: load_format=dummy makes up the weights."""
    cfg = dict(SHAPES[model], torch_dtype="bfloat16")
    if layers:
        cfg["num_hidden_layers"] = layers
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def write_adapters(model_dir: Path, root: Path, count: int, rank: int) -> list[Path]:
    """`count` PEFT folders of rank `rank` on all seven projections. One random safetensors file
    is written (benchmarks/common.make_random_adapters, numpy only) and linked from the others:
    the values do not change a step's time, and 64 float32 copies at the 1B shape would be 2.9 GB
    to draw and write on the chip's host. Each folder is still a separate adapter to the engine."""
    first = make_random_adapters(model_dir, root, 1, rank=rank)[0]
    paths = [first]
    for i in range(1, count):
        p = root / f"adapter_{i:04d}"
        p.mkdir(parents=True, exist_ok=True)
        shutil.copy(first / "adapter_config.json", p / "adapter_config.json")
        link = p / "adapter_model.safetensors"
        if not link.exists():
            link.symlink_to(first / "adapter_model.safetensors")
        paths.append(p)
    return paths


# ---------------------------------------------------------------- engine set-up and teardown


def pool_tokens(args, step_cases: int) -> int:
    """KV pool tokens for `step_cases` cases (each decode case's rows, a page of growth each, and
    the prefill case) or for the offline batch, so that no engine claims the whole chip (by
    default sglang-jax takes 88 % of its memory for the KV pool)."""
    if args.max_total_tokens:
        return args.max_total_tokens
    if step_cases:
        per_case = args.decode_seqs * (args.decode_ctx + args.page_size) + 2 * args.prefill_tokens
        return step_cases * per_case + 4 * args.page_size
    return args.requests * (args.prompt_len + 8 + args.new_tokens + args.page_size) + 4 * args.page_size


def server_args(args, model_dir: Path, adapters: list[Path], max_total_tokens: int, **extra):
    """ServerArgs as a user would pass them for this workload (LoRA on when adapters are given),
    normalised by check_server_args as sglang-jax's launcher does."""
    from sgl_jax.srt.server_args import ServerArgs
    lora = {}
    if adapters:
        lora = dict(lora_paths=[{"name": f"a{i}", "path": str(p), "pinned": True} for i, p in enumerate(adapters)],
                    max_loras_per_batch=len(adapters) + 1, max_lora_rank=args.rank, lora_target_modules=["all"])
    platform = os.environ.get("JAX_PLATFORMS", "").split(",")[0] or None
    sa = ServerArgs(model_path=str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                    page_size=args.page_size, context_length=args.context_length,
                    max_running_requests=args.max_running_requests, max_total_tokens=max_total_tokens,
                    disable_precompile=True, random_seed=0, device="cpu" if platform == "cpu" else None,
                    log_level="warning", **lora, **extra)
    sa.check_server_args()
    return sa


def device_arrays_of(root) -> list:
    """The device arrays reachable from `root` through attributes, containers and bound methods,
    not through modules, classes or functions: module-level caches (sglang-jax keeps shared zero
    arrays for its sampler) stay out of reach and alive."""
    import collections
    import types

    import jax
    import numpy as np
    skip = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, str, bytes, int, float,
            np.ndarray)
    seen, stack, found = set(), [root], {}
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, skip):
            continue
        seen.add(id(o))
        if isinstance(o, jax.Array):
            found[id(o)] = o
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(o)
        elif isinstance(o, types.MethodType):
            stack.append(o.__self__)
        else:
            stack.extend(getattr(o, "__dict__", {}).values())
            stack.extend(getattr(o, name) for name in getattr(type(o), "__slots__", ()) if hasattr(o, name))
    return list(found.values())


def release_device_memory(root) -> None:
    """Delete the device arrays of a dropped engine (its weights, KV cache, adapter pool): its
    threads keep it reachable, so garbage collection alone would leave them on the chip."""
    for a in device_arrays_of(root):
        if not a.is_deleted():
            a.delete()
    gc.collect()


def stop_engine(engine) -> None:
    """End a finished single-process Engine's scheduler thread (it polls its sockets in a busy
    loop when idle). SystemExit is not caught by the thread's `except Exception` (which would
    signal the whole process to die) and ends the thread quietly."""
    def _stop():
        raise SystemExit
    engine.scheduler_info["scheduler"].recv_requests = _stop
    for t in threading.enumerate():
        if t.name.startswith("sglang::scheduler"):
            t.join(timeout=10)


# ---------------------------------------------------------------- step timing on the ModelWorker


class StepBench:
    """One ModelWorker and the batches of its cases, built as sglang-jax's Scheduler builds them."""

    def __init__(self, sa, mesh, max_requests: int):
        """max_requests: request slots for all cases together. The Scheduler's pool holds only
        max_running_requests, but every case keeps its requests (the cases' steps are re-run
        interleaved); a larger pool handed to the worker leaves its batch buckets unchanged."""
        import numpy as np
        from sgl_jax.srt.managers.tp_worker import ModelWorker
        from sgl_jax.srt.mem_cache.chunk_cache import ChunkCache
        from sgl_jax.srt.mem_cache.memory_pool import ReqToTokenPool
        self.sa, self.mesh = sa, mesh
        pool = ReqToTokenPool(size=max_requests, max_context_len=sa.context_length + 4, dtype=np.int32)
        self.worker = ModelWorker(sa, mesh, req_to_token_pool=pool)
        self.runner = self.worker.model_runner
        self.cache = ChunkCache(self.runner.req_to_token_pool, self.runner.token_to_kv_pool_allocator, sa.page_size)
        self.paddings = self.worker.get_precompile_paddings()
        self.lora_ids = [ref.lora_id for ref in (sa.lora_paths or [])]
        self.vocab = self.runner.model_config.vocab_size
        self._rid = 0

    def requests(self, lengths, adapters: int, rng):
        """Requests of the given prompt lengths, each on one of the first `adapters` adapters
        (drawn as forward_step.py draws them), or on none."""
        from sgl_jax.srt.managers.schedule_batch import Req
        from sgl_jax.srt.sampling.sampling_params import SamplingParams
        out = []
        for n in lengths:
            sp = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
            sp.normalize(None)
            lora = self.lora_ids[int(rng.integers(adapters))] if adapters else None
            r = Req(rid=str(self._rid), origin_input_text="", origin_input_ids=rng.integers(3, 32000, n).tolist(),
                    sampling_params=sp, vocab_size=self.vocab, lora_id=lora)
            self._rid += 1
            r.fill_ids, r.prefix_indices = r.origin_input_ids, []
            r.extend_input_len, r.logprob_start_len = n, n - 1
            out.append(r)
        return out

    def schedule_batch(self, reqs):
        from sgl_jax.srt.managers.schedule_batch import ScheduleBatch
        return ScheduleBatch.init_new(reqs=[reqs], req_to_token_pool=self.runner.req_to_token_pool,
                                      token_to_kv_pool_allocator=self.runner.token_to_kv_pool_allocator,
                                      tree_cache=self.cache, model_config=self.runner.model_config,
                                      enable_overlap=False, dp_size=1, mesh=self.mesh)

    def worker_batch(self, batch):
        """The step's ModelWorkerBatch, as Scheduler.run_batch makes it. Its cache_loc is a view of
        one host buffer that every call rewrites: copied, since the cases' batches are kept."""
        mwb = batch.get_model_worker_batch(*self.paddings, self.sa.page_size, False)
        mwb.cache_loc = mwb.cache_loc.copy()
        return mwb

    def prefill_batch(self, reqs):
        b = self.schedule_batch(reqs)
        b.prepare_for_extend()
        return b

    def decode_batch(self, n_seqs: int, ctx: int, budget: int, adapters: int, rng):
        """n_seqs rows of ctx cached tokens: prompts of ctx-1 tokens prefilled in steps of at most
        `budget` tokens, the Scheduler's way (forward, sampled ids as output_ids, merge into the
        running batch), then prepare_for_decode."""
        import numpy as np
        per_step = max(1, budget // (ctx - 1))
        running = None
        for s in range(0, n_seqs, per_step):
            reqs = self.requests([ctx - 1] * min(per_step, n_seqs - s), adapters, rng)
            b = self.prefill_batch(reqs)
            mwb = self.worker_batch(b)
            _, ids, _ = self.worker.forward_batch_generation(mwb)
            b.output_ids = np.asarray(ids)[:len(reqs)]
            for r, t in zip(reqs, b.output_ids):
                r.output_ids.append(int(t))
            if running is None:
                running = b
            else:
                running.merge_batch(b)
        running.prepare_for_decode()
        return running

    def run_step(self, mwb):
        """The worker's whole step, as the Scheduler calls it, up to the sampled ids."""
        import jax
        _, ids, _ = self.worker.forward_batch_generation(mwb)
        jax.block_until_ready(ids)

    def run_forward(self, mwb):
        """The model's forward alone (ForwardBatch, attention metadata, model_runner.forward) up
        to the logits, after the step's LoRA batch preparation (untimed here, as forward_step.py
        prepares its LoRA arrays before timing)."""
        import jax
        from sgl_jax.srt.layers.logits_processor import LogitsMetadata
        from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch
        fb = ForwardBatch.init_new(mwb, self.runner)
        self.runner.attn_backend.forward_metadata = self.runner.attn_backend.get_forward_metadata(mwb)
        out, _, _ = self.runner.forward(fb, logits_metadata=LogitsMetadata.from_model_worker_batch(mwb, self.mesh))
        jax.block_until_ready(out.next_token_logits)

    def prepare_lora(self, mwb):
        if self.sa.enable_lora:
            self.worker.prepare_lora_batch(mwb)


def step_cases(args, bench: StepBench, adapter_counts, rng):
    """The (mode, adapters) cases of this engine, each with its worker batch, compiled."""
    cases = []
    for k in adapter_counts:
        for mode in [m for m in ("decode", "prefill") if m in args.parts]:
            t = time.perf_counter()
            if mode == "decode":
                batch = bench.decode_batch(args.decode_seqs, args.decode_ctx, args.prefill_tokens, k, rng)
            else:
                n = args.prefill_tokens // args.prompt_len
                batch = bench.prefill_batch(bench.requests([args.prompt_len] * n, k, rng))
            mwb = bench.worker_batch(batch)
            bench.run_step(mwb)  # compiles the step (and the forward it calls)
            bench.prepare_lora(mwb)
            bench.run_forward(mwb)
            cases.append(dict(mode=mode, adapters=k, mwb=mwb, step=[], forward=[],
                              tokens=int(mwb.real_input_ids_len), padded_tokens=len(mwb.input_ids),
                              rows=int(mwb.real_bs), cache_loc=len(mwb.cache_loc),
                              seq_len_mean=float(mwb.seq_lens[:mwb.real_bs].mean()),
                              warmup_s=time.perf_counter() - t))
            log(f"  {mode} with {k} adapters ready ({mwb.real_input_ids_len} tokens padded to "
                f"{len(mwb.input_ids)}, {mwb.real_bs} rows): {cases[-1]['warmup_s']:.1f} s")
    return cases


def time_cases(bench: StepBench, cases, repeats: int) -> None:
    """Interleaved repeats (as forward_step.py), so the cases share the machine's noise."""
    for _ in range(repeats):
        for c in cases:
            t = time.perf_counter()
            bench.run_step(c["mwb"])
            c["step"].append(time.perf_counter() - t)
            bench.prepare_lora(c["mwb"])
            t = time.perf_counter()
            bench.run_forward(c["mwb"])
            c["forward"].append(time.perf_counter() - t)


def run_steps(args, model_dir, adapters, adapter_counts, mesh, results, save):
    import numpy as np
    sa = server_args(args, model_dir, adapters, pool_tokens(args, len(adapter_counts)))
    log(f"steps: ModelWorker, LoRA {'on, %d slots' % (len(adapters) + 1) if adapters else 'off'}")
    per_case = max(args.decode_seqs, args.prefill_tokens // args.prompt_len)
    bench = StepBench(sa, mesh, 2 * len(adapter_counts) * per_case + 1)
    log(f"  worker ready (KV pool {bench.runner.max_total_num_tokens} tokens, "
        f"attention {sa.attention_backend}, paddings {[list(p) for p in bench.paddings[:2]]})")
    cases = step_cases(args, bench, adapter_counts, np.random.default_rng(0))
    time_cases(bench, cases, args.repeats)
    for c in cases:
        row = {k: v for k, v in c.items() if k != "mwb"}
        row.update(kind="step", lora=bool(adapters), slots=len(adapters) + 1 if adapters else 0,
                   step_median_s=statistics.median(c["step"]), forward_median_s=statistics.median(c["forward"]))
        results.append(row)
        log(f"  {c['mode']:7} adapters={c['adapters']:3d}: forward {1e3 * row['forward_median_s']:8.2f} ms, "
            f"step {1e3 * row['step_median_s']:8.2f} ms")
    save()
    del cases
    release_device_memory(bench)


# ---------------------------------------------------------------- offline throughput on the Engine


def run_offline(args, model_dir, adapters, adapter_counts, results, save):
    from sgl_jax.srt.entrypoints.engine import Engine
    sa = server_args(args, model_dir, adapters, pool_tokens(args, 0), enable_single_process=True)
    log(f"offline: Engine, LoRA {'on, %d slots' % (len(adapters) + 1) if adapters else 'off'}")
    t = time.perf_counter()
    engine = Engine(server_args=sa)
    log(f"  engine ready: {time.perf_counter() - t:.1f} s")
    prompts = fixed_prompts(args.requests, args.prompt_len, 49152)  # engine_throughput.py's prompts
    params = dict(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for k in adapter_counts:
        names = [f"a{i % k}" for i in range(len(prompts))] if k else None
        t = time.perf_counter()
        # untimed: compiles its shapes; twice, since the first run's prompts are new to the radix
        # cache and every later run's cached (steps of other sizes), as engine_throughput.py does
        for _ in range(2):
            engine.generate(input_ids=prompts, sampling_params=params, lora_path=names)
        warm = time.perf_counter() - t
        runs = []  # several timed runs, their median: a run that compiled again shows as an outlier
        for _ in range(max(1, args.repeats)):
            t = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params, lora_path=names)
            runs.append(time.perf_counter() - t)
        secs = statistics.median(runs)
        toks = sum(len(o["output_ids"]) for o in outs)
        results.append(dict(kind="offline", adapters=k, lora=bool(adapters),
                            slots=len(adapters) + 1 if adapters else 0, requests=len(prompts), tokens=toks,
                            seconds=secs, run_seconds=runs, tok_per_s=toks / secs, warmup_s=warm))
        log(f"  offline adapters={k:3d}: {toks / secs:8.1f} tok/s ({toks} tokens, median of "
            f"{', '.join(f'{r:.2f}' for r in runs)} s; two untimed runs {warm:.1f} s)")
        save()
    stop_engine(engine)
    release_device_memory(engine)


# ---------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES))
    ap.add_argument("--adapters", type=int, nargs="+", default=[0, 8, 64])
    ap.add_argument("--parts", nargs="+", default=["decode", "prefill", "offline"],
                    choices=["decode", "prefill", "offline"])
    ap.add_argument("--json", type=Path, default=None, help="results, rewritten after every case")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--decode-seqs", type=int, default=64)
    ap.add_argument("--decode-ctx", type=int, default=None,
                    help="tokens in each decode row's cache (default: 80 at SmolLM2's shape, 256 at the 1B shape)")
    ap.add_argument("--prefill-tokens", type=int, default=512,
                    help="the prefill step's token budget, filled with --prompt-len prompts (512: 10 x 48)")
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--requests", type=int, default=64, help="offline: requests")
    ap.add_argument("--new-tokens", type=int, default=64, help="offline: tokens generated per request")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=128, help="sglang-jax's KV page (its docs' usual TPU setting)")
    ap.add_argument("--context-length", type=int, default=512,
                    help="the engine's context (the model's own 8192 / 131072 shrinks the running batch)")
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="KV pool tokens (default: what the cases hold; see pool_tokens)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model (CPU smoke runs)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: 8 decode rows, 2 repeats, 4 x 8 offline")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/sglang-jax-bench"))
    ap.add_argument("--compilation-cache", default="/tmp/sglang-jax-bench/jax-cache",
                    help="JAX's persistent compilation cache ('' for none)")
    args = ap.parse_args(argv)
    if args.quick:
        args.decode_seqs, args.repeats, args.requests, args.new_tokens = 8, 2, 4, 8
        args.max_running_requests = min(args.max_running_requests, 16)
    args.decode_ctx = args.decode_ctx or DEFAULT_DECODE_CTX[args.model]
    return args


def main(argv=None):
    args = parse_args(argv)
    import jax
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    from sgl_jax.srt.utils.mesh_utils import create_device_mesh
    log(f"jax {jax.__version__} on {jax.devices()}")
    work = args.workdir / (args.model + (f"-{args.layers}l" if args.layers else ""))
    model_dir = write_model_folder(work / "model", args.model, args.layers)
    with_lora = sorted(k for k in set(args.adapters) if k > 0)
    adapters = write_adapters(model_dir, work / "adapters", max(with_lora), args.rank) if with_lora else []
    log(f"config and {len(adapters)} adapters under {work}")
    results = []
    meta = dict(engine="sglang-jax", commit="cddbf6f1", model=args.model, layers=args.layers,
                devices=str(jax.devices()), jax=jax.__version__, decode_ctx=args.decode_ctx,
                args={k: str(v) for k, v in vars(args).items()})

    def save():
        if args.json:
            args.json.write_text(json.dumps(dict(meta, results=results), indent=2))

    mesh = create_device_mesh(ici_parallelism=[-1, 1], dcn_parallelism=[1, 1])
    groups = [(k_list, ads) for k_list, ads in (([0], []), (with_lora, adapters)) if k_list and set(k_list) & set(args.adapters)]
    if {"decode", "prefill"} & set(args.parts):
        for ks, ads in groups:
            run_steps(args, model_dir, ads, ks, mesh, results, save)
    if "offline" in args.parts:
        for ks, ads in groups:
            run_offline(args, model_dir, ads, ks, results, save)
    save()
    log("done")
    return results


if __name__ == "__main__":
    main()
