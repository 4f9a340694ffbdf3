"""Logical axis names -> mesh axes, in one rules table.

Every array names its axes logically ("vocab", "q_out", "ffn", ...); the rules map them to the
mesh's "tp" axis or to replication. One device is a 1-device mesh, so tensor parallelism is a
change of mesh, not of model code. Megatron-style: q/k/v and gate/up split by output features,
o and down by input features; LoRA B follows its column-parallel base layer's output split, LoRA
A its row-parallel base layer's input split, and the other factor is replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multilora.config import ModelConfig

TP = "tp"

# Logical axis -> mesh axis (None: replicated).
BASE_RULES: dict[str, str | None] = {
    "layers": None,
    "embed": None,
    "vocab": TP,
    "q_out": TP,
    "kv_out": TP,
    "ffn": TP,
    "kv_heads": TP,
    "head_dim": None,
    "pages": None,
    "page": None,
    "slots": None,
    "rank": None,
}

WEIGHT_AXES = {
    "embed_VD": ("vocab", "embed"),
    "final_norm_D": ("embed",),
    "lm_head_DV": ("embed", "vocab"),
    "attn_norm_LD": ("layers", "embed"),
    "mlp_norm_LD": ("layers", "embed"),
    "wq_LDO": ("layers", "embed", "q_out"),
    "wk_LDO": ("layers", "embed", "kv_out"),
    "wv_LDO": ("layers", "embed", "kv_out"),
    "wo_LOD": ("layers", "q_out", "embed"),
    "bq_LO": ("layers", "q_out"),
    "bk_LO": ("layers", "kv_out"),
    "bv_LO": ("layers", "kv_out"),
    "w_gate_LDF": ("layers", "embed", "ffn"),
    "w_up_LDF": ("layers", "embed", "ffn"),
    "w_down_LFD": ("layers", "ffn", "embed"),
}

LORA_AXES = {
    "qkv_a_LSRD": ("layers", "slots", "rank", "embed"),
    "q_b_LSOR": ("layers", "slots", "q_out", "rank"),
    "k_b_LSOR": ("layers", "slots", "kv_out", "rank"),
    "v_b_LSOR": ("layers", "slots", "kv_out", "rank"),
    "o_a_LSRO": ("layers", "slots", "rank", "q_out"),
    "o_b_LSDR": ("layers", "slots", "embed", "rank"),
    "gate_up_a_LSRD": ("layers", "slots", "rank", "embed"),
    "gate_b_LSFR": ("layers", "slots", "ffn", "rank"),
    "up_b_LSFR": ("layers", "slots", "ffn", "rank"),
    "down_a_LSRF": ("layers", "slots", "rank", "ffn"),
    "down_b_LSDR": ("layers", "slots", "embed", "rank"),
}

KV_AXES = ("layers", "pages", "page", "kv_heads", "head_dim")


def make_mesh(tensor_parallel_size: int = 1, devices=None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if tensor_parallel_size < 1 or tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs that many devices; "
                         f"{len(devices)} available ({devices[0].platform})")
    return Mesh(np.array(devices[:tensor_parallel_size]), (TP,))


def rules_for(cfg: ModelConfig, mesh: Mesh) -> dict[str, str | None]:
    """The rules table for this model on this mesh. An axis that the mesh does not divide is
    replicated (e.g. fewer KV heads than devices); the vocabulary must divide, the heads too."""
    tp = mesh.shape[TP]
    rules = dict(BASE_RULES)
    if tp == 1:
        return {k: None for k in rules}
    if cfg.num_heads % tp or cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads={cfg.num_heads} "
                         f"and intermediate_size={cfg.intermediate_size}")
    if cfg.num_kv_heads % tp:
        rules["kv_out"] = None
        rules["kv_heads"] = None
    if cfg.vocab_size % tp:
        rules["vocab"] = None
    return rules


def sharding(mesh: Mesh, rules: dict[str, str | None], axes: tuple[str, ...]) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*(rules[a] for a in axes)))


def dataclass_shardings(obj, axes_table: dict[str, tuple[str, ...]], mesh: Mesh, rules) -> object:
    """A pytree of NamedSharding matching a weights dataclass (None fields stay None)."""
    import dataclasses
    kwargs = {}
    for f in dataclasses.fields(obj):
        val = getattr(obj, f.name)
        if val is None:
            kwargs[f.name] = None
        elif dataclasses.is_dataclass(val):
            kwargs[f.name] = dataclass_shardings(val, axes_table, mesh, rules)
        else:
            kwargs[f.name] = sharding(mesh, rules, axes_table[f.name])
    return type(obj)(**kwargs)
