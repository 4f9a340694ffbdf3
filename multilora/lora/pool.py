"""Device slots for adapters: stacked A/B buffers padded to max_lora_rank, one slot per adapter
in a batch plus slot 0 ("no adapter", all zeros).

Putting an adapter into a slot rewrites buffer contents in place (an update that the runner
jits, buffers donated, slot index traced), so shapes never change and nothing recompiles.
Under tensor parallelism the buffers are sharded by LORA_AXES (B by output features where its
base layer is column-parallel, A by input features where it is row-parallel); a slot write takes
the new slot already split the same way and keeps every buffer's sharding (out_shardings), so
each device receives only its part and the compiled steps see the shardings they were built for.
Which adapter lives in which slot, and what to evict, is decided in multilora.lora.registry.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from multilora.config import LoRAConfig, ModelConfig
from multilora.lora.adapter import LoRAAdapter
from multilora.lora.batch import NO_ADAPTER
from multilora.model.llama import LoRAWeights
from multilora.model.sharding import LORA_AXES, dataclass_shardings, put, replicated, rules_for, without_axis


def lora_buffer_shapes(cfg: ModelConfig, num_slots: int, max_rank: int) -> dict[str, tuple[int, ...]]:
    L, S, R, D, F = cfg.num_layers, num_slots, max_rank, cfg.hidden_size, cfg.intermediate_size
    qo, kvo = cfg.q_dim, cfg.kv_dim
    return {
        "qkv_a_LSRD": (L, S, 3 * R, D),
        "q_b_LSRO": (L, S, R, qo),
        "k_b_LSRO": (L, S, R, kvo),
        "v_b_LSRO": (L, S, R, kvo),
        "o_a_LSRO": (L, S, R, qo),
        "o_b_LSRD": (L, S, R, D),
        "gate_up_a_LSRD": (L, S, 2 * R, D),
        "gate_b_LSRF": (L, S, R, F),
        "up_b_LSRF": (L, S, R, F),
        "down_a_LSRF": (L, S, R, F),
        "down_b_LSRD": (L, S, R, D),
    }


def init_lora_weights(cfg: ModelConfig, lora_cfg: LoRAConfig, dtype, mesh) -> LoRAWeights:
    shapes = lora_buffer_shapes(cfg, lora_cfg.num_slots, lora_cfg.max_lora_rank)
    shardings = lora_shardings(cfg, mesh)
    # Created in place, shard by shard: no device ever holds a whole (possibly large) buffer.
    return LoRAWeights(**{
        k: jnp.zeros(shape, dtype, device=getattr(shardings, k)) for k, shape in shapes.items()
    })


def lora_shardings(cfg: ModelConfig, mesh, axes_table=LORA_AXES) -> LoRAWeights:
    """A LoRAWeights of NamedShardings (per the rules table) for the slot buffers, or for one
    slot's arrays with axes_table=without_axis(LORA_AXES, "slots")."""
    host = LoRAWeights(**{k: np.zeros((), np.float32) for k in LORA_AXES})
    return dataclass_shardings(host, axes_table, mesh, rules_for(cfg, mesh))


def adapter_slot_arrays(adapter: LoRAAdapter | None, cfg: ModelConfig, max_rank: int) -> LoRAWeights:
    """One slot's contents (host float32, no S axis), laid out like LoRAWeights: A rows past a
    module's rank and every untargeted module stay zero."""
    shapes = {k: s[:1] + s[2:] for k, s in lora_buffer_shapes(cfg, 1, max_rank).items()}
    out = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    if adapter is None:
        return LoRAWeights(**out)
    R = max_rank
    mods = adapter.modules

    def put_a(field, module, block=0):
        if module in mods:
            a_LRI = mods[module][0]
            out[field][:, block * R:block * R + a_LRI.shape[1]] = a_LRI

    def put_b(field, module):
        if module in mods:
            b_LOR = mods[module][1]  # PEFT's (out, rank); the slots keep (rank, out)
            out[field][:, :b_LOR.shape[2], :] = b_LOR.transpose(0, 2, 1)

    for i, m in enumerate(("q_proj", "k_proj", "v_proj")):
        put_a("qkv_a_LSRD", m, i)
    for i, m in enumerate(("gate_proj", "up_proj")):
        put_a("gate_up_a_LSRD", m, i)
    put_a("o_a_LSRO", "o_proj")
    put_a("down_a_LSRF", "down_proj")
    for field, m in (("q_b_LSRO", "q_proj"), ("k_b_LSRO", "k_proj"), ("v_b_LSRO", "v_proj"),
                     ("o_b_LSRD", "o_proj"), ("gate_b_LSRF", "gate_proj"), ("up_b_LSRF", "up_proj"),
                     ("down_b_LSRD", "down_proj")):
        put_b(field, m)
    return LoRAWeights(**out)


def write_slot(lora: LoRAWeights, slot: jax.Array, new: LoRAWeights) -> LoRAWeights:
    """Pure: lora with slot `slot` replaced by `new` (jitted with donation in the runner)."""
    return jax.tree.map(
        lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), slot, axis=1),
        lora, new)


class LoRASlots:
    """The device buffers plus each slot's scaling and rank (host arrays fed to every batch)."""

    def __init__(self, cfg: ModelConfig, lora_cfg: LoRAConfig, dtype, mesh, jit_writer=None):
        """jit_writer: the runner's jit_slot_writer (jit lives in the runner; it is handed in so
        that this module does not import the runner). Without it slots are written eagerly."""
        self.cfg, self.lora_cfg = cfg, lora_cfg
        self.shardings = lora_shardings(cfg, mesh)
        self.weights = init_lora_weights(cfg, lora_cfg, dtype, mesh)
        self._slot_shardings = lora_shardings(cfg, mesh, without_axis(LORA_AXES, "slots"))
        self._write = (jit_writer(write_slot, self.weights, self.shardings, self._slot_shardings,
                                  replicated(mesh)) if jit_writer is not None else write_slot)
        self.scalings_S = np.zeros((lora_cfg.num_slots,), np.float32)
        self.ranks_S = np.zeros((lora_cfg.num_slots,), np.int32)

    @property
    def num_slots(self) -> int:
        return self.lora_cfg.num_slots

    def _check(self, slot: int):
        if not (NO_ADAPTER < slot < self.num_slots):
            raise ValueError(f"slot {slot} out of range: adapter slots are 1..{self.num_slots - 1} "
                             f"(slot {NO_ADAPTER} is the base model)")

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        self._check(slot)
        if adapter.rank > self.lora_cfg.max_lora_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank} > max_lora_rank "
                             f"{self.lora_cfg.max_lora_rank}")
        new = adapter_slot_arrays(adapter, self.cfg, self.lora_cfg.max_lora_rank)
        self.weights = self._write(self.weights, np.int32(slot), jax.tree.map(put, new, self._slot_shardings))
        self.scalings_S[slot] = adapter.scaling
        self.ranks_S[slot] = adapter.rank

    def clear(self, slot: int) -> None:
        self._check(slot)
        new = adapter_slot_arrays(None, self.cfg, self.lora_cfg.max_lora_rank)
        self.weights = self._write(self.weights, np.int32(slot), jax.tree.map(put, new, self._slot_shardings))
        self.scalings_S[slot] = 0.0
        self.ranks_S[slot] = 0
