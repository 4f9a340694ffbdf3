"""A PEFT adapter's adapter_config.json: read, and checked for what multilora serves (plain LoRA
on the supported modules, numbers where numbers go) before any tensor is read."""

from __future__ import annotations

import json
import re
from pathlib import Path

from multilora.adapters.errors import AdapterError
from multilora.config import LORA_MODULES, ROUTER_LORA_MODULE

_ALL_LINEAR = "all-linear"
# PEFT settings under which the saved A and B no longer give the delta scaling * B A x on this base
# model's projections: each is refused by name (PEFT would serve something else than what we load)
_NOT_PLAIN_LORA = {
    "layer_replication": "it stacks copies of the base model's layers into a deeper model",
    "trainable_token_indices": "it trains rows of the embedding (trainable tokens)",
    "use_bdlora": "its A or B is block diagonal (BD-LoRA)",
    "kasa_config": "KaSA truncates the base weights and scales the rank by a trained diagonal",
    "arrow_config": "Arrow routes each token among several LoRAs",
}
# init_lora_weights that subtract the initial B A from the base weights (PiSSA, CorDA, OLoRA,
# LoRA-GA) or quantize them (LoftQ): the saved adapter fits that residual base, not the original
_BASE_REWRITING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


def pattern_value(patterns: dict, key: str, default):
    # PEFT's get_pattern_key: a pattern matches a trailing, dot-separated part of the module name.
    for pat, val in patterns.items():
        if re.match(rf"(.*\.)?({pat})$", key):
            return val
    return default


def read_config(name: str, folder: Path) -> dict:
    cfg_path = folder / "adapter_config.json"
    if not folder.is_dir():
        raise AdapterError(name, f"adapter folder {str(folder)!r} does not exist")
    if not cfg_path.is_file():
        raise AdapterError(name, f"no adapter_config.json in {str(folder)!r}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(name, f"adapter_config.json is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(name, "adapter_config.json must hold a JSON object")
    return cfg


def check_config(name: str, cfg: dict) -> None:
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(name, f"peft_type {peft_type!r} is not supported; only LORA adapters are")
    if cfg.get("use_dora"):
        raise AdapterError(name, "use_dora=true (DoRA) is not supported; only plain LoRA is")
    if cfg.get("modules_to_save"):
        raise AdapterError(name, f"modules_to_save={cfg['modules_to_save']} is not supported: it replaces "
                                 "base weights per adapter; only LoRA deltas on "
                                 f"{', '.join(LORA_MODULES)} are")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(name, f"bias={cfg['bias']!r} is not supported; only bias='none' is")
    if cfg.get("lora_bias"):
        raise AdapterError(name, "lora_bias=true (a trained bias on each lora_B) is not supported; only "
                                 "LoRA without biases (lora_bias=false) is")
    if cfg.get("alora_invocation_tokens"):
        raise AdapterError(name, "activated LoRA (alora_invocation_tokens) is not supported")
    for key, why in _NOT_PLAIN_LORA.items():
        if cfg.get(key):
            raise AdapterError(name, f"{key}={cfg[key]!r} is not supported: {why}; only plain LoRA deltas on "
                                     f"{', '.join(LORA_MODULES)} are")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise AdapterError(name, f"init_lora_weights={init!r} is not supported: that initialization rewrites the "
                                 "base model's weights, so the adapter fits the rewritten base, not this one; save it "
                                 "with PEFT's save_pretrained(path_initial_model_for_weight_conversion=...) to convert "
                                 "it to a plain LoRA (init_lora_weights true), which is supported")
    targets = cfg.get("target_modules")
    if targets is not None and not isinstance(targets, (list, str)):
        raise AdapterError(name, f"target_modules must be a list of names or a regex string, got {targets!r}")
    if isinstance(targets, list):
        if any(not isinstance(t, str) for t in targets):
            raise AdapterError(name, f"target_modules must hold module names (strings), got {targets!r}")
        allowed = LORA_MODULES + (ROUTER_LORA_MODULE,)
        bad = [t for t in targets if t.split(".")[-1] not in allowed and t != _ALL_LINEAR]
        if bad:
            raise AdapterError(name, f"target_modules {bad} are outside the supported set "
                                     f"{', '.join(allowed)}")
    params = cfg.get("target_parameters")
    if params is not None and (not isinstance(params, list) or any(not isinstance(p, str) for p in params)):
        raise AdapterError(name, f"target_parameters must be a list of parameter names, got {params!r}")
    for p in params or ():
        if p.split(".")[-1] not in ("gate_up_proj", "down_proj") and not is_router_parameter(p):
            raise AdapterError(name, f"target_parameters {p!r} is not supported; only a Qwen3-MoE's router "
                                     "(gate.weight) and experts (gate_up_proj, down_proj) are")
    r = cfg.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterError(name, f"r must be a positive integer, got {r!r}")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise AdapterError(name, f"lora_alpha must be a positive number, got {alpha!r}")
    for key, kind in (("rank_pattern", int), ("alpha_pattern", (int, float))):
        pat = cfg.get(key) or {}
        if not isinstance(pat, dict) or any(
                isinstance(v, bool) or not isinstance(v, kind) or not v > 0 for v in pat.values()):
            raise AdapterError(name, f"{key} must map module patterns to positive numbers, got {pat!r}")


def is_router_parameter(p: str) -> bool:
    """Whether a target_parameters entry names the MoE router's weight (gate.weight)."""
    return p.split(".")[-2:] == ["gate", "weight"]
