"""LoRA op micro-benchmark: one projection's shrink + expand (D -> R -> D) against its base matmul.

Compares the `bgmv` and `sgmv` backends with sglang-jax's one-hot einsum anchor
(`einsum("td,tX,Xld->tl", x, one_hot(idx, X), W)`, used for the shrink and the expand alike) over
token counts, adapters in the pool and model dims. Reports each op's median time divided by the
median time of the base matmul `x_TD @ W_DD` of the same shape, all variants of a shape measured
interleaved in one loop so that the machine's noise hits them alike.

The op measured is the LoRA delta alone (no add onto the base output). Each variant is its own
jitted function that applies the op K times in a `lax.scan` over K different inputs (each with its
own copy of the batch info, so nothing is loop-invariant and hoisted): one jitted call costs 50 to
150 us of dispatch on these machines, which a real forward pass (one jit for the whole model) does
not pay per projection, and which alone is 2 to 6 % of a decode matmul at d=4096. K is chosen per
shape so that the base variant runs about --inner-ms per call; `--inner 1` gives per-call times.
The "scan floor" column is the same scan around a near-no-op. float32 throughout: bf16 is upcast
on XLA CPU. The scan is not unrolled on purpose: unrolled, XLA is free to combine the K products
that share a weight (the one-hot einsum came out 3x cheaper that way), which no forward pass does.

    python benchmarks/lora_op.py [--dims 576 4096] [--tokens 1 16 256 1024] [--adapters 1 8 64]
                                 [--rank 16] [--repeats N] [--budget-s S] [--inner K | --inner-ms MS]
                                 [--ops bgmv sgmv onehot] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import machine_info, save_json  # noqa: E402
from multilora.config import NO_ADAPTER  # noqa: E402
from multilora.lora import backend as backends  # noqa: E402
from multilora.lora.batch import make_lora_batch_info  # noqa: E402
from multilora.adapters.pool import slot_major_pool, slot_major_rows  # noqa: E402

DEFAULT_OPS = ("bgmv", "sgmv", "onehot")
ANCHOR = "onehot"  # sglang-jax's einsum; every other op is a multilora backend by name


def onehot_einsum(x_TD, w_XLD, slot_T):
    """sglang-jax's BGMV anchor: the one-hot selection contracted with every slot's weights."""
    return jnp.einsum("td,tX,Xld->tl", x_TD, jax.nn.one_hot(slot_T, w_XLD.shape[0], dtype=x_TD.dtype), w_XLD)


def onehot_lora(x_TD, a_SRD, b_SRO, info):
    h_TR = onehot_einsum(x_TD, a_SRD, info.slot_T)
    h_TR = h_TR * jnp.take(info.scalings_S, info.slot_T)[:, None].astype(h_TR.dtype)
    one_hot_TS = jax.nn.one_hot(info.slot_T, b_SRO.shape[0], dtype=h_TR.dtype)
    return jnp.einsum("tr,ts,sro->to", h_TR, one_hot_TS, b_SRO)


def backend_lora(name):
    be = backends.get_backend(name)

    def op(x_TD, a_SRD, b_SRO, info):
        return be.run_lora_b_gemm(be.run_lora_a_gemm(x_TD, a_SRD, info), b_SRO, info)
    return op


def base_matmul(x_TD, w_DD):
    return x_TD @ w_DD


def scan_floor(x_TD, a_SRD, b_SRO, info):
    return x_TD[:, :1] * 2.0


def scanned(op):
    """jit(K applications of op in a lax.scan over K inputs and K batch infos)."""
    def f(x_KTD, a_SRD, b_SRO, info_K):
        def body(carry, x_info):
            x_TD, info = x_info
            return carry, op(x_TD, a_SRD, b_SRO, info)
        return jax.lax.scan(body, 0, (x_KTD, info_K))[1]
    return jax.jit(f)


def base_op(x_TD, w_DD, b_SRO, info):
    return base_matmul(x_TD, w_DD)


def slot_assignment(num_tokens: int, num_adapters: int, seed: int) -> np.ndarray:
    """Tokens over adapters 1..N round-robin, then shuffled (fixed seed) so they arrive unsorted."""
    slot_T = 1 + np.arange(num_tokens) % num_adapters
    return np.random.default_rng(seed).permutation(slot_T).astype(np.int32)


def make_case(dim: int, num_tokens: int, num_adapters: int, rank: int, inner: int, seed: int):
    rng = np.random.default_rng(seed)
    num_slots = num_adapters + 1  # slot 0 = no adapter, all zeros
    x = rng.standard_normal((inner, num_tokens, dim), np.float32)
    w = rng.standard_normal((dim, dim), np.float32) / np.sqrt(dim)
    a = rng.standard_normal((num_slots, rank, dim), np.float32) / np.sqrt(dim)
    b = rng.standard_normal((num_slots, rank, dim), np.float32) / np.sqrt(rank)
    a[NO_ADAPTER] = 0.0
    b[NO_ADAPTER] = 0.0
    scalings = np.full((num_slots,), 2.0, np.float32)
    scalings[NO_ADAPTER] = 0.0
    ranks = np.full((num_slots,), rank, np.int32)
    ranks[NO_ADAPTER] = 0
    slot_T = slot_assignment(num_tokens, num_adapters, seed)
    # host, once per batch; the backends read the slots as the engine's pool of rank rows
    info = make_lora_batch_info(slot_T, scalings, ranks, slot_major_rows(num_slots, rank))
    info_K = jax.tree.map(lambda v: np.stack([v] * inner), info)
    dev = jax.device_put  # everything on the device before timing
    return dict(x=dev(x), w=dev(w), a=dev(a), b=dev(b), a_pool=dev(slot_major_pool(a)),
                b_pool=dev(slot_major_pool(b)), info=dev(info_K)), len(set(slot_T.tolist()))


def check_agreement(outs: dict[str, np.ndarray]) -> float:
    """Largest difference between any two ops' outputs (all compute the same delta)."""
    if len(outs) < 2:
        return float("nan")
    ref = next(iter(outs.values()))
    return max(float(np.abs(v - ref).max()) for v in outs.values())


