"""An engine's end: what Engine.shutdown() (and leaving `with Engine(...) as eng:`) gives back, and
what dropping an engine unshut gives back on its own.

Measured on a 2-core host (issue 61): a process that built engines of different models one after
another kept every engine's executables (JAX keys its traces, lowerings and executables weakly on
the jitted function, and the runner jitted module-level functions), each XLA CPU executable with
memory mappings of its code: ~6,800 mappings an engine, never given back, until the tenth engine's
compile passed the kernel's limit (vm.max_map_count, 65,530) and LLVM died. Now:

- the runner jits functions of its own (multilora.engine.runner.owned): an engine dropped takes
  its executables with it, shut down or not;
- its threads end with it: the adapter loader's workers hold their loader weakly and leave when it
  goes or is closed; a background warm-up is told to stop when the engine is collected
  (watch) and is stopped and waited for at shutdown;
- shutdown() drops the device arrays (weights, KV cache, adapter pools) and compiled steps at once,
  whoever still holds the engine; the last engine of the process to shut down also clears JAX's
  caches of eager operations on its shapes (a few mappings a model otherwise), and glibc's
  allocator gives the freed heap back to the system (malloc_trim).

After shutdown the engine refuses work with EngineShutDownError; shutdown() twice is a no-op."""

from __future__ import annotations

import ctypes
import gc
import logging
import weakref

log = logging.getLogger("multilora.engine")

# engines built and not shut down in this process (the last one out clears JAX's caches)
_live: "weakref.WeakSet" = weakref.WeakSet()


class EngineShutDownError(RuntimeError):
    """The engine was shut down: it takes no more requests, steps or adapters."""


def check_open(engine, what: str) -> None:
    """Raise EngineShutDownError if the engine was shut down."""
    if engine._shut_down:
        raise EngineShutDownError(f"{what}: the engine was shut down")


def watch(engine) -> None:
    """Count the engine as live, and when it is collected without a shutdown, tell its background
    warm-up to stop (without waiting: a collection may run on any thread)."""
    _live.add(engine)
    for runner in _runners(engine):
        weakref.finalize(engine, runner.compiler.request_stop)


def _runners(engine) -> list:
    """The engine's model runner, and its draft model's (speculative decoding) if it has one."""
    drafter = getattr(engine.speculator, "drafter", None)
    return [engine.runner] + ([drafter.runner] if drafter is not None else [])


def shutdown(engine) -> None:
    """Stop the engine's threads and give back its device buffers and executables (see the
    module's docstring)."""
    if getattr(engine, "_shut_down", False):
        return
    engine._shut_down = True
    _live.discard(engine)
    for runner in _runners(engine):
        runner.release()  # stops and waits for its warm-up first
    engine.loader.close()
    if engine.slots is not None:
        engine.slots.release()
    engine.registry.release_host_copies()
    engine._requests.clear()
    engine._inflight = None
    gc.collect()
    if not _live:  # nothing else in this process uses what JAX keeps for the shapes seen
        import jax
        jax.clear_caches()
        gc.collect()
    _trim_heap()
    log.info("engine shut down: its threads stopped, its arrays and executables released")


def _trim_heap() -> None:
    """Give the freed heap back to the system where the C library is glibc (its malloc keeps
    freed memory for reuse: an engine's worth of compiler and host buffers stayed in RSS)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
