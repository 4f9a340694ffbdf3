"""Data-parallel replicas on Ray Serve: R multilora engines behind one OpenAI-compatible endpoint,
each request routed by its adapter (`multilora serve-ray`, or `serve run
multilora.server.ray_serve:build ...`). See docs/ray.md.

Three pieces, one Serve application:

* **EngineReplica** (R replicas): an Engine, its AsyncEngine and the very FastAPI app of `multilora
  serve` (build_app), run in process. Each HTTP request the ingress forwards goes through that
  ASGI app, so every route, validation and OpenAI error JSON is the single-node server's; the
  response comes back as a stream of items: first `{"accepted": replica}` (the request has
  started here), then the whole response, or for SSE its head and then one item per body chunk.
  `serve.multiplexed(max_num_models_per_replica=N)` keeps the N adapters this replica served last:
  that set is what Serve's router reads to send an adapter's requests to a replica that holds it.
  Underneath, the engine's own tiers (device slots, host copies, disk) decide what is resident;
  the multiplexed set is the routing view, not a memory bound (give --max-loaded-loras >= N so
  that the adapters a replica advertises keep their host copies).
* **AdapterDirectory** (one named Ray actor): the source of truth for adapters, name -> {path,
  pinned}, with a version that every change bumps. It starts with --lora-modules. Before it
  serves any request a replica compares its version with the directory's (one small actor call)
  and, when it moved, unloads what the directory no longer has (or has under another path). New
  adapters are registered lazily, by the first request for them on each replica. So a runtime
  load or unload reaches every replica: after /v1/unload_lora_adapter returns, no replica starts
  a request for that adapter; after /v1/load_lora_adapter returns, every replica serves it
  (vLLM's /v1/load_lora_adapter reaches one data-parallel replica only).
* **Ingress** (the HTTP endpoint): checks the API key and the body size, answers the cluster's
  routes itself (/v1/models from the directory; load: validated by the app on one replica, then
  recorded in the directory; unload: removed from the directory) and forwards everything else
  to a replica through the handle, `.options(multiplexed_model_id=<the body's model>)` for an
  adapter (none for the base model), streamed.

A replica that dies is replaced by Serve. A request that the ingress sent to it but that had not
started there (no "accepted" item yet: routed just before the death, or queued in the dead
actor) is sent again, to another replica, up to `max_attempts` times; one that had started fails
cleanly: a 503 OpenAI error JSON when nothing was sent to the client yet, or an SSE error event
that ends the stream. Started requests are not retried: the request might be what killed the
replica, and a retry would take the next one down too.

Ray is imported lazily: `import multilora` and `multilora --help` never need it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import json
import logging
import os
import time
import urllib.parse
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable, Optional

from multilora.server import protocol as P

log = logging.getLogger("multilora.server.ray")

DIRECTORY_NAMESPACE = "multilora"
REPLICA_HEADER = "x-multilora-replica"      # the replica that served the request
HELD_HEADER = "x-multilora-held"            # the adapters it held after taking this one
WARM_HEADER = "x-multilora-warm"            # 1: it held the request's adapter when the request arrived
ATTEMPTS_HEADER = "x-multilora-attempts"    # replicas tried: > 1 when a replica died before starting it
_HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"}


# ---- configuration -------------------------------------------------------------------------------
@dataclasses.dataclass
class RayServeConfig:
    """Everything the deployments need, picklable (it travels to every replica)."""
    engine_kwargs: dict                    # Engine(**engine_kwargs): model, lora_modules, config
    num_replicas: int = 2
    max_adapters_per_replica: int = 8      # serve.multiplexed's max_num_models_per_replica
    max_ongoing_requests: int = 64         # per replica; more wait in Serve's router
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    api_key: Optional[str] = None
    lora_root: Optional[str] = None
    allow_any_lora_path: bool = False
    max_body_bytes: int = 4 * 2**20
    max_queue: int = 512
    drain_timeout: float = 30.0
    max_attempts: int = 3                  # replicas a request that never started may be sent to
    app_name: str = "multilora"
    health_check_period_s: float = 2.0
    route_by_adapter: bool = True          # False: no multiplexed id (the benchmark's baseline)

    def __post_init__(self):
        check_config(self)

    @property
    def directory_name(self) -> str:
        return f"multilora-adapters-{self.app_name}"


def check_config(cfg: RayServeConfig) -> None:
    """Raise ValueError naming the setting that is wrong and what it may be."""
    if not isinstance(cfg.num_replicas, int) or cfg.num_replicas < 1:
        raise ValueError(f"num_replicas must be an integer >= 1, got {cfg.num_replicas!r}")
    if not isinstance(cfg.max_adapters_per_replica, int) or cfg.max_adapters_per_replica < 1:
        raise ValueError("max_adapters_per_replica must be an integer >= 1 (adapters a replica advertises "
                         f"to the router), got {cfg.max_adapters_per_replica!r}")
    if not isinstance(cfg.max_ongoing_requests, int) or cfg.max_ongoing_requests < 1:
        raise ValueError(f"max_ongoing_requests must be an integer >= 1, got {cfg.max_ongoing_requests!r}")
    if not isinstance(cfg.max_attempts, int) or cfg.max_attempts < 1:
        raise ValueError(f"max_attempts must be an integer >= 1, got {cfg.max_attempts!r}")
    if cfg.replica_cpus < 0 or cfg.replica_gpus < 0:
        raise ValueError(f"replica_cpus and replica_gpus must be >= 0, got {cfg.replica_cpus!r} and "
                         f"{cfg.replica_gpus!r}")
    if cfg.max_queue < 0:
        raise ValueError(f"max_queue must be >= 0, got {cfg.max_queue!r}")


# ---- small pure helpers --------------------------------------------------------------------------
def _body_object(body: bytes) -> dict:
    try:
        obj = json.loads(body or b"null")
    except (ValueError, UnicodeDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def request_model(body: bytes) -> tuple[Optional[str], bool]:
    """(the body's `model` when it is a string, whether it asks for an `adapters` mix). Anything
    unreadable gives (None, False): the replica's app reports what is wrong with it."""
    obj = _body_object(body)
    model = obj.get("model")
    return (model if isinstance(model, str) else None), obj.get("adapters") is not None


def mix_parts(body: bytes) -> list[str]:
    """The adapters an `adapters` mix names ({name: weight}); [] when there is none."""
    parts = _body_object(body).get("adapters")
    return [p for p in parts if isinstance(p, str)] if isinstance(parts, dict) else []


def multiplexed_id(model: Optional[str], mix: bool, base_names: set[str]) -> str:
    """The multiplexed model id a request is routed by: its adapter's name; "" (no affinity) for
    the base model, a mix (its parts are what is held) or no model at all."""
    if not model or mix or model in base_names:
        return ""
    return model


def stale_adapters(applied: dict[str, str], entries: dict[str, dict]) -> list[str]:
    """Adapters a replica registered from the directory (name -> path) that the directory no
    longer has, or has under another path: to be unloaded there."""
    return sorted(n for n, path in applied.items() if n not in entries or entries[n]["path"] != path)


def encode_names(names) -> str:
    """Adapter names for a header: percent-encoded, comma-separated (names may hold commas)."""
    return ",".join(urllib.parse.quote(n, safe="") for n in names)


def decode_names(value: str) -> list[str]:
    return [urllib.parse.unquote(n) for n in value.split(",")] if value else []


def bearer_ok(authorization: str, api_key: Optional[str]) -> bool:
    if not api_key:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.split(b";")[0].strip() == b"text/event-stream"
               for k, v in headers)


