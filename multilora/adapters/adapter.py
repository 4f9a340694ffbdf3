"""Read and validate a PEFT LoRA adapter folder -> host arrays per module, stacked over layers.

Each module's per-layer scaling (alpha / r, or alpha / sqrt(r) with rsLoRA; rank_pattern and
alpha_pattern respected) is split as: the adapter's default scaling, applied per slot by the
backend, times a per-module ratio folded into B here (1.0 unless a pattern changes it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import struct
import sys
import threading
from pathlib import Path
from typing import Any, Optional

import ml_dtypes  # bfloat16 for numpy: bf16 adapter files and host copies
import numpy as np

from multilora.config import (ALL_LORA_MODULES, EXPERT_LORA_MODULES, LORA_MODULES, ROUTER_LORA_MODULE, LoRAType,
                              ModelConfig)
from multilora.adapters.adapter_config import check_config, is_router_parameter, pattern_value, read_config
from multilora.adapters.errors import AdapterError  # noqa: F401  (callers import it from here)
from multilora.adapters.pacing import checkpoint
from multilora.adapters.per_expert import PER_EXPERT_RE, Fused, fuse, plan as per_expert_plan
from multilora.adapters.safetensors_views import Scratch, parse_tensors, read_header, read_tensors, views
from multilora.adapters.torch_bin import bin_as_safetensors

_KEY_RE = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.(?:[\w-]+\.)?weight$")
# PEFT's LoRA on a Qwen3-MoE layer's experts (target_parameters on transformers 5's fused
# gate_up_proj and down_proj): one ParamWrapper per parameter, nested (the inner one under
# base_layer), each lora_A (r * E, in), lora_B (out, r * E); which parameter a wrapper adapts is
# told by its shapes (experts.gate_up_proj: D -> 2M, experts.down_proj: M -> D, never both).
_EXPERT_KEY_RE = re.compile(r"layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)\.lora_([AB])\.(?:[\w-]+\.)?weight$")
_HASH_CHUNK = 1 << 20  # bytes hashed between two checkpoints (multilora.adapters.pacing)
_BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclasses.dataclass
class LoRAAdapter:
    """Host copy of one adapter, in the dtype of the device pool it is written to (float32: the
    exact path; bfloat16: half the bytes to read, hash, keep and write, and the values the pool
    would hold anyway). a_LRI / b_LOR are zero for layers the adapter does not touch."""

    name: str
    path: str
    rank: int                      # the largest rank over its modules
    scaling: float                 # default scaling, applied per slot
    modules: dict[str, tuple[np.ndarray, np.ndarray]]  # module -> (a_LRI, b_LOR)
    # (table width, LoRAWeights of host arrays): the rows laid out for a slot write ahead of it,
    # by a loader thread (multilora.adapters.pool.prepare_slot_layout), until the write takes them
    slot_layout: Optional[tuple[int, Any]] = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(m for m in ALL_LORA_MODULES if m in self.modules)

    @property
    def content_hash(self) -> bytes:
        """A hash of what the adapter computes (every module's A and B, its rank and scaling),
        never of its name or path: the root of its requests' prefix-cache keys, so a name
        reloaded with other weights never reuses stale pages."""
        cached = self.__dict__.get("_content_hash")
        if cached is None:
            h = hashlib.sha256(b"multilora:lora:v1")
            h.update(struct.pack("<qd", self.rank, self.scaling))
            for m in sorted(self.modules):
                a, b = self.modules[m]
                h.update(m.encode() + b"\0")
                for arr in (a, b):
                    arr = np.ascontiguousarray(arr)
                    h.update(str((arr.dtype.str, arr.shape)).encode())
                    flat = arr.reshape(-1).view(np.uint8)
                    for i in range(0, flat.size, _HASH_CHUNK):  # a paced read pauses between chunks
                        checkpoint()
                        h.update(flat[i:i + _HASH_CHUNK])
            cached = self.__dict__["_content_hash"] = h.digest()
        return cached

    @property
    def nbytes(self) -> int:
        """Host memory the copy holds: its modules, and a slot layout prepared for its write
        (multilora.adapters.pool.prepare_slot_layout) while it waits to be taken."""
        held = sum(a.nbytes + b.nbytes for a, b in self.modules.values())
        if self.slot_layout is not None:
            rows = self.slot_layout[1]
            arrays = (getattr(rows, f.name) for f in dataclasses.fields(rows))
            held += sum(int(x.nbytes) for x in arrays if x is not None)
        return held


@dataclasses.dataclass(frozen=True)
class AdapterProbe:
    """What an adapter folder's config and safetensors header say, read without its weights:
    enough to register it (its rank, its size), with its data read on first use."""

    name: str
    path: str
    rank: int
    nbytes: int          # of its host copy once read (in the pool's dtype, stacked over layers)
    fingerprint: bytes   # of the folder as found (config, file size and time): stands in for the
                         # content hash until the weights are read


def _weights_file(name: str, folder: Path) -> Path:
    """adapter_model.safetensors, else the adapter_model.bin older PEFT wrote (torch_bin reads it)."""
    for weights_file in (folder / "adapter_model.safetensors", folder / "adapter_model.bin"):
        if weights_file.is_file():
            return weights_file
    raise AdapterError(name, f"no adapter_model.safetensors (nor adapter_model.bin) in {str(folder)!r}")


def _tensors_of(weights_file: Path, scratch: Optional[Scratch] = None):
    """read_tensors' (bytes, entries, header) of the weights file; a .bin as the safetensors file
    of its tensors (converted in memory, once a read: the loader's paths are the same after)."""
    if weights_file.suffix == ".bin":
        return parse_tensors(memoryview(bin_as_safetensors(weights_file)).toreadonly())
    return read_tensors(weights_file, scratch)


def _plan(name: str, cfg: dict, shapes: dict[str, tuple[int, ...]], model_cfg: ModelConfig,
          max_lora_rank: int) -> tuple[dict[str, dict[int, tuple]], int, float]:
    """Check every tensor's name and shape against the config and the base model (what the
    header alone tells). Returns module -> layer -> (A key, B key, scaling ratio folded into B),
    or (per_expert.Fused, None, 1.0) for transformers 4's per-expert tensors, the largest rank and
    the default scaling."""
    r_default = int(cfg.get("r", 8))
    alpha_default = float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora", False))
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}

    def scaling_of(alpha: float, r: int) -> float:
        return alpha / math.sqrt(r) if rslora else alpha / r

    default_scaling = scaling_of(alpha_default, r_default)

    def ratio_of(what: str, module_key: str, r: int) -> float:
        """The module's scaling over the default one; its rank checked against rank_pattern."""
        r_cfg = int(pattern_value(rank_pattern, module_key, r_default))
        if r_cfg != r:
            raise AdapterError(name, f"{what}: weights have rank {r} but the config says {r_cfg}")
        return scaling_of(float(pattern_value(alpha_pattern, module_key, alpha_default)), r) / default_scaling

    found: dict[tuple[int, str], dict[LoRAType, str]] = {}
    for (layer, module), ab in _expert_keys(name, shapes, model_cfg).items():
        found[(layer, module)] = ab
    per_expert = per_expert_plan(name, shapes, model_cfg, ratio_of, max_lora_rank, set(found))
    for key in shapes:
        if _EXPERT_KEY_RE.search(key) or PER_EXPERT_RE.search(key):
            continue
        m = _KEY_RE.search(key)
        if m is None:
            raise AdapterError(name, f"tensor {key!r} is not a LoRA A/B weight of "
                                     f"{', '.join(LORA_MODULES)} (embedding, lm_head and other "
                                     "targets are not supported)")
        layer, module, ab = int(m.group(1)), m.group(3), LoRAType(m.group(4))
        if module == ROUTER_LORA_MODULE and m.group(2) == "mlp":
            if layer not in model_cfg.moe_layers:
                raise AdapterError(name, f"tensor {key!r} adapts an MoE router (mlp.gate), but layer {layer} "
                                         "of the base model has none (an adapter for another model?)")
        elif module in ("gate_proj", "up_proj", "down_proj") and layer in model_cfg.moe_layers:
            raise AdapterError(name, f"tensor {key!r} adapts a dense MLP, but layer {layer} of the base model "
                                     "is a mixture of experts (an adapter for another model?)")
        elif module not in LORA_MODULES:
            raise AdapterError(name, f"target module {module!r} is outside the supported set "
                                     f"{', '.join(LORA_MODULES)}")
        if layer >= model_cfg.num_layers:
            raise AdapterError(name, f"tensor {key!r} names layer {layer}, but the base model has "
                                     f"{model_cfg.num_layers} layers (an adapter for another model?)")
        found.setdefault((layer, module), {})[ab] = key
    if not found and not per_expert:
        raise AdapterError(name, "adapter_model.safetensors holds no LoRA weights")

    plan: dict[str, dict[int, tuple]] = {}
    max_rank = 0
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != set(LoRAType):
            raise AdapterError(name, f"layer {layer} {module} has lora_{''.join(t.value for t in ab)} "
                                     "but not its pair")
        sa, sb = tuple(shapes[ab[LoRAType.A]]), tuple(shapes[ab[LoRAType.B]])
        experts = _experts_of(module, model_cfg)
        d_in, d_out = model_cfg.expert_dims(module) if experts > 1 else model_cfg.module_dims(module)
        r = sa[0] // experts if sa else 0  # an expert module's A holds every expert's r rows
        if len(sa) != 2 or len(sb) != 2 or sa != (r * experts, d_in) or sb != (d_out, r * experts):
            raise AdapterError(name, f"layer {layer} {module}: lora_A {sa} / lora_B {sb} "
                                     f"do not fit the base model's {module} ({d_in} -> {d_out}"
                                     f"{f', {experts} experts' if experts > 1 else ''}); "
                                     "an adapter for another model?")
        if r > max_lora_rank:
            raise AdapterError(name, f"rank {r} ({module}) exceeds max_lora_rank={max_lora_rank}: serve it with "
                                     f"--max-lora-rank {r} or more (an adapter's pool rows follow its own rank)")
        module_key = f"model.layers.{layer}.{'self_attn' if module[0] in 'qkvo' else 'mlp'}.{module}"
        if module == ROUTER_LORA_MODULE and any(map(is_router_parameter, cfg.get("target_parameters") or ())):
            module_key += ".weight"  # PEFT's key of a targeted parameter, as its patterns see it
        ratio = ratio_of(f"layer {layer} {module}", module_key, r)
        plan.setdefault(module, {})[layer] = (ab[LoRAType.A], ab[LoRAType.B], ratio)
        max_rank = max(max_rank, r)
    for (layer, module), fused in sorted(per_expert.items()):
        plan.setdefault(module, {})[layer] = (fused, None, 1.0)
        max_rank = max(max_rank, fused.rank)
    return plan, max_rank, default_scaling


def _experts_of(module: str, model_cfg: ModelConfig) -> int:
    """How many experts' LoRAs one of the module's tensors holds (1: a plain projection)."""
    return max(model_cfg.num_experts, 1) if module in EXPERT_LORA_MODULES else 1


def _expert_keys(name: str, shapes: dict[str, tuple[int, ...]],
                 model_cfg: ModelConfig) -> dict[tuple[int, str], dict[LoRAType, str]]:
    """(layer, expert module) -> its A and B keys, from PEFT's nested ParamWrapper keys, each
    wrapper's module told by its shapes (see _EXPERT_KEY_RE)."""
    wrappers: dict[tuple[int, str], dict[LoRAType, str]] = {}
    for key in shapes:
        m = _EXPERT_KEY_RE.search(key)
        if m is not None:
            wrappers.setdefault((int(m.group(1)), m.group(2)), {})[LoRAType(m.group(3))] = key
    out: dict[tuple[int, str], dict[LoRAType, str]] = {}
    for (layer, _), ab in sorted(wrappers.items()):
        if not model_cfg.moe_layers:
            raise AdapterError(name, f"tensor {next(iter(ab.values()))!r} adapts MoE experts, but the base "
                                     "model has none (an adapter for another model?)")
        if layer not in model_cfg.moe_layers:
            raise AdapterError(name, f"tensor {next(iter(ab.values()))!r} adapts experts in layer {layer}, "
                                     "whose MLP is dense (an adapter for another model?)")
        if set(ab) != set(LoRAType):
            key = next(iter(ab.values()))
            raise AdapterError(name, f"tensor {key!r} has no lora_{'B' if LoRAType.A in ab else 'A'} beside it")
        a_in, b_out = shapes[ab[LoRAType.A]][-1], shapes[ab[LoRAType.B]][0]
        module = next((mod for mod in EXPERT_LORA_MODULES if model_cfg.expert_dims(mod) == (a_in, b_out)), None)
        if module is None:
            raise AdapterError(name, f"layer {layer} experts: lora_A {tuple(shapes[ab[LoRAType.A]])} / lora_B "
                                     f"{tuple(shapes[ab[LoRAType.B]])} fit neither gate_up_proj "
                                     f"{model_cfg.expert_dims(EXPERT_LORA_MODULES[0])} nor down_proj "
                                     f"{model_cfg.expert_dims(EXPERT_LORA_MODULES[1])} of the base model's experts")
        if (layer, module) in out:
            raise AdapterError(name, f"layer {layer} adapts the experts' {module.split('.')[1]} twice")
        out[(layer, module)] = ab
    return out


def _a_rows(ka, shapes) -> int:
    """Rows of a layer's lora_A in a plan (_plan): its tensor's, or E * R once fused (per_expert)."""
    return ka.experts * ka.rank if isinstance(ka, Fused) else shapes[ka][0]


def _host_bytes(plan, shapes, model_cfg: ModelConfig, itemsize: int) -> int:
    total = 0
    for module, layers in plan.items():
        d_in, d_out = model_cfg.module_dims(module)
        r_mod = max(_a_rows(ka, shapes) for ka, _, _ in layers.values()) // _experts_of(module, model_cfg)
        total += itemsize * model_cfg.num_layers * r_mod * (d_in + d_out)
    return total


def probe_adapter(name: str, path: str | Path, model_cfg: ModelConfig, max_lora_rank: int,
                  dtype=np.float32) -> AdapterProbe:
    """Validate an adapter folder from its config and its safetensors header only (names,
    dtypes, shapes, ranks against the base model and max_lora_rank), reading none of its
    weights; what only the weights can tell (NaN or Inf) is checked when load_adapter reads them."""
    folder, cfg, weights_file = _checked_folder(name, path)
    try:
        shapes = ({k: shape for k, (_, shape, _) in _tensors_of(weights_file)[1].items()}
                  if weights_file.suffix == ".bin" else
                  {k: shape for k, (_, shape) in read_header(weights_file).items()})
        st = weights_file.stat()
    except (OSError, ValueError) as e:
        raise AdapterError(name, f"{weights_file.name} is not readable ({e})") from None
    plan, rank, _ = _plan(name, cfg, shapes, model_cfg, max_lora_rank)
    h = hashlib.sha256(b"multilora:lora-unread:v1")
    h.update(json.dumps(cfg, sort_keys=True).encode())
    h.update(struct.pack("<qq", st.st_size, st.st_mtime_ns))
    h.update(str(weights_file.resolve()).encode())
    return AdapterProbe(name=name, path=str(folder), rank=rank, nbytes=_host_bytes(plan, shapes, model_cfg, host_dtype(dtype).itemsize),
                        fingerprint=h.digest())


_scratch = threading.local()  # each reading thread's reused buffers (its read, the finite checks' temporaries)


def _read_weights(name: str, weights_file: Path):
    """The file read into this thread's read buffer: (its bytes, its entries, its header's bytes;
    safetensors_views.read_tensors). load_adapter copies the tensors out (into the host copy's
    arrays) before the thread reads again."""
    if not hasattr(_scratch, "buf"):
        _scratch.buf = Scratch()
    try:
        return _tensors_of(weights_file, _scratch.buf)
    except (OSError, ValueError) as e:
        raise AdapterError(name, f"{weights_file.name} is not readable ({e})") from None


def _checked_folder(name: str, path: str | Path) -> tuple[Path, dict, Path]:
    """The folder, its checked adapter_config.json and its weights file: what both reads share."""
    folder = Path(path)
    cfg = read_config(name, folder)
    check_config(name, cfg)
    return folder, cfg, _weights_file(name, folder)


def _not_finite(name: str, keys, tensors) -> AdapterError:
    """The error for a module whose float32 copy holds NaN or Inf, naming the first such tensor."""
    for key in keys:
        if not np.isfinite(tensors[key].astype(np.float32)).all():
            return AdapterError(name, f"tensor {key!r} holds NaN or Inf values")
    return AdapterError(name, f"tensors {sorted(keys)} hold NaN or Inf values")


def _all_finite(x: np.ndarray) -> bool:
    """No NaN or Inf in x. Its temporaries are this thread's reused buffers: fresh ones of a
    module's size cost more in page faults than the check (4 ms of an adapter's 17 against 0.5)."""
    n = x.size
    if getattr(_scratch, "check", np.empty(0, np.uint16)).size < n:
        _scratch.check = np.empty(n, np.uint16)
        _scratch.flags = np.empty(n, np.bool_)
    flags = _scratch.flags[:n].reshape(x.shape)
    if x.dtype == _BF16:  # by the bits (exponent all ones: Inf or NaN), 4x faster
        exp = np.bitwise_and(x.view(np.uint16), 0x7F80, out=_scratch.check[:n].reshape(x.shape))
        return not np.equal(exp, 0x7F80, out=flags).any()
    return bool(np.isfinite(x, out=flags).all())


def _round_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src, rounded to dst's dtype: float32 into a contiguous bfloat16 block through
    the native kernels' rounder where this process has loaded them (multilora.kernels: 5-10x
    faster than numpy's cast, the same values), else numpy's assignment."""
    kernels = sys.modules.get("multilora.kernels")
    rounder = kernels.bf16_rounder() if kernels is not None else None
    if (rounder is not None and dst.dtype == _BF16 and src.dtype == np.float32 and dst.shape == src.shape
            and dst.flags.c_contiguous and src.flags.c_contiguous):
        rounder(src.ctypes.data, dst.ctypes.data, src.size)
    else:
        dst[...] = src


def host_dtype(dtype) -> np.dtype:
    """The numpy dtype of host copies for a pool of `dtype` (float32, bfloat16 or float16)."""
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float16), _BF16):
        raise ValueError(f"adapter host copies are float32, bfloat16 or float16, not {dt.name}")
    return dt


@dataclasses.dataclass(frozen=True)
class _Part:
    """Where one module's arrays lie in an adapter's host block, and how its tensors get there."""
    module: str
    a_start: int                  # first element of a_LRI in the block
    a_shape: tuple[int, int, int]
    b_start: int
    b_shape: tuple[int, int, int]
    keys: tuple[str, ...]         # its tensors' names, A and B of every layer
    # (layer, A key, B key, scaling ratio) for the numpy path
    layers: tuple[tuple[int, str, str, float], ...]
    jobs: Optional[np.ndarray]    # (n, 8) int64 for kernels.tensor_copier, None: the numpy path
    experts: int = 1              # an expert module's: its tensors hold this many experts' LoRAs


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """How a file of one layout becomes a host copy: the same for every adapter trained alike
    (one header, one config), so it is worked out once (_recipe) and reused."""
    parts: tuple[_Part, ...]
    size: int                     # elements of the host block
    rank: int
    scaling: float


_SRC_KINDS = {np.dtype("<f4"): 0, _BF16: 1}      # tensor dtypes the copier reads
_DST_KINDS = {np.dtype(np.float32): 0, _BF16: 1}  # host dtypes it writes
_F32_BITS = lambda v: int(np.float32(v).view(np.uint32))  # noqa: E731  (a job's scale, by its bits)
_RECIPES: dict[tuple, _Recipe] = {}
_RECIPES_MAX = 32
_recipes_lock = threading.Lock()


def _make_recipe(name: str, cfg: dict, entries: dict, header: bytes, model_cfg: ModelConfig,
                 max_lora_rank: int, dtype: np.dtype) -> _Recipe:
    shapes = {k: shape for k, (_, shape, _) in entries.items()}
    plan, max_rank, default_scaling = _plan(name, cfg, shapes, model_cfg, max_lora_rank)
    base = 8 + len(header)  # tensors' offsets in the file's bytes
    parts, size = [], 0
    for module, layers in plan.items():
        d_in, d_out = model_cfg.module_dims(module)
        experts = _experts_of(module, model_cfg)
        r_mod = max(_a_rows(ka, shapes) for ka, _, _ in layers.values()) // experts
        L = model_cfg.num_layers
        a_start, b_start = size, size + L * r_mod * d_in
        size = b_start + L * d_out * r_mod
        # the experts' tensors are rearranged on the way (_copy_part), which the copier does not do
        native = experts == 1 and dtype in _DST_KINDS and all(
            not isinstance(ka, Fused) and entries[k][0] in _SRC_KINDS
            for ka, kb, _ in layers.values() for k in (ka, kb))
        jobs = []  # multilora_copy_tensors' rows: src offset, kind, dst offset, rows, cols, strides, scale
        for layer, (ka, kb, ratio) in sorted(layers.items()) if native else ():
            r = entries[ka][1][0]
            jobs.append((base + entries[ka][2], _SRC_KINDS[entries[ka][0]], a_start + layer * r_mod * d_in,
                         r, d_in, d_in, d_in, _F32_BITS(1.0)))
            jobs.append((base + entries[kb][2], _SRC_KINDS[entries[kb][0]], b_start + layer * d_out * r_mod,
                         d_out, r, r, r_mod, _F32_BITS(ratio)))
        parts.append(_Part(module=module, a_start=a_start, a_shape=(L, r_mod, d_in), b_start=b_start,
                           b_shape=(L, d_out, r_mod),
                           keys=tuple(k for ka, kb, _ in layers.values()
                                      for k in (ka.keys if isinstance(ka, Fused) else (ka, kb))),
                           layers=tuple((layer, ka, kb, ratio) for layer, (ka, kb, ratio) in sorted(layers.items())),
                           jobs=np.ascontiguousarray(jobs, np.int64) if native else None, experts=experts))
    return _Recipe(parts=tuple(parts), size=size, rank=max_rank, scaling=default_scaling)


def _recipe(name: str, cfg: dict, entries: dict, header: bytes, model_cfg: ModelConfig, max_lora_rank: int,
            dtype: np.dtype) -> _Recipe:
    """_make_recipe, remembered for the last few layouts: checking the names and shapes of
    hundreds of tensors against the config and the model costs ~1.6 ms an adapter."""
    key = (header, json.dumps(cfg, sort_keys=True, default=str), model_cfg, max_lora_rank, dtype.str)
    got = _RECIPES.get(key)
    if got is None:
        got = _make_recipe(name, cfg, entries, header, model_cfg, max_lora_rank, dtype)  # raises: nothing kept
        with _recipes_lock:
            if len(_RECIPES) >= _RECIPES_MAX:
                _RECIPES.pop(next(iter(_RECIPES)))
            _RECIPES[key] = got
    return got


def _bad_values(name: str, part: _Part, tensors: dict, dtype: np.dtype) -> AdapterError:
    """The error for a module whose host copy holds NaN or Inf: the file's own values, or values
    its dtype cannot hold."""
    if all(_all_finite(tensors[k]) for k in part.keys):
        return AdapterError(name, f"{part.module}: values beyond what the adapter pool's {dtype.name} holds "
                                  f"(|x| > {float(ml_dtypes.finfo(dtype).max):.3g}, or after a pattern's scaling)")
    return _not_finite(name, part.keys, tensors)


def _copy_part(part: _Part, tensors: dict, a_LRI: np.ndarray, b_LOR: np.ndarray) -> bool:
    """One module's tensors into its host arrays by numpy (each value rounded once to the host
    dtype); False if the result holds NaN or Inf."""
    e = part.experts
    for layer, ka, kb, ratio in part.layers:
        if isinstance(ka, Fused):  # transformers 4's per-expert tensors, fused into the rows below
            a_ri, b_or = fuse(ka, tensors)
            r = ka.rank
        else:
            a_ri, b_or = tensors[ka], tensors[kb]
            r = a_ri.shape[0] // e
            if e > 1:  # PEFT's A rows e * r + j and B columns j * E + e -> expert e's run of a rank row
                a_ri = np.ascontiguousarray(a_ri.reshape(e, r, -1).transpose(1, 0, 2).reshape(r, -1))
                b_or = np.ascontiguousarray(b_or.reshape(-1, r, e).transpose(2, 0, 1).reshape(-1, r))
        _round_into(a_LRI[layer, :r], a_ri)
        # a pattern's scaling ratio, folded into B in float32 before the one rounding
        _round_into(b_LOR[layer, :, :r], b_or if ratio == 1.0 else b_or.astype(np.float32) * np.float32(ratio))
    return _all_finite(a_LRI) and _all_finite(b_LOR)


def _host_block(part: _Part, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a_LRI = block[part.a_start:part.a_start + math.prod(part.a_shape)].reshape(part.a_shape)
    b_LOR = block[part.b_start:part.b_start + math.prod(part.b_shape)].reshape(part.b_shape)
    return a_LRI, b_LOR


TENSORS_PATH = "<tensors>"  # the path of an adapter given as arrays: there is no folder to read again


def adapter_from_tensors(name: str, tensors: dict, config: dict, model_cfg: ModelConfig, max_lora_rank: int,
                         dtype=np.float32) -> LoRAAdapter:
    """An adapter from arrays in memory (a training loop's, no file between): `tensors` maps PEFT
    tensor names (`...layers.{i}.self_attn.q_proj.lora_A.weight`, A r x in, B out x r) to numpy or
    jax arrays, `config` is a PEFT adapter_config dict. Checked exactly as a folder is (the same
    config checks, names and shapes against the model, rank pattern, NaN/Inf and the pool dtype's
    range), with the same errors; the arrays are copied, so the caller may go on changing its own."""
    dtype = host_dtype(dtype)
    if not isinstance(config, dict):
        raise AdapterError(name, f"config must be a PEFT adapter_config dict, got {type(config).__name__}")
    check_config(name, config)
    if not isinstance(tensors, dict) or not tensors:
        raise AdapterError(name, "tensors must be a non-empty dict of PEFT tensor names to arrays")
    host = {}
    for key, value in tensors.items():
        try:  # a jax array comes to the host here (one transfer per tensor)
            arr = np.asarray(value)
        except Exception as e:  # noqa: BLE001 - anything not an array is the caller's error
            raise AdapterError(name, f"tensor {key!r} is not an array ({e})") from None
        if arr.dtype not in (np.dtype(np.float32), np.dtype(np.float16), _BF16, np.dtype(np.float64)):
            raise AdapterError(name, f"tensor {key!r} has dtype {arr.dtype}; float32, bfloat16, float16 or "
                                     "float64 is accepted")
        host[str(key)] = arr
    # No header here: entries carry no source dtype the native copier reads, so the numpy path runs.
    recipe = _make_recipe(name, config, {k: (None, a.shape, 0) for k, a in host.items()}, b"", model_cfg,
                          max_lora_rank, dtype)
    block = np.zeros(recipe.size, dtype)
    modules = {}
    for part in recipe.parts:
        a_LRI, b_LOR = _host_block(part, block)
        if not _copy_part(part, host, a_LRI, b_LOR):
            raise _bad_values(name, part, host, dtype)
        modules[part.module] = (a_LRI, b_LOR)
    return LoRAAdapter(name=name, path=TENSORS_PATH, rank=recipe.rank, scaling=recipe.scaling, modules=modules)


def load_adapter(name: str, path: str | Path, model_cfg: ModelConfig, max_lora_rank: int,
                 dtype=np.float32) -> LoRAAdapter:
    """Read, validate and lay out one adapter, its host copy in `dtype` (the pool's: each value
    rounded once, to nearest even, as the pool's write would round it). Raises AdapterError;
    changes no shared state (a file layout's recipe is remembered, _recipe). Runs beside decoding streams (on the loader's thread), so its work
    is a few calls that release the GIL rather than many small ones: one read of the file, then
    per module one call of the native kernels' tensor copier (multilora.kernels.tensor_copier:
    every tensor converted, scaled and checked for NaN/Inf in one pass), where this process has
    loaded them; else one converting copy per tensor and one finite check per module (after the
    conversion, so that a value beyond a bfloat16 pool's range is refused too). The modules'
    arrays are views of one zeroed block (layers the adapter does not touch, and rows past a
    layer's rank, stay zero)."""
    dtype = host_dtype(dtype)
    folder, cfg, weights_file = _checked_folder(name, path)
    data, entries, header = _read_weights(name, weights_file)
    recipe = _recipe(name, cfg, entries, header, model_cfg, max_lora_rank, dtype)
    kernels = sys.modules.get("multilora.kernels")  # never built from a loader thread
    copier = kernels.tensor_copier() if kernels is not None else None
    block = np.zeros(recipe.size, dtype)
    src = np.frombuffer(data, np.uint8)
    modules = {}
    for part in recipe.parts:
        checkpoint()  # a paced read pauses here while the engine runs a step
        a_LRI, b_LOR = _host_block(part, block)
        if copier is not None and part.jobs is not None:
            ok = copier(src.ctypes.data, block.ctypes.data, _DST_KINDS[dtype], part.jobs.ctypes.data,
                        len(part.jobs)) < 0
            tensors = None
        else:
            tensors = views(data, entries, part.keys)
            ok = _copy_part(part, tensors, a_LRI, b_LOR)
        if not ok:
            raise _bad_values(name, part, tensors if tensors is not None else views(data, entries, part.keys), dtype)
        modules[part.module] = (a_LRI, b_LOR)
    return LoRAAdapter(name=name, path=str(folder), rank=recipe.rank, scaling=recipe.scaling, modules=modules)
