"""Ray and Serve started so that a busy host does not fail them (docs/ray.md, "On a busy host").

* init_ray: Ray starts its worker processes (Serve's controller and proxy, the replicas) at
  niceness 15, so that any other busy process on the host takes nearly all the CPU from them (a
  nice-0 process weighs 28 times a nice-15 one); a local cluster started here runs them at 0.
* start_serve: Serve's controller gives its HTTP proxy 5 s (RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S)
  to answer its first readiness check, else kills it (ray.kill) and starts another, and
  `serve.start()`, which waits on that first proxy, then fails with ActorDiedError ("killed by
  ray.kill ... never ran") although a replacement is on its way. start_serve gives the controller
  generous proxy timeouts (unless the environment sets them) and then waits for the proxies to
  be HEALTHY, whatever happened to the first one, up to a stated timeout.

Ray is imported lazily."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

log = logging.getLogger("multilora.server.ray")

# Serve's proxy timeouts as the controller reads them from its environment, and ours: a proxy
# that has not answered its first readiness check within READY is killed and started again (with
# READY x restarts the next time); one whose health checks take over HEALTH three times in a row
# is replaced. Serve's defaults are 5 and 10 s; a busy 2-core host needed more (docs/faults.md).
PROXY_TIMEOUT_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                     "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}
START_TIMEOUT_S = 300.0   # how long start_serve waits for the proxies to be ready
WORKER_NICENESS_ENV = "RAY_worker_niceness"   # Ray's worker_niceness, read by a new node's raylet


def init_ray(**kwargs):
    """ray.init(**kwargs). A local cluster it starts runs its worker processes at niceness 0
    (unless RAY_worker_niceness says otherwise); joining a running cluster keeps that cluster's
    setting (start it with RAY_worker_niceness=0 for the same)."""
    import ray
    ours = WORKER_NICENESS_ENV not in os.environ
    os.environ.setdefault(WORKER_NICENESS_ENV, "0")
    try:   # the raylet it starts takes its environment now
        return ray.init(**kwargs)
    finally:
        if ours:
            os.environ.pop(WORKER_NICENESS_ENV, None)


def controller_env(environ=None) -> dict[str, str]:
    """The environment variables Serve's controller is started with: the proxy timeouts, ours
    unless `environ` (os.environ) sets them."""
    environ = os.environ if environ is None else environ
    return {name: environ.get(name, value) for name, value in PROXY_TIMEOUT_ENV.items()}


def _proxy_start_failure(e: BaseException) -> bool:
    """serve.start's own wait on the first proxy failed: killed before it was ready
    (RayActorError), or not ready within Serve's HTTP_PROXY_TIMEOUT (TimeoutError)."""
    import ray.exceptions
    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, TimeoutError))


def start_serve(http_options: dict, timeout_s: float = START_TIMEOUT_S, serve=None,
                clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """serve.start(http_options) on the Ray cluster ray.init() joined, robust on a busy host: the
    controller gets generous proxy timeouts (controller_env), a first proxy killed for missing
    its readiness check is waited out, and this returns once every proxy is HEALTHY, or raises
    TimeoutError after timeout_s saying which proxies are not. `serve` (ray.serve) and the clock
    are parameters for the tests."""
    if serve is None:
        from ray import serve
    try:
        serve.start(http_options=http_options, controller_options={"runtime_env": {"env_vars": controller_env()}})
    except Exception as e:  # noqa: BLE001 - sorted below
        if not _proxy_start_failure(e):
            raise
        log.warning("Ray Serve's first HTTP proxy was not ready in time (%s: %s); waiting up to %.0f s for "
                    "the one the controller starts instead", type(e).__name__, str(e).splitlines()[0] if str(e)
                    else "", timeout_s)
    wait_for_proxies(serve, timeout_s, http_options, clock, sleep)


def wait_for_proxies(serve, timeout_s: float, http_options: Optional[dict] = None,
                     clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once Serve reports at least one proxy and every proxy HEALTHY (none STARTING or
    UNHEALTHY); TimeoutError after timeout_s."""
    deadline = clock() + timeout_s
    states: dict = {}
    while True:
        try:
            states = {node: getattr(s, "value", str(s)) for node, s in serve.status().proxies.items()}
        except Exception as e:  # noqa: BLE001 - the controller is busy: ask again
            log.info("Serve's status is not available yet: %s", e)
        if states and all(s == "HEALTHY" for s in states.values()):
            return
        if clock() >= deadline:
            where = "" if not http_options else f" on {http_options.get('host')}:{http_options.get('port')}"
            raise TimeoutError(
                f"Ray Serve's HTTP proxy{where} is not ready after {timeout_s:.0f} s (proxies by node: "
                f"{states or 'none yet'}); is the host overloaded, or the port taken? Serve's logs are under "
                "/tmp/ray/session_latest/logs/serve/")
        sleep(0.25)
