"""Transformers 4's per-expert LoRA on a Qwen3-MoE, fused at load time into the layout that
multilora reads transformers 5's adapters into.

PEFT on transformers 4 adapts every expert's gate_proj, up_proj and down_proj as a Linear of its
own: `...layers.{L}.mlp.experts.{e}.gate_proj.lora_A.weight` (r, D) and `...lora_B.weight`
(M, r), likewise up_proj, and down_proj's A (r, M), B (D, r); each with its own rank and scaling
(rank_pattern, alpha_pattern and rsLoRA on its module path). PEFT on transformers 5 adapts the
fused parameters instead (target_parameters gate_up_proj, whose 2M outputs are gate's then up's,
and down_proj): one tensor pair per layer and parameter holding every expert's A (R, in) and
B (out, R), which adapter.py lays out as rank rows holding every expert's A row, or B row, side
by side. fuse builds those rows from the per-expert tensors, with the math of PEFT's own
conversion (peft.utils.transformers_weight_conversion, PeftConcatenate): gate and up read the
same input, so expert e's gate_up LoRA is A' = [A_gate; A_up] (rank rows gate's then up's) and
B' = [[B_gate, 0], [0, B_up]] (block diagonal, outputs gate's then up's); down_proj maps one to
one. PEFT's conversion gives gate_up_proj rank 2r and alpha 2 * lora_alpha, one scaling for both
halves (with rsLoRA, sqrt(2) times the trained one) and ignores patterns on gate_proj or up_proj;
here each expert's scaling over the adapter's default one is folded into its own B block, so
every half keeps the scaling it was trained with. A projection the adapter does not target is a
zero block (no rank rows); experts of one projection with different ranks are zero-padded to the
largest. One layer's fused copy exists at a time (adapter.py's _copy_part writes it into the
host copy).

Legend: E experts, R a fused module's rank (the sum of its halves' largest ranks), I / O an
expert's in / out features of the fused module, r one expert's rank.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Optional

import numpy as np

from multilora.adapters.errors import AdapterError
from multilora.config import ModelConfig

# any tensor under an expert of a layer (what this module reads or refuses)
PER_EXPERT_RE = re.compile(r"layers\.\d+\.mlp\.experts\.\d+\.")
_KEY_RE = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.lora_([AB])\.(?:[\w-]+\.)?weight$")
# each fused module's halves, in the order of its rank rows and outputs
HALVES = {"experts.gate_up_proj": ("gate_proj", "up_proj"), "experts.down_proj": ("down_proj",)}
_MODULE_OF = {half: module for module, halves in HALVES.items() for half in halves}


@dataclasses.dataclass(frozen=True)
class Half:
    """One projection of one layer, every expert's: its tensors' names (expert e's at e), the
    largest of its experts' ranks (the rows it takes in the fused rank) and each expert's scaling
    ratio (folded into its B)."""

    proj: str                  # gate_proj, up_proj or down_proj
    a_keys: tuple[str, ...]    # lora_A (r, I)
    b_keys: tuple[str, ...]    # lora_B (out, r)
    ratios: tuple[float, ...]
    rank: int


@dataclasses.dataclass(frozen=True)
class Fused:
    """How one layer's experts.gate_up_proj or experts.down_proj LoRA is built from per-expert
    tensors (fuse); in adapter.py's plan in place of a fused tensor pair."""

    module: str
    halves: tuple[Optional[Half], ...]  # HALVES[module]'s, None where the adapter has none
    experts: int
    d_in: int                           # I
    d_half: int                         # each half's out features: O = len(halves) * d_half

    @property
    def rank(self) -> int:
        return sum(h.rank for h in self.halves if h is not None)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for h in self.halves if h is not None for k in h.a_keys + h.b_keys)


