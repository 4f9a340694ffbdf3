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


def onehot_shrink(x_TD, a_NRD, index_T, scalings_N):
    """Every token against each of N adapters' A in one GEMM, each token keeping its own
    (index_T; N or -1: none): h_TR, scaled. A select, not a product, picks, so rows of an
    adapter no token uses never reach the result, whatever they hold."""
    n, r, d = a_NRD.shape
    h_TNR = (x_TD @ a_NRD.reshape(n * r, d).astype(x_TD.dtype).T).reshape(-1, n, r)
    onehot_TN = jax.nn.one_hot(index_T, n, dtype=h_TNR.dtype)
    scale_T1 = (onehot_TN @ scalings_N.astype(h_TNR.dtype))[:, None]
    return jnp.sum(jnp.where(onehot_TN[:, :, None] > 0, h_TNR, 0.0), axis=1) * scale_T1


def onehot_expand(h_TR, b_NRO, index_T):
    """h_TR expanded through each token's own adapter's B (index_T) as one GEMM over N adapters."""
    n, r, o = b_NRO.shape
    onehot_TN = jax.nn.one_hot(index_T, n, dtype=h_TR.dtype)
    h_TX = (onehot_TN[:, :, None] * h_TR[:, None, :]).reshape(-1, n * r)
    return h_TX @ b_NRO.reshape(n * r, o).astype(h_TR.dtype)


class DenseLoRABackend(BaseLoRABackend):
    name = "dense"

    def run_lora_a_gemm(self, x_TD, lora_a_UD, info: LoRABatchInfo, blocks: int = 1):
        # over the adapter slots 1..S-1 only: base rows (slot 0) are one_hot(-1), all zero
        a_SRD = slot_rows(lora_a_UD, info, _adapter_slots(info), blocks)
        return onehot_shrink(x_TD, a_SRD, info.slot_T - 1, info.scalings_S[NO_ADAPTER + 1:])

    def run_lora_b_gemm(self, h_TR, lora_b_UO, info: LoRABatchInfo, base_output_TO=None):
        b_SRO = slot_rows(lora_b_UO, info, _adapter_slots(info))
        return add_base(onehot_expand(h_TR, b_SRO, info.slot_T - 1), base_output_TO)
