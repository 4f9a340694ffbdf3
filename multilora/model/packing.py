"""A step's host arrays in one transfer: every 4-byte leaf of a pytree of numpy arrays packed
into one int32 buffer on the host (`pack`), and taken apart again inside the jitted step
(`unpack`) by static slices.

A Batch with its LoRABatchInfo has ~18 small arrays; passed as they are, each is its own
host -> device copy on every step, and on a TPU each copy has a fixed latency the step waits
for. Packed, a step makes one. Float32 leaves travel as their bits (a bitcast each way), so the
values are exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_WORD = np.dtype(np.int32)


@dataclasses.dataclass(frozen=True)
class PackSpec:
    """What `unpack` needs, all static (hashable: a jit static argument and a compile key):
    the tree's structure and each leaf's dtype name, shape and offset in the buffer."""

    treedef: Any
    leaves: tuple[tuple[str, tuple[int, ...], int], ...]
    size: int


def pack(tree) -> tuple[PackSpec, np.ndarray]:
    """A pytree of numpy arrays (or scalars) of 4-byte dtypes -> (its spec, one int32 buffer)."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [np.asarray(a) for a in leaves]
    metas, off = [], 0
    for a in arrays:
        if a.dtype.itemsize != 4:
            raise TypeError(f"pack takes 4-byte dtypes (int32, uint32, float32), not {a.dtype}")
        metas.append((a.dtype.name, a.shape, off))
        off += a.size
    buf = np.empty(off, _WORD)
    for a, (_, _, o) in zip(arrays, metas):
        buf[o:o + a.size] = a.reshape(-1).view(_WORD)
    return PackSpec(treedef, tuple(metas), off), buf


def unpack(spec: PackSpec, buf: jax.Array):
    """Inside jit: the buffer made by `pack` -> the pytree it came from (device arrays)."""
    out = []
    for dtype, shape, off in spec.leaves:
        n = int(np.prod(shape, dtype=np.int64))
        a = jax.lax.slice(buf, (off,), (off + n,)).reshape(shape)
        if dtype != _WORD.name:
            a = jax.lax.bitcast_convert_type(a, jnp.dtype(dtype))
        out.append(a)
    return jax.tree.unflatten(spec.treedef, out)


def abstract_buffer(spec: PackSpec, sharding=None) -> jax.ShapeDtypeStruct:
    """The buffer's shape, for lowering a step before any batch exists."""
    return jax.ShapeDtypeStruct((spec.size,), _WORD, sharding=sharding)
