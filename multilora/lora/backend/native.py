"""Per-token LoRA through multilora's own CPU kernels (multilora/kernels/lora_kernels.cc).

The same per-token arithmetic as bgmv, without its copies: XLA runs bgmv's gather as a copy of
every token's adapter matrices followed by a batched matrix-vector product, and the copy costs
more than the product. These kernels read each token's rows in place (by the slot's row table), straight out of the whole
pool at the step's layer (forward hands a `PoolLayer` instead of a layer slice, so the scan over
layers copies nothing either), take a slot's tokens together so its rows are read once per step,
and stop at each slot's true rank. A group (q/k/v, gate/up, or one projection) is one call:
shrink and expand per work item, the item's h kept local (each call and each spread over the
threads costs tens of microseconds, which at decode shapes was more than the arithmetic).
Float32 or bfloat16 pools on the CPU (on a bf16 pool where the CPU has AVX512-BF16, the group
calls multiply bf16 pairs: x and h rounded to bf16, sums float32), on one device (under tensor parallelism the XLA backends
keep their shardings); `auto` picks it for every shape when it is available.
"""

from __future__ import annotations

import jax  # noqa: F401

from multilora import kernels
from multilora.lora.backend.base import BaseLoRABackend, PoolLayer, add_base, pool_layer as _pool_layer  # noqa: F401
from multilora.lora.batch import LoRABatchInfo


class NativeLoRABackend(BaseLoRABackend):
    name = "native"
    reads_pool_in_place = True

    def __init__(self):
        if not kernels.available():
            raise ValueError(f"lora_backend 'native' is not available here: {kernels.unavailable_reason()}")

    def run_lora_a_gemm(self, x_TD, lora_a_UD, info: LoRABatchInfo, blocks: int = 1):
        a = _pool_layer(lora_a_UD)
        h_TR = kernels.shrink(x_TD, a.pool, a.layer, info.slot_T, info.scalings_S, info.ranks_S,
                              info.rows_SR, blocks)
        return h_TR.astype(x_TD.dtype)

    def run_lora_b_gemm(self, h_TR, lora_b_UO, info: LoRABatchInfo, base_output_TO=None):
        b = _pool_layer(lora_b_UO)
        y_TO = kernels.expand(h_TR, b.pool, b.layer, info.slot_T, info.ranks_S, info.rows_SR)
        return add_base(y_TO.astype(h_TR.dtype), base_output_TO)

    def run_lora(self, x_TD, lora_a_UD, lora_b_UO, info: LoRABatchInfo, base_output_TO=None):
        return add_base(self._stacked(x_TD, lora_a_UD, (lora_b_UO,), info)[0], base_output_TO)

    def _stacked(self, x_TD, a_UD, lora_b, info):
        a = _pool_layer(a_UD)
        bs = [_pool_layer(b) for b in lora_b]
        ys = kernels.lora_apply(x_TD, a.pool, tuple(b.pool for b in bs), a.layer, info.slot_T,
                                info.scalings_S, info.ranks_S, info.rows_SR)
        return tuple(y.astype(x_TD.dtype) for y in ys)
