"""Per-batch LoRA metadata: which adapter slot each token uses, and the grouping a segmented
(SGMV) backend needs. Built once per batch on the host, shared by every layer.

Slot NO_ADAPTER (0) means "base model only": its buffers are all zeros and both backends skip it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from multilora.config import NO_ADAPTER, PAGE_ROWS, LoRAType  # noqa: F401  (defined in config, which has no jax)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoRABatchInfo:
    """Device arrays describing one batch's adapters.

    slot_T:       adapter slot of each token (NO_ADAPTER for base rows and padding).
    scalings_S:   per-slot scaling (alpha / r, or alpha / sqrt(r) with rsLoRA).
    ranks_S:      per-slot rank (0 for empty slots).
    rows_SR:      per-slot row table: the pool row holding rank row r of slot s (multilora.adapters.pool),
                  in aligned runs of PAGE_ROWS (pages) when its width is a multiple of PAGE_ROWS;
                  entries past a slot's pages, and every entry of an empty slot, name page 0
                  (zeros), rows past its rank inside its last page hold zeros.
    tile_slot_G:  SGMV: the slot of each tile of rows.
    tile_rows_GM: SGMV: token index of each row of each tile (T = padding, reads a zero row).
    token_pos_T:  SGMV: where token t sits in the flattened tiles (G*M = "no adapter", zero row).
    step_slots_A: the step's distinct adapter slots in order of first appearance, padded with
                  NO_ADAPTER to A (static: as many adapters as a step may use, at most
                  max_num_seqs however many slots the pool holds): what a kernel that reads only
                  the step's own adapters walks (multilora.kernels.lora_pallas).
    local_T:      each token's index into step_slots_A (A for base rows and padding).
    mode:         which path a step takes (a scalar): NO_LORA (no row has an adapter: no LoRA op
                  runs), GROUPED (the tiles above hold every adapter row) or PER_TOKEN (more
                  distinct adapters than the tiles were sized for: the tiles are empty and a
                  per-token backend runs).
    kernel_plan:  what a backend derives from the fields above once per step, inside the step,
                  for every layer's calls (BaseLoRABackend.plan_step; None until then).
    """

    slot_T: jax.Array
    scalings_S: jax.Array
    ranks_S: jax.Array
    rows_SR: jax.Array
    tile_slot_G: jax.Array
    tile_rows_GM: jax.Array
    token_pos_T: jax.Array
    step_slots_A: jax.Array
    local_T: jax.Array
    mode: jax.Array
    kernel_plan: Any = None


def stacked_rows(rows_R, blocks: int, num_rows: int):
    """Row ids of every block of a stacked pool (multilora.adapters.pool): rows_R (..., R) ->
    (..., blocks * R), block j offset by j * num_rows. numpy or jax arrays alike."""
    if blocks == 1:
        return rows_R
    xp = np if isinstance(rows_R, np.ndarray) else jax.numpy
    return xp.concatenate([rows_R + j * num_rows for j in range(blocks)], axis=-1)


# LoRABatchInfo.mode
NO_LORA, GROUPED, PER_TOKEN = 0, 1, 2


def sgmv_tile_rows(num_tokens: int, num_slots: int = 9) -> int:
    """Rows per SGMV tile, static for a compiled (tokens, slots) shape. Tiles are padded in the
    worst case (one partial tile per adapter), so with many slots they shrink towards
    T / adapters rows: that keeps the padded rows near 2T instead of T + slots * M."""
    if num_tokens <= 64:
        m = 8
    elif num_tokens <= 512:
        m = 32
    else:
        m = 64
    per_adapter = num_tokens // max(num_slots - 1, 1)
    while m > 8 and m > per_adapter:
        m //= 2
    return m


def sgmv_num_tiles(num_tokens: int, num_slots: int) -> int:
    """Upper bound of tiles: full tiles plus one partial tile per adapter in the batch."""
    m = sgmv_tile_rows(num_tokens, num_slots)
    return -(-num_tokens // m) + min(num_slots - 1, num_tokens)


def group_tokens_by_slot(slot_T: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort tokens by slot into tiles of M rows: (tile_slot_G, tile_rows_GM, token_pos_T).

    Tokens in NO_ADAPTER are left out of every tile; unused tiles use slot NO_ADAPTER and
    padding rows, so their products are zeros that nothing reads.
    """
    t = int(slot_T.shape[0])
    m = sgmv_tile_rows(t, num_slots)
    g = sgmv_num_tiles(t, num_slots)
    tile_slot = np.full((g,), NO_ADAPTER, np.int32)
    tile_rows = np.full((g, m), t, np.int32)
    token_pos = np.full((t,), g * m, np.int32)
    if t == 0:
        return tile_slot, tile_rows, token_pos
    order = np.argsort(slot_T, kind="stable")
    sorted_slots = slot_T[order]
    tile = 0
    starts = np.flatnonzero(np.r_[True, sorted_slots[1:] != sorted_slots[:-1]])
    ends = np.r_[starts[1:], t]
    for s0, s1 in zip(starts, ends):
        slot = int(sorted_slots[s0])
        if slot == NO_ADAPTER:
            continue
        toks = order[s0:s1]
        for c0 in range(0, len(toks), m):
            chunk = toks[c0:c0 + m]
            tile_slot[tile] = slot
            tile_rows[tile, :len(chunk)] = chunk
            token_pos[chunk] = tile * m + np.arange(len(chunk))
            tile += 1
    assert tile <= g, (tile, g)
    return tile_slot, tile_rows, token_pos


