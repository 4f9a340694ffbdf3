"""Per-token LoRA through multilora's own CPU kernels (kernels/lora_kernels.cc).

The same per-token arithmetic as bgmv, without its copies: XLA runs bgmv's gather as a copy of
every token's adapter matrices followed by a batched matrix-vector product, and the copy costs
more than the product. These kernels read each token's slot in place, straight out of the whole
pool at the step's layer (forward hands a `PoolLayer` instead of a layer slice, so the scan over
layers copies nothing either), take a slot's tokens together so its rows are read once per step,
and stop at each slot's true rank. Float32 on the CPU, on one device (under tensor parallelism
the XLA backends keep their shardings); `auto` picks it for decode shapes when it is available.
"""

from __future__ import annotations

import dataclasses

import jax

from multilora.lora.backend import kernels
from multilora.lora.backend.base import BaseLoRABackend, add_base
from multilora.lora.batch import LoRABatchInfo


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PoolLayer:
    """One layer of a slot buffer, not sliced out: the kernel indexes pool_L... at `layer`."""

    pool: jax.Array
    layer: jax.Array


def _pool_layer(w) -> PoolLayer:
    # A plain (S, R, X) slot array (one layer already picked) is a one-layer pool.
    return w if isinstance(w, PoolLayer) else PoolLayer(w[None], jax.numpy.int32(0))


class NativeLoRABackend(BaseLoRABackend):
    name = "native"
    reads_pool_in_place = True

    def __init__(self):
        if not kernels.available():
            raise ValueError(f"lora_backend 'native' is not available here: {kernels.unavailable_reason()}")

    def run_lora_a_gemm(self, x_TD, lora_a_SRD, info: LoRABatchInfo, blocks: int = 1):
        a = _pool_layer(lora_a_SRD)
        h_TR = kernels.shrink(x_TD, a.pool, a.layer, info.slot_T, info.scalings_S, info.ranks_S, blocks)
        return h_TR.astype(x_TD.dtype)

    def run_lora_b_gemm(self, h_TR, lora_b_SRO, info: LoRABatchInfo, base_output_TO=None):
        b = _pool_layer(lora_b_SRO)
        y_TO = kernels.expand(h_TR, b.pool, b.layer, info.slot_T, info.ranks_S).astype(h_TR.dtype)
        return add_base(y_TO, base_output_TO)

    def _stacked(self, x_TD, a_SRD, lora_b, info):
        # The stacked A is `len(lora_b)` blocks of max_rank rows; each slot's true rank applies
        # per block (rows past it are padding the kernel skips).
        blocks = len(lora_b)
        h_TR = self.run_lora_a_gemm(x_TD, a_SRD, info, blocks)
        r = h_TR.shape[1] // blocks
        return tuple(self.run_lora_b_gemm(h_TR[:, i * r:(i + 1) * r], b, info)
                     for i, b in enumerate(lora_b))
