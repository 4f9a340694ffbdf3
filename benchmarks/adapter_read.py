"""What reading one adapter costs, stage by stage, for each host-copy dtype: the loader's read
(file, validation, the converting copy, the finite check), its content hash, the slot layout
(the loader's urgent workers) and the slot write (the engine's thread, between steps), on the
embedded default model with the serving benchmark's random rank-16 adapters (all seven
projections). Medians over the adapters, the dtypes alternated adapter by adapter in one run.

    python benchmarks/adapter_read.py [--adapters 40] [--json out.json]
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

from benchmarks.common import machine_info, make_random_adapters, save_json  # noqa: E402

CACHE = Path(os.path.expanduser("~/.cache/multilora/bench"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=40)
    ap.add_argument("--adapter-dir", default=str(CACHE / "serving-adapters-r16"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import ml_dtypes
    import numpy as np

    from multilora.config import LoRAConfig, ModelConfig
    from multilora.engine.runner import jit_slot_writer
    from multilora.adapters.adapter import load_adapter
    from multilora.adapters.pool import LoRASlots, page_rows, prepare_slot_layout
    from multilora.default_model import default_model_dir
    from multilora.model.sharding import make_mesh

    model = default_model_dir()
    cfg = ModelConfig.from_dir(model)
    paths = make_random_adapters(Path(model), Path(args.adapter_dir), args.adapters, rank=16)
    mesh = make_mesh(1)
    lcfg = LoRAConfig(max_loras_per_batch=2, max_lora_rank=16)
    dtypes = {"float32": (np.float32, jnp.float32), "bfloat16": (ml_dtypes.bfloat16, jnp.bfloat16)}
    slots = {k: LoRASlots(cfg, lcfg, jdt, mesh, jit_writer=jit_slot_writer) for k, (_, jdt) in dtypes.items()}
    times = {k: {s: [] for s in ("read", "hash", "layout", "write")} for k in dtypes}
    for p in paths:
        for k, (ndt, _) in dtypes.items():
            t0 = time.perf_counter()
            ad = load_adapter(p.name, p, cfg, 16, ndt)
            t1 = time.perf_counter()
            ad.content_hash  # noqa: B018
            t2 = time.perf_counter()
            prepare_slot_layout(ad, cfg, lcfg.table_width)
            t3 = time.perf_counter()
            slots[k].load(1, page_rows([1, 2]), ad)
            jax.block_until_ready(slots[k].weights)
            t4 = time.perf_counter()
            for s, dt in zip(("read", "hash", "layout", "write"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[k][s].append(dt * 1e3)
    res = {"machine": machine_info(), "adapters": len(paths), "host_bytes": {}, "ms": {}}
    print(f"{len(paths)} rank-16 adapters, medians in ms per adapter")
    print(f"| host copy | read | hash | layout | loader total | slot write (engine thread) |")
    print("|---|---:|---:|---:|---:|---:|")
    for k in dtypes:
        med = {s: statistics.median(v) for s, v in times[k].items()}
        res["ms"][k] = med
        print(f"| {k} | {med['read']:.1f} | {med['hash']:.1f} | {med['layout']:.1f} | "
              f"{med['read'] + med['hash'] + med['layout']:.1f} | {med['write']:.1f} |")
    if args.json:
        save_json(Path(args.json), res)


if __name__ == "__main__":
    main()