def relayed_headers(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The replica's response headers for the ingress's response (without hop-by-hop ones)."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in headers
            if k.decode("latin-1").lower() not in _HOP_BY_HOP}


def error_json(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> bytes:
    return json.dumps(P.error_body(status, message, param, code), separators=(",", ":")).encode()


def sse_error(status: int, message: str, code: Optional[str] = None) -> bytes:
    return b"data: " + error_json(status, message, None, code) + b"\n\n"


def replica_gone(exc: BaseException) -> bool:
    """Whether a call failed because its replica died or went away (not because of the request)."""
    import ray.exceptions
    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError))


# ---- the adapter directory (a named Ray actor) ---------------------------------------------------
class AdapterDirectory:
    """name -> {"path", "pinned"}: which adapters the deployment serves, whatever replica answers.
    A plain class; run as one Ray actor (its calls run one at a time, so each is atomic)."""

    def __init__(self, seed: Optional[dict[str, dict]] = None):
        self.entries: dict[str, dict] = {}
        self._version = 0
        self.seed(seed or {})

    def version(self) -> int:
        return self._version

    def snapshot(self) -> tuple[int, dict[str, dict]]:
        return self._version, {n: dict(e) for n, e in self.entries.items()}

    def seed(self, entries: dict[str, dict]) -> int:
        """Add the entries whose names are not there yet (a redeploy keeps runtime loads)."""
        for name, e in entries.items():
            if name not in self.entries:
                self.entries[name] = {"path": str(e["path"]), "pinned": bool(e.get("pinned", False))}
                self._version += 1
        return self._version

    def add(self, name: str, path: str, pinned: bool = False) -> tuple[bool, Optional[dict]]:
        """(True, None) when added; (False, the entry there) when the name is taken. Adding the
        same name and path again is a success that changes nothing."""
        have = self.entries.get(name)
        if have is not None:
            return have["path"] == str(path), dict(have)
        self.entries[name] = {"path": str(path), "pinned": bool(pinned)}
        self._version += 1
        return True, None

    def remove(self, name: str) -> Optional[dict]:
        """The removed entry, or None when there was none."""
        entry = self.entries.pop(name, None)
        if entry is not None:
            self._version += 1
        return entry


