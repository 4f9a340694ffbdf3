"""LoRA through a Pallas TPU kernel that reads only the step's own adapters, in place.

Each projection's delta is one kernel call (multilora.kernels.lora_pallas): the step's distinct
adapters (LoRABatchInfo.step_slots_A, in order of first appearance) are walked a chunk at a time,
their pages DMA'd from the pool at the step's layer straight into VMEM, shrink and expand fused.
Its cost follows the step's adapters and tokens, not the pool's slots: the XLA backends' gathers
(bgmv, sgmv, dense) cost far more than their bytes on a TPU, and the one-hot product over every
slot (sglang-jax's, `dense` here) reads the whole pool every step.

Off a TPU the kernel runs in Pallas's TPU interpreter (slow; the tests' path): `auto` takes this
backend on TPUs only. run_lora_a_gemm / run_lora_b_gemm alone (the interface kept from
sglang-jax) go through the `dense` arithmetic over the step's adapters in plain XLA; the model
calls the fused run_lora / run_qkv_lora / run_gate_up_lora.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from multilora.kernels.lora_pallas import lora_delta
from multilora.lora.backend.base import BaseLoRABackend, add_base, pool_layer, slot_rows
from multilora.lora.batch import PAGE_ROWS, PER_TOKEN, LoRABatchInfo


def _paged(info: LoRABatchInfo) -> bool:
    """The kernel reads whole pages: a row table of whole pages (as the engine's pools keep it);
    other widths (hand-made tables) take the XLA arithmetic below."""
    return info.rows_SR.shape[1] % PAGE_ROWS == 0


def _interpret() -> bool:
    return jax.default_backend() != "tpu"


class PallasLoRABackend(BaseLoRABackend):
    name = "pallas"
    reads_pool_in_place = True

    def prepare_lora_batch(self, slot_T, scalings_S, ranks_S, rows_SR, max_grouped=None) -> LoRABatchInfo:
        info = super().prepare_lora_batch(slot_T, scalings_S, ranks_S, rows_SR, max_grouped)
        if int(info.mode) == PER_TOKEN:
            raise ValueError(f"lora_backend 'pallas': a step uses more distinct adapters than the "
                             f"{info.step_slots_A.shape[0]} it was compiled for (max_num_seqs)")
        return info

    def _delta(self, x_TD, a, b, info: LoRABatchInfo, a_block: int = 0, a_blocks: int = 1):
        a, b = pool_layer(a), pool_layer(b)
        return lora_delta(x_TD, a.pool, b.pool, a.layer, info.step_slots_A, info.local_T, info.rows_SR,
                          info.scalings_S, a_block, a_blocks, interpret=_interpret())

    def run_lora(self, x_TD, lora_a_UD, lora_b_UO, info: LoRABatchInfo):
        if not _paged(info):
            return super().run_lora(x_TD, lora_a_UD, lora_b_UO, info)
        return self._delta(x_TD, lora_a_UD, lora_b_UO, info)

    def _stacked(self, x_TD, a_UD, lora_b, info):
        if not _paged(info):
            return super()._stacked(x_TD, a_UD, lora_b, info)
        return tuple(self._delta(x_TD, a_UD, b_UO, info, i, len(lora_b)) for i, b_UO in enumerate(lora_b))

    # The interface's separate shrink and expand: the one-hot arithmetic over the step's adapters.
    def run_lora_a_gemm(self, x_TD, lora_a_UD, info: LoRABatchInfo, blocks: int = 1):
        a = pool_layer(lora_a_UD)
        a_ARD = slot_rows(a.pool[a.layer], info, info.step_slots_A, blocks).astype(x_TD.dtype)
        n, r, d = a_ARD.shape
        h_TAR = (x_TD @ a_ARD.reshape(n * r, d).T).reshape(-1, n, r)
        onehot_TA = jax.nn.one_hot(info.local_T, n, dtype=h_TAR.dtype)
        scale_T1 = (onehot_TA @ jnp.take(info.scalings_S, info.step_slots_A).astype(h_TAR.dtype))[:, None]
        return jnp.einsum("tar,ta->tr", h_TAR, onehot_TA) * scale_T1

    def run_lora_b_gemm(self, h_TR, lora_b_UO, info: LoRABatchInfo, base_output_TO=None):
        b = pool_layer(lora_b_UO)
        b_ARO = slot_rows(b.pool[b.layer], info, info.step_slots_A).astype(h_TR.dtype)
        n, r, o = b_ARO.shape
        onehot_TA = jax.nn.one_hot(info.local_T, n, dtype=h_TR.dtype)
        y_TO = (onehot_TA[:, :, None] * h_TR[:, None, :]).reshape(-1, n * r) @ b_ARO.reshape(n * r, o)
        return add_base(y_TO, base_output_TO)
