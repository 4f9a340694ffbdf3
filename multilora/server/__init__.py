"""The OpenAI-compatible HTTP server: protocol (schemas), async_engine (the engine's thread),
metrics (Prometheus text), app (FastAPI routes, `multilora serve`). See docs/server.md."""

from __future__ import annotations


def __getattr__(name):
    # Lazy, like the package root: importing multilora.server stays light until used.
    if name in ("build_app", "run_serve", "add_serve_args", "serve"):
        from multilora.server import app
        return getattr(app, name)
    if name in ("AsyncEngine", "QueueFullError", "EngineStoppedError"):
        from multilora.server import async_engine
        return getattr(async_engine, name)
    raise AttributeError(name)


__all__ = ["AsyncEngine", "EngineStoppedError", "QueueFullError", "add_serve_args", "build_app",
           "run_serve", "serve"]
