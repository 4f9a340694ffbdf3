"""The large copies in one compiled model step: forward_step's steps (the same workload, pool and
backend choice), compiled for this machine's device and read from the optimized HLO. Nothing is
run, and nothing of the model's size is allocated: the step is compiled for abstract arrays.

    python benchmarks/hlo_copies.py --modes prefill decode --slots 256
    python benchmarks/hlo_copies.py --slots 256 --hlo-dir /tmp/hlo     # + each step's HLO text
    python benchmarks/hlo_copies.py --pool-layout default              # pools as the device lays them out

Each case prints every copy (copy, copy-start) of at least --min-mb, with its shape, the layouts
it goes from and to, and the computation it sits in (ENTRY: once a step, before or after the
layer loop; a while body: once a layer). Written to find why a TPU step copied every LoRA pool
whole before the layer loop, whether or not a row used an adapter (benchmarks/log/24-2026-12-05-tpu-v5e-rows-major.md): the pools came
in the TPU's default layout, and the loop reads them rows-major (multilora.adapters.pool.POOL_LAYOUT).
--pool-layout default compiles the step for pools in the device's default layout, as they were.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.layout import Format  # noqa: E402

from benchmarks.common import SMOLLM2_135M  # noqa: E402
from benchmarks.forward_step import (pow2_pages, prefill_chunks, random_lora, random_weights,  # noqa: E402
                                     workload_chunks)
from multilora.config import ModelConfig  # noqa: E402
from multilora.engine.batching import build_batch, pages_needed  # noqa: E402
from multilora.lora.backend import SWITCH, choose_backend, get_backend, grouped_cap, native_usable  # noqa: E402
from multilora.adapters.pool import POOL_LAYOUT, slot_major_rows  # noqa: E402
from multilora.model.llama import KVCache, forward, init_kv_cache, kv_cache_formats, kv_heads_major_on  # noqa: E402

_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}
# An instruction: "%copy.3 = bf16[30,12336,576]{2,1,0:T(8,128)(2,1)} copy(%param.2)" (the operand
# printed with or without its shape); a copy-start's result is a (dest, source, context) tuple.
_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = (\(?\w+)\[([\d,]*)\](\{[^}]*\})?\S* ([\w-]+)\((.*)$")
_START = re.compile(r"^\s*(?:ROOT )?%?([\w.-]+) = \((\w+)\[([\d,]*)\](\{[^}]*\})?.* (copy-start)\((.*)$")


def large_copies(hlo: str, min_bytes: int) -> list[dict]:
    """Every copy of at least min_bytes outside fusions in the HLO text: shape, the layouts it
    goes from and to, its operand and the computation it sits in."""
    layouts, copies, comp = {}, [], "?"  # layouts: every instruction's, for the copies' operands
    for line in hlo.splitlines():
        if line.startswith(("%", "ENTRY")) and line.rstrip().endswith("{"):  # a computation's header
            comp = line.split(" (")[0].lstrip("%")
            continue
        m = _DEF.match(line) or _START.match(line)
        if m is None:
            continue
        name, dt, dims, layout, op, rest = m.groups()
        layouts[name] = layout
        if op in ("copy", "copy-start") and "fused_computation" not in comp:
            arg = re.match(r"\s*(?:\w+\[[\d,]*\](\{[^}]*\})? )?%?([\w.-]+)", rest)
            src_layout, operand = arg.groups() if arg else (None, "?")
            shape = [int(d) for d in dims.split(",") if d]
            nbytes = int(np.prod(shape)) * _DTYPE_BYTES.get(dt.lstrip("("), 4)
            if nbytes >= min_bytes:
                copies.append(dict(name=name, op=op, dtype=dt.lstrip("("), shape=shape, mb=nbytes / 2**20,
                                   to=layout, frm=src_layout, operand=operand, computation=comp))
    for c in copies:
        c["frm"] = c["frm"] or layouts.get(c["operand"], "?")
    return copies


def abstract(tree, sharding=None):
    """Shapes only: the step is compiled, never run, so nothing of the model's size is made."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["prefill", "decode"], choices=["prefill", "decode"])
    ap.add_argument("--slots", type=int, nargs="+", default=[256])
    ap.add_argument("--adapters", type=int, default=0, help="adapters the step's rows use (0: LoRA on, unused)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--min-mb", type=float, default=1.0)
    ap.add_argument("--pool-layout", default="rows-major", choices=["rows-major", "default"],
                    help="the pools' layout: the engine's (POOL_LAYOUT) or the device's default for their shape")
    ap.add_argument("--kv-layout", default="auto", choices=["auto", "default", "heads-major"],
                    help="the KV cache's layout (auto: as the engine makes it, heads-major on a TPU: "
                         "multilora.model.llama.KV_HEADS_MAJOR)")
    ap.add_argument("--hlo-dir", type=Path, default=None)
    args = ap.parse_args(argv)

    cfg = ModelConfig.from_hf_dict(SMOLLM2_135M)
    dt = jnp.dtype(args.dtype)
    weights = abstract(jax.eval_shape(lambda: jax.tree.map(lambda a: a.astype(dt), random_weights(cfg, on_host=False))))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    hm = kv_heads_major_on(jax.devices()[0].platform) if args.kv_layout == "auto" else args.kv_layout == "heads-major"
    kv_formats = kv_cache_formats(KVCache(one, one), hm)
    fwd = jax.jit(forward, static_argnames=("cfg", "backend", "native_attention", "kv_heads_major"),
                  donate_argnames=("kv",), **(dict(out_shardings=(one, kv_formats)) if hm else {}))
    pool_sharding = Format(POOL_LAYOUT, one) if args.pool_layout == "rows-major" else one
    platform = jax.devices()[0].platform
    rng = np.random.default_rng(0)
    for slots in args.slots:
        s = slots + 1
        pools = jax.eval_shape(lambda s=s: random_lora(cfg, s, args.rank, dtype=dt))
        lora = abstract(pools, pool_sharding)
        for mode in args.modes:
            if mode == "decode":
                chunks, t = workload_chunks("decode", 64, 80, 16, args.adapters, rng), 64
            else:
                chunks, t = prefill_chunks(512, 16, args.adapters, rng, first_page=1), 512
            x = pow2_pages(sum(pages_needed(c, 16) for c in chunks))
            native = args.backend == "auto" and native_usable(dt, jax.devices()[:1])
            backend = choose_backend(args.backend, t, t <= 64, s, native, platform)  # as forward_step
            be = get_backend(backend.split(SWITCH)[0])
            cap = grouped_cap(t) if SWITCH in backend else 64
            scal, ranks = np.full(s, 2.0, np.float32), np.full(s, args.rank, np.int32)
            scal[0], ranks[0] = 0, 0
            table = slot_major_rows(s, args.rank)
            batch = build_batch(chunks, num_tokens=t, num_pages=x, num_logits=min(t, 64), page_size=16,
                                prepare_lora=lambda slot_T: be.prepare_lora_batch(slot_T, scal, ranks, table, cap))
            num_pages = 1 + max(max(c.block_table) for c in chunks)
            kv = jax.eval_shape(lambda: init_kv_cache(cfg, num_pages, 16, dt))
            kv = KVCache(*(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=f)
                           for a, f in zip((kv.k_LPpKH, kv.v_LPpKH), (kv_formats.k_LPpKH, kv_formats.v_LPpKH))))
            hlo = fwd.lower(weights, lora, kv, batch, cfg=cfg, backend=backend,
                            native_attention=False, kv_heads_major=hm).compile().as_text()
            copies = large_copies(hlo, int(args.min_mb * 2**20))
            print(f"\n{mode}, {s} slots, {args.adapters} adapters, {backend}, pools {args.pool_layout}: "
                  f"kv {'heads-major' if hm else 'default'}: {len(copies)} copies of >= {args.min_mb} MB, {sum(c['mb'] for c in copies):.0f} MB in all")
            for c in copies:
                print(f"  {c['mb']:8.1f} MB {c['op']:10} {c['dtype']}{c['shape']} {c['frm']} -> {c['to']} "
                      f"of {c['operand']} in {c['computation']}")
            if args.hlo_dir:
                args.hlo_dir.mkdir(parents=True, exist_ok=True)
                name = f"{mode}_slots{slots}_{backend.replace(SWITCH, '-')}_{args.pool_layout}.hlo.txt"
                (args.hlo_dir / name).write_text(hlo)


if __name__ == "__main__":
    main()
