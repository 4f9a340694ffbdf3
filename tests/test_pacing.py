"""Background reads that step aside while the engine runs a step (multilora.adapters.pacing): an
unpaced thread never waits; a paced one waits at its checkpoints while the gate is closed, for
the rest of its duty cycle or until the gate opens; the loader paces its idle worker (run-time
loads, read-ahead) and never the reads a request waits for."""

from __future__ import annotations

import threading
import time

import pytest

from multilora.adapters.loader import AdapterLoader
from multilora.adapters.pacing import StepGate, checkpoint, paced


def _spin(seconds: float) -> None:
    """CPU work of about `seconds` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_unpaced_checkpoints_never_wait():
    gate = StepGate(duty=0.01)
    with gate.closed():
        _spin(0.02)
        t0 = time.monotonic()
        checkpoint()  # this thread is not paced
        with paced(None):
            checkpoint()
        assert time.monotonic() - t0 < 0.01


def test_a_paced_thread_waits_its_duty_cycle_while_closed_and_goes_on_when_opened():
    gate = StepGate(duty=0.2)
    waited = {}

    def worker(key):
        with paced(gate):
            _spin(0.02)          # a chunk of 20 ms: the rest of the cycle is 80 ms
            t0 = time.monotonic()
            checkpoint()
            waited[key] = time.monotonic() - t0

    with gate.closed():
        t = threading.Thread(target=worker, args=("closed",))
        t.start()
        t.join(5)
    assert 0.06 <= waited["closed"] < 1.0, waited   # the duty cycle's rest (0.08 s), not for ever

    blocker = gate.closed()
    blocker.__enter__()
    t = threading.Thread(target=worker, args=("opened",))
    t.start()
    time.sleep(0.03)   # inside its 80 ms wait
    t_open = time.monotonic()
    blocker.__exit__(None, None, None)
    t.join(5)
    assert waited["opened"] < 0.08 and time.monotonic() - t_open < 0.05, waited

    t = threading.Thread(target=worker, args=("open",))  # an open gate: no wait at all
    t.start()
    t.join(5)
    assert waited["open"] < 0.01, waited


def test_closings_nest_and_a_bad_duty_is_refused():
    gate = StepGate()
    with gate.closed():
        with gate.closed():
            assert not gate.is_open
        assert not gate.is_open
    assert gate.is_open
    with pytest.raises(ValueError, match="duty must be in"):
        StepGate(duty=0)
    with pytest.raises(ValueError, match="duty must be in"):
        StepGate(duty=1.5)


def test_the_loader_paces_its_idle_worker_and_not_the_urgent_ones():
    """While the engine's gate is closed a run-time load (idle worker) advances only at the duty
    cycle; a read a request waits for runs at full speed; opening the gate lets the load finish."""
    chunks, cpu = 10, 0.01

    def read(name, path):
        for _ in range(chunks):
            _spin(cpu)
            checkpoint()
        return type("A", (), {"content_hash": b"x", "name": name})()

    loader = AdapterLoader(read)
    blocker = loader.gate.closed()
    blocker.__enter__()
    try:
        t0 = time.monotonic()
        load = loader.submit("load", "/l")
        assert loader.prefetch("urgent", "/u", urgent=True)
        done = set()
        while "urgent" not in done and time.monotonic() - t0 < 10:
            loader.wait(0.05)
            done |= {name for name, *_ in loader.poll()}
        urgent_s = time.monotonic() - t0
        assert not load.done()  # at duty 0.25 its 10 chunks of 10 ms take >= 0.3 s closed
        assert urgent_s < 0.3 + chunks * cpu, urgent_s
    finally:
        blocker.__exit__(None, None, None)
    assert load.result(5).name == "load"


def test_a_paced_read_a_request_comes_to_wait_for_runs_unpaced():
    """A read-ahead running paced on the idle worker is rushed when a request comes to wait for
    that adapter (prefetch(urgent=True) of the same folder): it stops pausing."""
    chunks, cpu = 20, 0.01
    started = threading.Event()

    def read(name, path):
        started.set()
        for _ in range(chunks):
            _spin(cpu)
            checkpoint()
        return type("A", (), {"content_hash": b"x", "name": name})()

    loader = AdapterLoader(read)
    with loader.gate.closed():
        assert loader.prefetch("ahead", "/a")          # speculative: the idle worker, paced
        assert started.wait(5)
        time.sleep(0.1)
        assert loader.in_flight("ahead") == 1 and not list(loader.poll())  # still pausing
        t0 = time.monotonic()
        assert not loader.prefetch("ahead", "/a", urgent=True)  # running already: rushed instead
        done = []
        while not done and time.monotonic() - t0 < 10:
            loader.wait(0.05)
            done = [n for n, *_ in loader.poll()]
        # paced, the rest (>= 0.1 s of CPU) would take >= 0.3 s more; rushed it runs straight on
        assert done == ["ahead"] and time.monotonic() - t0 < 0.3 + chunks * cpu / 2, time.monotonic() - t0


def test_freezing_the_start_up_heap_leaves_it_out_of_full_collections():
    """What a server holds at start-up is frozen (multilora.server.heap): a full collection then
    walks only what came after, and garbage made after the freeze is still collected."""
    import gc

    from multilora.server.heap import freeze_startup_heap

    class Node:
        pass
    kept = [Node() for _ in range(1000)]
    try:
        n = freeze_startup_heap()
        assert n >= len(kept) and gc.get_freeze_count() > 0  # (frozen objects freed since leave the count)
        assert not any(isinstance(o, Node) for o in gc.get_objects())  # out of every generation
        a, b = Node(), Node()
        a.other, b.other = b, a   # a cycle made after the freeze
        del a, b
        assert gc.collect() >= 2
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
