"""Several processes (hosts), one engine: `jax.distributed` set-up and the per-step agreement.

Design: a replicated state machine. Multi-controller JAX needs every process to call the same
jitted computation, with the same shapes, in the same order. So every process builds the same
Engine (same arguments, same model and adapter files on its disk) over one global mesh, and
process 0, the leader, is the only one that takes requests. Every call that changes the engine's
state (add_request, abort_request, load_lora_adapter, unload_lora_adapter, add_mix: the typed
commands of multilora.engine.commands) is recorded on the leader; at the start of each step the
leader broadcasts that record (one small collective per step, a second one when the record is not
empty) and the other processes, the followers, apply it in the same order. From the same state and the same inputs, the scheduler, page pool and
registry (plain Python, deterministic) pick the same batch, the same adapter slot writes and the
same bucket everywhere; the sampled tokens come from a replicated array, equal on every device,
so the next state is the same again. Followers run `Engine.follow()`; the leader ends them with
`Engine.stop_followers()`.

Why not broadcast the batch itself: slot writes, slot clears and the sampler's rows would need
broadcasting too, and the scheduler state would still have to be mirrored for the next step; the
record of inputs is smaller and keeps one code path for one and for many processes.

CPU processes talk through gloo (set here, before initialize); GPUs and TPUs use their own
collectives. Gloo sets up each group of devices at its first collective and gives the peers 30 s
to arrive (not configurable from JAX): processes that finish compiling minutes apart would fail
there, so the engine waits at a coordination-service barrier (long timeout) once warm-up is done.
Later collectives wait without that limit (a follower idles in the next step's broadcast while
the leader has no work).

A process that dies: JAX's default is to abort every other process from its coordination
service's error poll. `initialize` turns on `jax_enable_recoverability` instead, so that a dead
follower fails the leader's next collective with an exception (gloo: "Connection closed by
peer") rather than killing it, and every process beats a heartbeat through the coordination
service's key-value store (`Heartbeat`): the leader watches the followers, the followers watch
the leader, so that a death is seen within PEER_TIMEOUT_S even while no step runs. What then
happens is the caller's choice (`StepSync.watch`): `multilora serve` fails the requests in
flight and stops with an error naming the process; a follower whose leader is gone exits. Not
covered: an adapter folder readable on the leader but not on a follower (the follower raises).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Callable, Optional

import numpy as np

from multilora.engine.commands import Command, StopFollowers, from_wire, to_wire

log = logging.getLogger("multilora.distributed")


def initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
               process_id: Optional[int] = None, local_device_ids=None,
               cpu_collectives: str = "gloo") -> None:
    """jax.distributed.initialize, before any device is touched. With num_processes <= 1 and no
    coordinator this does nothing (one process). On CPU, cross-process collectives need an
    implementation chosen before the backend starts: gloo."""
    import jax
    if coordinator_address is None and (num_processes or 1) <= 1:
        return
    if coordinator_address is None or num_processes is None or process_id is None:
        raise ValueError("several processes need coordinator_address (host:port), num_processes and "
                         "process_id, all three")
    if not (0 <= process_id < num_processes):
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    if jax.distributed.is_initialized():
        return
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    # a dead peer: an exception at the next collective, not an abort (the module docstring)
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, local_device_ids=local_device_ids)
    log.info("process %d of %d: %d local devices, %d in all", jax.process_index(), jax.process_count(),
             jax.local_device_count(), jax.device_count())


def barrier(name: str, timeout_s: float = 3600.0) -> None:
    """Wait until every process gets here (the coordination service's barrier, not a device
    collective: no gloo group to set up, and a timeout of our choosing)."""
    import jax
    if jax.process_count() == 1:
        return
    from jax._src import distributed as _dist  # the client behind jax.distributed.initialize
    client = _dist.global_state.client
    if client is None or not hasattr(client, "wait_at_barrier"):
        from jax.experimental.multihost_utils import sync_global_devices
        return sync_global_devices(name)
    client.wait_at_barrier(name, int(timeout_s * 1000))


def _bucket(n: int) -> int:
    """Payload sizes rounded up to powers of two: each size is one small compile, so few sizes."""
    size = 64
    while size < n:
        size *= 2
    return size


def broadcast_object(obj) -> object:
    """Process 0's JSON-able `obj` on every process (the others pass anything, e.g. None)."""
    import jax
    from jax.experimental.multihost_utils import broadcast_one_to_all
    leader = jax.process_index() == 0
    data = json.dumps(obj).encode() if leader else b""
    n = int(broadcast_one_to_all(np.array([len(data)], np.int32))[0])
    buf = np.zeros(_bucket(n), np.int32)
    if leader:
        buf[:n] = np.frombuffer(data, np.uint8)
    buf = broadcast_one_to_all(buf)
    return json.loads(bytes(np.asarray(buf[:n], np.uint8)).decode())


