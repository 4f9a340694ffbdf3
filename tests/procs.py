"""Helpers for tests that start multilora in subprocesses: a free local port, and the
environment a child process runs in (CPU JAX, the checkout importable, no inherited XLA flags)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict:
    """os.environ for a child: CPU JAX, passive OpenMP waits, the checkout on PYTHONPATH, unbuffered
    output, and no XLA_FLAGS (a parent's fake device count would change the child's devices)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(ROOT),
               PYTHONUNBUFFERED="1", **extra)
    env.pop("XLA_FLAGS", None)
    return env
