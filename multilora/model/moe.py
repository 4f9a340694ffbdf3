"""Qwen3-MoE's sparse MLP: the router's top-k and the experts as grouped matmuls.

    weights_TK, experts_TK = route(x_TD, router_DE, k, norm_topk_prob)
    y_TD = grouped_experts(x_TD, weights_TK, experts_TK, w_gate_EDM, w_up_EDM, w_down_EMD)

The router is transformers' Qwen3MoeTopKRouter: logits x @ W (in the activations' dtype), a
softmax over the experts in float32, the top k, renormalised to sum 1 when norm_topk_prob, cast
back. The experts run as grouped matmuls, never a loop over experts or tokens: the T*K routed
(token, expert) rows are sorted by expert (stable), gathered, and each expert's run of rows meets
its own matrices in one jax.lax.ragged_dot per projection (a grouped GEMM on TPU and GPU; on the
CPU XLA lowers it to a masked dense emulation, correct but E times the work: docs/design.md).
The rows' outputs are weighted, put back in token order by a gather (the inverse of the sort: no
scatter-add) and summed over each token's K experts. experts_reference is the plain-jnp
definition (every expert for every token) that tests/test_moe.py compares against.

LoRA on the router (PEFT's target_modules "gate", saved as target_parameters gate.weight) adds
to its logits through the LoRA backend, as any projection's. LoRA on the experts (PEFT's
target_parameters on gate_up_proj and down_proj: one low-rank delta
per expert, W_e + scaling * B_e A_e) is added to each routed row's gate/up and down outputs:
each row gathers its adapter's rows of its own expert from the pools (ExpertLoRA), as bgmv
gathers a token's; base rows add nothing, and a step without adapter rows runs none of it. The
LoRA backends (multilora.lora.backend) serve the attention, the dense MLP and the router; the experts' delta
is this one op whichever backend is chosen.

Legend: T tokens, D model dim, E experts, K experts per token, M an expert's ffn dim
(moe_intermediate_size), R = T * K routed rows, U adapter pool rows, W the row table's width
(rank rows of a slot), X/Y an expert's in/out features.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from multilora.lora.batch import NO_ADAPTER, NO_LORA, LoRABatchInfo
from multilora.model.layers import swiglu


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ExpertLoRA:
    """The experts' LoRA pools, stacked over layers as LoRAWeights holds them (a rank row: every
    expert's A row, or B row, side by side), the layer to read and the step's adapters."""

    gate_up_a_LUY: jax.Array
    gate_up_b_LUZ: jax.Array
    down_a_LUY: jax.Array
    down_b_LUZ: jax.Array
    layer: jax.Array
    info: LoRABatchInfo


def expert_lora_delta(x_RX: jax.Array, expert_R: jax.Array, slot_R: jax.Array, a_UY: jax.Array,
                      b_UZ: jax.Array, info: LoRABatchInfo, num_experts: int) -> jax.Array:
    """Each routed row's delta scaling[s] * B_{s,e} A_{s,e} x, s its adapter slot and e its
    expert (one layer's pools, (U, E * X) and (U, E * Y)); zero for base rows. In x's dtype."""
    u = a_UY.shape[0]
    a_UEX = a_UY.reshape(u, num_experts, -1)
    b_UEY = b_UZ.reshape(u, num_experts, -1)
    rows_RW = jnp.take(info.rows_SR, slot_R, axis=0, mode="clip")
    a_RWX = a_UEX[rows_RW, expert_R[:, None]].astype(x_RX.dtype)
    h_RW = jnp.einsum("rx,rwx->rw", x_RX, a_RWX)
    h_RW = h_RW * jnp.take(info.scalings_S, slot_R, mode="clip")[:, None].astype(h_RW.dtype)
    h_RW = jnp.where((slot_R == NO_ADAPTER)[:, None], 0.0, h_RW)  # never slot 0's rows
    b_RWY = b_UEY[rows_RW, expert_R[:, None]].astype(x_RX.dtype)
    return jnp.einsum("rw,rwy->ry", h_RW, b_RWY)


def route(x_TD: jax.Array, router_DE: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """(weights_TK in x's dtype, experts_TK int32): each token's k experts, most probable first."""
    logits_TE = jnp.einsum("td,de->te", x_TD.astype(router_DE.dtype), router_DE,
                           preferred_element_type=jnp.float32).astype(x_TD.dtype)
    return select_experts(logits_TE, k, norm_topk_prob)


def select_experts(logits_TE: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """route's choice from the router's logits (the model adds their LoRA delta first)."""
    probs_TE = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
    top_TK, experts_TK = jax.lax.top_k(probs_TE, k)
    if norm_topk_prob:
        top_TK = top_TK / jnp.sum(top_TK, axis=-1, keepdims=True)
    return top_TK.astype(logits_TE.dtype), experts_TK.astype(jnp.int32)


def _ragged(x_RX: jax.Array, w_EXY: jax.Array, sizes_E: jax.Array, out_dtype) -> jax.Array:
    """Each group's rows of x times its own matrix (groups in order, sizes_E rows each): the
    product in w's dtype, accumulated in float32, returned in out_dtype (as llama._proj)."""
    y = jax.lax.ragged_dot(x_RX.astype(w_EXY.dtype), w_EXY, sizes_E, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def grouped_experts(x_TD: jax.Array, weights_TK: jax.Array, experts_TK: jax.Array, w_gate_EDM: jax.Array,
                    w_up_EDM: jax.Array, w_down_EMD: jax.Array, lora: Optional[ExpertLoRA] = None) -> jax.Array:
    """sum over k of weights_TK[t, k] * expert_{experts_TK[t, k]}(x_t), the experts SwiGLU MLPs
    (w_down(silu(w_gate x) * w_up x)), as grouped matmuls over the rows sorted by expert; with
    `lora`, each row's adapter's delta of its expert added to its gate/up and down outputs."""
    t, k = experts_TK.shape
    e, m = w_gate_EDM.shape[0], w_gate_EDM.shape[2]
    flat_R = experts_TK.reshape(-1)
    order_R = jnp.argsort(flat_R, stable=True)
    sizes_E = jnp.bincount(flat_R, length=e).astype(jnp.int32)
    token_R, expert_R = order_R // k, jnp.take(flat_R, order_R)
    xs_RD = jnp.take(x_TD, token_R, axis=0)
    gate_RM, up_RM = _ragged(xs_RD, w_gate_EDM, sizes_E, x_TD.dtype), _ragged(xs_RD, w_up_EDM, sizes_E, x_TD.dtype)
    if lora is not None:
        slot_R = jnp.take(lora.info.slot_T, token_R, mode="clip")
        pick = lambda a: jax.lax.dynamic_index_in_dim(a, lora.layer, 0, keepdims=False)  # noqa: E731

        def add_gate_up():
            d = expert_lora_delta(xs_RD, expert_R, slot_R, pick(lora.gate_up_a_LUY), pick(lora.gate_up_b_LUZ),
                                  lora.info, e).astype(gate_RM.dtype)
            return gate_RM + d[:, :m], up_RM + d[:, m:]
        gate_RM, up_RM = jax.lax.cond(lora.info.mode != NO_LORA, add_gate_up, lambda: (gate_RM, up_RM))
    h_RM = swiglu(gate_RM, up_RM)
    y_RD = _ragged(h_RM, w_down_EMD, sizes_E, x_TD.dtype)
    if lora is not None:
        y_RD = jax.lax.cond(lora.info.mode != NO_LORA, lambda: y_RD + expert_lora_delta(
            h_RM, expert_R, slot_R, pick(lora.down_a_LUY), pick(lora.down_b_LUZ), lora.info, e).astype(y_RD.dtype),
            lambda: y_RD)
    y_RD = y_RD * jnp.take(weights_TK.reshape(-1), order_R)[:, None]
    unsort_R = jnp.argsort(order_R)  # row r of the sort holds routed row order_R[r]
    return jnp.sum(jnp.take(y_RD, unsort_R, axis=0).reshape(t, k, -1), axis=1)


def experts_reference(x_TD, weights_TK, experts_TK, w_gate_EDM, w_up_EDM, w_down_EMD):
    """The definition, dense: every expert's output for every token, weighted by the token's
    router weight for it (zero for the experts it did not pick)."""
    hp = jax.lax.Precision.HIGHEST
    gate_TEM = jnp.einsum("td,edm->tem", x_TD, w_gate_EDM, precision=hp)
    up_TEM = jnp.einsum("td,edm->tem", x_TD, w_up_EDM, precision=hp)
    y_TED = jnp.einsum("tem,emd->ted", swiglu(gate_TEM, up_TEM), w_down_EMD, precision=hp)
    w_TE = jnp.sum(jax.nn.one_hot(experts_TK, w_gate_EDM.shape[0], dtype=y_TED.dtype) * weights_TK[..., None], axis=1)
    return jnp.einsum("ted,te->td", y_TED, w_TE, precision=hp)
