"""The background adapter reader (multilora.lora.loader): urgent reads (a waiting request's
adapter) go ahead of queued background ones (the adapters given at start), a read is never
started twice, failures come back through poll, and wait() sleeps until a read finishes."""

from __future__ import annotations

import threading
import time

from multilora.lora.loader import AdapterLoader


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
    time.sleep(0.05)  # the worker is inside "first"
    for i in range(5):
        assert loader.prefetch(f"bg{i}", f"/p/bg{i}")
    assert not loader.prefetch("bg3", "/p/bg3")          # queued already: not twice
    assert not loader.prefetch("bg3", "/p/bg3", urgent=True)  # ...but moved ahead
    assert loader.prefetch("bad", "/p/bad", urgent=True)
    assert loader.in_flight() == 7
    t0 = time.time()
    loader.wait(0.2)  # nothing finishes while the gate is shut
    assert time.time() - t0 >= 0.15
    gate.set()
    got = {}
    deadline = time.time() + 10
    while len(got) < 7 and time.time() < deadline:
        loader.wait(0.5)
        for name, path, adapter, error in loader.poll():
            got[name] = (adapter, error)
    assert order == ["first", "bg3", "bad", "bg0", "bg1", "bg2", "bg4"]
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


def test_reads_run_on_a_thread_below_the_engines():
    """The worker runs at SCHED_IDLE where Linux allows it (else nice 19): a read only takes
    what the engine's threads leave of the cores."""
    import os
    seen = {}

    def read(name, path):
        tid = threading.get_native_id()
        seen["policy"] = os.sched_getscheduler(tid) if hasattr(os, "sched_getscheduler") else None
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)
        return _Adapter()

    class _Adapter:
        content_hash = b""

    loader = AdapterLoader(read)
    loader.submit("x", "/x").result(timeout=10)
    assert seen["policy"] == getattr(os, "SCHED_IDLE", None) or seen["nice"] == 19, seen
    if hasattr(os, "sched_getscheduler"):  # the engine's own thread is untouched
        assert os.sched_getscheduler(threading.get_native_id()) != getattr(os, "SCHED_IDLE", -1)
