"""LoRA compute backends, selected by name."""

import jax

from multilora.lora.backend.base import BaseLoRABackend
from multilora.lora.backend.bgmv import BgmvLoRABackend
from multilora import kernels
from multilora.config import LORA_BACKEND_CHOICES
from multilora.lora.backend.dense import DenseLoRABackend
from multilora.lora.backend.native import NativeLoRABackend
from multilora.lora.backend.pallas import PallasLoRABackend
from multilora.lora.backend.reference import ReferenceLoRABackend
from multilora.lora.backend.sgmv import SgmvLoRABackend
from multilora.lora.batch import sgmv_tile_rows

BACKENDS: dict[str, type[BaseLoRABackend]] = {
    "bgmv": BgmvLoRABackend,
    "sgmv": SgmvLoRABackend,
    "dense": DenseLoRABackend,
    "native": NativeLoRABackend,
    "pallas": PallasLoRABackend,
    "reference": ReferenceLoRABackend,
}
BACKEND_CHOICES = LORA_BACKEND_CHOICES   # the names, in multilora.config for the CLI (no jax there)
if set(BACKEND_CHOICES) != {"auto", *BACKENDS}:
    raise ImportError(f"multilora.config.LORA_BACKEND_CHOICES {BACKEND_CHOICES} does not name the backends {tuple(BACKENDS)}")


# A compiled shape may carry two backends, "grouped|per_token", picked at run time by the step's
# LoRABatchInfo.mode (GROUPED when its distinct adapters fit the tiles, else PER_TOKEN).
SWITCH = "|"


def get_backend(name: str) -> BaseLoRABackend:
    try:
        return BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown lora_backend {name!r}; choose one of {', '.join(BACKEND_CHOICES)}") from None


def get_backends(name: str) -> tuple[BaseLoRABackend, ...]:
    """One backend, or the (grouped, per-token) pair of a run-time switch."""
    return tuple(get_backend(n) for n in name.split(SWITCH))


def grouped_cap(num_tokens: int) -> int:
    """The most distinct adapters for which a decode step's tiles are still full on average
    (T >= M * adapters): beyond, grouping pads more than it saves."""
    return num_tokens // sgmv_tile_rows(num_tokens, 2)


def native_usable(dtype, devices) -> bool:
    """multilora's CPU kernels serve float32 or bfloat16 slots on one CPU device (built on first call)."""
    return (jax.numpy.dtype(dtype) in (jax.numpy.float32, jax.numpy.bfloat16) and len(devices) == 1
            and next(iter(devices)).platform == "cpu" and kernels.available())


def choose_backend(name: str, num_tokens: int, is_decode: bool, num_slots: int | None = None,
                   native: bool = False, platform: str = "cpu") -> str:
    """Resolve "auto" for one compiled shape (tokens and slots are both static there).
    Where multilora's CPU kernels serve (`native`), every shape with adapter slots takes them:
    they read each adapter's rows in place, where the tile backends copy every tile's weights
    (forward_step, a 512-token prefill with 8 adapters in 64 slots: native 1.16x of no adapter,
    sgmv 1.82x). Otherwise prefill groups tokens into tiles (`sgmv`). Decode does too when the tokens would fill every
    adapter's tile on average (T >= M * adapters), reads the whole small pool once (`dense`)
    when the adapters are still few next to the tokens (4 * adapters <= T); with more slots
    than that (a pool sized by memory), the shape carries both `sgmv` (tiles sized for the few
    adapters a step may use) and `bgmv`, and each step's distinct adapters pick one at run time;
    below one tile of rows it gathers per token (`bgmv`). Measured in benchmarks/log/01-2026-11-29-lora-op-micro-benchmark.md (forward_step: 64 rows with 8
    adapters sgmv 6 % ahead of dense; 32 rows dense 6 % ahead; 64 rows with 64 slots bgmv).
    On a TPU (`platform`), every shape with adapter slots takes `pallas`: XLA's gathers cost far
    more than their bytes there, and its kernel reads only the step's own adapters in place
    (benchmarks/log/27-2026-12-05-tpu-v5e-pallas-kernels.md: a 64-row decode step with
    64 adapters 50.2 ms with `dense`, 10.8 with `pallas`; the same at 257 slots)."""
    if name != "auto":
        get_backends(name)
        return name
    adapters = 0 if num_slots is None else num_slots - 1
    if native and adapters:
        return "native"
    if platform == "tpu" and adapters:
        return "pallas"
    if is_decode or num_tokens <= 64:
        if adapters and num_tokens >= sgmv_tile_rows(num_tokens, num_slots) * adapters:
            return "sgmv"
        if adapters and adapters * 4 <= num_tokens:
            return "dense"
        if adapters and grouped_cap(num_tokens) >= 1:
            # More slots than a step can group well: the step's own distinct adapters decide,
            # at run time (a pool sized by memory may hold 64 adapters while a step uses 3).
            return f"sgmv{SWITCH}bgmv"
        return "bgmv"
    return "sgmv"


__all__ = ["BaseLoRABackend", "BgmvLoRABackend", "SgmvLoRABackend", "DenseLoRABackend",
           "ReferenceLoRABackend", "NativeLoRABackend", "PallasLoRABackend", "native_usable",
           "get_backend", "get_backends", "grouped_cap", "choose_backend", "BACKENDS", "BACKEND_CHOICES", "SWITCH"]
