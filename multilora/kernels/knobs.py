"""The Pallas kernels' measurement knobs: environment variables that force a block size for a
benchmark (benchmarks/tpu_steps.sh sweeps them). Unset, empty or 0: the kernel's own choice."""

from __future__ import annotations

import os
from typing import Optional


def positive_int_knob(name: str) -> Optional[int]:
    """$name as a positive integer, or None where it is unset, empty or 0. Anything else is an
    error that names the variable, its value and what is allowed (read at trace time, so a typo
    stops the first compile instead of sizing a kernel by it)."""
    raw = os.environ.get(name, "").strip()
    if raw in ("", "0"):
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 1:
        raise ValueError(f"${name}={raw!r}: expected a positive integer (or unset, empty or 0 for the kernel's own choice)")
    return value


def switch_knob(name: str, default: bool = False) -> bool:
    """$name as a switch: "1" on, "0" off, unset or empty the default; anything else is an error
    that names the variable, its value and what is allowed."""
    raw = os.environ.get(name, "").strip()
    if raw == "":
        return default
    if raw not in ("0", "1"):
        raise ValueError(f"${name}={raw!r}: expected 0 or 1")
    return raw == "1"
