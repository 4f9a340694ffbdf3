"""Dense over slots: every token against every slot's A in one GEMM, and the expand as one GEMM
of slot-expanded h against all slots' B (sglang-jax's one-hot formulation, done as two plain
matmuls).

Its bytes are the whole pool read once, S x R x (D + O), where bgmv reads one copy per token,
T x R x (D + O): with a small pool and a large decode batch (S well under T) it reads less.
Its work grows with S, so `auto` takes it only for decode shapes with S <= T / 4.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from multilora.lora.backend.base import BaseLoRABackend, add_base
from multilora.lora.batch import NO_ADAPTER, LoRABatchInfo


def _slot_onehot_TS(info: LoRABatchInfo, num_slots: int, dtype) -> jax.Array:
    """Over the adapter slots 1..S-1 only: slot 0 (base rows) is never read, and its rows are
    all zero (one_hot of -1)."""
    return jax.nn.one_hot(info.slot_T - 1, num_slots - 1, dtype=dtype)


class DenseLoRABackend(BaseLoRABackend):
    name = "dense"

    def run_lora_a_gemm(self, x_TD, lora_a_SRD, info: LoRABatchInfo):
        s, r, d = lora_a_SRD.shape
        a_XD = lora_a_SRD[NO_ADAPTER + 1:].reshape((s - 1) * r, d).astype(x_TD.dtype)  # X = (S-1)*R
        h_TX = x_TD @ a_XD.T
        onehot_TS = _slot_onehot_TS(info, s, h_TX.dtype)
        scale_T1 = (onehot_TS @ info.scalings_S[NO_ADAPTER + 1:].astype(h_TX.dtype))[:, None]
        return jnp.einsum("tsr,ts->tr", h_TX.reshape(-1, s - 1, r), onehot_TS) * scale_T1

    def run_lora_b_gemm(self, h_TR, lora_b_SOR, info: LoRABatchInfo, base_output_TO=None):
        s, o, r = lora_b_SOR.shape
        onehot_TS = _slot_onehot_TS(info, s, h_TR.dtype)
        h_TX = (onehot_TS[:, :, None] * h_TR[:, None, :]).reshape(-1, (s - 1) * r)
        b_XO = jnp.transpose(lora_b_SOR[NO_ADAPTER + 1:], (0, 2, 1)).reshape((s - 1) * r, o)
        b_XO = b_XO.astype(h_TR.dtype)
        return add_base(h_TX @ b_XO, base_output_TO)
