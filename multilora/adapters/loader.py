"""Reading adapters off the engine thread: disk read, validation, the host copy and its content
hash run on background workers, so that no engine step ever waits on a disk.

    loader = AdapterLoader(read)            # read(name, path) -> LoRAAdapter (may raise AdapterError)
    loader.prefetch("x", "/adapters/x")     # starts a read unless one for (x, path) is in flight
    loader.prefetch("x", "/adapters/x", urgent=True)   # a request waits for it: its own workers
    fut = loader.submit("y", "/adapters/y")  # a run-time load; its caller waits on the future
    for name, path, adapter, error in loader.poll():   # finished reads, on the caller's thread
        ...
    loader.wait(0.05)                       # until some read finishes (or the timeout)

Urgent reads (a waiting request's adapter) run on their own workers (two) at normal priority (a
waiting request is as urgent as the running streams' next tokens): with thousands registered, a
request never queues behind other reads, and a burst of first uses (a deployment's first minute:
every request names an adapter not read yet) is read on both cores while the engine has nothing
else to run (40 adapters of 19.6 MB: 1.1-1.7 s against 2.0-2.1 s on one worker, an idle 2-core
machine). Run-time loads (`submit`) and background reads (the adapters given at start, read
ahead up to the host tier's size) share a SCHED_IDLE worker, loads first, and pause at their
checkpoints while the engine runs a step (its StepGate, multilora.adapters.pacing): SCHED_IDLE alone
still cost the decoding streams 20-35 % (the worker takes the core in every gap between a step's
ops); paced, they run between steps (measured in benchmarks/log/19-2026-12-05-loads-step-aside.md: load_during_decode.py,
serving.py 512 Zipf). Background reads also wait while the engine has work
(`hold_background(True)`, set by the engine around its steps): a speculative read takes CPU from
the running streams (on a 2-core machine, 512 adapters registered and read ahead during traffic
cost their steps ~2x), so they fill the host tier while the engine is idle instead.

Plain Python (three threads), no jax: device writes stay with the engine, between steps.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import weakref
from concurrent.futures import Future
from typing import Callable, Iterator, Optional

from multilora.adapters.adapter import LoRAAdapter
from multilora.adapters.pacing import StepGate, paced

logger = logging.getLogger(__name__)


def read_with_hash(read: Callable[[str, str], LoRAAdapter], name: str, path: str) -> LoRAAdapter:
    """Read and validate, and hash the contents too (the hash is what the prefix cache keys on;
    computing it here keeps that work off the engine thread as well)."""
    adapter = read(name, path)
    adapter.content_hash  # noqa: B018  (computed and cached on the object)
    return adapter


def _lower_priority() -> None:
    """Run this worker thread below the engine's threads (Linux schedules threads one by one):
    SCHED_IDLE, which runs only on what the engine's threads leave of the cores and yields to them
    as soon as they wake, for reads no request waits for (run-time loads, read-ahead); nice 19
    where SCHED_IDLE is refused. Reads a request waits for stay at normal priority: starved, they
    start their requests late and the steps run small (serving.py, 512 adapters drawn Zipf, 42
    used: 0.43x of 8 adapters with those reads at SCHED_IDLE, 0.68x at nice 19, 0.79x at normal
    priority, where every adapter was read before the first decode step; benchmarks/log/16-2026-12-04-zipf512-read-priority.md)."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError):  # not on this platform: reads run at normal priority
        pass