def measure(variants: dict, repeats: int, budget_s: float, skip_s: float, min_reps: int):
    """variants: name -> (jitted fn, args). Returns name -> dict(median_s, min_s, reps | skipped_s)."""
    first, results, outs = {}, {}, {}
    for name, (fn, args) in variants.items():
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))  # compile + first run
        compile_s = time.perf_counter() - t0
        slow_ok = name in ("base", "floor")  # the ratios need these, however long they take
        if compile_s > 4 * skip_s and not slow_ok:
            results[name] = dict(skipped_s=compile_s, with_compile=True)
            continue
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))  # warm-up
        t = time.perf_counter() - t0
        if t > skip_s and not slow_ok:
            results[name] = dict(skipped_s=t)
            continue
        first[name] = t
        outs[name] = np.asarray(out)
    # Slow variants get fewer repeats: each has an equal share of the shape's time budget.
    share = budget_s / max(1, len(first))
    reps = {n: int(min(repeats, max(min_reps, share // max(t, 1e-9)))) for n, t in first.items()}
    n_max = max(reps.values(), default=0)
    samples = {n: [] for n in first}
    names = list(first)
    for i in range(n_max):
        order = names[i % len(names):] + names[:i % len(names)]  # rotate: no position bias
        for n in order:
            k = reps[n]
            if (i * k) // n_max == ((i + 1) * k) // n_max:
                continue  # this variant's repeats are spread evenly over the loop
            fn, args = variants[n]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            samples[n].append(time.perf_counter() - t0)
    for n, s in samples.items():
        results[n] = dict(median_s=statistics.median(s), min_s=min(s), reps=len(s))
    return results, outs


def choose_inner(dim: int, num_tokens: int, args) -> int:
    """K such that K base matmuls take about --inner-ms (one quick timing of a single matmul)."""
    if args.inner:
        return args.inner
    x = jax.device_put(np.ones((num_tokens, dim), np.float32))
    w = jax.device_put(np.ones((dim, dim), np.float32))
    f = jax.jit(base_matmul)
    jax.block_until_ready(f(x, w))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, w))
        ts.append(time.perf_counter() - t0)
    return int(min(args.max_inner, max(1, round(args.inner_ms * 1e-3 / min(ts)))))


def run(args) -> list[dict]:
    ops = list(args.ops)
    jitted = {"base": scanned(base_op), "floor": scanned(scan_floor)}
    jitted.update({op: scanned(onehot_lora if op == ANCHOR else backend_lora(op)) for op in ops})
    has_auto = hasattr(backends, "choose_backend")
    rows = []
    for dim in args.dims:
        for num_tokens in args.tokens:
            inner = choose_inner(dim, num_tokens, args)
            for num_adapters in args.adapters:
                c, distinct = make_case(dim, num_tokens, num_adapters, args.rank, inner, args.seed)
                lora_args = (c["x"], c["a"], c["b"], c["info"])
                pool_args = (c["x"], c["a_pool"], c["b_pool"], c["info"])
                variants = {"base": (jitted["base"], (c["x"], c["w"], c["b"], c["info"])),
                            "floor": (jitted["floor"], lora_args)}
                variants.update({op: (jitted[op], lora_args if op == ANCHOR else pool_args) for op in ops})
                t0 = time.perf_counter()
                res, outs = measure(variants, args.repeats, args.budget_s, args.skip_s, args.min_reps)
                for r in res.values():  # per op application
                    for k in ("median_s", "min_s"):
                        if k in r:
                            r[k] /= inner
                row = dict(dim=dim, tokens=num_tokens, adapters_in_pool=num_adapters,
                           slots=num_adapters + 1, distinct_in_batch=distinct, rank=args.rank,
                           inner=inner, results=res,
                           max_abs_diff=check_agreement({k: outs[k] for k in ops if k in outs}),
                           wall_s=time.perf_counter() - t0)
                if has_auto:
                    # A shape of <= 64 tokens stands for a decode batch (one token per sequence).
                    try:
                        row["auto"] = backends.choose_backend("auto", num_tokens, num_tokens <= 64,
                                                             num_slots=num_adapters + 1,
                                                             platform=jax.devices()[0].platform)
                    except TypeError:  # the signature moved on; the column is then left out
                        has_auto = False
                scale = max(float(np.abs(o).max()) for o in outs.values()) if outs else 1.0
                if row["max_abs_diff"] > 1e-4 * max(scale, 1.0):
                    print(f"WARNING: ops disagree by {row['max_abs_diff']:.2e} (outputs up to {scale:.2e})",
                          file=sys.stderr)
                rows.append(row)
                print(f"# d={dim} T={num_tokens} N={num_adapters} K={inner}: {fmt_row_short(row, ops)} "
                      f"diff={row['max_abs_diff']:.1e} ({row['wall_s']:.1f}s)", file=sys.stderr, flush=True)
    return rows


def ratio(row, name):
    r = row["results"].get(name, {})
    base = row["results"]["base"].get("median_s")
    if "median_s" in r and base:
        return r["median_s"] / base
    return None


def cell(row, name):
    r = row["results"].get(name, {})
    if "skipped_s" in r:
        what = "first call, with compile" if r.get("with_compile") else "per call"
        return f"skipped (>{r['skipped_s']:.1f}s {what})"
    x = ratio(row, name)
    return "n/a" if x is None else f"{x:.3f}"


def fmt_row_short(row, ops):
    return " ".join(f"{n}={cell(row, n)}" for n in ops) + f" base={row['results']['base']['median_s'] * 1e3:.3f}ms"


def markdown(rows, ops) -> str:
    backends_run = [op for op in ops if op not in (ANCHOR, "reference")]
    has_auto = any("auto" in r for r in rows)
    head = ["d", "T", "adapters in pool (slots)", "distinct in batch", "K", "base ms", "scan floor us"]
    head += ["one-hot einsum" if op == ANCHOR else op for op in ops]
    if ANCHOR in ops and backends_run:
        head.append("best / one-hot")
    if has_auto:
        head.append("auto")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        res = row["results"]
        best = min((x for x in (ratio(row, n) for n in backends_run) if x is not None), default=None)
        cells = [str(row["dim"]), str(row["tokens"]), f"{row['adapters_in_pool']} ({row['slots']})",
                 str(row["distinct_in_batch"]), str(row["inner"]), f"{res['base']['median_s'] * 1e3:.4g}",
                 f"{res['floor']['median_s'] * 1e6:.3g}"] + [cell(row, op) for op in ops]
        if ANCHOR in ops and backends_run:
            oh = ratio(row, ANCHOR)
            if best is None:
                cells.append("n/a")
            elif "skipped_s" in res.get(ANCHOR, {}):
                cells.append("(one-hot skipped)")
            else:
                cells.append("n/a" if oh is None else f"{best / oh:.2f}")
        if has_auto:
            a = row.get("auto", "")
            mine = ratio(row, a)
            slower = mine is not None and best is not None and mine > 1.1 * best  # 10 %: past the noise
            cells.append(a + (f" ({mine / best:.1f}x the best)" if slower else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[576, 4096])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 1024])
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--ops", nargs="+", default=list(DEFAULT_OPS),
                   help=f"multilora backends by name, and {ANCHOR!r} for sglang-jax's one-hot einsum")
    p.add_argument("--repeats", type=int, default=50, help="most repeats per variant and shape")
    p.add_argument("--min-reps", type=int, default=5, help="fewest repeats, even for slow variants")
    p.add_argument("--budget-s", type=float, default=6.0, help="timing budget per shape (all variants)")
    p.add_argument("--skip-s", type=float, default=5.0, help="skip a variant whose one call takes longer")
    p.add_argument("--inner", type=int, default=0, help="op applications per timed call (0: auto)")
    p.add_argument("--inner-ms", type=float, default=60.0, help="auto K: K base matmuls take about this")
    p.add_argument("--max-inner", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    env = dict(machine_info(), date=datetime.date.today().isoformat())
    rows = run(args)
    print(f"LoRA op (shrink + expand, rank {args.rank}, float32) / base matmul x_TD @ W_DD, median times; "
          f"{env['cpu']}, {env['cores']} cores, JAX {env['jax']} ({env['backend']}), {env['date']}\n")
    print(markdown(rows, args.ops))
    print("\nRatios: median time of the op (shrink + expand of one projection, the LoRA delta only) over "
          "the median time of the base matmul; K ops per timed call in a lax.scan (dispatch amortized); "
          "'scan floor' is that scan around a no-op, per op. T=1 has one distinct adapter in the batch "
          "whatever the pool holds. 'best / one-hot' < 1 means the better multilora backend is ahead. "
          "'auto' is choose_backend('auto', T, is_decode=T<=64, num_slots=S); '(Nx the best)' flags a pick over 10 % "
          "slower than the best backend measured.")
    if args.json:
        save_json(args.json, dict(env=env, args={k: str(v) for k, v in vars(args).items()}, rows=rows))


if __name__ == "__main__":
    main()
