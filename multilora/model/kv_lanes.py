"""Heads-major KV pages with f = 128 // H kv heads side by side in one 128-lane row, for a head
dim H under a TPU's 128 lanes (SmolLM2 and Llama-3.2-1B have H = 64).

Why: a heads-major page is one (p, H) tile a kv head, and a TPU pads a tile's minor dim to 128
lanes, so with H = 64 the cache holds half the pages its memory could and the attention copies
twice the bytes it uses (1.07 GB a 64-row decode step at the 1B shape, for 0.54 GB of K and V).
Packed, a page is (p, f * H) a group of f kv heads, no lane padded (the last group padded with
zero heads where f does not divide K).

The attention needs no other kernel: a group is a kv head of dim f * H whose f * G query heads
each carry their query in their own head's lanes and zeros in the others, so that a query's
product with a packed key is its own head's score, and its weighted sum of packed values holds
its own head's output in its own lanes (unpack_outputs takes it from there). The scores' scale
stays H ** -0.5. New K and V rows are packed the same way, a reshape.

Legend: T tokens, N query heads, K kv heads, G = N / K, H head dim, f heads a group, Kg groups.
"""

from __future__ import annotations

import os

import jax.numpy as jnp

from multilora.kernels.knobs import switch_knob

LANES = 128
# On by default where it applies (a v5e's 1B prefill 10.38 -> 9.50 ms, decode 7.38 -> 7.00 ms with
# its own chunk keys, benchmarks/log/47); MULTILORA_KV_LANE_PACK=0 keeps one kv head a row.
ENV = "MULTILORA_KV_LANE_PACK"


def lane_pack(head_dim: int) -> int:
    """Kv heads a 128-lane group holds: 128 // H where H divides 128 (1 at H >= 128)."""
    return LANES // head_dim if head_dim < LANES and LANES % head_dim == 0 else 1


def lane_pack_on(head_dim: int, platform: str, tensor_parallel: int = 1) -> int:
    """The pack factor an engine's heads-major cache is made with: lane_pack(H) on one TPU chip
    where the Pallas attention is on (the only attention that reads packed pages) unless
    $MULTILORA_KV_LANE_PACK is 0, else 1."""
    if not switch_knob(ENV, default=True) or platform != "tpu" or tensor_parallel != 1:
        return 1
    if os.environ.get("MULTILORA_PALLAS_ATTENTION", "1") == "0":
        return 1
    return lane_pack(head_dim)


def lane_pack_for(cfg, platform: str, tensor_parallel: int = 1) -> int:
    """lane_pack_on for a model (ModelConfig) whose heads-major cache the Pallas attention reads:
    1 for soft-capped models, whose steps take XLA's attention."""
    if cfg.attn_logit_softcapping is not None:
        return 1
    return lane_pack_on(cfg.head_dim, platform, tensor_parallel)


def groups(num_kv: int, pack: int) -> int:
    """Groups of `pack` kv heads (the last padded with zero heads)."""
    return -(-num_kv // pack)


def pack_rows(x_TKH, pack: int):
    """(T, Kg, f * H): each token's K (or V) heads side by side, zero heads after the last."""
    if pack == 1:
        return x_TKH
    t, kvh, h = x_TKH.shape
    pad = groups(kvh, pack) * pack - kvh
    if pad:
        x_TKH = jnp.pad(x_TKH, ((0, 0), (0, pad), (0, 0)))
    return x_TKH.reshape(t, -1, pack * h)


def pack_queries(q_TNH, num_kv: int, pack: int):
    """(T, Kg * f * G, f * H): query head g of kv head k = group k // f's head (k % f) * G + g,
    its values in lanes (k % f) * H on, zeros in the other heads' lanes."""
    if pack == 1:
        return q_TNH
    t, n, h = q_TNH.shape
    g = n // num_kv
    kg = groups(num_kv, pack)
    q = q_TNH.reshape(t, num_kv, g, h)
    if kg * pack > num_kv:
        q = jnp.pad(q, ((0, 0), (0, kg * pack - num_kv), (0, 0), (0, 0)))
    q = q.reshape(t, kg, pack, g, 1, h)
    own = jnp.eye(pack, dtype=q.dtype).reshape(1, 1, pack, 1, pack, 1)   # lanes of the head's own slot
    return (q * own).reshape(t, kg * pack * g, pack * h)


def unpack_outputs(o_TMW, num_kv: int, num_heads: int, pack: int):
    """(T, N, H) from the packed heads' outputs: each head's own lanes (pack_queries' order)."""
    t, _, w = o_TMW.shape
    h, g = w // pack, num_heads // num_kv
    o = o_TMW.reshape(t, -1, pack, g, pack, h)
    own = jnp.eye(pack, dtype=o.dtype).reshape(1, 1, pack, 1, pack, 1)
    return jnp.sum(o * own, axis=4).reshape(t, -1, h)[:, :num_heads]
