"""One data-parallel replica: an Engine, its AsyncEngine and the single-node FastAPI app, run in
process; forwarded HTTP requests go through that ASGI app (run_asgi)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from typing import AsyncIterator, Callable, Optional

from multilora.server.ray.config import (HELD_HEADER, REPLICA_HEADER, WARM_HEADER, RayServeConfig, encode_names,
                                         entry_key, error_json, is_event_stream, mix_parts, stale_adapters)
from multilora.server.ray.directory import get_directory

log = logging.getLogger("multilora.server.ray")

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
                             drain_timeout=cfg.drain_timeout, tool_call_parser=cfg.tool_call_parser,
                             reasoning_parser=cfg.reasoning_parser, served_model_names=cfg.served_model_names,
                             chat_template=cfg.chat_template, generation_config=cfg.generation_config)
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

    def check_health(self) -> None:
        """Serve's health check (every health_check_period_s): a replica whose engine thread has
        died (docs/server.md, "Errors") would answer every request with a 503, so it reports
        itself unhealthy and Serve replaces it."""
        if not self.aengine.is_alive:
            raise RuntimeError(f"replica {self.replica_id}: {self.aengine.not_running_reason}")

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
        if entry is not None and self._applied.get(name) == entry_key(entry):
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
            self._applied[name] = entry_key(entry)
            return True
        if self.cfg.lora_root and name not in self.server.base_names:
            await self.server.resolve_model(name)  # loads a folder under --lora-root on first use
            reg = {a["name"]: a for a in await self.aengine.list_lora_adapters()}
            if name in reg and not reg[name]["unloading"]:
                ok, have = await self.directory.add.remote(name, reg[name]["path"], False)
                if ok:
                    self._applied[name] = entry_key({"path": reg[name]["path"]})
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
        if _asks_in_place(req):   # the other replicas load the new weights in place at their next sync
            self._applied[name] = entry_key(await self.directory.replace.remote(name, path, pinned))
            await self._sync()
            await self._take(name)
            return resp
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
                if name in entries:   # loaded in place elsewhere: the new weights in place here too
                    await self._reload_in_place(name, entries[name])
                    continue
                self._applied.pop(name, None)
                self._forget(name)
                try:
                    await self.aengine.unload_lora_adapter(name)
                    log.info("replica %s: unloaded %r (the directory dropped it)", self.replica_id, name)
                except KeyError:
                    pass
            self._entries, self._version = entries, version

    async def _reload_in_place(self, name: str, entry: dict) -> None:
        """Another replica loaded `name` in place: load the entry's weights in place here
        (requests already added finish on the old ones, as on the replica that took the call)."""
        try:
            await self.aengine.load_lora_adapter(name, entry["path"], pinned=entry["pinned"], load_inplace=True)
            self._applied[name] = entry_key(entry)
            log.info("replica %s: %r loaded in place (rev %d)", self.replica_id, name, entry.get("rev", 0))
        except Exception as e:  # noqa: BLE001 - unload rather than serve stale weights
            log.warning("replica %s: %r could not be loaded in place (%s); unloading it", self.replica_id, name, e)
            self._applied.pop(name, None)
            self._forget(name)
            try:
                await self.aengine.unload_lora_adapter(name)
            except KeyError:
                pass

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


def _asks_in_place(req: dict) -> bool:
    """Whether a /v1/load_lora_adapter body asks for load_inplace (the app has validated it)."""
    import json
    try:
        return bool(json.loads(req["body"] or b"{}").get("load_inplace", False))
    except (ValueError, AttributeError):
        return False
