"""LoRA through a Pallas TPU kernel that reads only the step's own adapters, in place.

Each call's deltas (one projection's, or q/k/v's and gate/up's together) are one kernel call
(multilora.kernels.lora_pallas): the step's distinct adapters (LoRABatchInfo.step_slots_A, in
order of first appearance) are walked a chunk at a time, their pages DMA'd from the pool at the
step's layer straight into VMEM, shrink and expand fused.
Its cost follows the step's adapters and tokens, not the pool's slots: the XLA backends' gathers
(bgmv, sgmv, dense) cost far more than their bytes on a TPU, and the one-hot product over every
slot (sglang-jax's, `dense` here) reads the whole pool every step.

Off a TPU the kernel runs in Pallas's TPU interpreter (slow; the tests' path): `auto` takes this
backend on TPUs only. run_lora_a_gemm / run_lora_b_gemm alone (the interface kept from
sglang-jax) go through `dense`'s one-hot arithmetic over the step's adapters in plain XLA; the model
calls the fused run_lora / run_qkv_lora / run_gate_up_lora.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from multilora.kernels.lora_pallas import lora_deltas, lora_plan, token_tile
from multilora.lora.backend.base import BaseLoRABackend, add_base, pool_layer, slot_rows
from multilora.lora.backend.dense import onehot_expand, onehot_shrink
from multilora.lora.batch import NO_ADAPTER, PAGE_ROWS, PER_TOKEN, LoRABatchInfo


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

    def plan_step(self, info: LoRABatchInfo, num_tokens: int, dims, dtype) -> LoRABatchInfo:
        """The kernel's per-step metadata (lora_plan), for the token tiles the step's calls will
        take (dims: each call's input features and its outputs' together), made once instead of
        in each of the step's layers x calls."""
        if not _paged(info):
            return info
        tiles = {token_tile(num_tokens, d, o, jnp.dtype(dtype).itemsize) for d, o in dims}
        plan = lora_plan(info.step_slots_A, info.local_T, info.rows_SR, info.scalings_S, tuple(tiles))
        return dataclasses.replace(info, kernel_plan=plan)

    def _deltas(self, x_TD, a, bs, info: LoRABatchInfo):
        """Every output of one A pool (its len(bs) blocks) in one kernel call. The callers add the
        base outputs with XLA (the kernel's own add was slower on a v5e, benchmarks/log/49)."""
        a = pool_layer(a)
        bs = [pool_layer(b).pool for b in bs]
        return lora_deltas(x_TD, a.pool, bs, a.layer, info.step_slots_A, info.local_T, info.rows_SR,
                           info.scalings_S, a_blocks=len(bs), interpret=_interpret(), plan=info.kernel_plan)

    def run_lora(self, x_TD, lora_a_UD, lora_b_UO, info: LoRABatchInfo, base_output_TO=None):
        if not _paged(info):
            return super().run_lora(x_TD, lora_a_UD, lora_b_UO, info, base_output_TO)
        return add_base(self._deltas(x_TD, lora_a_UD, (lora_b_UO,), info)[0], base_output_TO)

    def _stacked(self, x_TD, a_UD, lora_b, info):
        """run_qkv_lora / run_gate_up_lora's deltas (the base class adds their base outputs)."""
        if not _paged(info):
            return super()._stacked(x_TD, a_UD, lora_b, info)
        return self._deltas(x_TD, a_UD, lora_b, info)

    # The interface's separate shrink and expand: dense's one-hot arithmetic over the step's
    # adapters (padding entries, slot 0, read as zeros).
    def run_lora_a_gemm(self, x_TD, lora_a_UD, info: LoRABatchInfo, blocks: int = 1):
        a = pool_layer(lora_a_UD)
        a_ARD = _step_rows(slot_rows(a.pool[a.layer], info, info.step_slots_A, blocks), info)
        return onehot_shrink(x_TD, a_ARD, info.local_T, jnp.take(info.scalings_S, info.step_slots_A))

    def run_lora_b_gemm(self, h_TR, lora_b_UO, info: LoRABatchInfo, base_output_TO=None):
        b = pool_layer(lora_b_UO)
        b_ARO = _step_rows(slot_rows(b.pool[b.layer], info, info.step_slots_A), info)
        return add_base(onehot_expand(h_TR, b_ARO, info.local_T), base_output_TO)


def _step_rows(w_ARX, info: LoRABatchInfo):
    """The step's adapters' rows, zeros for the padding entries (never slot 0's rows)."""
    return jnp.where((info.step_slots_A == NO_ADAPTER)[:, None, None], 0, w_ARX)