def create_directory(cfg: RayServeConfig, lifetime: Optional[str] = "detached"):
    """The deployment's directory actor, created (seeded with --lora-modules) or, when it runs
    already (a redeploy), reused and seeded with the names it lacks."""
    import ray
    seed = {n: {"path": p, "pinned": False} for n, p in (cfg.engine_kwargs.get("lora_modules") or {}).items()}
    actor = ray.remote(AdapterDirectory).options(
        name=cfg.directory_name, namespace=DIRECTORY_NAMESPACE, get_if_exists=True, lifetime=lifetime,
        num_cpus=0, max_concurrency=1).remote(seed)
    ray.get(actor.seed.remote(seed))
    return actor


def get_directory(cfg: RayServeConfig, timeout: float = 60.0):
    import ray
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get_actor(cfg.directory_name, namespace=DIRECTORY_NAMESPACE)
        except ValueError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the adapter directory actor {cfg.directory_name!r} (namespace "
                                   f"{DIRECTORY_NAMESPACE!r}) does not exist: build the application with "
                                   "multilora.server.ray_serve.build_application") from None
            time.sleep(0.2)


# ---- one replica: an engine and the single-node app, in process -----------------------------------
async def run_asgi(app, req: dict, extra_headers: list[tuple[bytes, bytes]]) -> AsyncIterator[dict]:
    """Run one forwarded HTTP request through an in-process ASGI app. Yields the response as
    {"status", "headers", "body", "stream": False}, or for an event stream its head {"status",
    "headers", "stream": True} and then {"body": chunk} items. Leaving early (the client went
    away) tells the app the client disconnected and cancels it."""
    path = req["path"]
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": req["method"], "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": req.get("query_string", b""), "root_path": "",
             "headers": [(k.lower(), v) for k, v in req["headers"]],
             "client": tuple(req.get("client") or ("127.0.0.1", 0)), "server": ("multilora-replica", 80),
             "state": {}}
    queue: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_given = False

    async def receive():
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": req.get("body", b""), "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(msg):
        if msg["type"] == "http.response.start":
            msg = {**msg, "headers": list(msg.get("headers", [])) + extra_headers}
        queue.put_nowait(msg)

    task = asyncio.create_task(app(scope, receive, send))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    head, chunks, streaming = None, [], False
    try:
        while True:
            msg = await queue.get()
            if msg is None:
                break
            if msg["type"] == "http.response.start":
                head = msg
                streaming = is_event_stream(msg["headers"])
                if streaming:
                    yield {"status": msg["status"], "headers": msg["headers"], "stream": True}
            elif msg["type"] == "http.response.body" and head is not None:
                data = msg.get("body", b"")
                if streaming:
                    if data:
                        yield {"body": data}
                else:
                    chunks.append(data)
                    if not msg.get("more_body", False):
                        yield {"status": head["status"], "headers": head["headers"], "body": b"".join(chunks),
                               "stream": False}
                        head = None  # sent; what the app still does is background work
        exc = task.exception() if task.done() and not task.cancelled() else None
        if exc is not None and not streaming and not chunks:
            log.error("the app failed on %s: %r", path, exc)
            yield {"status": 500, "headers": [(b"content-type", b"application/json")] + extra_headers,
                   "body": error_json(500, f"internal server error: {type(exc).__name__}"), "stream": False}
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class _Held:
    """What serve.multiplexed caches for an adapter: its name. Its eviction (Serve calls __del__)
    takes it out of the replica's advertised set; the engine's own LRU tiers keep or drop its
    weights."""

    def __init__(self, name: str, on_evict: Callable[["_Held"], None]):
        self.name, self._on_evict, self._evicted = name, on_evict, False

    def __del__(self):
        if not self._evicted:
            self._evicted = True
            self._on_evict(self)


