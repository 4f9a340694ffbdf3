"""The LoRA compute interface, kept by name from sglang-jax.

Legend: T tokens, D in features, O out features, S adapter slots, R the row table's width
(max_lora_rank), U pool rows (see multilora.adapters.pool).
The weights a backend receives are one layer of a pool of rank rows, shared by every slot:
lora_a_UD holds A's rows (PEFT's rank x in layout, one row per unit of rank), lora_b_UO holds B's
rows (PEFT's out x rank, transposed: one (out,) row per unit of rank, so that every expand reads
a plain (rank, out) matrix). Which rows are a slot's is LoRABatchInfo.rows_SR; a stacked group
(q/k/v, gate/up) keeps one block of U rows per projection, so that one shrink serves them all
(`blocks`), giving h_TR with blocks * R columns.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from multilora.lora.batch import PAGE_ROWS, LoRABatchInfo, make_lora_batch_info, stacked_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PoolLayer:
    """One layer of a pool, not sliced out: the kernel indexes pool_L... at `layer` (the model
    hands these to backends whose `reads_pool_in_place` is set, so the scan copies no layer)."""

    pool: jax.Array
    layer: jax.Array


def pool_layer(w) -> PoolLayer:
    """A PoolLayer as it is; a plain (U, X) pool (one layer already picked) as a one-layer pool."""
    return w if isinstance(w, PoolLayer) else PoolLayer(w[None], jnp.int32(0))


class BaseLoRABackend:
    name = "base"

    def run_lora_a_gemm(self, x_TD: jax.Array, lora_a_UD: jax.Array, info: LoRABatchInfo,
                        blocks: int = 1) -> jax.Array:
        """Shrink: h_TR = (x_TD @ A[slot_t].T) * scaling[slot_t], A[s] the slot's rows of each of
        the pool's `blocks` blocks (h has blocks * R columns)."""
        raise NotImplementedError

    def run_lora_b_gemm(self, h_TR: jax.Array, lora_b_UO: jax.Array, info: LoRABatchInfo,
                        base_output_TO: jax.Array | None = None) -> jax.Array:
        """Expand: y_TO = h_TR @ B[slot_t], added to base_output_TO when given."""
        raise NotImplementedError

    def run_lora(self, x_TD: jax.Array, lora_a_UD: jax.Array, lora_b_UO: jax.Array,
                 info: LoRABatchInfo, base_output_TO: jax.Array | None = None) -> jax.Array:
        """One projection's delta, shrink then expand (o_proj, down_proj), added to
        base_output_TO when given."""
        return self.run_lora_b_gemm(self.run_lora_a_gemm(x_TD, lora_a_UD, info), lora_b_UO, info, base_output_TO)

    def run_qkv_lora(self, x_TD: jax.Array, qkv_a_UD: jax.Array, lora_b: Sequence[jax.Array], info: LoRABatchInfo,
                     base_outputs: Sequence[jax.Array] | None = None) -> tuple[jax.Array, ...]:
        """One shrink over the stacked q/k/v A (three blocks), then one expand per output; each
        added to its base output when base_outputs are given."""
        return add_bases(self._stacked(x_TD, qkv_a_UD, lora_b, info), base_outputs)

    def run_gate_up_lora(self, x_TD: jax.Array, gate_up_a_UD: jax.Array, lora_b: Sequence[jax.Array],
                         info: LoRABatchInfo, base_outputs: Sequence[jax.Array] | None = None) -> tuple[jax.Array, ...]:
        """One shrink over the stacked gate/up A (two blocks), then one expand per output; each
        added to its base output when base_outputs are given."""
        return add_bases(self._stacked(x_TD, gate_up_a_UD, lora_b, info), base_outputs)

    def _stacked(self, x_TD, a_UD, lora_b, info):
        h_TR = self.run_lora_a_gemm(x_TD, a_UD, info, len(lora_b))
        r = h_TR.shape[1] // len(lora_b)
        return tuple(self.run_lora_b_gemm(h_TR[:, i * r:(i + 1) * r], b_UO, info)
                     for i, b_UO in enumerate(lora_b))

    def plan_step(self, info: LoRABatchInfo, num_tokens: int, dims: Sequence[tuple[int, int]],
                  dtype) -> LoRABatchInfo:
        """Inside the step, before its layers: info with whatever the backend derives from it
        once for every layer's calls (LoRABatchInfo.kernel_plan). dims: the (in, out) features
        of each call it will get (run_qkv_lora's and run_gate_up_lora's outputs together);
        dtype: the activations'."""
        return info

    def prepare_lora_batch(self, slot_T: np.ndarray, scalings_S: np.ndarray, ranks_S: np.ndarray,
                           rows_SR: np.ndarray, max_grouped: int | None = None) -> LoRABatchInfo:
        """Host-side metadata -> LoRABatchInfo. Every backend reads the same fields, so a batch
        prepared once serves all layers and any backend (max_grouped: see make_lora_batch_info)."""
        return make_lora_batch_info(slot_T, scalings_S, ranks_S, rows_SR, max_grouped)


def slot_rows(pool_UX: jax.Array, info: LoRABatchInfo, slots_N: jax.Array, blocks: int = 1) -> jax.Array:
    """The weights of slots_N gathered from one layer's pool: (N, blocks * R, X). A table of
    whole pages (R a multiple of PAGE_ROWS, as LoRASlots keeps it) is gathered a page, an
    aligned run of PAGE_ROWS rows, per slice; any other width a row per slice."""
    rows_NR = jnp.take(info.rows_SR, slots_N, axis=0, mode="clip")
    paged = rows_NR.shape[1] % PAGE_ROWS == 0
    rows_NR = stacked_rows(rows_NR, blocks, pool_UX.shape[0] // blocks)
    n, r = rows_NR.shape
    if not paged:
        return jnp.take(pool_UX, rows_NR, axis=0, mode="clip")
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(2, 3), collapsed_slice_dims=(), start_index_map=(0,))
    first_NP1 = rows_NR[:, ::PAGE_ROWS, None]
    pages = jax.lax.gather(pool_UX, first_NP1, dims, slice_sizes=(PAGE_ROWS, pool_UX.shape[1]), mode="clip")
    return pages.reshape(n, r, pool_UX.shape[1])


def add_base(y_TO: jax.Array, base_output_TO: jax.Array | None) -> jax.Array:
    return y_TO if base_output_TO is None else base_output_TO + y_TO.astype(base_output_TO.dtype)


def add_bases(ys, base_outputs) -> tuple:
    """Each delta added to its base output (the deltas as they are where base_outputs is None)."""
    if base_outputs is None:
        return tuple(ys)
    if len(base_outputs) != len(ys):
        raise ValueError(f"{len(base_outputs)} base outputs for {len(ys)} LoRA outputs")
    return tuple(add_base(y, b) for y, b in zip(ys, base_outputs))


def token_scaling_T1(info: LoRABatchInfo, dtype) -> jax.Array:
    return jnp.take(info.scalings_S, info.slot_T, mode="clip")[:, None].astype(dtype)
