"""AsyncEngine: one thread owns the (single-threaded) Engine and runs its step loop; asyncio code
talks to it through commands that the thread applies between steps.

    aengine = AsyncEngine(engine, max_queue=512)
    aengine.start()
    stream = await aengine.submit(prompt_ids, SamplingParams(...), lora="name")  # errors raise here
    async for delta in stream:          # StreamDelta, the last one has finished=True
        ...
    await aengine.load_lora_adapter("x", "/adapters/x")                         # between steps
    await aengine.shutdown(timeout=30)  # stop taking requests, let running ones finish

Nothing but the engine thread touches the Engine's mutable state (the tokenizer, read-only, is
shared). Deltas reach each stream's event loop with call_soon_threadsafe. A stream that is left
early (client gone) aborts its request, which frees its KV pages at once. The queue is bounded:
when `max_queue` requests already wait for a place in the batch, submit raises QueueFullError.

When the engine thread dies (an exception outside a step, or MAX_STEP_FAILURES failed steps in a
row), every request in flight ends with the reason, and every later request, call and /health
answer says why the engine is not running; a command posted after the thread's end is answered
at once, never left waiting.

An engine that spans several processes (multilora.engine.distributed) cannot skip a step or lose
a process: a failed step, or a process whose heartbeat stops, ends the engine thread (every
request in flight gets the error) and calls `on_death(message)`, with which `multilora serve`
stops. At the end the thread lets the followers stop too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from typing import Any, Callable, Optional, Sequence, Union

from multilora.engine.commands import AddRequest
from multilora.engine.engine import StreamDelta
from multilora.engine.request import SamplingParams
from multilora.adapters.registry import public_name
from multilora.server.metrics import LoraInfo, Metrics

log = logging.getLogger("multilora.server")

Prompt = Union[str, Sequence[int]]

# A failed step fails the requests in flight and the engine goes on with the next ones; this many
# failed steps in a row (no step succeeded between them) mean the engine itself is broken: the
# thread stops, so that /health and every request say so (and a supervisor, or Ray Serve's health
# check, can replace it) instead of failing each request with a 500 behind a healthy /health.
MAX_STEP_FAILURES = 3


class QueueFullError(RuntimeError):
    """Too many requests wait already: try again later (HTTP 503)."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down or its thread has died (HTTP 503)."""


class PeerLostError(RuntimeError):
    """Another process of a multi-process engine is gone: the engine cannot go on."""


class EngineBrokenError(RuntimeError):
    """MAX_STEP_FAILURES steps in a row failed: the engine thread stops."""


class RequestStream:
    """One request on the server side, and the async iterator over its StreamDeltas: the asyncio
    side reads deltas from it; the engine thread keeps it (by request id) to time and deliver
    them. The engine-side state is the engine's Request; nothing else holds request state.
    Leaving it before the end (break, an exception, a cancelled task) should go through
    `abort()`; `async with` does that for you."""

    def __init__(self, owner: "AsyncEngine", request_id: str, lora: Optional[str],
                 loop: asyncio.AbstractEventLoop, prompt_token_ids: list[int]):
        self._owner = owner
        self.request_id, self.lora, self.loop = request_id, lora, loop
        self.prompt_token_ids = prompt_token_ids
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        # the engine thread's side
        self.first_token_at: Optional[float] = None
        self.last_token_at: Optional[float] = None
        self.num_tokens = 0
        self.done = False            # its final delta is on the way
        self.error: Optional[str] = None  # why it ended with "error" (a bad adapter, a failed step)
        # the consumer's side
        self.finished = False
        self.finish_reason: Optional[str] = None
        self.num_cached_tokens = 0   # prompt tokens served from the prefix cache (usage)
        self.lora_version: Optional[str] = None  # which adapter weights answer (system_fingerprint)

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamDelta:
        if self.finished:
            raise StopAsyncIteration
        delta: StreamDelta = await self.queue.get()
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.lora_version = delta.lora_version or self.lora_version
        if delta.finished:
            self.finished = True
            self.finish_reason = delta.finish_reason
        return delta

    def abort(self) -> None:
        """Stop generating (idempotent, thread-safe, never blocks); its KV pages are freed."""
        if not self.finished:
            self.finished = True
            self.finish_reason = "abort"
            self._owner._post(_Abort(self.request_id))

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()


# ---- what the asyncio side posts to the engine thread, applied there in order between steps ----
@dataclasses.dataclass(frozen=True)
class _Submit:
    """A new request: its stream, the engine command, and the future that gets its id (or why not)."""
    stream: "RequestStream"
    command: AddRequest
    future: asyncio.Future


@dataclasses.dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclasses.dataclass(frozen=True)
class _AbortAll:
    pass


