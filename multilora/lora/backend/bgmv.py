"""BGMV: each token gathers its own adapter's A and B (the decode path).

Work and bytes grow with the tokens in the batch, not with the number of slots (sglang-jax's
one-hot einsum reads every slot for every token). Slot 0 holds zeros, so base rows add nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from multilora.lora.backend.base import BaseLoRABackend, add_base, token_scaling_T1
from multilora.lora.batch import NO_ADAPTER, LoRABatchInfo


class BgmvLoRABackend(BaseLoRABackend):
    name = "bgmv"

    def run_lora_a_gemm(self, x_TD, lora_a_SRD, info: LoRABatchInfo):
        a_TRD = jnp.take(lora_a_SRD, info.slot_T, axis=0, mode="clip")
        h_TR = jnp.einsum("td,trd->tr", x_TD, a_TRD.astype(x_TD.dtype))
        h_TR = h_TR * token_scaling_T1(info, h_TR.dtype)
        # Base rows must never depend on slot 0's contents (vLLM's CPU build read a real slot).
        return jnp.where((info.slot_T == NO_ADAPTER)[:, None], 0.0, h_TR)

    def run_lora_b_gemm(self, h_TR, lora_b_SRO, info: LoRABatchInfo, base_output_TO=None):
        b_TRO = jnp.take(lora_b_SRO, info.slot_T, axis=0, mode="clip")
        y_TO = jnp.einsum("tr,tro->to", h_TR, b_TRO.astype(h_TR.dtype))
        y_TO = jnp.where((info.slot_T == NO_ADAPTER)[:, None], 0.0, y_TO)
        return add_base(y_TO, base_output_TO)