class EngineReplica:
    """One data-parallel replica (a Serve deployment class; see the module docstring)."""

    def __init__(self, cfg: RayServeConfig):
        import ray
        from ray import serve

        from multilora.engine.engine import Engine
        from multilora.server.app import build_app
        from multilora.server.async_engine import AsyncEngine
        from multilora.server.heap import freeze_startup_heap

        self.cfg = cfg
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.actor_name = ray.get_runtime_context().get_actor_name()
        self.directory = get_directory(cfg)
        engine = Engine(**cfg.engine_kwargs)
        self.engine = engine
        self.aengine = AsyncEngine(engine, max_queue=cfg.max_queue).start()
        self.app = build_app(self.aengine, api_key=None, lora_root=cfg.lora_root,
                             max_body_bytes=cfg.max_body_bytes, allow_any_lora_path=cfg.allow_any_lora_path,
                             drain_timeout=cfg.drain_timeout)
        freeze_startup_heap()  # full collections then skip the start-up heap (multilora.server.heap)
        self.server = self.app.state.server
        # adapters registered here from the directory, name -> path (--lora-modules at start)
        self._applied: dict[str, str] = {a["name"]: a["path"] for a in engine.list_lora_adapters()}
        self._entries: dict[str, dict] = {}
        self._version: Optional[int] = None
        self._sync_lock = asyncio.Lock()
        self._loading: dict[str, asyncio.Future] = {}
        self._held: OrderedDict[str, _Held] = OrderedDict()   # the multiplexed set, LRU order
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._poller: Optional[asyncio.Task] = None

        async def hold(model_id: str) -> _Held:
            return await self._hold(model_id)

        # wired per instance so that the bound (N) comes from the config
        self._get_held = serve.multiplexed(max_num_models_per_replica=cfg.max_adapters_per_replica)(hold)
        log.info("replica %s ready: %s with %d adapters at start", self.replica_id, engine.model_name,
                 len(self._applied))

    # ---- what the ingress calls ------------------------------------------------------------
    def info(self) -> dict:
        return dict(replica_id=self.replica_id, actor_name=self.actor_name, pid=os.getpid(),
                    base_name=self.server.base_name, base_names=sorted(self.server.base_names),
                    model_path=str(self.engine.model_path), max_model_len=self.engine.max_model_len)

    def held(self) -> list[str]:
        return list(self._held)

    async def forward(self, req: dict, op: str = "http") -> AsyncIterator[dict]:
        """One HTTP request through this replica's app (op "http"), or /v1/load_lora_adapter
        validated here and then recorded in the directory (op "load")."""
        from ray import serve
        yield {"accepted": self.replica_id}
        self._start_poller()
        await self._sync()
        # the ingress's routing id; without routing by adapter (a baseline), the adapter it names
        model_id = serve.get_multiplexed_model_id() or req.get("adapter", "")
        warm = model_id in self._held if model_id else None
        if model_id and op == "http":
            await self._take(model_id)
        for part in mix_parts(req.get("body", b"")) if op == "http" and not model_id else ():
            await self._ensure_quietly(part)   # a mix's parts must be registered here
        extra = [(REPLICA_HEADER.encode(), self.replica_id.encode())]
        if op == "load":
            yield await self._load(req, model_id, extra)
            return
        extra.append((HELD_HEADER.encode(), encode_names(self._held).encode("latin-1")))
        if warm is not None:
            extra.append((WARM_HEADER.encode(), b"1" if warm else b"0"))
        async for item in run_asgi(self.app, req, extra):
            yield item

    # ---- adapters ----------------------------------------------------------------------------
    async def _take(self, name: str) -> None:
        """Make `name` part of the multiplexed set and registered here, when it is an adapter the
        directory (or --lora-root) has; otherwise the app answers (a 404 naming what exists)."""
        try:
            await self._get_held(name)
            await self._ensure(name)  # also on a cache hit: an unload may have dropped it since
        except Exception as e:  # noqa: BLE001 - the app reports the request's error
            log.info("adapter %r not held on replica %s: %s", name, self.replica_id, e)

    async def _ensure_quietly(self, name: str) -> None:
        try:
            await self._ensure(name)
        except Exception as e:  # noqa: BLE001 - the app reports the request's error
            log.info("adapter %r not registered on replica %s: %s", name, self.replica_id, e)

    async def _hold(self, name: str) -> _Held:
        """serve.multiplexed's loader: only names this replica can serve enter the set."""
        if not await self._ensure(name):
            raise KeyError(f"{name!r} is neither a registered LoRA adapter nor a folder under --lora-root")
        held = _Held(name, self._evicted)
        self._held[name] = held
        return held

    def _evicted(self, held: _Held) -> None:
        # Serve calls __del__ from a worker thread; the set belongs to the event loop
        def drop():
            if self._held.get(held.name) is held:
                del self._held[held.name]
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(drop)

    async def _ensure(self, name: str) -> bool:
        """Register `name` on this engine if the directory has it (or it names a folder under
        --lora-root, which is then recorded in the directory). True: it is servable here."""
        entry = self._entries.get(name)
        if entry is not None and self._applied.get(name) == entry["path"]:
            return True
        fut = self._loading.get(name)
        if fut is None:
            fut = self._loading[name] = asyncio.ensure_future(self._register(name, entry))
            fut.add_done_callback(lambda _: self._loading.pop(name, None))
        return await asyncio.shield(fut)

    async def _register(self, name: str, entry: Optional[dict]) -> bool:
        from multilora.adapters.registry import AdapterConflictError
        if entry is not None:
            try:
                await self.aengine.load_lora_adapter(name, entry["path"], pinned=entry["pinned"])
            except AdapterConflictError:
                pass  # registered already (at start, or by a concurrent load)
            self._applied[name] = entry["path"]
            return True
        if self.cfg.lora_root and name not in self.server.base_names:
            await self.server.resolve_model(name)  # loads a folder under --lora-root on first use
            reg = {a["name"]: a for a in await self.aengine.list_lora_adapters()}
            if name in reg and not reg[name]["unloading"]:
                ok, have = await self.directory.add.remote(name, reg[name]["path"], False)
                if ok:
                    self._applied[name] = reg[name]["path"]
                return True
        return False

    async def _load(self, req: dict, name: str, extra: list) -> dict:
        """/v1/load_lora_adapter: the app validates and registers it here; then the directory
        records it (409 if another load took the name meanwhile)."""
        resp = None
        async for item in run_asgi(self.app, req, extra):
            resp = item
        if resp is None or resp["status"] != 200:
            return resp
        reg = {a["name"]: a for a in await self.aengine.list_lora_adapters()}
        path, pinned = reg[name]["path"], reg[name]["pinned"]
        ok, have = await self.directory.add.remote(name, path, pinned)
        if not ok:
            await self.aengine.unload_lora_adapter(name)
            return {"status": 409, "headers": [(b"content-type", b"application/json")] + extra, "stream": False,
                    "body": error_json(409, f"LoRA adapter {name!r} is already loaded (from {have['path']}); "
                                            "unload it first", "lora_name", "adapter_conflict")}
        self._applied[name] = path
        await self._sync()
        await self._take(name)   # warm here: the router sends its first requests to this replica
        return resp

    async def _sync(self) -> None:
        """Catch up with the directory: unload here what it dropped (or moved)."""
        try:
            version = await self.directory.version.remote()
        except Exception as e:  # noqa: BLE001 - keep serving with what we have
            log.warning("replica %s: the adapter directory is unreachable (%s); serving its last state",
                        self.replica_id, e)
            return
        if version == self._version:
            return
        async with self._sync_lock:
            version, entries = await self.directory.snapshot.remote()
            if version == self._version:
                return
            for name in stale_adapters(self._applied, entries):
                self._applied.pop(name, None)
                self._forget(name)
                try:
                    await self.aengine.unload_lora_adapter(name)
                    log.info("replica %s: unloaded %r (the directory dropped it)", self.replica_id, name)
                except KeyError:
                    pass
            self._entries, self._version = entries, version

    def _forget(self, name: str) -> None:
        """Take an unloaded adapter out of the multiplexed set, so that it stops drawing its
        requests here and frees its place in the LRU. Serve has no public call for this: this
        reaches into serve.multiplexed's cache, and does nothing if that changed (the name then
        ages out of the LRU)."""
        held = self._held.pop(name, None)
        if held is not None:
            held._evicted = True
        cache = getattr(getattr(self._get_held, "__wrapped__", None), "__serve_multiplex_wrapper", None)
        models = getattr(cache, "models", None)
        if isinstance(models, OrderedDict) and models.pop(name, None) is not None:
            cache._push_multiplexed_replica_info = True   # tell the routers at the next push

    def _start_poller(self) -> None:
        """Apply unloads while idle too (every second), not only at the next request."""
        if self._poller is None:
            self._loop = asyncio.get_running_loop()

            async def poll():
                while True:
                    await asyncio.sleep(1.0)
                    await self._sync()

            self._poller = asyncio.ensure_future(poll())

    def __del__(self):
        # Serve calls this once it has let the replica's ongoing requests finish
        # (graceful_shutdown_timeout_s); stopping the engine thread aborts whatever is left.
        poller, self._poller = getattr(self, "_poller", None), None
        if poller is not None:
            poller.cancel()
        if getattr(self, "aengine", None) is not None:
            self.aengine.stop()


