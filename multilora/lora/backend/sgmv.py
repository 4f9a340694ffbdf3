"""SGMV: tokens grouped by adapter into tiles of M rows, one small batched matmul over tiles.

`jax.lax.ragged_dot` would be the natural grouped matmul, but on the CPU it lowers to a masked
dense emulation (a copy of x per group); fixed-size tiles sorted by slot keep every shape static
and the work proportional to the tokens. Base-model tokens are in no tile and get zeros.
Where the worst-case tiles would pad the batch far beyond its tokens (many slots) and each tile
is a large matmul (wide inputs), a fori_loop visits only the tiles actually used instead, reading
each tile's adapter rows inside the loop rather than materializing per-tile copies.
Legend: G tiles, M rows per tile (see multilora.lora.batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from multilora.lora.backend.base import BaseLoRABackend, add_base, slot_rows
from multilora.lora.batch import NO_ADAPTER, LoRABatchInfo

LOOP_MIN_WIDTH = 1024  # below this input width a loop iteration costs more than the padding saves


def _to_tiles(x_TX: jax.Array, info: LoRABatchInfo) -> jax.Array:
    x_pad = jnp.concatenate([x_TX, jnp.zeros((1, x_TX.shape[1]), x_TX.dtype)], axis=0)
    return jnp.take(x_pad, info.tile_rows_GM, axis=0, mode="clip")  # (G, M, X)


def _from_tiles(y_GMX: jax.Array, info: LoRABatchInfo) -> jax.Array:
    g, m, x = y_GMX.shape
    y_pad = jnp.concatenate([y_GMX.reshape(g * m, x), jnp.zeros((1, x), y_GMX.dtype)], axis=0)
    return jnp.take(y_pad, info.token_pos_T, axis=0, mode="clip")


def shrink_tiles(x_TD, lora_a_UD, info: LoRABatchInfo, blocks: int = 1) -> jax.Array:
    x_GMD = _to_tiles(x_TD, info)
    a_GRD = slot_rows(lora_a_UD, info, info.tile_slot_G, blocks).astype(x_TD.dtype)
    h_GMR = jnp.einsum("gmd,grd->gmr", x_GMD, a_GRD)
    scale_G11 = jnp.take(info.scalings_S, info.tile_slot_G, mode="clip")[:, None, None].astype(h_GMR.dtype)
    return h_GMR * scale_G11


def expand_tiles(h_GMR, lora_b_UO, info: LoRABatchInfo) -> jax.Array:
    b_GRO = slot_rows(lora_b_UO, info, info.tile_slot_G).astype(h_GMR.dtype)
    y_GMO = jnp.einsum("gmr,gro->gmo", h_GMR, b_GRO)
    return _from_tiles(y_GMO, info)


def _use_loop(info: LoRABatchInfo, num_tokens: int, width: int) -> bool:
    """Static per compiled shape: tiles padded beyond 2x the tokens, and wide inputs."""
    g, m = info.tile_rows_GM.shape
    return g * m > 2 * num_tokens and width >= LOOP_MIN_WIDTH


def tile_loop(in_TX, pool_UX, info: LoRABatchInfo, scale: bool, is_a: bool, blocks: int = 1) -> jax.Array:
    """out[t] = in[t] @ w[slot_t] (* scaling) over the used tiles only (a prefix of the tile
    list); padding rows read and write row T, which is dropped. A tile's weights are its slot's
    rows of the pool: (R, in) for A (the dot reads them transposed), (R, out) for B."""
    t = in_TX.shape[0]
    in_pad = jnp.concatenate([in_TX, jnp.zeros((1, in_TX.shape[1]), in_TX.dtype)], axis=0)

    def body(g, out_pad):
        slot = info.tile_slot_G[g]
        rows_M = info.tile_rows_GM[g]
        in_MX = in_pad.at[rows_M].get(mode="promise_in_bounds")
        w = slot_rows(pool_UX, info, slot[None], blocks)[0].astype(in_TX.dtype)
        out_MY = in_MX @ (w.T if is_a else w)
        if scale:
            out_MY = out_MY * info.scalings_S[slot].astype(out_MY.dtype)
        return out_pad.at[rows_M].set(out_MY, mode="promise_in_bounds")

    width = blocks * info.rows_SR.shape[1] if is_a else pool_UX.shape[1]
    out_pad = jnp.zeros((t + 1, width), in_TX.dtype)
    used = jnp.sum(info.tile_slot_G != NO_ADAPTER)
    return jax.lax.fori_loop(0, used, body, out_pad)[:t]


class SgmvLoRABackend(BaseLoRABackend):
    name = "sgmv"

    def run_lora_a_gemm(self, x_TD, lora_a_UD, info: LoRABatchInfo, blocks: int = 1):
        if _use_loop(info, x_TD.shape[0], x_TD.shape[1]):
            return tile_loop(x_TD, lora_a_UD, info, scale=True, is_a=True, blocks=blocks)
        return _from_tiles(shrink_tiles(x_TD, lora_a_UD, info, blocks), info)

    def run_lora_b_gemm(self, h_TR, lora_b_UO, info: LoRABatchInfo, base_output_TO=None):
        if _use_loop(info, h_TR.shape[0], lora_b_UO.shape[1]):
            return add_base(tile_loop(h_TR, lora_b_UO, info, scale=False, is_a=False), base_output_TO)
        return add_base(expand_tiles(_to_tiles(h_TR, info), lora_b_UO, info), base_output_TO)

    def _stacked(self, x_TD, a_UD, lora_b, info):
        if _use_loop(info, x_TD.shape[0], x_TD.shape[1]):
            return BaseLoRABackend._stacked(self, x_TD, a_UD, lora_b, info)
        # Stay in tile space between the shrink and the expands: one regroup, not one per output.
        h_GMR = shrink_tiles(x_TD, a_UD, info, len(lora_b))
        r = h_GMR.shape[-1] // len(lora_b)
        return tuple(expand_tiles(h_GMR[..., i * r:(i + 1) * r], b_UO, info)
                     for i, b_UO in enumerate(lora_b))
