"""Dense over slots: every token against every slot's A in one GEMM, and the expand as one GEMM
of slot-expanded h against all slots' B (sglang-jax's one-hot formulation, done as two plain
matmuls).

Its bytes are every adapter slot read once, (S-1) x R x (D + O) (gathered from the pool by the
row table), where bgmv reads one copy per token, T x R x (D + O): with few slots and a large
decode batch (S well under T) it reads less. Its work grows with S, so `auto` takes it only for
decode shapes with 4 (S-1) <= T (and sgmv instead once the tokens fill every adapter's tile).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from multilora.lora.backend.base import BaseLoRABackend, add_base, slot_rows
from multilora.lora.batch import NO_ADAPTER, LoRABatchInfo


def _adapter_slots(info: LoRABatchInfo) -> jax.Array:
    """Slots 1..S-1: slot 0 (base rows) is never read."""
    return jnp.arange(NO_ADAPTER + 1, info.rows_SR.shape[0])


def _slot_onehot_TS(info: LoRABatchInfo, dtype) -> jax.Array:
    """Over the adapter slots 1..S-1 only: base rows are all zero (one_hot of -1)."""
    return jax.nn.one_hot(info.slot_T - 1, info.rows_SR.shape[0] - 1, dtype=dtype)


class DenseLoRABackend(BaseLoRABackend):
    name = "dense"

    def run_lora_a_gemm(self, x_TD, lora_a_UD, info: LoRABatchInfo, blocks: int = 1):
        a_SRD = slot_rows(lora_a_UD, info, _adapter_slots(info), blocks)
        s, r, d = a_SRD.shape
        h_TSR = (x_TD @ a_SRD.reshape(s * r, d).astype(x_TD.dtype).T).reshape(-1, s, r)
        onehot_TS = _slot_onehot_TS(info, h_TSR.dtype)
        scale_T1 = (onehot_TS @ info.scalings_S[NO_ADAPTER + 1:].astype(h_TSR.dtype))[:, None]
        picked_TSR = jnp.where(onehot_TS[:, :, None] > 0, h_TSR, 0.0)
        return jnp.sum(picked_TSR, axis=1) * scale_T1

    def run_lora_b_gemm(self, h_TR, lora_b_UO, info: LoRABatchInfo, base_output_TO=None):
        b_SRO = slot_rows(lora_b_UO, info, _adapter_slots(info))
        s, r, o = b_SRO.shape
        onehot_TS = _slot_onehot_TS(info, h_TR.dtype)
        h_TX = (onehot_TS[:, :, None] * h_TR[:, None, :]).reshape(-1, s * r)
        return add_base(h_TX @ b_SRO.reshape(s * r, o).astype(h_TR.dtype), base_output_TO)