# ---- the HTTP endpoint -----------------------------------------------------------------------------
class Ingress:
    """The deployment's HTTP endpoint (a Serve deployment class; see the module docstring)."""

    def __init__(self, replicas, cfg: RayServeConfig):
        self.replicas, self.cfg = replicas, cfg
        self.directory = get_directory(cfg)
        self._info: Optional[dict] = None

    async def __call__(self, request):
        from starlette.responses import Response
        path, method = request.url.path, request.method
        headers = {k.lower(): v for k, v in request.headers.items()}
        if path.rstrip("/") != "/health" and not bearer_ok(headers.get("authorization", ""), self.cfg.api_key):
            return _json(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                         code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None and (not length.strip().isdigit() or int(length) > self.cfg.max_body_bytes):
            if not length.strip().isdigit():
                return _json(400, "Content-Length is not a number")
            return self._too_large()
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.cfg.max_body_bytes:
                return self._too_large()
        req = {"method": method, "path": path, "query_string": request.url.query.encode(),
               "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()],
               "body": body, "client": tuple(request.client) if request.client else None}
        route = path.rstrip("/") or "/"
        try:
            if route == "/v1/models" and method == "GET":
                return await self._models()
            if route == "/v1/load_lora_adapter" and method == "POST":
                return await self._load(req)
            if route == "/v1/unload_lora_adapter" and method == "POST":
                return await self._unload(req)
            model, mix = request_model(body)
            mid = multiplexed_id(model, mix, set((await self._base())["base_names"])) if model else ""
            return await self._forward(req, mid)
        except _Unavailable as e:
            return _json(503, str(e), code="unavailable")
        except Exception as e:  # noqa: BLE001 - every answer is OpenAI error JSON
            if type(e).__name__ == "BackPressureError":  # ray.serve.exceptions: every replica is full
                return _json(503, "the server is overloaded: every replica has max_ongoing_requests "
                                  "requests and Serve's queue is full; retry later", code="queue_full")
            if replica_gone(e):
                return _json(503, f"no replica could take the request: {type(e).__name__}", code="unavailable")
            log.exception("ingress failed on %s", path)
            return Response(error_json(500, f"internal server error: {type(e).__name__}"), 500,
                            media_type="application/json")

    def _too_large(self):
        return _json(413, f"the request body exceeds {self.cfg.max_body_bytes} bytes (max_body_bytes)",
                     code="request_too_large", headers={"Connection": "close"})

    async def _base(self) -> dict:
        """The base model's names (asked of a replica once)."""
        if self._info is None:
            last = None
            for attempt in range(self.cfg.max_attempts):
                try:
                    self._info = await self.replicas.info.remote()
                    break
                except Exception as e:  # noqa: BLE001
                    if not replica_gone(e):
                        raise
                    last = e
                    await asyncio.sleep(0.1 * 2 ** attempt)
            else:
                raise _Unavailable(f"no replica answered: {type(last).__name__}")
        return self._info

    # ---- forwarding --------------------------------------------------------------------------
    async def _forward(self, req: dict, model_id: str, op: str = "http"):
        """Send the request to a replica; again to another when its replica died before it
        started there; a clean 503 (or SSE error event) when it died after."""
        from starlette.responses import Response, StreamingResponse
        routing_id = model_id if self.cfg.route_by_adapter or op == "load" else ""
        req = {**req, "adapter": model_id}
        stream, replica, attempts = await open_on_replica(
            lambda: self.replicas.options(stream=True, multiplexed_model_id=routing_id).forward.remote(req, op),
            self.cfg.max_attempts)
        try:
            head = await stream.__anext__()
        except asyncio.CancelledError:  # the client left: stop the replica's work
            stream.cancel()
            raise
        except StopAsyncIteration:
            return _json(500, "the replica ended the request without a response", code="internal_error")
        except Exception as e:  # noqa: BLE001
            if not replica_gone(e):
                raise
            return _json(503, died_message(replica), code="replica_died",
                         headers={REPLICA_HEADER: replica, ATTEMPTS_HEADER: str(attempts)})
        headers = relayed_headers(head["headers"])
        headers[ATTEMPTS_HEADER] = str(attempts)
        if not head["stream"]:
            return Response(head["body"], head["status"], headers=headers)
        return StreamingResponse(relay_stream(stream, replica), head["status"], headers=headers)

    # ---- the cluster's own routes ------------------------------------------------------------
    async def _models(self):
        from starlette.responses import Response
        info = await self._base()
        try:
            _, entries = await self.directory.snapshot.remote()
        except Exception as e:  # noqa: BLE001
            raise _Unavailable(f"the adapter directory is unreachable: {type(e).__name__}")
        cards = [P.ModelCard(id=info["base_name"], root=info["model_path"], max_model_len=info["max_model_len"])]
        cards += [P.ModelCard(id=n, root=e["path"], parent=info["base_name"], max_model_len=info["max_model_len"])
                  for n, e in sorted(entries.items())]
        return Response(P.ModelList(data=cards).model_dump_json(), media_type="application/json")

    async def _load(self, req: dict):
        parsed = _parse(req["body"], P.LoadLoRAAdapterRequest)
        if not isinstance(parsed, P.LoadLoRAAdapterRequest):
            return parsed
        name = parsed.lora_name
        info = await self._base()
        if name and name not in info["base_names"]:
            try:
                _, entries = await self.directory.snapshot.remote()
            except Exception as e:  # noqa: BLE001
                raise _Unavailable(f"the adapter directory is unreachable: {type(e).__name__}")
            if name in entries:
                return _json(409, f"LoRA adapter {name!r} is already loaded; unload it first", "lora_name",
                             "adapter_conflict")
        # the app on one replica validates (name, path policy, the adapter itself) and registers
        return await self._forward(req, name if name and name not in info["base_names"] else "", op="load")

    async def _unload(self, req: dict):
        from starlette.responses import PlainTextResponse
        parsed = _parse(req["body"], P.UnloadLoRAAdapterRequest)
        if not isinstance(parsed, P.UnloadLoRAAdapterRequest):
            return parsed
        name = parsed.lora_name
        if name in (await self._base())["base_names"]:
            return _json(400, "the base model cannot be unloaded", "lora_name")
        try:
            removed = await self.directory.remove.remote(name)
            _, entries = await self.directory.snapshot.remote()
        except Exception as e:  # noqa: BLE001
            raise _Unavailable(f"the adapter directory is unreachable: {type(e).__name__}")
        if removed is None:
            known = ", ".join(sorted(entries)) or "(none)"
            return _json(404, f"unknown LoRA adapter {name!r}; loaded adapters: {known}", "lora_name",
                         "adapter_not_found")
        log.info("unloaded LoRA adapter %r from every replica", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


class _Unavailable(Exception):
    pass


def died_message(replica: str) -> str:
    return (f"the replica {replica} died while it served this request; the request had started there, "
            "so it was not sent again (it might be what took the replica down): retry it")


async def open_on_replica(call: Callable[[], Any], max_attempts: int,
                          gone: Callable[[BaseException], bool] = None) -> tuple[Any, str, int]:
    """call() -> a response stream whose first item is {"accepted": replica}. Calls again (Serve
    routes to a live replica) while the call fails because its replica died before accepting,
    up to max_attempts calls. Returns (the stream, the replica, the calls made)."""
    gone = gone or replica_gone
    last = None
    for attempt in range(1, max_attempts + 1):
        stream = call()
        try:
            first = await stream.__anext__()
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as e:  # noqa: BLE001
            if not gone(e):
                raise
            last = e
            log.warning("a replica died before it started a request (attempt %d of %d): %s", attempt,
                        max_attempts, type(e).__name__)
            await asyncio.sleep(0.05 * 2 ** (attempt - 1))
            continue
        return stream, first["accepted"], attempt
    raise _Unavailable(f"no replica could take the request: {max_attempts} replicas died before starting it "
                       f"(last: {type(last).__name__})")


async def relay_stream(stream, replica: str, gone: Callable[[BaseException], bool] = None) -> AsyncIterator[bytes]:
    """The body chunks of an event stream; an SSE error event ends it when its replica dies."""
    gone = gone or replica_gone
    done = False
    try:
        async for item in stream:
            yield item["body"]
        done = True
    except Exception as e:  # noqa: BLE001
        done = True
        if gone(e):
            yield sse_error(503, died_message(replica), "replica_died")
        else:
            log.exception("relaying a stream from replica %s failed", replica)
            yield sse_error(500, f"internal server error: {type(e).__name__}", "internal_error")
    finally:
        if not done:  # the client left: stop the replica's work
            stream.cancel()


def _json(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
          headers: Optional[dict] = None):
    from starlette.responses import Response
    return Response(error_json(status, message, param, code), status, headers=headers,
                    media_type="application/json")


def _parse(body: bytes, model):
    """The body as `model`, or the 400 response the single-node server gives for it."""
    from multilora.server.errors import APIError, parse_json_body
    try:
        return parse_json_body(body, model)
    except APIError as e:
        return _json(e.status, e.message, e.param, e.code)


# ---- the application -------------------------------------------------------------------------------
def build_application(cfg: RayServeConfig):
    """The Serve application (ingress + R replicas); creates the adapter directory actor. Call
    after ray.init()."""
    from ray import serve
    create_directory(cfg)
    replica = serve.deployment(
        EngineReplica, name="EngineReplica", num_replicas=cfg.num_replicas,
        max_ongoing_requests=cfg.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.replica_cpus, "num_gpus": cfg.replica_gpus},
        health_check_period_s=cfg.health_check_period_s, graceful_shutdown_timeout_s=cfg.drain_timeout)
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=max(1000, cfg.num_replicas * cfg.max_ongoing_requests * 2))
    return ingress.bind(replica.bind(cfg), cfg)