def step_adapters(slot_T: np.ndarray, num_adapters: int) -> tuple[np.ndarray, np.ndarray]:
    """(step_slots_A, local_T): the distinct adapter slots of slot_T in order of first appearance,
    padded with NO_ADAPTER to num_adapters, and each token's index into them (num_adapters for
    NO_ADAPTER). A step with more distinct adapters than num_adapters keeps the first ones and
    names the others num_adapters too: its mode is PER_TOKEN, which a step-adapter kernel refuses."""
    slot_T = np.asarray(slot_T, np.int32)
    uniq, first = np.unique(slot_T, return_index=True)
    keep = uniq != NO_ADAPTER
    ordered = uniq[keep][np.argsort(first[keep], kind="stable")][:num_adapters]
    step_slots = np.full((num_adapters,), NO_ADAPTER, np.int32)
    step_slots[:len(ordered)] = ordered
    index_of = np.full((int(slot_T.max(initial=0)) + 1,), num_adapters, np.int32)
    index_of[ordered] = np.arange(len(ordered), dtype=np.int32)
    return step_slots, index_of[slot_T] if slot_T.size else np.zeros((0,), np.int32)


def make_lora_batch_info(slot_T: np.ndarray, scalings_S: np.ndarray, ranks_S: np.ndarray,
                         rows_SR: np.ndarray, max_grouped: int | None = None) -> LoRABatchInfo:
    """Host arrays -> LoRABatchInfo (numpy; jit moves them to the device). max_grouped: size the
    tiles for at most this many distinct adapters (static per compiled shape, however many
    slots there are); a step with more gets empty tiles and mode PER_TOKEN."""
    slot_T = np.asarray(slot_T, np.int32)
    num_slots = int(scalings_S.shape[0])
    if slot_T.size and (slot_T.min() < 0 or slot_T.max() >= num_slots):
        raise ValueError(f"adapter slot out of range: slots must be in [0, {num_slots})")
    rows_SR = np.asarray(rows_SR, np.int32)
    if rows_SR.ndim != 2 or rows_SR.shape[0] != num_slots or np.shape(ranks_S) != (num_slots,):
        raise ValueError(f"rows_SR must be (slots, max_rank) and ranks_S (slots,) for {num_slots} slots, "
                         f"got {rows_SR.shape} and {np.shape(ranks_S)}")
    tile_slots = num_slots if max_grouped is None else max(1, min(num_slots, max_grouped + 1))
    distinct = int(np.count_nonzero(np.unique(slot_T) != NO_ADAPTER))
    if distinct == 0:
        mode = NO_LORA
    elif max_grouped is None or distinct <= max_grouped:
        mode = GROUPED
    else:
        mode = PER_TOKEN
    step_slots, local = step_adapters(slot_T, max(1, tile_slots - 1))
    grouped_slots = slot_T if mode == GROUPED else np.zeros_like(slot_T)
    tile_slot, tile_rows, token_pos = group_tokens_by_slot(grouped_slots, tile_slots)
    return LoRABatchInfo(
        slot_T=slot_T,
        scalings_S=np.asarray(scalings_S, np.float32),
        ranks_S=np.asarray(ranks_S, np.int32),
        rows_SR=rows_SR,
        tile_slot_G=tile_slot,
        tile_rows_GM=tile_rows,
        token_pos_T=token_pos,
        step_slots_A=step_slots,
        local_T=local,
        mode=np.int32(mode),
    )