@dataclasses.dataclass(frozen=True)
class _Fatal:
    """Another process is gone: the engine thread stops."""
    message: str


@dataclasses.dataclass(frozen=True)
class _Call:
    """fn(engine) between two steps; its result or exception goes to the future."""
    fn: Callable[[Any], Any]
    future: asyncio.Future


_Post = Union[_Submit, _Abort, _AbortAll, _Fatal, _Call]


def _set_future(fut: asyncio.Future, result: Any = None, exc: Optional[BaseException] = None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class AsyncEngine:
    def __init__(self, engine, max_queue: int = 512, metrics: Optional[Metrics] = None):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics or Metrics(engine.model_name)
        self._lock = threading.Lock()
        self._commands: list[_Post] = []
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}       # engine thread only
        self._pending_adds = 0                              # under _lock
        self._engine_waiting = 0                            # under _lock: engine.num_waiting
        self._inflight = 0                                  # under _lock: submitted, not yet ended
        self._accepting = True
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self._dead: Optional[str] = None
        self.snapshot: dict[str, float] = {}
        self.on_death: Optional[Callable[[str], None]] = None   # called once the engine thread died
        self._multiprocess = getattr(engine, "num_processes", 1) > 1
        self._fatal: Optional[str] = None                       # a lost process (engine thread)
        self._closed = False                                    # under _lock: the thread has ended
        self._step_failures = 0                                 # failed steps in a row (engine thread)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        if self._thread is None:
            self._publish()
            if self._multiprocess:
                self.engine.watch_peers(self._peer_lost)
            self._thread = threading.Thread(target=self._run, name="multilora-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def death(self) -> Optional[str]:
        """Why the engine thread died (None while it runs, or after a clean stop)."""
        return self._dead

    def _peer_lost(self, message: str) -> None:
        """From the heartbeat thread: end the engine thread between two steps; should it be stuck
        in a collective with the lost process, report the death without it after a grace period."""
        self._post(_Fatal(message))

        def _late() -> None:
            if self._thread is not None and self._thread.is_alive():
                log.error("the engine thread did not stop within 10 s (stuck in a collective?)")
                self._dead = self._dead or message
                self._call_on_death()
        timer = threading.Timer(10.0, _late)
        timer.daemon = True
        timer.start()

    def _call_on_death(self) -> None:
        callback, self.on_death = self.on_death, None   # once
        if callback is not None and self._dead is not None:
            callback(self._dead)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def num_inflight(self) -> int:
        with self._lock:
            return self._inflight

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new requests, let running ones finish (up to `timeout` seconds), abort the
        rest, then stop the engine thread."""
        self._accepting = False
        deadline = time.monotonic() + max(0.0, timeout)
        while self.num_inflight and time.monotonic() < deadline and self.is_alive:
            await asyncio.sleep(0.02)
        if self.num_inflight:
            log.warning("shutdown: aborting %d unfinished requests", self.num_inflight)
        await asyncio.get_running_loop().run_in_executor(None, self.stop)

    def stop(self) -> None:
        """Abort whatever runs and stop the thread now (blocking; safe from any thread)."""
        self._accepting = False
        self._post(_AbortAll())
        self._stop = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    # ---- the asyncio side ------------------------------------------------------------------
    def _post(self, cmd: _Post) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                self._commands.append(cmd)
        if closed:   # the thread has ended (after the caller's check): nobody will apply it
            self._refuse(cmd)
            return
        self._wake.set()

    @property
    def not_running_reason(self) -> str:
        """What a request, a call or /health is told while the engine does not run."""
        return f"the engine is not running: {self._dead}" if self._dead is not None else "the engine is not running"

    def _stopped(self) -> EngineStoppedError:
        return EngineStoppedError(self.not_running_reason)

    def _refuse(self, cmd: _Post) -> None:
        """Answer a command that will never be applied (any thread)."""
        if isinstance(cmd, _Submit):
            with self._lock:
                self._pending_adds -= 1
                self._inflight -= 1
            self._to_loop(cmd.stream.loop, _set_future, cmd.future, None, self._stopped())
        elif isinstance(cmd, _Call):
            self._to_loop(cmd.future.get_loop(), _set_future, cmd.future, None, self._stopped())

    def _check_running(self) -> None:
        if self._dead is not None:   # before the shutdown check: a dead thread also stops accepting
            raise self._stopped()
        if not self._accepting or self._stop:
            raise EngineStoppedError("the server is shutting down and takes no new requests")
        if not self.is_alive:
            raise self._stopped()

    async def submit(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                     lora: Optional[str] = None, request_id: Optional[str] = None,
                     follows: Optional[str] = None) -> RequestStream:
        """Queue a request. Raises (before anything streams) what Engine.add_request raises
        (ValueError, UnknownAdapterError, AdapterUnloadingError), QueueFullError or
        EngineStoppedError."""
        try:
            self._check_running()
        except EngineStoppedError:
            self.metrics.request_rejected("unavailable")
            raise
        prompt_ids = self.engine.tokenize(prompt)   # the tokenizer is read-only: safe off-thread
        params = params or SamplingParams()
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, lora, loop, prompt_ids)
        with self._lock:
            if self._pending_adds + self._engine_waiting >= self.max_queue:
                full = True
            else:
                full = False
                self._pending_adds += 1
                self._inflight += 1
        if full:
            self.metrics.request_rejected("queue_full")
            raise QueueFullError(f"the server is overloaded: {self.max_queue} requests are already "
                                 "waiting (max_queue); retry later")
        fut = loop.create_future()
        self._post(_Submit(stream, AddRequest(prompt_ids, params, lora, request_id, follows), fut))
        try:
            await fut
        except asyncio.CancelledError:
            self._post(_Abort(request_id))   # commands run in order: after its add
            raise
        self.metrics.request_accepted(lora, len(prompt_ids))
        return stream

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread between two steps; its result or its exception."""
        if not self.is_alive:
            raise self._stopped()
        fut = asyncio.get_running_loop().create_future()
        self._post(_Call(fn, fut))
        return await fut

    async def load_lora_adapter(self, name: str, path: str, pinned: bool = False, load_inplace: bool = False) -> None:
        """Read and validate on the engine's low-priority loader thread (the disk never stalls a
        step, the read never takes the cores from it), then register the copy between two steps."""
        if not self.is_alive:
            raise self._stopped()
        adapter = await asyncio.wrap_future(self.engine.read_adapter_async(name, path))
        await self.call(lambda e: e.load_lora_adapter(name, path, pinned=pinned, adapter=adapter,
                                                      load_inplace=load_inplace))

    async def unload_lora_adapter(self, name: str) -> None:
        await self.call(lambda e: e.unload_lora_adapter(name))

    async def list_lora_adapters(self) -> list[dict]:
        return await self.call(lambda e: e.list_lora_adapters())

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._loop_once():
                pass
        except (PeerLostError, EngineBrokenError) as e:
            self._dead = str(e)
            self._fail_all(self._dead)
        except BaseException as e:  # noqa: BLE001 - the thread must not die silently
            log.exception("the engine thread died")
            self._dead = f"{type(e).__name__}: {e}"
            self._fail_all(f"the engine thread died: {self._dead}")
        finally:
            self._accepting = False
            with self._lock:   # from now on _post answers what comes itself
                self._closed = True
                cmds, self._commands = self._commands, []
            for cmd in cmds:  # nobody will run these now: answer their callers
                self._refuse(cmd)
            self._fail_all("the engine has stopped")
            if self._multiprocess and self._dead is None:
                try:  # the followers' follow() returns after this last exchange
                    self.engine.stop_followers()
                except Exception:  # noqa: BLE001 - a follower already gone: nothing to stop
                    log.exception("stopping the follower processes failed")
            self._call_on_death()

    def _loop_once(self) -> bool:
        """One turn: apply queued commands, then one step (or wait for work). True: stop."""
        eng = self.engine
        self._wake.clear()
        with self._lock:
            cmds, self._commands = self._commands, []
        for cmd in cmds:
            self._apply(cmd)
        if self._fatal is not None:
            raise PeerLostError(self._fatal)
        if cmds:
            self._publish()
        if self._stop:
            with self._lock:
                return not self._commands
        if not eng.has_unfinished():
            self._wake.wait(1.0)
            return False
        try:
            deltas = eng.step()
        except Exception as e:  # a bug: fail the requests in flight, keep serving the next ones
            if self._multiprocess:  # ... unless the processes may now disagree: stop
                raise PeerLostError(f"a step of the multi-process engine failed ({type(e).__name__}: {e}); "
                                    "the processes can no longer agree, so the engine stops") from e
            log.exception("engine step failed")
            self._fail_all(f"internal error in the engine step: {type(e).__name__}: {e}")
            self._step_failures += 1
            if self._step_failures >= MAX_STEP_FAILURES:  # ... unless every step fails: stop
                raise EngineBrokenError(f"{self._step_failures} engine steps in a row failed, the last with "
                                        f"{type(e).__name__}: {e}") from e
            return False
        self._step_failures = 0
        self._dispatch(deltas)
        self._publish()
        if not deltas and eng.num_running == 0:
            self._wake.wait(0.01)  # nothing could be scheduled: don't spin
        return False

    def _apply(self, cmd: _Post) -> None:
        eng = self.engine
        if isinstance(cmd, _Submit):
            st = cmd.stream
            with self._lock:
                self._pending_adds -= 1
            try:
                if self._stop:
                    raise EngineStoppedError("the server is shutting down")
                cmd.command.apply(eng)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                with self._lock:
                    self._inflight -= 1
                self._to_loop(st.loop, _set_future, cmd.future, None, e)
                return
            self._streams[st.request_id] = st
            with self._lock:
                self._engine_waiting = eng.num_waiting
            self._to_loop(st.loop, _set_future, cmd.future, st.request_id, None)
        elif isinstance(cmd, _Abort):
            self._abort(cmd.request_id, "abort")
        elif isinstance(cmd, _Fatal):
            self._fatal = cmd.message
        elif isinstance(cmd, _AbortAll):
            for rid in list(self._streams):
                self._abort(rid, "abort")
        elif isinstance(cmd, _Call):
            try:
                result, exc = cmd.fn(eng), None
            except BaseException as e:  # noqa: BLE001
                result, exc = None, e
            self._to_loop(cmd.future.get_loop(), _set_future, cmd.future, result, exc)

    def _abort(self, rid: str, reason: str, error: Optional[str] = None) -> None:
        try:
            self.engine.abort_request(rid)
            self.engine.release_finished(rid)
        except Exception:  # never let one request's cleanup stop the loop
            log.exception("aborting %s failed", rid)
        st = self._streams.pop(rid, None)
        if st is not None:
            st.error = error
            self._end(st, StreamDelta(rid, [], "", True, reason))

    def _end(self, st: RequestStream, final: StreamDelta) -> None:
        st.done = True
        with self._lock:
            self._inflight -= 1
        self.metrics.request_finished(st.lora, final.finish_reason, time.monotonic() - st.arrival)
        self._to_loop(st.loop, st.queue.put_nowait, final)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._streams):
            self._abort(rid, "error", message)

    def _dispatch(self, deltas: list[StreamDelta]) -> None:
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for d in deltas:
            st = self._streams.get(d.request_id)
            if st is None:  # not ours (aborted already, or added straight to the engine)
                if d.finished:
                    self.engine.release_finished(d.request_id)
                continue
            n = len(d.token_ids)
            if n:
                ttft = itl = None
                if st.first_token_at is None:
                    st.first_token_at = now
                    ttft = now - st.arrival
                else:
                    itl = (now - st.last_token_at) / n
                st.last_token_at = now
                st.num_tokens += n
                self.metrics.tokens_generated(st.lora, n, ttft, itl)
            if d.finished:
                out = self.engine.pop_output(d.request_id)
                st.error = out.error
                del self._streams[d.request_id]
                st.done = True
                with self._lock:
                    self._inflight -= 1
                self.metrics.request_finished(st.lora, d.finish_reason, now - st.arrival)
            by_loop.setdefault(st.loop, []).append((st.queue, d))
        for loop, items in by_loop.items():
            self._to_loop(loop, _deliver, items)

    def _to_loop(self, loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: its consumers are gone
            pass

    def _publish(self) -> None:
        eng = self.engine
        with self._lock:
            self._engine_waiting = eng.num_waiting
            pending = self._pending_adds
        pages = eng.pages
        snap = {
            "multilora_num_requests_waiting": eng.num_waiting + pending,
            "multilora_num_requests_running": eng.num_running,
            "multilora_kv_pages_used": pages.num_used,
            "multilora_kv_pages_total": pages.capacity,
            "multilora_kv_cache_usage_ratio": pages.num_used / max(pages.capacity, 1),
            "multilora_loaded_adapters": len(eng.registry.entries),
            "multilora_lora_loads_in_flight": eng.loader.in_flight(),
            "multilora_lora_resident_adapters": sum(e.slot is not None for e in eng.registry.entries.values()),
            "multilora_lora_pool_rows_used": eng.registry.rows_in_use,
            "multilora_lora_pool_rows_total": eng.registry.num_rows or 0,
        }
        self.snapshot = snap
        # a replaced adapter's last requests count under its name (registry.public_name)
        lora_info = LoraInfo((public_name(r.adapter) for r in eng.scheduler.running if r.adapter is not None),
                             (public_name(r.adapter) for r in eng.scheduler.waiting if r.adapter is not None),
                             eng.registry.num_slots)
        spec = getattr(eng, "speculator", None)
        self.metrics.set_snapshot(snap, dataclasses.asdict(eng.registry.stats), dict(eng.scheduler.stats),
                                  lora_info, None if spec is None else
                                  {**spec.stats, "accepted_per_pos": list(spec.accepted_per_pos)})


def _deliver(items: list) -> None:
    for queue, delta in items:
        queue.put_nowait(delta)