def config_from_args(args) -> RayServeConfig:
    """RayServeConfig from `multilora serve-ray`'s parsed flags."""
    from multilora.args import engine_kwargs
    from multilora.server.app import with_demo_adapters
    args = with_demo_adapters(args)
    if args.lora_root and not os.path.isdir(args.lora_root):
        raise SystemExit(f"--lora-root {args.lora_root!r} is not a folder")
    kw = engine_kwargs(args)
    if kw.pop("distributed", None):
        raise SystemExit("serve-ray runs one engine per replica: --coordinator-address/--num-processes "
                         "do not apply")
    if kw["model"] is None:  # fetched and converted once, here, not by R replicas at once
        from multilora.default_model import default_model_dir
        kw["model"] = str(default_model_dir())
    kw["model"] = os.path.abspath(kw["model"])
    kw["lora_modules"] = {n: os.path.abspath(p) for n, p in kw["lora_modules"].items()}
    try:
        return RayServeConfig(
            engine_kwargs=kw, num_replicas=args.num_replicas, max_adapters_per_replica=args.max_adapters_per_replica,
            max_ongoing_requests=args.max_ongoing_requests, replica_cpus=args.replica_cpus,
            replica_gpus=args.replica_gpus,
            api_key=args.api_key or os.environ.get("MULTILORA_API_KEY") or None, lora_root=args.lora_root,
            allow_any_lora_path=args.allow_any_lora_path, max_body_bytes=args.max_body_bytes,
            max_queue=args.max_queue, drain_timeout=args.drain_timeout, app_name=args.app_name)
    except ValueError as e:
        raise SystemExit(str(e))