def _spans(ids: list[int]) -> str:
    """Sorted ints as runs: [0, 1, 2, 5] -> '0-2, 5'."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _keys_of(name: str, shapes: dict, model_cfg: ModelConfig) -> dict[tuple[int, str], dict[int, dict[str, str]]]:
    """(layer, projection) -> expert -> {"A": key, "B": key}, from the per-expert tensor names;
    names of what the base model lacks refused."""
    found: dict[tuple[int, str], dict[int, dict[str, str]]] = {}
    e_count = model_cfg.num_experts
    for key in shapes:
        if not PER_EXPERT_RE.search(key):
            continue
        m = _KEY_RE.search(key)
        if m is None or m.group(3) not in _MODULE_OF:
            raise AdapterError(name, f"tensor {key!r} is not a LoRA A/B weight of an expert's "
                                     f"{', '.join(_MODULE_OF)}")
        layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
        if not model_cfg.moe_layers:
            raise AdapterError(name, f"tensor {key!r} adapts MoE experts, but the base model has none "
                                     "(an adapter for another model?)")
        if layer >= model_cfg.num_layers:
            raise AdapterError(name, f"tensor {key!r} names layer {layer}, but the base model has "
                                     f"{model_cfg.num_layers} layers (an adapter for another model?)")
        if layer not in model_cfg.moe_layers:
            raise AdapterError(name, f"tensor {key!r} adapts experts in layer {layer}, whose MLP is dense "
                                     "(an adapter for another model?)")
        if expert >= e_count:
            raise AdapterError(name, f"tensor {key!r} names expert {expert}, but the base model's layers have "
                                     f"{e_count} experts (0-{e_count - 1}; an adapter for another model?)")
        found.setdefault((layer, proj), {}).setdefault(expert, {})[m.group(4)] = key
    return found


def _half(name: str, layer: int, proj: str, experts: dict[int, dict[str, str]], shapes: dict,
          model_cfg: ModelConfig, ratio_of: Callable[[str, str, int], float]) -> Half:
    """One projection's Half, its tensors checked: every expert present, each with A and B of
    the expert's shapes, its rank as the config says."""
    e_count = model_cfg.num_experts
    missing = sorted(set(range(e_count)) - set(experts))
    if missing:
        raise AdapterError(name, f"layer {layer} {proj} has LoRA tensors for experts {_spans(sorted(experts))} "
                                 f"but none for {_spans(missing)}: PEFT adapts every expert of a targeted "
                                 f"projection, and the base model's layers have {e_count} (an adapter for another "
                                 "model?)")
    d_in, d_out = model_cfg.expert_dims(_MODULE_OF[proj])
    if proj != "down_proj":
        d_out //= 2  # gate_up_proj's out features are gate's and up's
    a_keys, b_keys, ratios, ranks = [], [], [], []
    for e in range(e_count):
        ab = experts[e]
        if set(ab) != {"A", "B"}:
            key = next(iter(ab.values()))
            raise AdapterError(name, f"tensor {key!r} has no lora_{'B' if 'A' in ab else 'A'} beside it")
        sa, sb = tuple(shapes[ab["A"]]), tuple(shapes[ab["B"]])
        if len(sa) != 2 or sa[0] < 1 or sa[1] != d_in:
            raise AdapterError(name, f"tensor {ab['A']!r} has shape {sa}; expert {e}'s {proj} takes lora_A "
                                     f"(r, {d_in}), r >= 1 (the base model's experts' {proj}: {d_in} -> {d_out}; "
                                     "an adapter for another model?)")
        if sb != (d_out, sa[0]):
            raise AdapterError(name, f"tensor {ab['B']!r} has shape {sb}; expert {e}'s {proj} takes lora_B "
                                     f"({d_out}, {sa[0]}) beside its lora_A {sa} (the base model's experts' {proj}: "
                                     f"{d_in} -> {d_out}; an adapter for another model?)")
        a_keys.append(ab["A"])
        b_keys.append(ab["B"])
        ranks.append(sa[0])
        ratios.append(ratio_of(f"layer {layer} experts.{e}.{proj}", f"model.layers.{layer}.mlp.experts.{e}.{proj}",
                               sa[0]))
    return Half(proj=proj, a_keys=tuple(a_keys), b_keys=tuple(b_keys), ratios=tuple(ratios), rank=max(ranks))


def plan(name: str, shapes: dict, model_cfg: ModelConfig, ratio_of: Callable[[str, str, int], float],
         max_lora_rank: int, fused_layout: set) -> dict[tuple[int, str], Fused]:
    """(layer, fused expert module) -> its Fused, for every layer the per-expert tensors among
    `shapes` (tensor name -> shape) adapt; {} if there are none. ratio_of(what, module path, r)
    is the adapter's scaling ratio of a module (adapter.py's: it checks r against rank_pattern);
    fused_layout holds the (layer, module)s the adapter's fused tensors adapt. Raises AdapterError
    naming the tensor, or the layer and projection, that does not fit."""
    found = _keys_of(name, shapes, model_cfg)
    halves: dict[tuple[int, str], dict[str, Half]] = {}
    for (layer, proj), experts in sorted(found.items()):
        half = _half(name, layer, proj, experts, shapes, model_cfg, ratio_of)
        halves.setdefault((layer, _MODULE_OF[proj]), {})[proj] = half
    out = {}
    for (layer, module), got in halves.items():
        if (layer, module) in fused_layout:
            raise AdapterError(name, f"layer {layer} adapts the experts' {module.split('.')[1]} twice: per expert "
                                     "(transformers 4's layout) and fused (transformers 5's)")
        d_in, d_out = model_cfg.expert_dims(module)
        out[(layer, module)] = f = Fused(module=module, halves=tuple(got.get(p) for p in HALVES[module]),
                                         experts=model_cfg.num_experts, d_in=d_in, d_half=d_out // len(HALVES[module]))
        if f.rank > max_lora_rank:
            raise AdapterError(name, f"rank {f.rank} ({module} of layer {layer}: "
                                     f"{' + '.join(f'{h.proj} {h.rank}' for h in f.halves if h)}, fused) exceeds "
                                     f"max_lora_rank={max_lora_rank}")
    return out


def fuse(fused: Fused, tensors: dict) -> tuple[np.ndarray, np.ndarray]:
    """(a_RX, b_YR) float32, X = E * I, Y = E * O: the fused LoRA as adapter.py lays out the
    experts' (a rank row holds every expert's A row, or B row, side by side: expert e's A (R, I)
    at a_RX[:, e * I:(e + 1) * I], its B (O, R) at b_YR[e * O:(e + 1) * O]), from the per-expert
    tensors (name -> array): each half's rank rows after the halves before it, its outputs at its
    place among the halves, each expert's B times its ratio (in float32), zeros elsewhere."""
    e_count, rank = fused.experts, fused.rank
    a_REI = np.zeros((rank, e_count, fused.d_in), np.float32)
    b_EOR = np.zeros((e_count, len(fused.halves) * fused.d_half, rank), np.float32)
    row = 0
    for i, half in enumerate(fused.halves):
        if half is None:
            continue
        outs = slice(i * fused.d_half, (i + 1) * fused.d_half)
        for e, (ka, kb, ratio) in enumerate(zip(half.a_keys, half.b_keys, half.ratios)):
            a_ri, b_or = tensors[ka], tensors[kb]
            r = a_ri.shape[0]
            a_REI[row:row + r, e] = a_ri
            b_EOR[e, outs, row:row + r] = b_or if ratio == 1.0 else b_or.astype(np.float32) * np.float32(ratio)
        row += half.rank
    return a_REI.reshape(rank, -1), b_EOR.reshape(-1, rank)
