"""The background adapter reader (multilora.adapters.loader): urgent reads (a waiting request's
adapter) go ahead of queued background ones (the adapters given at start), a read is never
started twice, failures come back through poll, and wait() sleeps until a read finishes."""

from __future__ import annotations

import threading
import time

from multilora.adapters.loader import AdapterLoader


class _Adapter:
    content_hash = b"x"

    def __init__(self, name):
        self.name = name


def test_urgent_reads_go_ahead_of_background_ones():
    gate, order = threading.Event(), []

    def read(name, path):
        if name == "first":
            gate.wait(10)
        order.append(name)
        if name == "bad":
            raise ValueError("bad adapter")
        return _Adapter(name)

    loader = AdapterLoader(read)
    assert loader.prefetch("first", "/p/first")
    time.sleep(0.05)  # the background worker is inside "first"
    for i in range(5):
        assert loader.prefetch(f"bg{i}", f"/p/bg{i}")
    assert not loader.prefetch("bg3", "/p/bg3")          # queued already: not twice
    assert not loader.prefetch("bg3", "/p/bg3", urgent=True)  # ...but moved ahead
    assert loader.prefetch("bad", "/p/bad", urgent=True)
    assert loader.in_flight() == 7
    got = {}
    deadline = time.time() + 10
    while len(got) < 2 and time.time() < deadline:  # the urgent ones do not wait for "first"
        loader.wait(0.5)
        for name, path, adapter, error in loader.poll():
            got[name] = (adapter, error)
    assert order == ["bg3", "bad"] and set(got) == {"bg3", "bad"}
    t0 = time.time()
    loader.wait(0.2)  # nothing else finishes while the gate is shut
    assert time.time() - t0 >= 0.15 and not list(loader.poll())
    gate.set()
    deadline = time.time() + 10
    while len(got) < 7 and time.time() < deadline:
        loader.wait(0.5)
        for name, path, adapter, error in loader.poll():
            got[name] = (adapter, error)
    assert order == ["bg3", "bad", "first", "bg0", "bg1", "bg2", "bg4"]
    assert isinstance(got["bad"][1], ValueError) and got["bad"][0] is None
    assert got["bg3"][0].name == "bg3" and loader.in_flight() == 0
    assert loader.submit("late", "/p/late").result(5).name == "late"


def test_background_reads_wait_while_held_and_urgent_ones_do_not():
    """hold_background(True) (the engine has work): queued background reads wait, urgent reads
    (a waiting request's adapter, a run-time load) still run; releasing starts the rest."""
    order = []

    def read(name, path):
        order.append(name)
        return _Adapter(name)

    loader = AdapterLoader(read)
    loader.hold_background(True)
    for i in range(3):
        assert loader.prefetch(f"bg{i}", f"/p/bg{i}")
    assert loader.submit("now", "/p/now").result(5).name == "now"
    assert loader.prefetch("asked", "/p/asked", urgent=True)
    assert not loader.prefetch("bg1", "/p/bg1", urgent=True)  # a request waits for it: moved ahead
    deadline = time.time() + 5
    while len(order) < 3 and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert order == ["now", "asked", "bg1"]      # bg0 and bg2 held
    assert loader.in_flight() == 4               # asked, bg1 done but unpolled; bg0, bg2 queued
    loader.hold_background(False)
    deadline = time.time() + 5
    while len(order) < 5 and time.time() < deadline:
        time.sleep(0.01)
    assert order == ["now", "asked", "bg1", "bg0", "bg2"]


def test_reads_run_at_their_priorities():
    """Reads a request waits for run at the engine's priority (normal, nice 0); run-time loads
    and speculative reads below it, at SCHED_IDLE where Linux allows it (else nice 19); the
    engine's own thread stays as it was."""
    import os
    seen = {}

    def read(name, path):
        tid = threading.get_native_id()
        seen[name] = (os.sched_getscheduler(tid) if hasattr(os, "sched_getscheduler") else None,
                      os.getpriority(os.PRIO_PROCESS, tid))
        return _Adapter(name)

    loader = AdapterLoader(read)
    loader.submit("load", "/x").result(timeout=10)
    assert loader.prefetch("urgent", "/u", urgent=True) and loader.prefetch("speculative", "/y")
    deadline = time.time() + 10
    while not {"urgent", "speculative"} <= set(seen) and time.time() < deadline:
        loader.wait(0.2)
    idle = getattr(os, "SCHED_IDLE", None)
    assert seen["urgent"][1] == os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), seen
    assert seen["urgent"][0] != idle, seen
    for name in ("load", "speculative"):
        assert seen[name][0] == idle or seen[name][1] == 19, seen
    if hasattr(os, "sched_getscheduler"):  # the engine's own thread is untouched
        assert os.sched_getscheduler(threading.get_native_id()) != idle
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != 19


def test_prepare_runs_after_urgent_reads_only():
    """The engine's prepare (the slot write's layout) runs on the urgent workers, after the read
    and before the future completes; run-time loads and read-ahead (kept in the host tier, maybe
    never written) are not prepared."""
    prepared = []

    def read(name, path):
        return _Adapter(name)

    loader = AdapterLoader(read, prepare=lambda a: prepared.append(a.name))
    assert loader.submit("load", "/l").result(5).name == "load"
    assert loader.prefetch("ahead", "/a") and loader.prefetch("waited", "/w", urgent=True)
    got = set()
    deadline = time.time() + 5
    while got != {"ahead", "waited"} and time.time() < deadline:
        loader.wait(0.1)
        got |= {name for name, *_ in loader.poll()}
    assert got == {"ahead", "waited"} and prepared == ["waited"]


def test_a_failed_prepare_leaves_the_read_whole(caplog):
    """prepare is only a head start for the slot write (which lays the adapter out itself when
    nothing was prepared): an exception in it is logged and the read still succeeds."""
    def read(name, path):
        return _Adapter(name)

    def prepare(adapter):
        raise MemoryError("no room for the layout")

    loader = AdapterLoader(read, prepare=prepare)
    assert loader.prefetch("waited", "/w", urgent=True)
    got = {}
    deadline = time.time() + 5
    while "waited" not in got and time.time() < deadline:
        loader.wait(0.1)
        got.update({name: rest for name, *rest in loader.poll()})
    assert "waited" in got, "the read did not arrive"
    _, adapter, err = got["waited"]
    assert err is None and adapter.name == "waited", got
    assert "laying out adapter 'waited'" in caplog.text