class _Queues:
    """What the workers share with their loader, without the loader: a worker waits on this, so
    that while it waits it keeps no loader alive (workers each holding it between their
    waits would keep it alive for ever)."""

    def __init__(self, read: Callable[[str, str], LoRAAdapter],
                 prepare: Optional[Callable[[LoRAAdapter], None]] = None):
        self.read = read
        self.prepare = prepare
        self.cv = threading.Condition()
        # per worker, a heap of (priority, order, future, name, path)
        self.heaps: dict[int, list] = {AdapterLoader.URGENT: [], AdapterLoader.BACKGROUND: []}
        self.hold = False          # background reads wait while the engine has work
        self.closed = False        # the loader is closed: its workers leave
        self.gate = StepGate()     # closed by the engine during a step: the idle worker's reads pause

    def next(self, worker: int, timeout: float):
        """The worker's next read, marked running (None after `timeout` with nothing to do).
        Speculative reads wait while held."""
        heap = self.heaps[worker]
        with self.cv:
            while True:
                while not heap or (heap[0][0] == AdapterLoader.BACKGROUND and self.hold):
                    if self.closed or not self.cv.wait(timeout):
                        return None
                _, _, fut, name, path = heapq.heappop(heap)
                # queued twice (moved ahead) and taken already, or cancelled: skip
                if not (fut.running() or fut.done()) and fut.set_running_or_notify_cancel():
                    return fut, name, path

    def run(self, fut: Future, name: str, path: str, urgent: bool = False) -> None:
        try:
            adapter = read_with_hash(self.read, name, path)
            if urgent and self.prepare is not None:  # a request waits: it is written next
                try:
                    self.prepare(adapter)
                except Exception:  # noqa: BLE001 - only a head start: the write lays it out itself
                    logger.warning("laying out adapter %r for its slot write failed; the write will "
                                   "lay it out", name, exc_info=True)
            fut.set_result(adapter)
        except BaseException as e:  # noqa: BLE001 - handed to whoever polls
            fut.set_exception(e)
        with self.cv:
            self.cv.notify_all()


def _work(queues: _Queues, ref: "weakref.ref[AdapterLoader]", worker: int) -> None:
    """One of the loader's workers (URGENT, two of them: the reads requests wait for; BACKGROUND:
    run-time loads and speculative reads): runs reads while its loader lives (an engine dropped takes its
    loader, and so this thread, with it: the worker holds the loader only weakly)."""
    background = worker == AdapterLoader.BACKGROUND
    if background:
        _lower_priority()
    while ref() is not None and not queues.closed:
        job = queues.next(worker, timeout=1.0)
        if job is not None:
            fut = job[0]
            # its reads pause while a step runs, until a request waits for one (prefetch, urgent)
            with paced(queues.gate if background else None, rushed=lambda: getattr(fut, "rushed", False)):
                queues.run(*job, urgent=worker == AdapterLoader.URGENT)
            del fut
        del job


