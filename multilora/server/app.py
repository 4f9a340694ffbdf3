"""The OpenAI-compatible HTTP server: the FastAPI app over an AsyncEngine (its routers are
multilora.server.routes), the API-key and body-size guards, OpenAI's error JSON for every error,
and serve() (uvicorn; `multilora serve` is multilora.cli.serve). What the routes share (model
resolution, sampling fields, submit and collect) is in multilora.server.service, OpenAI's error
JSON in multilora.server.errors, the SSE streams in multilora.server.streaming and the OpenAPI
document in multilora.server.openapi.

Routes: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming), GET /v1/models,
POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter, POST /v1/tokenize, POST /v1/detokenize
(vLLM's), GET /health, GET /metrics. A request picks an adapter by naming it in `model` (vLLM's
convention); the base model answers to its folder name or its path. See docs/server.md.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from typing import Optional, Sequence

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from multilora.server import openapi, routes
from multilora.server.async_engine import AsyncEngine
from multilora.server.errors import APIError, error_response
from multilora.server.service import Server

log = logging.getLogger("multilora.server")

DEFAULT_MAX_BODY_BYTES = 4 * 2**20


class _BodyTooLarge(Exception):
    pass


class _Guard:
    def __init__(self, app, api_key: Optional[str], max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key and scope["path"].rstrip("/") != "/health":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                resp = error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                return await error_response(400, "Content-Length is not a number")(scope, receive, send)
            if int(length) > self.max_body_bytes:
                return await self._too_large(scope, receive, send)
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge()
            return msg

        async def tracking_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if started:
                raise
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope, receive, send):
        resp = error_response(413, f"the request body exceeds {self.max_body_bytes} bytes (max_body_bytes)",
                              code="request_too_large", headers={"Connection": "close"})
        await resp(scope, receive, send)


# ---- helpers -------------------------------------------------------------------------------------
def build_app(async_engine: AsyncEngine, api_key: Optional[str] = None, lora_root: Optional[str] = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allow_any_lora_path: bool = False,
              drain_timeout: float = 30.0, tool_call_parser: str = "auto",
              reasoning_parser: Optional[str] = None,
              served_model_names: Optional[Sequence[str]] = None, chat_template: Optional[str] = None,
              generation_config: str = "auto") -> FastAPI:
    """The FastAPI app. Its lifespan starts the engine thread and, at shutdown, lets running
    requests finish (up to drain_timeout seconds) before stopping it. tool_call_parser and
    reasoning_parser: --tool-call-parser and --reasoning-parser (docs/server.md); served_model_names:
    --served-model-name (the base model's names; default: its folder's name and path); chat_template:
    --chat-template's text (in place of the model's own; an adapter's own still wins for its requests);
    generation_config: --generation-config (the defaults of a request's unset sampling fields)."""
    srv = Server(async_engine, lora_root, allow_any_lora_path, tool_call_parser, reasoning_parser,
                 served_model_names, chat_template, generation_config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async_engine.start()
        yield
        await async_engine.shutdown(drain_timeout)

    app = FastAPI(title="multilora", version="0.1.0", lifespan=lifespan)
    app.state.server = srv
    app.state.async_engine = async_engine
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        return error_response(400, f"invalid request: {'.'.join(loc) or 'body'}: {first.get('msg', '')}",
                              loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal server error: {type(e).__name__}")

    for router in (routes.generation, routes.tokenizer, routes.adapters, routes.operations):
        app.include_router(router)
    openapi.install(app)
    return app


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
          log_level: str = "info") -> None:
    """Run uvicorn until SIGTERM/SIGINT; then running requests finish (up to drain_timeout)."""
    import uvicorn

    class _UvicornServer(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started and self.servers:
                h, p = self.servers[0].sockets[0].getsockname()[:2]
                h = f"[{h}]" if ":" in h else h
                print(f"multilora: serving on http://{h}:{p}/v1", flush=True)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=drain_timeout, access_log=False)
    server = _UvicornServer(config)
    # for the engine side (any thread): stop as SIGTERM would, without a signal that uvicorn
    # re-raises at its exit
    app.state.stop_server = lambda: setattr(server, "should_exit", True)
    server.run()
