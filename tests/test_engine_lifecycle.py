"""An engine gives back what it takes (multilora.engine.lifecycle): a dozen engines of different
models built, used and dropped (or shut down) one after another in one process keep the process's
memory mappings and RSS within a bound, their threads end, and a shut-down engine refuses work
with a clear error.

Before: every engine's executables stayed (JAX's caches keyed on the module-level functions the
runner jitted), ~125 mappings an engine built like these (~6,800 with a full warm-up), until a
process passed the kernel's vm.max_map_count and LLVM died compiling (issue 61)."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from multilora.engine.engine import Engine
from multilora.engine.lifecycle import EngineShutDownError
from multilora.engine.request import SamplingParams
from tests import reference

NUM_MODELS = 12
# Bounds on what 11 engines after the first may add, with margin: measured here (2-core EPYC)
# +39 mappings and +27 MB of RSS, where kept executables added 1,348 mappings.
MAX_NEW_MAPS = 400
MAX_NEW_RSS_MB = 400
KW = dict(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=16, page_size=8, warmup=False,
          max_loras_per_batch=2, max_lora_rank=8)


def num_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def loader_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("multilora-lora-load", "multilora-warmup"))]


def wait_for_no_loader_threads(timeout: float = 10.0) -> list[str]:
    deadline = time.time() + timeout
    while loader_threads() and time.time() < deadline:
        time.sleep(0.05)
    return loader_threads()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """NUM_MODELS tiny Llamas that differ in their MLP width (every engine compiles anew), two
    PEFT adapters each."""
    root = tmp_path_factory.mktemp("lifecycle")
    out = []
    for i in range(NUM_MODELS):
        cfg = dict(reference.TINY_CONFIGS["llama"], intermediate_size=96 + 16 * i)
        model_dir = reference.make_tiny_model(root / f"m{i}", cfg)
        adapters = {f"a{j}": str(reference.make_adapter(model_dir, root / f"m{i}-a{j}", seed=j, r=4, lora_alpha=8,
                                                        target_modules=reference.ALL)) for j in range(2)}
        out.append((model_dir, adapters))
    return out


def use(eng: Engine) -> None:
    outs = eng.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                        lora=["a0", None])
    assert [len(o.token_ids) for o in outs] == [3, 3]


def test_a_dozen_engines_of_different_models_keep_maps_and_rss_bounded(models):
    """Each engine dropped unshut (del): its executables go with it (the runner's own jitted
    functions), its loader's threads end."""
    first = None
    for model_dir, adapters in models:
        eng = Engine(str(model_dir), adapters, **KW)
        use(eng)
        del eng
        gc.collect()
        if first is None:
            first = (num_maps(), rss_mb())
    maps, rss = num_maps(), rss_mb()
    assert maps - first[0] <= MAX_NEW_MAPS, f"mappings grew {first[0]} -> {maps} over {NUM_MODELS - 1} engines"
    assert rss - first[1] <= MAX_NEW_RSS_MB, f"RSS grew {first[1]:.0f} -> {rss:.0f} MB over {NUM_MODELS - 1} engines"
    assert wait_for_no_loader_threads() == []


def test_shutdown_stops_threads_and_refuses_work(models):
    """`with` and shutdown(): the threads told to stop (not left to time out), the arrays and
    executables let go at once (the mappings back to within a few of before the engine: the last
    engine out clears JAX's caches too), and every call after refused by name."""
    model_dir, adapters = models[0]
    gc.collect()
    before = num_maps()
    with Engine(str(model_dir), adapters, **{**KW, "warmup": "background"}) as eng:
        use(eng)
        assert loader_threads()  # the adapter loader's workers (and maybe the warm-up's) run
    assert wait_for_no_loader_threads(timeout=5.0) == []
    assert num_maps() - before <= 60, f"mappings {before} -> {num_maps()} after a shutdown"
    assert eng.runner.weights is None and eng.runner.kv is None and eng.slots.weights is None
    for call, what in ((lambda: eng.add_request([5, 6]), "add_request"), (eng.step, "step"),
                       (lambda: eng.load_lora_adapter("x", adapters["a1"]), "load_lora_adapter"),
                       (lambda: eng.read_adapter_async("x", adapters["a1"]), "read_adapter_async"),
                       (lambda: eng.generate([[5, 6]]), "add_request")):
        with pytest.raises(EngineShutDownError, match=f"{what}: the engine was shut down"):
            call()
    eng.shutdown()  # a second time: nothing to do


def test_a_dropped_engine_takes_its_threads_along(models):
    model_dir, adapters = models[1]
    eng = Engine(str(model_dir), adapters, **KW)
    use(eng)
    assert loader_threads()
    del eng
    gc.collect()
    assert wait_for_no_loader_threads() == []