def add_ray_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`multilora serve-ray`: the flags of `multilora serve`, then the replicas'."""
    from multilora.server.app import add_serve_args
    add_serve_args(parser)
    g = parser.add_argument_group("Ray Serve replicas (see docs/ray.md)")
    g.add_argument("--num-replicas", type=int, default=2, help="engines serving behind the endpoint")
    g.add_argument("--max-adapters-per-replica", type=int, default=8,
                   help="adapters each replica advertises to the router (serve.multiplexed's LRU): an "
                        "adapter's requests go to a replica that holds it")
    g.add_argument("--max-ongoing-requests", type=int, default=64,
                   help="requests a replica takes at once; more wait in Serve's router")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs each replica reserves")
    g.add_argument("--replica-gpus", type=float, default=0.0,
                   help="Ray GPUs each replica reserves (Ray gives it those devices only)")
    g.add_argument("--address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS, else start a local one)")
    g.add_argument("--app-name", default="multilora", help="the Serve application's name")
    return parser


def run_serve_ray(args) -> int:
    """`multilora serve-ray`: deploy on Ray Serve and serve until SIGINT/SIGTERM."""
    import signal
    import threading

    try:
        import ray
        from ray import serve
    except ImportError:
        raise SystemExit("serve-ray needs Ray Serve: pip install 'multilora[ray]'") from None
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    cfg = config_from_args(args)
    ray.init(address=args.address, include_dashboard=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 p for p in [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             os.environ.get("PYTHONPATH", "")] if p)}})
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_application(cfg), name=cfg.app_name, route_prefix="/")
    print(f"multilora: {cfg.num_replicas} replicas serving on http://{args.host}:{args.port}/v1", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete(cfg.app_name)
    try:
        ray.kill(ray.get_actor(cfg.directory_name, namespace=DIRECTORY_NAMESPACE))
    except ValueError:
        pass
    serve.shutdown()
    return 0


def build(args: dict):
    """`serve run multilora.server.ray_serve:build model=DIR num-replicas=2 lora-modules="a=DIR b=DIR"`:
    the application from serve-ray's flags as key=value pairs (a flag without a value: "true")."""
    argv = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if str(value).lower() == "true":
            argv.append(flag)
        elif flag == "--lora-modules":
            argv += [flag, *str(value).split()]
        else:
            argv += [flag, str(value)]
    parsed = add_ray_serve_args(argparse.ArgumentParser(prog="multilora.server.ray_serve:build")).parse_args(argv)
    return build_application(config_from_args(parsed))
