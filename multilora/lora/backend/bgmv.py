"""BGMV: each token gathers its own adapter's A and B rows (the decode path).

Work and bytes grow with the tokens in the batch, not with the number of slots (sglang-jax's
one-hot einsum reads every slot for every token). Base rows (slot 0) add nothing.
"""

from __future__ import annotations

import jax.numpy as jnp

from multilora.lora.backend.base import BaseLoRABackend, add_base, slot_rows, token_scaling_T1
from multilora.lora.batch import NO_ADAPTER, LoRABatchInfo


class BgmvLoRABackend(BaseLoRABackend):
    name = "bgmv"

    def run_lora_a_gemm(self, x_TD, lora_a_UD, info: LoRABatchInfo, blocks: int = 1):
        a_TRD = slot_rows(lora_a_UD, info, info.slot_T, blocks)
        h_TR = jnp.einsum("td,trd->tr", x_TD, a_TRD.astype(x_TD.dtype))
        h_TR = h_TR * token_scaling_T1(info, h_TR.dtype)
        # Base rows must never depend on slot 0's table or rows (vLLM's CPU build read a real slot).
        return jnp.where((info.slot_T == NO_ADAPTER)[:, None], 0.0, h_TR)

    def run_lora_b_gemm(self, h_TR, lora_b_UO, info: LoRABatchInfo, base_output_TO=None):
        b_TRO = slot_rows(lora_b_UO, info, info.slot_T)
        y_TO = jnp.einsum("tr,tro->to", h_TR, b_TRO.astype(h_TR.dtype))
        y_TO = jnp.where((info.slot_T == NO_ADAPTER)[:, None], 0.0, y_TO)
        return add_base(y_TO, base_output_TO)
