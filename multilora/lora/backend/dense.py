"""Dense over slots: every token against every slot's A in one GEMM, and the expand as one GEMM
of slot-expanded h against all slots' B (sglang-jax's one-hot formulation, done as two plain
matmuls).

Its bytes are the whole pool read once, S x R x (D + O), where bgmv reads one copy per token,
T x R x (D + O): with a small pool and a large decode batch (S well under T) it reads less.
Its work grows with S, so `auto` takes it only for decode shapes with 4 (S-1) <= T (and sgmv
instead once the tokens fill every adapter's tile).
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
        # The shrink reads the whole pool in place (slot 0 included: no sliced copy) and then
        # selects, so whatever slot 0 holds (even NaN) never reaches a result.
        s, r, d = lora_a_SRD.shape
        h_TSR = (x_TD @ lora_a_SRD.reshape(s * r, d).astype(x_TD.dtype).T).reshape(-1, s, r)
        onehot_TS = _slot_onehot_TS(info, s, h_TSR.dtype)
        scale_T1 = (onehot_TS @ info.scalings_S[NO_ADAPTER + 1:].astype(h_TSR.dtype))[:, None]
        picked_TSR = jnp.where(onehot_TS[:, :, None] > 0, h_TSR[:, NO_ADAPTER + 1:], 0.0)
        return jnp.sum(picked_TSR, axis=1) * scale_T1

    def run_lora_b_gemm(self, h_TR, lora_b_SRO, info: LoRABatchInfo, base_output_TO=None):
        # B is (S, R, O): the adapter slots are one contiguous (S-1)*R x O matrix, no transpose.
        s, r, o = lora_b_SRO.shape
        onehot_TS = _slot_onehot_TS(info, s, h_TR.dtype)
        h_TX = (onehot_TS[:, :, None] * h_TR[:, None, :]).reshape(-1, (s - 1) * r)
        b_XO = lora_b_SRO[NO_ADAPTER + 1:].reshape((s - 1) * r, o).astype(h_TR.dtype)
        return add_base(h_TX @ b_XO, base_output_TO)
