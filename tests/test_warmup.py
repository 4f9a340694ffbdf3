"""The runner's ShapeCompiler (multilora.engine.warmup) with fake lowerings, no JAX: every shape
compiled once whoever asks first, a step that needs a shape a background thread compiles waits for
that compile and gets its executable, the background skips what a step compiled, a failed
background compile is done again by the step that needs it, and the warm-up reports how far it is.
The same against a real engine: tests/test_engine.py (test_background_warmup_...)."""

from __future__ import annotations

import threading
import time

import pytest

from multilora.engine.warmup import ShapeCompiler


class Lowerer:
    """key -> a fake Lowered whose compile() records who compiled what, may wait on a gate or
    fail once, and returns a fresh object (so that "the same executable" is checkable)."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []
        self.gates: dict[object, threading.Event] = {}
        self.fail_once: set = set()
        self.started: dict[object, threading.Event] = {}
        self._lock = threading.Lock()

    def __call__(self, key):
        return _Lowered(self, key)


class _Lowered:
    def __init__(self, owner: Lowerer, key):
        self.owner, self.key = owner, key

    def compile(self):
        o = self.owner
        with o._lock:
            o.calls.append((threading.current_thread().name, self.key))
        o.started.setdefault(self.key, threading.Event()).set()
        gate = o.gates.get(self.key)
        if gate is not None:
            assert gate.wait(10), "gate never opened"
        if self.key in o.fail_once:
            o.fail_once.discard(self.key)
            raise RuntimeError(f"compile of {self.key} failed")
        return object()


def jobs_of(lower: Lowerer, keys) -> list:
    return [("step", k, lower) for k in keys]


def test_a_full_warmup_compiles_each_shape_once_and_counts_only_missing_buckets():
    lower, comp = Lowerer(), ShapeCompiler()
    assert comp.get("step", 99, lower) is not None          # before any warm-up: not counted
    assert comp.compiles_after_warmup == 0 and not comp.warm
    comp.start(jobs_of(lower, [1, 2, 3, 99]), num_first=1, background=False)
    assert comp.warm and comp.status() == {"compiled": 4, "total": 4, "done": True, "seconds": comp.status()["seconds"]}
    assert sorted(k for _, k in lower.calls) == [1, 2, 3, 99]   # 99 was compiled already
    exe = comp.table("step")[2]
    assert comp.get("step", 2, lower) is exe and len(lower.calls) == 4
    comp.get("step", 7, lower)                                # a shape outside the plan
    assert comp.compiles_after_warmup == 1
    assert comp.compiles == len(lower.calls) == 5             # every compile, warm-up or not, once


def test_background_warmup_returns_after_the_first_shapes():
    lower, comp = Lowerer(), ShapeCompiler()
    lower.gates[3] = threading.Event()                        # the background stalls on shape 3
    comp.start(jobs_of(lower, [1, 2, 3, 4]), num_first=2, background=True, background_threads=1)
    assert set(comp.table("step")) >= {1, 2}
    st = comp.status()
    assert not comp.warm and not st["done"] and st["total"] == 4 and 2 <= st["compiled"] < 4
    assert lower.started.setdefault(3, threading.Event()).wait(5)
    lower.gates[3].set()
    assert comp.wait(10) and comp.warm and comp.status()["compiled"] == 4
    assert sorted(k for _, k in lower.calls) == [1, 2, 3, 4]
    assert all(name.startswith("multilora-warmup") for name, k in lower.calls if k in (3, 4))
    assert comp.compiles_after_warmup == 0


def test_a_step_waits_for_the_shape_the_background_compiles_and_gets_its_executable():
    lower, comp = Lowerer(), ShapeCompiler()
    lower.gates[3] = threading.Event()
    comp.start(jobs_of(lower, [1, 3, 4]), num_first=1, background=True, background_threads=1)
    assert lower.started.setdefault(3, threading.Event()).wait(5)   # the background compiles 3 now
    threading.Timer(0.3, lower.gates[3].set).start()
    t0 = time.perf_counter()
    exe = comp.get("step", 3, lower)                          # waits for that compile, compiles nothing
    assert time.perf_counter() - t0 >= 0.2
    assert exe is comp.table("step")[3]
    assert [k for _, k in lower.calls].count(3) == 1
    assert comp.wait(10) and comp.compiles_after_warmup == 0


def test_a_step_compiles_a_shape_the_background_has_not_reached_and_the_background_skips_it():
    lower, comp = Lowerer(), ShapeCompiler()
    lower.gates[2] = threading.Event()
    comp.start(jobs_of(lower, [1, 2, 3, 4]), num_first=1, background=True, background_threads=1)
    assert lower.started.setdefault(2, threading.Event()).wait(5)
    exe = comp.get("step", 4, lower)                          # not reached yet: compiled here
    assert (threading.current_thread().name, 4) in lower.calls
    lower.gates[2].set()
    assert comp.wait(10) and comp.warm
    assert comp.table("step")[4] is exe
    assert [k for _, k in lower.calls].count(4) == 1          # not again on the background thread
    assert comp.compiles_after_warmup == 0                    # a planned shape, done early


def test_a_failed_background_compile_is_done_again_by_the_step_that_needs_it(caplog):
    lower, comp = Lowerer(), ShapeCompiler()
    lower.fail_once.add(2)
    comp.start(jobs_of(lower, [1, 2, 3]), num_first=1, background=True, background_threads=1)
    comp.wait(10)
    assert not comp.warm and comp.status()["compiled"] == 2
    assert "background compile of step shape 2 failed" in caplog.text
    assert comp.get("step", 2, lower) is comp.table("step")[2]
    assert comp.warm and comp.compiles_after_warmup == 0


def test_a_failed_compile_reaches_every_step_waiting_for_it_then_is_retried():
    lower, comp = Lowerer(), ShapeCompiler()
    lower.gates[5], lower.fail_once = threading.Event(), {5}
    comp.start(jobs_of(lower, [1]), num_first=1, background=False)
    errors = []
    first = threading.Thread(target=lambda: errors.append(_try(lambda: comp.get("step", 5, lower))))
    first.start()
    assert lower.started.setdefault(5, threading.Event()).wait(5)
    waiter = threading.Thread(target=lambda: errors.append(_try(lambda: comp.get("step", 5, lower))))
    waiter.start()
    time.sleep(0.1)
    lower.gates[5].set()
    first.join(5)
    waiter.join(5)
    # the compiling thread raises; the waiter compiles it once more itself and gets it
    assert sorted(map(str, errors)) == ["compile of 5 failed", "ok"]
    assert 5 in comp.table("step")


def _try(fn):
    try:
        fn()
        return "ok"
    except RuntimeError as e:
        return e


def test_stop_ends_the_background_threads():
    lower, comp = Lowerer(), ShapeCompiler()
    lower.gates[2] = threading.Event()
    comp.start(jobs_of(lower, [1, 2, 3, 4]), num_first=1, background=True, background_threads=1)
    assert lower.started.setdefault(2, threading.Event()).wait(5)
    stopper = threading.Thread(target=comp.stop)
    stopper.start()
    lower.gates[2].set()
    stopper.join(5)
    assert not stopper.is_alive() and not comp.warm
    assert 3 not in comp.table("step") or 4 not in comp.table("step")


@pytest.mark.parametrize("threads", [1, 2])
def test_many_steps_asking_at_once_get_one_compile_per_shape(threads):
    lower, comp = Lowerer(), ShapeCompiler()
    comp.start(jobs_of(lower, range(40)), num_first=2, background=True, background_threads=threads)
    got: dict = {}

    def ask(i):
        for k in range(39, -1, -1):
            got.setdefault(k, set()).add(id(comp.get("step", k, lower)))

    askers = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in askers:
        t.start()
    for t in askers:
        t.join(10)
    assert comp.wait(10) and comp.warm
    assert all(len(ids) == 1 for ids in got.values())
    assert sorted(k for _, k in lower.calls) == list(range(40))


def test_compile_threads_follow_the_cores_within_bounds():
    """A foreground warm-up compiles one shape a core: 2 on a 2-core host (and below), all the
    cores up to MAX_COMPILE_THREADS on an accelerator's host."""
    from multilora.engine.warmup import MAX_COMPILE_THREADS, compile_threads
    assert [compile_threads(c) for c in (1, 2, 3, 6)] == [2, 2, 3, 6]
    assert compile_threads(224) == MAX_COMPILE_THREADS == 8
    assert 2 <= compile_threads() <= MAX_COMPILE_THREADS


def test_a_foreground_warm_up_compiles_on_several_threads_at_once(monkeypatch):
    """start() without `threads` runs compile_threads() compiles side by side: two shapes whose
    compiles wait for each other at a barrier both finish (one thread would wait at the barrier
    until it times out, and the warm-up would raise)."""
    from multilora.engine import warmup
    monkeypatch.setattr(warmup.os, "cpu_count", lambda: 2)
    barrier = threading.Barrier(2, timeout=10)

    class Lowered:
        def compile(self):
            barrier.wait()   # returns once the other shape's compile is here too
            return lambda: None

    comp = ShapeCompiler()
    comp.start([("step", k, lambda key: Lowered()) for k in (1, 2)], num_first=0, background=False)
    assert comp.warm and sorted(comp.table("step")) == [1, 2]
