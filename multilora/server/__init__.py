"""The OpenAI-compatible HTTP server: protocol (schemas), async_engine (the engine's thread),
metrics (Prometheus text), app (FastAPI routes), ray (replicas on Ray Serve). The command lines
(`multilora serve`, `serve-ray`) are multilora.cli's. See docs/server.md."""

from __future__ import annotations


def __getattr__(name):
    # Lazy, like the package root: importing multilora.server stays light until used.
    if name in ("build_app", "serve"):
        from multilora.server import app
        return getattr(app, name)
    if name in ("AsyncEngine", "QueueFullError", "EngineStoppedError"):
        from multilora.server import async_engine
        return getattr(async_engine, name)
    raise AttributeError(name)


__all__ = ["AsyncEngine", "EngineStoppedError", "QueueFullError", "build_app", "serve"]
