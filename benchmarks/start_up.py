"""What registering adapters at start costs: `Engine(default model, {K adapters})` with
warmup=False (the step compile is not timed), wall time and the process's peak RSS.

    python benchmarks/start_up.py 256     # K rank-16 adapters from benchmarks/serving.py's pool
    python benchmarks/start_up.py 0       # the same engine with none registered

The adapters are the ones benchmarks/serving.py makes under ~/.cache/multilora/bench
(serving-adapters-r16); run serving.py once with --adapters K first, or any K it has made.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main() -> None:
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 256
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


if __name__ == "__main__":
    main()