HEARTBEAT_S = 1.0       # each process writes its heartbeat this often
PEER_TIMEOUT_S = 15.0   # a peer whose heartbeat has not changed for this long is gone
STOP_GRACE_S = 1.0      # process 0 outlives the followers' exit by this much


def _client():
    from jax._src import distributed as _dist  # the client behind jax.distributed.initialize
    return _dist.global_state.client


class Heartbeat:
    """A thread that writes this process's beat counter into the coordination service's
    key-value store every `period_s` and watches the `peers`' counters: a counter that has not
    changed for `timeout_s` (by this process's clock: no clock agreement needed), or a store that
    cannot be reached (it lives in process 0), calls `on_lost(message)` once and ends the watch."""

    def __init__(self, me: int, peers: list[int], on_lost: Callable[[str], None],
                 period_s: float = HEARTBEAT_S, timeout_s: float = PEER_TIMEOUT_S):
        self.me, self.peers, self.on_lost = me, list(peers), on_lost
        self.period_s, self.timeout_s = period_s, timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="multilora-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @staticmethod
    def _key(process: int) -> str:
        return f"multilora/heartbeat/{process}"

    def _run(self) -> None:
        client = _client()
        beat = 0
        seen = {p: (None, time.monotonic()) for p in self.peers}  # peer -> (last value, when it changed)
        while not self._stop.wait(self.period_s):
            beat += 1
            try:
                client.key_value_set(self._key(self.me), str(beat), allow_overwrite=True)
                values = {p: _try_get(client, self._key(p)) for p in self.peers}
            except Exception as e:  # noqa: BLE001 - the store lives in process 0
                if not self._stop.is_set():
                    self._lost(f"process 0's coordination service cannot be reached ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}): process 0 has stopped")
                return
            now = time.monotonic()
            for p, value in values.items():
                last, since = seen[p]
                if value != last:
                    seen[p] = (value, now)
                elif now - since > self.timeout_s and not self._stop.is_set():
                    self._lost(f"process {p} has sent no heartbeat for {now - since:.0f} s: it has stopped "
                               "(or hangs), and a multi-process engine cannot go on without it")
                    return

    def _lost(self, message: str) -> None:
        self._stop.set()
        log.error("%s", message)
        self.on_lost(message)


def _try_get(client, key: str) -> Optional[str]:
    try:
        return client.key_value_try_get(key)
    except Exception as e:  # noqa: BLE001 - not written yet is not an error
        if "NOT_FOUND" in str(e):
            return None
        raise


def _exit_follower(message: str) -> None:
    """A follower whose leader is gone: nothing left to follow."""
    log.error("this follower exits: %s", message)
    os._exit(1)


class StepSync:
    """The leader's record of state changes since the last step, and its exchange."""

    def __init__(self):
        import jax
        self.leader = jax.process_index() == 0
        self.running = True
        self._pending: list = []
        self._replaying = False
        barrier("multilora_engine_ready")  # every process has compiled: collectives may start
        n = jax.process_count()
        self._on_lost: Callable[[str], None] = (lambda message: None) if self.leader else _exit_follower
        self.heartbeat = Heartbeat(jax.process_index(), list(range(1, n)) if self.leader else [0],
                                   lambda message: self._on_lost(message))

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """What to do (from the heartbeat's thread) when another process is gone."""
        self._on_lost = on_lost

    def stop_barrier(self) -> None:
        """After the stop: every process here before any leaves. With recoverable tasks JAX's
        own shutdown does not wait for the peers, and a follower still running when process 0
        (the coordination service) exits is aborted by JAX; so followers exit at once after this
        barrier, and process 0 gives them a moment (STOP_GRACE_S) before it exits."""
        barrier("multilora_engine_stopped", timeout_s=120.0)
        if self.leader:
            time.sleep(STOP_GRACE_S)

    def stopped(self) -> None:
        """The followers have been told to stop (or this follower was): no more watching."""
        self.running = False
        self.heartbeat.stop()

    def guard(self, what: str) -> None:
        """Before a state change: only the leader (or a follower replaying it) may make one."""
        if not self.leader and not self._replaying:
            raise RuntimeError(f"{what}: on a multi-process engine only process 0 takes requests and "
                               "adapter changes; the other processes run Engine.follow()")

    def record(self, cmd: "Command") -> None:
        """After a state change succeeded on the leader: to be replayed by the followers."""
        if self.leader:
            self._pending.append(to_wire(cmd))

    def exchange(self, engine) -> bool:
        """At the start of a step, on every process: the leader sends its record, the followers
        apply it (each command through its own apply, as the leader's engine did). False once
        the leader has stopped (the step must not run)."""
        items = broadcast_object(self._pending if self.leader else None)
        self._pending = []
        cmds = [from_wire(item) for item in items]
        if not self.leader:
            self._replaying = True
            try:
                for cmd in cmds:
                    cmd.apply(engine)
            finally:
                self._replaying = False
        if any(isinstance(cmd, StopFollowers) for cmd in cmds):
            self.stopped()
        return self.running
