"""An exact weighted mix of adapters, as one adapter: sum_i w_i * (s_i * B_i A_i) is itself a
LoRA whose rank is the sum of the parts' ranks (A stacked along the rank, B stacked and each
part's block times w_i * s_i), so it runs in a batch beside single-adapter and base rows with no
merged copy of any base weight. PEFT's add_weighted_adapter(..., combination_type="cat")
builds the same product (scaling 1).

A mix is registered under its canonical name, `mix(a=0.7,b=0.3)`, and its path records the
parts' folders and weights (`mix:` + JSON), so an evicted host copy is rebuilt from them.
"""

from __future__ import annotations

import json
import math
from typing import Callable, Sequence

import numpy as np

from multilora.config import ALL_LORA_MODULES
from multilora.adapters.adapter import LoRAAdapter

MIX_PREFIX = "mix:"
MAX_PARTS = 8


def mix_name(weights: dict[str, float]) -> str:
    return "mix(" + ",".join(f"{n}={weights[n]!r}" for n in sorted(weights)) + ")"


def check_weights(weights) -> dict[str, float]:
    """A non-empty {adapter name: finite weight} of at most MAX_PARTS adapters, else ValueError."""
    if not isinstance(weights, dict) or not weights:
        raise ValueError("adapters must map adapter names to weights, e.g. {\"a\": 0.7, \"b\": 0.3}")
    if len(weights) > MAX_PARTS:
        raise ValueError(f"adapters: a mix takes at most {MAX_PARTS} adapters, got {len(weights)}")
    out = {}
    for name, w in weights.items():
        if not isinstance(name, str) or not name:
            raise ValueError("adapters: names must be non-empty strings")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"adapters: the weight of {name!r} must be a finite number, got {w!r}")
        out[name] = float(w)
    return out


def mix_path(parts: Sequence[tuple[str, str, float]]) -> str:
    """parts: (name, folder, weight)."""
    return MIX_PREFIX + json.dumps([[n, p, w] for n, p, w in parts])


def parse_mix_path(path: str) -> list[tuple[str, str, float]]:
    return [(n, p, float(w)) for n, p, w in json.loads(path[len(MIX_PREFIX):])]


def mix_adapters(name: str, path: str, parts: Sequence[tuple[LoRAAdapter, float]]) -> LoRAAdapter:
    """The weighted sum of the parts' deltas as one adapter of scaling 1 (see the module doc),
    in the parts' host dtype (the pool's): B's blocks are scaled in float32 and rounded once
    more where that dtype is bfloat16 (exact on the float32 path)."""
    modules = {}
    for m in ALL_LORA_MODULES:
        have = [(ad, w) for ad, w in parts if m in ad.modules]
        if not have:
            continue
        dtype = have[0][0].modules[m][0].dtype
        a_LRI = np.concatenate([ad.modules[m][0] for ad, _ in have], axis=1)
        b_LOR = np.concatenate([ad.modules[m][1].astype(np.float32) * np.float32(w * ad.scaling)
                                for ad, w in have], axis=2)
        modules[m] = (a_LRI.astype(dtype), b_LOR.astype(dtype))
    rank = max(a.shape[1] for a, _ in modules.values())
    return LoRAAdapter(name=name, path=path, rank=rank, scaling=1.0, modules=modules)


def read_mix(name: str, path: str, read: Callable[[str, str], LoRAAdapter]) -> LoRAAdapter:
    """Rebuild a mix from its parts' folders (an evicted host copy)."""
    parts = parse_mix_path(path)
    return mix_adapters(name, path, [(read(n, p), w) for n, p, w in parts])
