"""Rotary scaling as a Hugging Face config states it (rope_scaling, or transformers 5's
rope_parameters), read the way transformers reads it: the fields multilora.model.layers turns
into frequencies."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from multilora.errors import UnsupportedModelError


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: "llama3" (Llama 3.1's smooth per-band scaling), "linear"
    (every frequency divided by factor, i.e. positions interpolated) or "yarn" (YaRN: the
    frequencies between beta_fast and beta_slow rotations over the original context ramped from
    kept to interpolated, cos and sin scaled by attention_factor; Qwen2.5's and Qwen3's long
    context)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def parse_rope_scaling(rs: dict[str, Any] | None, model_cfg: dict[str, Any]) -> RopeScaling | None:
    """The config's rope_scaling (or transformers 5's rope_parameters) as transformers reads it;
    model_cfg gives yarn's original context where the scaling leaves it out (a top-level
    original_max_position_embeddings first, else max_position_embeddings)."""
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    needs = {"linear": ("factor",), "yarn": (),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    if kind not in needs:
        raise UnsupportedModelError(
            f"unsupported rope_scaling type {kind!r}; supported: 'llama3', 'linear', 'yarn' (or none)")
    missing = [k for k in needs[kind] if not _is_number(rs.get(k))]
    if missing:
        raise UnsupportedModelError(f"rope_scaling type {kind!r} needs numeric {', '.join(needs[kind])}; "
                                    f"missing or not a number: {', '.join(missing)}")
    if rs.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={rs['partial_rotary_factor']} is not supported "
                                    "(the whole head turns)")
    if kind == "linear":
        return RopeScaling(factor=float(rs["factor"]), rope_type="linear")
    if kind == "yarn":
        return _parse_yarn(rs, model_cfg)
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
    )


def _parse_yarn(rs: dict[str, Any], model_cfg: dict[str, Any]) -> RopeScaling:
    """YaRN's fields with transformers' defaults: factor, when absent, the ratio of
    max_position_embeddings to the original context; attention_factor, when absent,
    0.1 ln(factor) + 1 (or DeepSeek's ratio of mscale and mscale_all_dim's)."""
    original = model_cfg.get("original_max_position_embeddings") or rs.get("original_max_position_embeddings") \
        or model_cfg.get("max_position_embeddings", 2048)
    factor = rs.get("factor")
    if factor is None:
        factor = model_cfg.get("max_position_embeddings", 2048) / original
    for key, v in (("factor", factor), ("original_max_position_embeddings", original)):
        if not _is_number(v) or not v > 0:
            raise UnsupportedModelError(f"rope_scaling type 'yarn' needs a positive {key}, got {v!r}")
    attention_factor = rs.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    for key in ("beta_fast", "beta_slow", "attention_factor"):
        v = attention_factor if key == "attention_factor" else rs.get(key)
        if v is not None and not _is_number(v):
            raise UnsupportedModelError(f"rope_scaling type 'yarn': {key} must be a number, got {v!r}")
    return RopeScaling(factor=float(factor), original_max_position_embeddings=int(original), rope_type="yarn",
                       beta_fast=float(rs.get("beta_fast") or 32.0), beta_slow=float(rs.get("beta_slow") or 1.0),
                       truncate=bool(rs.get("truncate", True)), attention_factor=float(attention_factor))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def gemma3_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None, float]:
    """Gemma 3's (global theta, global scaling, local theta), from either form of its config:
    transformers 5's rope_parameters keyed by layer type, or the older rope_theta, rope_scaling
    (the global layers') and rope_local_base_freq. The local layers' RoPE is never scaled."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full, local = params["full_attention"] or {}, params.get("sliding_attention") or {}
        if parse_rope_scaling(local, cfg) is not None:
            raise UnsupportedModelError("Gemma 3 with a scaled RoPE on its sliding-window layers is not supported")
        return (float(full.get("rope_theta", 1000000.0)), parse_rope_scaling(full, cfg),
                float(local.get("rope_theta", 10000.0)))
    return (float(cfg.get("rope_theta", 1000000.0)), parse_rope_scaling(cfg.get("rope_scaling"), cfg),
            float(cfg.get("rope_local_base_freq", 10000.0)))
