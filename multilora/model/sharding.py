"""Logical axis names -> mesh axes, in one rules table.

Every array names its axes logically ("vocab", "q_out", "ffn", ...); the rules map them to mesh
axes or to replication. One device is a 1-device mesh, so tensor parallelism is a change of mesh,
not of model code. Megatron-style: q/k/v and gate/up split by output features, o and down by
input features; LoRA B follows its column-parallel base layer's output split, LoRA A its
row-parallel base layer's input split, and the other factor is replicated.

The mesh of tp devices has two axes, "tp_kv" (g = gcd(num_kv_heads, tp) devices) and "tp_rep"
(tp / g): tensor parallelism uses both together (TP), the KV heads only the first. With as many
KV heads as devices (or a multiple) g = tp and this is the plain 1-D split. With fewer KV heads
than devices, each device holds only the KV heads that its query heads read (their group), each
group copied on tp / g devices, which is the layout XLA would otherwise build inside every step
and undo with an all-gather of the whole cache at its end. One KV head (tp / g = tp): every device
holds the whole KV cache and computes all of k and v.

Qwen3-MoE's experts are split like the dense MLP, each expert over its own ffn width
(moe_intermediate_size: gate/up by output features, down by input features; one all-reduce after
the MoE block, as after a dense MLP), every device holding a slice of every expert; the router
is replicated. So every device computes every routed row (no all-to-all, no load imbalance
between devices), which suits a few devices; expert parallelism (experts split across devices)
is not implemented. The router's and the experts' LoRA pools (every expert's rows side by side
in a rank row) are replicated.

Must divide tp: the query heads, the FFN width and the experts' width (an error otherwise). May
not: the vocabulary (embed/lm_head then replicated). See docs/distributed.md.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from multilora.config import ModelConfig

TP_KV = "tp_kv"           # splits the KV heads
TP_REP = "tp_rep"         # copies of each KV head group
TP = (TP_KV, TP_REP)      # the whole tensor-parallel group, as one PartitionSpec entry

# Logical axis -> mesh axes (None: replicated).
BASE_RULES: dict[str, object] = {
    "layers": None,
    "embed": None,
    "vocab": TP,
    "q_out": TP,
    "kv_out": TP_KV,
    "ffn": TP,
    "experts": None,
    "moe_ffn": TP,
    "moe_embed": None,          # the router's and the experts' LoRA pools: replicated
    "experts_embed": None,      # (the experts': E experts side by side in a row)
    "experts_moe_ffn": None,
    "experts_gate_up": None,
    "kv_heads": TP_KV,
    "head_dim": None,
    "pages": None,
    "page": None,
    "lora_rows": None,
    "rank": None,
}

# The weights' and LoRA pools' axes are declared on their dataclass fields (multilora.model.arrays,
# multilora.model.llama). One adapter's rows on their way into the pools
# (multilora.adapters.pool.write_rows) are split like the pools, their rows axis named "rank".
LORA_ROWS_RENAME = {"lora_rows": "rank"}

KV_AXES = ("layers", "pages", "page", "kv_heads", "head_dim")


def make_mesh(tensor_parallel_size: int = 1, devices=None, num_kv_heads: int | None = None) -> Mesh:
    """The ("tp_kv", "tp_rep") mesh over the first tensor_parallel_size devices, shaped
    (g, tp / g) with g = gcd(num_kv_heads, tp) (g = tp when num_kv_heads is not given). With
    several processes the mesh takes every process's devices, in jax.devices() order: a process
    that owned none of it could not join the computation."""
    devices = list(devices if devices is not None else jax.devices())
    tp = tensor_parallel_size
    if not isinstance(tp, int) or tp < 1 or tp > len(devices):
        hint = ("; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N set before the start "
                "gives N devices (docs/distributed.md)" if devices[0].platform == "cpu" else "")
        raise ValueError(f"tensor_parallel_size={tp} needs that many devices; "
                         f"{len(devices)} available ({devices[0].platform}){hint}")
    if jax.process_count() > 1 and tp != len(devices):
        raise ValueError(f"with {jax.process_count()} processes, tensor_parallel_size must equal the "
                         f"total device count {len(devices)}, got {tp}")
    g = math.gcd(num_kv_heads, tp) if num_kv_heads else tp
    return Mesh(np.array(devices[:tp]).reshape(g, tp // g), TP)


def tp_size(mesh: Mesh) -> int:
    return mesh.shape[TP_KV] * mesh.shape[TP_REP]


def rules_for(cfg: ModelConfig, mesh: Mesh) -> dict[str, object]:
    """The rules table for this model on this mesh. The query heads and the FFN width must divide
    tp; the vocabulary is replicated where tp does not divide it, the KV heads where "tp_kv"
    does not (a mesh not made for this model)."""
    tp = tp_size(mesh)
    rules = dict(BASE_RULES)
    if tp == 1:
        return {k: None for k in rules}
    split = [("num_attention_heads", cfg.num_heads)]
    split += [("intermediate_size", cfg.intermediate_size)] if cfg.has_dense_mlp else []
    split += [("moe_intermediate_size", cfg.moe_intermediate_size)] if cfg.moe_layers else []
    bad = [f"{name}={n}" for name, n in split if n % tp]
    if bad:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's {' and '.join(bad)} "
                         f"(query heads and FFN widths are split across devices); choose a divisor of "
                         f"{math.gcd(*(n for _, n in split))}")
    if cfg.num_kv_heads % mesh.shape[TP_KV]:
        rules["kv_out"] = None
        rules["kv_heads"] = None
    if cfg.vocab_size % tp:
        rules["vocab"] = None
    if cfg.intermediate_size % tp:  # no dense MLP (checked above): only the idle LoRA pools have it
        rules["ffn"] = None
    return rules


def sharding(mesh: Mesh, rules: dict[str, str | None], axes: tuple[str, ...]) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*(rules[a] for a in axes)))


def put(host, sharding: NamedSharding) -> jax.Array:
    """A host array -> a device array with this sharding, each device receiving only its piece.
    Under several processes each process supplies its own devices' pieces from its copy:
    jax.device_put would first compare the whole value across processes (a collective per array,
    over all of its bytes), make_array_from_callback does not."""
    host = np.asarray(host)
    if jax.process_count() == 1:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array: step inputs (token ids, block tables...), logits."""
    return NamedSharding(mesh, PartitionSpec())


def dataclass_shardings(obj, mesh: Mesh, rules, rename: dict[str, str] | None = None) -> object:
    """A pytree of NamedSharding matching a weights dataclass, from each field's declared axes
    (multilora.model.arrays; `rename` maps some axis names to others). None fields stay None."""
    import dataclasses
    kwargs = {}
    for f in dataclasses.fields(obj):
        val = getattr(obj, f.name)
        if val is None:
            kwargs[f.name] = None
        elif dataclasses.is_dataclass(val):
            kwargs[f.name] = dataclass_shardings(val, mesh, rules, rename)
        else:
            axes = f.metadata["array"].axes
            kwargs[f.name] = sharding(mesh, rules, tuple((rename or {}).get(a, a) for a in axes))
    return type(obj)(**kwargs)
