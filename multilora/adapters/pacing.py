"""Background work that steps aside while the engine runs a step.

A read on a SCHED_IDLE thread still cost the decoding streams 20-35 % of their step time on two
cores (benchmarks/load_during_decode.py; benchmarks/log/19-2026-12-05-loads-step-aside.md): XLA's pool threads sleep in every gap
between a step's ops, the low-priority thread takes the core for those microseconds, and each op
then starts on a core whose caches it has flushed; where it holds the GIL, the engine's thread
waits for it besides. So reads that no request waits for run in chunks, and between chunks they
wait while the engine is inside a step: the engine closes its StepGate around each step, and a
worker running such a read marks its thread `paced`, which makes `checkpoint()` (called by the
read code between chunks: a part of the file, a module's layout, a part of the hash) wait for
the gate. Anywhere else `checkpoint()` returns at once: a read on the engine's thread or for a
waiting request never waits.

    gate = StepGate()
    with gate.closed():          # the engine, around a step
        ...
    with paced(gate):            # a worker, around a background read
        read(...)                # calls checkpoint() between chunks

While the gate is closed a paced thread still runs, at a duty cycle: after a chunk that took w
seconds of its CPU time it waits w * (1 - duty) / duty (or until the gate opens), so it takes at
most `duty` of a core from the steps (0.25: a rank-16 adapter of SmolLM2-135M, ~30 ms of reading
and hashing, is registered 0.6-0.8 s after its load was asked for while 32 streams decode).
Waiting for the gate alone starved it: between two steps the engine's thread runs Python,
holding the GIL, and the next step closes the gate before a woken reader gets to run. A paced
read that a request comes to wait for is rushed: it runs unpaced from its next checkpoint on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

_local = threading.local()


class StepGate:
    """Open between engine steps, closed during one (nested closings allowed)."""

    def __init__(self, duty: float = 0.25):
        if not 0 < duty <= 1:
            raise ValueError(f"duty must be in (0, 1], got {duty!r}")
        self.duty = duty
        self._cv = threading.Condition()
        self._depth = 0
        self._openings = 0  # times the gate opened: a waiter goes on once it has opened at all

    @contextlib.contextmanager
    def closed(self):
        with self._cv:
            self._depth += 1
        try:
            yield
        finally:
            with self._cv:
                self._depth -= 1
                if self._depth == 0:
                    self._openings += 1
                    self._cv.notify_all()

    @property
    def is_open(self) -> bool:
        return self._depth == 0

    def wait(self, worked: float) -> None:
        """After a chunk of `worked` seconds: while the gate is closed, wait until it opens (has
        opened once: a woken waiter may find the next step already begun) or for the rest of the
        duty cycle."""
        if self._depth == 0:
            return
        deadline = time.monotonic() + worked * (1 - self.duty) / self.duty
        with self._cv:
            openings = self._openings
            while self._depth and self._openings == openings:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cv.wait(left)


@contextlib.contextmanager
def paced(gate: "StepGate | None", rushed: "Callable[[], bool] | None" = None):
    """checkpoint() on this thread paces it by `gate` inside the block (None: never waits), until
    `rushed()` turns True (a request has come to wait for this work: it then runs unpaced)."""
    before = getattr(_local, "gate", None), getattr(_local, "since", None), getattr(_local, "rushed", None)
    _local.gate, _local.since, _local.rushed = gate, time.thread_time(), rushed
    try:
        yield
    finally:
        _local.gate, _local.since, _local.rushed = before


def checkpoint() -> None:
    """Between two chunks of background work: if this thread is paced and the engine is inside a
    step, wait (the duty cycle's rest, or until the step ends); else return at once."""
    gate = getattr(_local, "gate", None)
    if gate is None or (_local.rushed is not None and _local.rushed()):
        return
    gate.wait(time.thread_time() - _local.since)  # the chunk's CPU time: not time preempted
    _local.since = time.thread_time()
