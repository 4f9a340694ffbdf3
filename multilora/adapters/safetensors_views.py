"""A safetensors file read whole in one call, its tensors as numpy views into that one buffer.

An adapter is read on a background thread beside decoding streams; reading it tensor by tensor
(safetensors' get_tensor, hundreds of calls for one adapter) holds the GIL for most of the read,
and a low-priority thread that holds the GIL stalls the engine's thread. Here the file is read
with one call (the GIL is released during it), the header is parsed and checked, and each tensor
is a view: no per-tensor copy.

    tensors = read_views(path)      # {name: read-only np.ndarray}; ValueError or OSError if bad
    tensors = read_views(path, scratch)  # the same, read into a reused buffer (Scratch)
    data, entries, header = read_tensors(path, scratch)  # the bytes, and where each tensor lies
    header = read_header(path)      # {name: (dtype name, shape)}, reading the header alone

Format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N, N
bytes of JSON {name: {dtype, shape, data_offsets: [start, end]}, "__metadata__": {...}}, then the
data, offsets relative to its start.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from pathlib import Path
from typing import Optional

import ml_dtypes
import numpy as np

from multilora.adapters.pacing import checkpoint

DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "BF16": np.dtype(ml_dtypes.bfloat16)}
_MAX_HEADER = 100 << 20   # safetensors' own bound on the header
_CHUNK = 4 << 20          # bytes read between two checkpoints (multilora.adapters.pacing)


def _entries(header_bytes: bytes, data_size: int) -> dict[str, tuple[np.dtype, tuple[int, ...], int]]:
    """The header's tensors, checked against a data section of data_size bytes:
    name -> (dtype, shape, start offset). Raises ValueError naming what is wrong."""
    try:
        header = json.loads(header_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise ValueError(f"tensor {key!r}: header entry is not an object")
        dtype = DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ValueError(f"tensor {key!r}: dtype {info.get('dtype')!r} is not one of {', '.join(DTYPES)}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"tensor {key!r}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_size):
            raise ValueError(f"tensor {key!r}: data_offsets {offsets!r} are outside the file's "
                             f"{data_size} data bytes (a truncated file?)")
        if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {key!r}: {offsets[1] - offsets[0]} bytes do not hold "
                             f"{dtype.name} {tuple(shape)}")
        out[key] = (dtype, tuple(shape), offsets[0])
    return out


def _header_length(prefix: bytes, file_size: int) -> int:
    if file_size < 8:
        raise ValueError(f"a file of {file_size} bytes is too short to be safetensors")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > min(_MAX_HEADER, file_size - 8):
        raise ValueError(f"header length {n} does not fit a file of {file_size} bytes")
    return n


def read_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors a safetensors file holds, name -> (dtype name, shape), from its header alone
    (checked as read_views checks it, against the file's size)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = _header_length(f.read(8), size)
        entries = _entries(f.read(n), size - 8 - n)
    return {k: (str(dtype), shape) for k, (dtype, shape, _) in entries.items()}


class Scratch:
    """A read buffer reused across reads (keep one per thread): a fresh buffer of an adapter's
    size costs more in page faults than reading the file. A buffer still viewed (arrays of the
    last read alive) is never written again: a new one is taken."""

    def __init__(self):
        self._buf = bytearray()

    def take(self, size: int) -> memoryview:
        buf = self._buf
        try:
            buf.append(0)  # raises BufferError while any view of it is alive
            buf.pop()
        except BufferError:
            buf = bytearray()
        if len(buf) < size:
            buf = bytearray(size)
        self._buf = buf
        return memoryview(buf)[:size]


_LAYOUTS: dict[tuple[bytes, int], dict] = {}  # (header bytes, data size) -> checked entries
_LAYOUTS_MAX = 32
_layouts_lock = threading.Lock()


def _entries_cached(header_bytes: bytes, data_size: int) -> dict[str, tuple[np.dtype, tuple[int, ...], int]]:
    """_entries, remembered for the last few distinct headers: adapters trained alike (one base,
    one config) share a header byte for byte, and parsing and checking one of hundreds of tensors
    costs about a millisecond. The dict returned is shared: read it, never change it."""
    key = (header_bytes, data_size)
    got = _LAYOUTS.get(key)
    if got is None:
        got = _entries(header_bytes, data_size)  # raises for a bad header: nothing remembered
        with _layouts_lock:
            if len(_LAYOUTS) >= _LAYOUTS_MAX:
                _LAYOUTS.pop(next(iter(_LAYOUTS)))
            _LAYOUTS[key] = got
    return got


def read_tensors(path: str | Path, scratch: Optional[Scratch] = None
                 ) -> tuple[memoryview, dict[str, tuple[np.dtype, tuple[int, ...], int]], bytes]:
    """A safetensors file read with one call: (its bytes, read-only; its checked entries, name ->
    (dtype, shape, byte offset into those bytes); its header's bytes, which identify its layout).
    The entries are shared between reads of files with the same header: never change them.
    Raises ValueError naming what is wrong (as read_views). scratch: read into its buffer."""
    if scratch is None:
        data = memoryview(Path(path).read_bytes())
    else:
        with open(path, "rb") as f:
            buf = scratch.take(os.fstat(f.fileno()).st_size)
            got = 0
            while got < len(buf):  # in chunks: a paced read pauses between them
                checkpoint()
                n = f.readinto(buf[got:got + _CHUNK])
                if not n:
                    break
                got += n
        data = buf[:got].toreadonly()
    return parse_tensors(data)


def parse_tensors(data: memoryview) -> tuple[memoryview, dict[str, tuple[np.dtype, tuple[int, ...], int]], bytes]:
    """read_tensors' result for a safetensors file's bytes already in memory."""
    n = _header_length(data, len(data))
    header = bytes(data[8:8 + n])
    entries = _entries_cached(header, len(data) - 8 - n)
    return data, entries, header


def views(data: memoryview, entries: dict, keys=None) -> dict[str, np.ndarray]:
    """The tensors `keys` (default: all) of read_tensors' result as read-only numpy views into data."""
    n = _header_length(data, len(data))
    base = 8 + n
    return {k: np.frombuffer(data, entries[k][0], count=math.prod(entries[k][1]), offset=base + entries[k][2]
                             ).reshape(entries[k][1])
            for k in (entries if keys is None else keys)}


def read_views(path: str | Path, scratch: Optional[Scratch] = None) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file, read with one call, as read-only views into that one
    buffer. Raises ValueError naming what is wrong (a truncated file, a bad header, a tensor
    whose bytes do not match its shape, a dtype other than the floating ones in DTYPES).
    scratch: read into its buffer (the views then alias it until they are dropped)."""
    data, entries, _ = read_tensors(path, scratch)
    return views(data, entries)
