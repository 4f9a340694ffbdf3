"""One declaration per array: each field of the weights dataclasses (multilora.model.llama)
carries its ArrayInfo, and everything else is derived from it: the shape (from the logical axes
and the model config), the sharding (the axes through the rules table, multilora.model.sharding),
where a checkpoint holds it (the loader), and for the LoRA pools which PEFT modules fill them.

    wq_LDO: jax.Array = weight(("layers", "embed", "q_out"), "self_attn.q_proj.weight", transpose=True)
    shape_of(info_of(LayerWeights, "wq_LDO"), cfg)   # (num_layers, hidden_size, q_dim)

No jax here beyond dataclass fields; plain functions of ModelConfig.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Optional

from multilora.config import ModelConfig

# Logical axes that have a size fixed by the model config (the others, "lora_rows", "rank",
# "pages", ..., are sized by the engine).
_MODEL_DIMS: dict[str, Callable[[ModelConfig], int]] = {
    "layers": lambda c: c.num_layers,
    "embed": lambda c: c.hidden_size,
    "vocab": lambda c: c.vocab_size,
    "q_out": lambda c: c.q_dim,
    "kv_out": lambda c: c.kv_dim,
    "ffn": lambda c: c.intermediate_size,
    "head_dim": lambda c: c.head_dim,
    "experts": lambda c: c.num_experts,
    "moe_ffn": lambda c: c.moe_intermediate_size,
    # the router's and the experts' LoRA pools (no features in a model without experts); the
    # experts': every expert's features side by side in one rank row
    "moe_embed": lambda c: c.hidden_size if c.num_experts else 0,
    "experts_embed": lambda c: c.num_experts * c.hidden_size,
    "experts_moe_ffn": lambda c: c.num_experts * c.moe_intermediate_size,
    "experts_gate_up": lambda c: c.num_experts * 2 * c.moe_intermediate_size,
}


def _always(cfg: ModelConfig) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """axes: the logical axis names (shape and sharding). key: the checkpoint tensor's name,
    under "model.layers.{i}." for a per-layer array (stacked along "layers"); transpose: the
    checkpoint holds it (out, in). present: whether this model config has it (biases, an untied
    LM head). in_layers: the layers whose checkpoint holds a per-layer array (None: every layer;
    the others' entries are zeros: Qwen3-MoE's dense MLP and experts, each in its own layers).
    A key with "{e}" names one expert's tensor (the array stacks them along "experts").
    LoRA pools: side "a" or "b" and the PEFT modules whose rows they hold (several
    modules: one block of rows each, stacked)."""

    axes: tuple[str, ...]
    key: Optional[str] = None
    transpose: bool = False
    present: Callable[[ModelConfig], bool] = _always
    side: Optional[str] = None
    modules: tuple[str, ...] = ()
    in_layers: Optional[Callable[[ModelConfig], tuple[int, ...]]] = None

    @property
    def blocks(self) -> int:
        """Row blocks of a LoRA pool (one per module it stacks)."""
        return max(1, len(self.modules))


def weight(axes: tuple[str, ...], key: str, *, transpose: bool = False,
           present: Optional[Callable[[ModelConfig], bool]] = None,
           in_layers: Optional[Callable[[ModelConfig], tuple[int, ...]]] = None):
    """A dataclass field declaring a model weight; optional ones (present given) default to None."""
    info = ArrayInfo(tuple(axes), key, transpose, present or _always, in_layers=in_layers)
    if present is None:
        return dataclasses.field(metadata={"array": info})
    return dataclasses.field(default=None, metadata={"array": info})


def lora_pool(axes: tuple[str, ...], side: str, *modules: str):
    """A dataclass field declaring a LoRA pool of rank rows: A (side "a", PEFT's layout, one
    block per module) or B (side "b", transposed: one row per rank)."""
    if side not in ("a", "b") or not modules or (side == "b" and len(modules) != 1):
        raise ValueError(f"a LoRA pool is side a (one or more modules) or b (one module), got {side!r} {modules}")
    return dataclasses.field(metadata={"array": ArrayInfo(tuple(axes), side=side, modules=tuple(modules))})


def arrays(cls) -> Iterator[tuple[str, ArrayInfo]]:
    """(field name, ArrayInfo) of every declared array field of a dataclass, in field order."""
    for f in dataclasses.fields(cls):
        if "array" in f.metadata:
            yield f.name, f.metadata["array"]


def info_of(cls, name: str) -> ArrayInfo:
    return dict(arrays(cls))[name]


def dim(cfg: ModelConfig, axis: str) -> int:
    if axis not in _MODEL_DIMS:
        raise KeyError(f"axis {axis!r} has no size in the model config")
    return _MODEL_DIMS[axis](cfg)


def shape_of(info: ArrayInfo, cfg: ModelConfig, **sizes: int) -> tuple[int, ...]:
    """The array's shape: model-config axes from cfg, the others from sizes (e.g. lora_rows=U)."""
    return tuple(sizes[a] if a in sizes else dim(cfg, a) for a in info.axes)
