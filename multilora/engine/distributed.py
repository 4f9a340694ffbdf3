"""Several processes (hosts), one engine: `jax.distributed` set-up and the per-step agreement.

Design: a replicated state machine. Multi-controller JAX needs every process to call the same
jitted computation, with the same shapes, in the same order. So every process builds the same
Engine (same arguments, same model and adapter files on its disk) over one global mesh, and
process 0, the leader, is the only one that takes requests. Every call that changes the engine's
state (add_request, abort_request, load_lora_adapter, unload_lora_adapter) is recorded on the
leader; at the start of each step the leader broadcasts that record (one small collective per
step, a second one when the record is not empty) and the other processes, the followers, apply
it in the same order. From the same state and the same inputs, the scheduler, page pool and
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
the leader has no work). Not covered: a process that dies (the others fail at the next
collective or at the shutdown barrier), and an adapter folder readable on the leader but not on
a follower (the follower raises).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Optional

import numpy as np

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


class StepSync:
    """The leader's record of state changes since the last step, and its exchange."""

    def __init__(self):
        import jax
        self.leader = jax.process_index() == 0
        self.running = True
        self._pending: list = []
        self._replaying = False
        barrier("multilora_engine_ready")  # every process has compiled: collectives may start

    def guard(self, what: str) -> None:
        """Before a state change: only the leader (or a follower replaying it) may make one."""
        if not self.leader and not self._replaying:
            raise RuntimeError(f"{what}: on a multi-process engine only process 0 takes requests and "
                               "adapter changes; the other processes run Engine.follow()")

    def record(self, op: str, **kw) -> None:
        """After a state change succeeded on the leader: to be replayed by the followers."""
        if self.leader:
            self._pending.append([op, kw])

    def exchange(self, engine) -> bool:
        """At the start of a step, on every process: the leader sends its record, the followers
        apply it. False once the leader has stopped (the step must not run)."""
        cmds = broadcast_object(self._pending if self.leader else None)
        self._pending = []
        if not self.leader:
            self._replaying = True
            try:
                for op, kw in cmds:
                    self._apply(engine, op, kw)
            finally:
                self._replaying = False
        elif any(op == "stop" for op, _ in cmds):
            self.running = False
        return self.running

    def _apply(self, engine, op: str, kw: dict) -> None:
        from multilora.engine.request import SamplingParams
        if op == "add":
            engine.add_request(kw["prompt"], SamplingParams(**kw["params"]), kw["lora"], kw["request_id"],
                               kw.get("follows"))
        elif op == "mix":
            engine.add_mix(kw["weights"])
        elif op == "abort":
            engine.abort_request(kw["request_id"])
        elif op == "load":
            engine.load_lora_adapter(kw["name"], kw["path"], pinned=kw["pinned"])
        elif op == "unload":
            engine.unload_lora_adapter(kw["name"])
        elif op == "stop":
            self.running = False
        else:
            raise ValueError(f"unknown command {op!r} from the leader")


def params_dict(params) -> dict:
    """SamplingParams -> JSON-able keyword arguments."""
    d = dataclasses.asdict(params)
    d["stop"], d["stop_token_ids"] = list(d["stop"]), [int(t) for t in d["stop_token_ids"]]
    return d
