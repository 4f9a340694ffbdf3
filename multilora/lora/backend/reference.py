"""Plain-jnp reference: every slot's product for every token, then each token picks its own.

Slow by design and obviously correct; the kernels are tested against it.
"""

from __future__ import annotations

import jax.numpy as jnp

from multilora.lora.backend.base import BaseLoRABackend, add_base, slot_rows, token_scaling_T1
from multilora.lora.batch import NO_ADAPTER, LoRABatchInfo


def _all_slots(pool_UX, info, blocks=1):
    return slot_rows(pool_UX, info, jnp.arange(info.rows_SR.shape[0]), blocks)


class ReferenceLoRABackend(BaseLoRABackend):
    name = "reference"

    def run_lora_a_gemm(self, x_TD, lora_a_UD, info: LoRABatchInfo, blocks: int = 1):
        h_TSR = jnp.einsum("td,srd->tsr", x_TD, _all_slots(lora_a_UD, info, blocks).astype(x_TD.dtype))
        h_TR = jnp.take_along_axis(h_TSR, info.slot_T[:, None, None], axis=1)[:, 0]
        h_TR = h_TR * token_scaling_T1(info, h_TR.dtype)
        return jnp.where((info.slot_T == NO_ADAPTER)[:, None], 0.0, h_TR)

    def run_lora_b_gemm(self, h_TR, lora_b_UO, info: LoRABatchInfo, base_output_TO=None):
        y_TSO = jnp.einsum("tr,sro->tso", h_TR, _all_slots(lora_b_UO, info).astype(h_TR.dtype))
        y_TO = jnp.take_along_axis(y_TSO, info.slot_T[:, None, None], axis=1)[:, 0]
        y_TO = jnp.where((info.slot_T == NO_ADAPTER)[:, None], 0.0, y_TO)
        return add_base(y_TO, base_output_TO)
