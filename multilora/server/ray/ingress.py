"""The ingress (the HTTP endpoint) and the Serve application: the API key and body size checked,
the cluster's routes answered here (models, load, unload through the directory), everything else
forwarded to a replica by adapter, with retries for requests that never started."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable, Optional

from multilora.server import protocol as P
from multilora.server.ray.config import (ATTEMPTS_HEADER, REPLICA_HEADER, RayServeConfig, bearer_ok, error_json,
                                         multiplexed_id, relayed_headers, replica_gone, request_model, sse_error)
from multilora.server.ray.directory import create_directory, get_directory
from multilora.server.ray.replica import EngineReplica

log = logging.getLogger("multilora.server.ray")

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
        except NoReplicaError as e:
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
                raise NoReplicaError(f"no replica answered: {type(last).__name__}")
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
            raise NoReplicaError(f"the adapter directory is unreachable: {type(e).__name__}")
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
                raise NoReplicaError(f"the adapter directory is unreachable: {type(e).__name__}")
            if name in entries and not parsed.load_inplace:
                return _json(409, f"LoRA adapter {name!r} is already loaded; unload it first, or load it "
                                  "with load_inplace", "lora_name", "adapter_conflict")
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
            raise NoReplicaError(f"the adapter directory is unreachable: {type(e).__name__}")
        if removed is None:
            known = ", ".join(sorted(entries)) or "(none)"
            return _json(404, f"unknown LoRA adapter {name!r}; loaded adapters: {known}", "lora_name",
                         "adapter_not_found")
        log.info("unloaded LoRA adapter %r from every replica", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


class NoReplicaError(Exception):
    """No replica could take the request (HTTP 503)."""


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
    raise NoReplicaError(f"no replica could take the request: {max_attempts} replicas died before starting it "
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
