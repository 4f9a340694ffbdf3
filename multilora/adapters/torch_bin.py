"""A PyTorch checkpoint (`adapter_model.bin`, what PEFT wrote before safetensors) read without
torch, as the bytes of the safetensors file that holds the same tensors: the adapter's loader
then reads it as it reads any safetensors file.

    data = bin_as_safetensors(path)   # bytes in safetensors' format; ValueError if not readable

torch.save's format (since torch 1.6): a zip archive of `<name>/data.pkl`, a pickle of the
state dict whose tensors are `torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
...)` calls over storages named by persistent ids `("storage", torch.FloatStorage, key, device,
numel)`, each storage's little-endian bytes in `<name>/data/<key>`. The pickle is read by an
unpickler that resolves only those names (a dict, an OrderedDict, the rebuild functions and the
float storage classes): anything else, code above all, is refused, not run. The older non-zip
format (torch < 1.6) is refused by name.
"""

from __future__ import annotations

import collections
import io
import json
import math
import pickle
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

# torch's storage classes -> (numpy dtype, safetensors' dtype name)
_STORAGES = {"FloatStorage": (np.dtype("<f4"), "F32"), "HalfStorage": (np.dtype("<f2"), "F16"),
             "BFloat16Storage": (np.dtype(ml_dtypes.bfloat16), "BF16"), "DoubleStorage": (np.dtype("<f8"), "F64")}


class _Storage:
    def __init__(self, kind: str, key: str):
        self.kind, self.key = kind, key


class _StorageClass:
    """What `torch.FloatStorage` (and the others) resolve to: only its name is used."""

    def __init__(self, kind: str):
        self.kind = kind


class _Tensor:
    def __init__(self, storage: _Storage, offset: int, size: tuple, stride: tuple):
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)


def _rebuild_tensor(storage, storage_offset, size, stride, *_):
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor without a storage")
    return _Tensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, *_):
    """An nn.Parameter is its tensor here."""
    return data


class _Unpickler(pickle.Unpickler):
    _ALLOWED = {("collections", "OrderedDict"): collections.OrderedDict,
                ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
                ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
                ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
                ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter}

    def find_class(self, module, name):
        if module == "torch" and name in _STORAGES:
            return _StorageClass(name)
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"{module}.{name} is not a tensor or a float storage: refused") from None

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage"
                and isinstance(pid[1], _StorageClass)):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return _Storage(pid[1].kind, str(pid[2]))


def read_bin(path: str | Path) -> dict[str, np.ndarray]:
    """The tensors of a torch.save'd state dict (float32/16, bfloat16, float64), as numpy arrays.
    Raises ValueError naming what is wrong."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise ValueError("not a zip archive: torch.save's format before torch 1.6 is not read "
                         "(save it again with a newer torch, or as safetensors)") from None
    with archive:
        names = archive.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise ValueError("no data.pkl in the archive: not a torch.save'd file")
        prefix = pkl[0][: -len("data.pkl")]
        if prefix + "byteorder" in names and archive.read(prefix + "byteorder").strip() != b"little":
            raise ValueError("a big-endian checkpoint is not read")
        try:
            state = _Unpickler(io.BytesIO(archive.read(pkl[0]))).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
            raise ValueError(f"its pickle is not a plain state dict of tensors ({e})") from None
        if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, _Tensor)
                                                  for k, v in state.items()):
            raise ValueError("its pickle is not a dict of named tensors")
        buffers: dict[str, np.ndarray] = {}
        out = {}
        for name, t in state.items():
            dtype = _STORAGES[t.storage.kind][0]
            key = t.storage.key
            if key not in buffers:
                try:
                    buffers[key] = np.frombuffer(archive.read(f"{prefix}data/{key}"), dtype)
                except KeyError:
                    raise ValueError(f"tensor {name!r}: its storage {key!r} is missing") from None
            flat = buffers[key]
            if flat.dtype != dtype:
                raise ValueError(f"tensor {name!r}: storage {key!r} is read as two dtypes")
            need = t.offset + sum((n - 1) * s for n, s in zip(t.size, t.stride)) + 1 if math.prod(t.size) else 0
            if t.offset < 0 or any(s < 0 for s in t.stride) or need > flat.size:
                raise ValueError(f"tensor {name!r}: size {t.size} stride {t.stride} at {t.offset} is "
                                 f"outside its storage of {flat.size}")
            view = np.lib.stride_tricks.as_strided(flat[t.offset:], t.size,
                                                   tuple(s * dtype.itemsize for s in t.stride), writeable=False)
            out[name] = np.ascontiguousarray(view)
    return out


def safetensors_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    """The bytes of a safetensors file of these tensors (header padded to 8 bytes, as the format's own writer)."""
    names = {dt: n for dt, n in _STORAGES.values()}
    header, offset = {}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(a.tobytes() for a in tensors.values())


def bin_as_safetensors(path: str | Path) -> bytes:
    """read_bin's tensors as a safetensors file's bytes."""
    return safetensors_bytes(read_bin(path))
