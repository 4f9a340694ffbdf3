"""Reading adapters off the engine thread: disk read, validation, the host copy and its content
hash run on one background worker, so that no engine step ever waits on a disk.

    loader = AdapterLoader(read)            # read(name, path) -> LoRAAdapter (may raise AdapterError)
    loader.prefetch("x", "/adapters/x")     # starts a read unless one for (x, path) is in flight
    fut = loader.submit("y", "/adapters/y")  # a read whose caller waits on the future itself
    for name, path, adapter, error in loader.poll():   # finished reads, on the caller's thread
        ...

Plain Python (a thread pool), no jax: device writes stay with the engine, between steps.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterator, Optional

from multilora.lora.adapter import LoRAAdapter


def read_with_hash(read: Callable[[str, str], LoRAAdapter], name: str, path: str) -> LoRAAdapter:
    """Read and validate, and hash the contents too (the hash is what the prefix cache keys on;
    computing it here keeps that work off the engine thread as well)."""
    adapter = read(name, path)
    adapter.content_hash  # noqa: B018  (computed and cached on the object)
    return adapter


def _lower_priority() -> None:
    """Run this worker thread at the lowest CPU priority (Linux: nice is per thread): a read uses
    what the engine's step leaves of the cores instead of taking its turn from the streams. A
    read then takes longer on a busy machine; a step does not."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not on this platform: reads run at normal priority
        pass


class AdapterLoader:
    def __init__(self, read: Callable[[str, str], LoRAAdapter], workers: int = 1):
        self._read = read
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="multilora-lora-load",
                                        initializer=_lower_priority)
        self._lock = threading.Lock()
        self._inflight: dict[tuple[str, str], Future] = {}

    def submit(self, name: str, path: str) -> Future:
        """Read on the loader's (low-priority) worker; the future holds the adapter or the error.
        For callers that wait for it themselves (the server's /v1/load_lora_adapter)."""
        return self._pool.submit(read_with_hash, self._read, name, str(path))

    def prefetch(self, name: str, path: str) -> bool:
        """Start reading (name, path) in the background unless it already is; True if started."""
        key = (name, str(path))
        with self._lock:
            if key in self._inflight:
                return False
            self._inflight[key] = self.submit(name, path)
            return True

    def in_flight(self, name: Optional[str] = None) -> int:
        with self._lock:
            return sum(1 for (n, _) in self._inflight if name is None or n == name)

    def poll(self) -> Iterator[tuple[str, str, Optional[LoRAAdapter], Optional[BaseException]]]:
        """The reads that finished since the last poll: (name, path, adapter or None, error)."""
        with self._lock:
            done = [(k, f) for k, f in self._inflight.items() if f.done()]
            for k, _ in done:
                del self._inflight[k]
        for (name, path), fut in done:
            err = fut.exception()
            yield name, path, (None if err is not None else fut.result()), err
