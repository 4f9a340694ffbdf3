"""The runner's compiled executables and its warm-up: each shape compiled once, by whichever
thread asks first.

A shape is (what, key): ("step", (T, X)), ("sampler", (rows, mode, logprobs)), and so on; `lower`
turns a key into a jax Lowered (multilora.engine.runner, the one place that jits, passes its own).
`get` is the steps' way in: the executable, compiled now by this thread unless another thread
compiles it already, in which case it waits for that compile (a Future per shape in flight). No
lock is held while compiling, and a waiter only ever waits for a compile that is running, so two
threads never wait on each other.

The warm-up (`start`) compiles a plan of shapes: all of them before it returns, or (background)
only the few that lead the plan (what a first short request needs) and the rest on daemon
threads, which skip a shape another thread is compiling. A shape outside the plan compiled after
a warm-up began counts in `compiles_after_warmup`, with a warning (a missing bucket); a planned
shape a step needed before the background got to it does not (it is the warm-up's own work,
done early).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Sequence

log = logging.getLogger("multilora.runner")

Lower = Callable[[object], object]          # key -> jax.stages.Lowered
Job = tuple[str, object, Lower]             # (what, key, lower)

# Compilers with background threads: at interpreter exit their threads finish the compile they
# are in and stop, before JAX's own exit handlers tear its backends down under them.
_running: "weakref.WeakSet[ShapeCompiler]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for compiler in list(_running):
        compiler.stop()


MAX_COMPILE_THREADS = 8   # each compile in flight holds its module's compiler memory


def compile_threads(cpus: Optional[int] = None) -> int:
    """Threads for a warm-up that compiles before the engine serves: XLA compiles a module on
    the thread that asks and releases the GIL, so one compile per core keeps the host busy (a
    TPU step shape with the Pallas LoRA kernel takes ~15-20 s of host time, and an engine plans
    tens of shapes); at least 2, at most MAX_COMPILE_THREADS."""
    cpus = (os.cpu_count() or 2) if cpus is None else cpus
    return max(2, min(MAX_COMPILE_THREADS, cpus))


class ShapeCompiler:
    def __init__(self):
        self.tables: dict[str, dict] = {}     # what -> key -> compiled executable
        self.compiles_after_warmup = 0
        self.compiles = 0                     # every shape compiled, warm-up or not
        self._lock = threading.Lock()
        self._inflight: dict[tuple, Future] = {}
        self._planned: set[tuple] = set()
        self._done = 0
        self._started: Optional[float] = None
        self._finished: Optional[float] = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # before_compile(what, key): called by the thread about to compile a shape, before it
        # lowers it (a hook for tests and progress reports; None: nothing)
        self.before_compile: Optional[Callable[[str, object], None]] = None

    def table(self, what: str) -> dict:
        return self.tables.setdefault(what, {})

    def get(self, what: str, key, lower: Lower):
        """The executable for (what, key): at once if compiled, else compiled here or waited for."""
        fn = self.table(what).get(key)
        if fn is None:
            fn, _ = self._compile(what, key, lower, on_demand=True)
        return fn

    def _compile(self, what: str, key, lower: Lower, on_demand: bool):
        """(executable, whether this call compiled it). A warm-up thread (on_demand False) does
        not wait for a shape another thread compiles: it gets (None, False) and moves on."""
        ident = (what, key)
        table = self.table(what)
        with self._lock:
            fn = table.get(key)
            if fn is not None:
                return fn, False
            fut = self._inflight.get(ident)
            mine = fut is None
            if mine:
                fut = self._inflight[ident] = Future()
                if on_demand and self._started is not None and ident not in self._planned:
                    self.compiles_after_warmup += 1
                    log.warning("compiling %s shape %s after warm-up (a missing bucket)", what, key)
                elif on_demand and self._started is not None and self._finished is None:
                    log.info("compiling %s shape %s now, ahead of the background warm-up", what, key)
        if not mine:
            if not on_demand:
                return None, False
            try:
                return fut.result(), False
            except Exception:  # noqa: BLE001 - that thread's compile failed: try it here, once more
                return self._compile(what, key, lower, on_demand)
        try:
            if self.before_compile is not None:
                self.before_compile(what, key)
            fn = lower(key).compile()
        except BaseException as e:
            with self._lock:
                del self._inflight[ident]
            fut.set_exception(e)
            raise
        with self._lock:
            table[key] = fn
            self.compiles += 1
            del self._inflight[ident]
            if ident in self._planned:
                self._done += 1
                if self._done == len(self._planned):
                    self._finished = time.time()
                    if self._threads:
                        log.info("warm-up done: all %d shapes compiled, %.1fs after it began",
                                 len(self._planned), self._finished - self._started)
        fut.set_result(fn)
        return fn, True

    def start(self, jobs: Sequence[Job], num_first: int, background: bool, progress: bool = False,
              threads: Optional[int] = None, background_threads: Optional[int] = None) -> float:
        """Compile the plan `jobs`: all of it now on `threads` threads (default compile_threads():
        one a core, 2 to 8), or with background its first
        num_first jobs now and the rest on `background_threads` daemon threads (default: half
        the cores, at least one, so that steps keep a core), returning once the first are done.
        The seconds spent here."""
        t0 = time.time()
        with self._lock:
            self._planned = {(what, key) for what, key, _ in jobs}
            self._done = sum(1 for what, key, _ in jobs if key in self.table(what))
            self._started = t0
        now = list(jobs[:num_first] if background else jobs)
        with ThreadPoolExecutor(max(1, threads or compile_threads())) as pool:
            for i, _ in enumerate(pool.map(lambda j: self._compile(j[0], j[1], j[2], on_demand=False), now), 1):
                if progress:
                    _progress("compiling" if not background else "compiling the first shapes", i, len(now), t0)
        with self._lock:
            if self._done == len(self._planned) and self._finished is None:
                self._finished = time.time()
        rest = list(jobs[len(now):])
        if rest:
            n = background_threads or max(1, (os.cpu_count() or 2) // 2)
            log.info("compiled %d shapes for the first requests in %.1fs; %d more compile in the "
                     "background on %d thread(s)", len(now), time.time() - t0, len(rest), n)
            qlock = threading.Lock()

            def worker():
                while not self._stop.is_set():
                    with qlock:
                        if not rest:
                            return
                        what, key, lower = rest.pop(0)
                    try:
                        _, compiled = self._compile(what, key, lower, on_demand=False)
                    except Exception as e:  # noqa: BLE001 - a step that needs it compiles it (and raises)
                        log.error("background compile of %s shape %s failed: %s", what, key, e)
                        continue
                    if compiled:
                        self._log_progress()

            self._threads = [threading.Thread(target=worker, name=f"multilora-warmup-{i}", daemon=True)
                             for i in range(n)]
            _running.add(self)
            for t in self._threads:
                t.start()
        return time.time() - t0

    def _log_progress(self) -> None:
        with self._lock:
            done, total, started = self._done, len(self._planned), self._started
        if done < total and done % max(1, total // 10) == 0:
            log.info("background warm-up: %d of %d shapes compiled (%.1fs)", done, total, time.time() - started)

    @property
    def warm(self) -> bool:
        """True once a warm-up has compiled every shape of its plan."""
        return self._finished is not None

    def status(self) -> dict:
        """Shapes compiled of those planned, seconds since the warm-up began (to its end, once
        done), and whether it is done (thread-safe: the server's /health reports it)."""
        with self._lock:
            done, total, started, finished = self._done, len(self._planned), self._started, self._finished
        end = finished if finished is not None else time.time()
        return {"compiled": done, "total": total, "done": finished is not None,
                "seconds": round(end - started, 1) if started is not None else 0.0}

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the background threads; True when every planned shape is compiled."""
        deadline = None if timeout is None else time.time() + timeout
        for t in list(self._threads):
            t.join(None if deadline is None else max(0.0, deadline - time.time()))
        return self.warm

    def request_stop(self) -> None:
        """Let the background threads stop after their current compile (not waiting for them)."""
        self._stop.set()

    def stop(self) -> None:
        """Let the background threads stop after their current compile, and wait for them."""
        self.request_stop()
        for t in list(self._threads):
            t.join()


def _progress(desc: str, i: int, total: int, t0: float) -> None:
    frac = i / max(total, 1)
    sys.stderr.write(f"\r{desc}: [{'#' * int(frac * 30):<30}] {i}/{total} {time.time() - t0:5.1f}s")
    if i >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()
