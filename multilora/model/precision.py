"""What an engine's `dtype` means: the dtypes its activations, projection matrices, KV cache and
adapter pool run in, resolved once from what the user named and where the model is placed.

    dtype="auto" (the default): the fastest choice of the platform. On a CPU, float32 activations,
        KV cache and adapters, with the projection matrices in bfloat16 through multilora's packed
        GEMM where it runs (projection_dtype auto: multilora.model.projections); on an
        accelerator, bfloat16 throughout.
    dtype="float32" | "bfloat16" | "float16": that dtype, as vLLM users read the flag: the
        activations, the projection matrices and the adapter pool all in it. An explicit float32
        is the exact path, PEFT's numbers; a faster mix is asked for by name (projection_dtype,
        lora_dtype: the expert's knobs, which win over what dtype implies).

The one exception is the KV cache of a 16-bit dtype on a CPU, kept in float32 (kv_cache_dtype):
it holds the 16-bit K/V exactly, so the numbers are the dtype's.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from multilora.config import DTYPE_CHOICES



def activation_dtype(dtype: str, platform: str) -> str:
    """The activations' dtype name for `dtype` as asked: auto is float32 on a CPU (XLA's CPU
    backend runs 16-bit arithmetic several times slower than float32: benchmarks/log/35) and
    bfloat16 on an accelerator. Raises ValueError on a name not in DTYPE_CHOICES."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
    if dtype == "auto":
        return "float32" if platform == "cpu" else "bfloat16"
    return dtype


def kv_cache_dtype(dtype, platform: str) -> np.dtype:
    """The KV cache's element type for activations of `dtype`: the same, except on a CPU, where a
    16-bit float cache is kept in float32. XLA's CPU backend takes no scatter (nor update slice)
    of 16-bit floats: it converted the whole cache to float32 and back around each layer's K/V
    write, so a SmolLM2 decode step of 2 rows over the default 2 GB of bfloat16 cache (5,825 pages)
    took 20 s, 0.17 s with the float32 cache (benchmarks/log/50). The K/V a bfloat16 model writes
    are bfloat16 values, held exactly in float32: a page takes twice the bytes (the budget holds
    half the pages), nothing else changes; the decode attention then takes the CPU kernel."""
    dtype = jnp.dtype(dtype)
    if platform == "cpu" and dtype.itemsize == 2 and dtype.kind in "fV":
        return np.dtype(np.float32)
    return dtype


@dataclasses.dataclass(frozen=True)
class Precision:
    """What runs, by name: `dtype` as asked, then the dtype of each part (projections: a mode
    of multilora.model.projections, e.g. "bfloat16-packed" or "int8-packed")."""

    dtype: str
    activations: str
    projections: str
    kv_cache: str
    adapter_pool: str

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        return (f"dtype {self.dtype}: activations {self.activations}, projections {self.projections}, "
                f"KV cache {self.kv_cache}, adapter pool {self.adapter_pool}")


def resolve_precision(dtype: str, projection_dtype: str, lora_dtype: str, quantization, lora_backend: str,
                      like) -> Precision:
    """The Precision an engine built with these options runs, for weights placed like `like` (a
    jax.Array: its devices say the platform and whether the packed CPU kernels serve it)."""
    from multilora.model import projections
    platform = next(iter(like.sharding.device_set)).platform
    activations = activation_dtype(dtype, platform)
    mode = (projections.quantized_mode(quantization, like) if quantization else
            projections.resolve(projection_dtype, activations, like, implied=None if dtype == "auto" else activations))
    pool = projections.lora_pool_dtype(lora_dtype, activations, mode, lora_backend)
    return Precision(dtype=dtype, activations=activations, projections=mode,
                     kv_cache=kv_cache_dtype(activations, platform).name, adapter_pool=jnp.dtype(pool).name)