class AdapterLoader:
    # URGENT: a request waits for it (two workers, normal priority). LOAD: a run-time load, whose caller waits
    # on the future (the idle worker, never held). BACKGROUND: speculative (the idle worker, held
    # while the engine has work).
    URGENT, LOAD, BACKGROUND = 0, 1, 2

    def __init__(self, read: Callable[[str, str], LoRAAdapter],
                 prepare: Optional[Callable[[LoRAAdapter], None]] = None):
        """prepare(adapter): run on the urgent workers after a read (the engine lays out the
        slot write there: multilora.adapters.pool.prepare_slot_layout)."""
        self._q = _Queues(read, prepare)
        self._cv = self._q.cv
        self._order = itertools.count()
        self._inflight: dict[tuple[str, str], Future] = {}
        # Separate workers, so that no other read delays one a request waits for; two of those,
        # so that a burst of first uses is read on two cores while the engine waits for it.
        for worker, kind in ((self.URGENT, "urgent"), (self.URGENT, "urgent-2"), (self.BACKGROUND, "background")):
            threading.Thread(target=_work, args=(self._q, weakref.ref(self), worker),
                             name=f"multilora-lora-load-{kind}", daemon=True).start()

    def close(self) -> None:
        """Let the workers leave now (a read under way finishes first; queued reads are dropped,
        their futures cancelled). The engine's shutdown calls this."""
        with self._cv:
            self._q.closed = True
            for heap in self._q.heaps.values():
                for _, _, fut, _, _ in heap:
                    fut.cancel()
                heap.clear()
            self._inflight.clear()
            self._cv.notify_all()

    def _enqueue(self, fut: Future, name: str, path: str, priority: int) -> None:
        worker = self.URGENT if priority == self.URGENT else self.BACKGROUND
        with self._cv:
            if self._q.closed:
                raise RuntimeError("the adapter loader is closed (its engine was shut down)")
            heapq.heappush(self._q.heaps[worker], (priority, next(self._order), fut, name, path))
            self._cv.notify_all()

    @property
    def read(self) -> Callable[[str, str], LoRAAdapter]:
        """The function the workers read an adapter with, (name, path) -> LoRAAdapter. It may be
        replaced while the loader runs (tests inject slow or failing reads); reads already
        started finish with the old one."""
        return self._q.read

    @read.setter
    def read(self, fn: Callable[[str, str], LoRAAdapter]) -> None:
        self._q.read = fn

    @property
    def gate(self) -> StepGate:
        """The engine closes it around each step: run-time loads and read-ahead (the idle
        worker's reads) wait at their checkpoints while it is closed (multilora.adapters.pacing)."""
        return self._q.gate

    def hold_background(self, hold: bool) -> None:
        """Hold (True) or release background reads; urgent ones always run. A read already
        started finishes."""
        with self._cv:
            if hold != self._q.hold:
                self._q.hold = hold
                self._cv.notify_all()

    def submit(self, name: str, path: str) -> Future:
        """A run-time load on the idle worker, ahead of speculative reads and never held: it
        takes only what the engine leaves of the cores, so the running streams do not pay for
        it; the future holds the adapter or the error. For callers that wait for it themselves
        (the server's /v1/load_lora_adapter)."""
        fut: Future = Future()
        self._enqueue(fut, name, str(path), self.LOAD)
        return fut

    def prefetch(self, name: str, path: str, urgent: bool = False) -> bool:
        """Start reading (name, path) in the background unless it already is (then an urgent
        call moves a queued read ahead); True if a read started."""
        key = (name, str(path))
        priority = self.URGENT if urgent else self.BACKGROUND
        with self._cv:  # a re-entrant lock: _enqueue takes it again
            fut = self._inflight.get(key)
            if fut is not None:
                if urgent and not fut.running() and not fut.done():
                    self._enqueue(fut, name, str(path), priority)  # the worker skips the older entry
                elif urgent:
                    fut.rushed = True  # running paced on the idle worker: no more pauses
                return False
            fut = self._inflight[key] = Future()
            self._enqueue(fut, name, str(path), priority)
        return True

    def forget(self, name: str) -> None:
        """Drop the reads under way for `name` from what poll reports (an in-place load replaced
        its weights: a read of the folder started before could hold the old contents). They run
        to their end unseen; a later prefetch starts a new read."""
        with self._cv:
            for key in [k for k in self._inflight if k[0] == name]:
                del self._inflight[key]

    def in_flight(self, name: Optional[str] = None) -> int:
        with self._cv:
            return sum(1 for (n, _) in self._inflight if name is None or n == name)

    def wait(self, timeout: float) -> None:
        """Block until some read finishes, at most timeout seconds (an idle engine whose waiting
        requests all wait for reads sleeps here instead of spinning)."""
        with self._cv:
            if any(f.done() for f in self._inflight.values()) or not self._inflight:
                return
            self._cv.wait(timeout)

    def poll(self) -> Iterator[tuple[str, str, Optional[LoRAAdapter], Optional[BaseException]]]:
        """The reads that finished since the last poll: (name, path, adapter or None, error)."""
        with self._cv:
            done = [(k, f) for k, f in self._inflight.items() if f.done()]
            for k, _ in done:
                del self._inflight[k]
        for (name, path), fut in done:
            err = fut.exception()
            yield name, path, (None if err is not None else fut.result()), err
