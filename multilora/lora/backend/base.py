"""The LoRA compute interface, kept by name from sglang-jax.

Legend: T tokens, D in features, O out features, S adapter slots, R (padded) rank.
A keeps PEFT's layout, lora_a_SRD (rank x in); B is stored transposed from PEFT's (out x rank), as
lora_b_SRO (rank x out), so that every expand reads it as a plain (rank, out) matrix. Stacked groups
(q/k/v, gate/up) put their A matrices one after another along R so that one shrink serves them.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from multilora.lora.batch import LoRABatchInfo, make_lora_batch_info


class BaseLoRABackend:
    name = "base"

    def run_lora_a_gemm(self, x_TD: jax.Array, lora_a_SRD: jax.Array, info: LoRABatchInfo) -> jax.Array:
        """Shrink: h_TR = (x_TD @ A[slot_t].T) * scaling[slot_t]."""
        raise NotImplementedError

    def run_lora_b_gemm(self, h_TR: jax.Array, lora_b_SRO: jax.Array, info: LoRABatchInfo,
                        base_output_TO: jax.Array | None = None) -> jax.Array:
        """Expand: y_TO = h_TR @ B[slot_t], added to base_output_TO when given."""
        raise NotImplementedError

    def run_qkv_lora(self, x_TD: jax.Array, qkv_a_SRD: jax.Array,
                     lora_b: Sequence[jax.Array], info: LoRABatchInfo) -> tuple[jax.Array, ...]:
        """One shrink over the stacked q/k/v A (R = 3 * rank), then one expand per output."""
        return self._stacked(x_TD, qkv_a_SRD, lora_b, info)

    def run_gate_up_lora(self, x_TD: jax.Array, gate_up_a_SRD: jax.Array,
                         lora_b: Sequence[jax.Array], info: LoRABatchInfo) -> tuple[jax.Array, ...]:
        """One shrink over the stacked gate/up A (R = 2 * rank), then one expand per output."""
        return self._stacked(x_TD, gate_up_a_SRD, lora_b, info)

    def _stacked(self, x_TD, a_SRD, lora_b, info):
        h_TR = self.run_lora_a_gemm(x_TD, a_SRD, info)
        r = a_SRD.shape[1] // len(lora_b)
        return tuple(self.run_lora_b_gemm(h_TR[:, i * r:(i + 1) * r], b_SRO, info)
                     for i, b_SRO in enumerate(lora_b))

    def prepare_lora_batch(self, slot_T: np.ndarray, scalings_S: np.ndarray,
                           ranks_S: np.ndarray, max_grouped: int | None = None) -> LoRABatchInfo:
        """Host-side metadata -> LoRABatchInfo. Every backend reads the same fields, so a batch
        prepared once serves all layers and any backend (max_grouped: see make_lora_batch_info)."""
        return make_lora_batch_info(slot_T, scalings_S, ranks_S, max_grouped)


def add_base(y_TO: jax.Array, base_output_TO: jax.Array | None) -> jax.Array:
    return y_TO if base_output_TO is None else base_output_TO + y_TO.astype(base_output_TO.dtype)


def token_scaling_T1(info: LoRABatchInfo, dtype) -> jax.Array:
    return jnp.take(info.scalings_S, info.slot_T, mode="clip")[:, None].astype(dtype)
