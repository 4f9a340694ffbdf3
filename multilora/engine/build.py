"""Start-up sizing: what an Engine is built with, worked out from its EngineConfig, the model and
the machine: the KV cache's pages (its dtype: multilora.model.precision), the adapter slots and the pool of rank rows, the default
max_lora_rank, the model's extra EOS tokens, JAX's persistent compilation cache and the CPU
kernels' first build. Functions of their inputs; the Engine (multilora.engine.engine) calls them
once, in its constructor."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Optional

import numpy as np

from multilora.config import EngineConfig, LoRAConfig, ModelConfig, lora_pool_size, round_to_pages

log = logging.getLogger("multilora.engine")


def kv_layout(cfg: ModelConfig, c: EngineConfig, platform: str) -> tuple[bool, int]:
    """The cache's layout: heads-major on a TPU (llama.KV_HEADS_MAJOR, the layout its step reads
    in place), and how many kv heads share a 128-lane row (model.kv_lanes: opt-in, where H < 128;
    read by the Pallas attention only, which soft-capped models do not take)."""
    from multilora.model import kv_lanes
    from multilora.model.llama import kv_heads_major_on
    heads_major = kv_heads_major_on(platform)
    return heads_major, kv_lanes.lane_pack_for(cfg, platform, c.tensor_parallel_size) if heads_major else 1


def kv_cache_pages(cfg: ModelConfig, c: EngineConfig, max_model_len: int, dtype, heads_major: bool,
                   lane_pack: int = 1) -> int:
    """c.num_pages, else as many pages as c.kv_cache_memory_gb holds (pages of lane_pack kv heads
    a row: llama.kv_page_bytes), no more than max_num_seqs sequences of max_model_len need; at
    least one such sequence (and the reserved page)."""
    from multilora.model.llama import kv_page_bytes
    page_size = c.page_size
    max_pages_seq = -(-max_model_len // page_size)
    num_pages = c.num_pages
    bytes_per_page = kv_page_bytes(cfg, page_size, dtype, heads_major, lane_pack)
    if num_pages is None:
        by_memory = int(c.kv_cache_memory_gb * 2**30 // bytes_per_page)
        num_pages = max(min(by_memory, c.max_num_seqs * max_pages_seq + 1), max_pages_seq + 1)
    if num_pages < max_pages_seq + 1:
        raise ValueError(f"num_pages={num_pages} cannot hold one sequence of max_model_len="
                         f"{max_model_len} ({max_pages_seq} pages of {page_size} + 1 reserved)")
    layout = ("heads-major" + (f", {lane_pack} kv heads a row" if lane_pack > 1 else "")) if heads_major else "default layout"
    log.info("KV cache: %d pages of %d tokens (%d tokens besides the reserved page, %.1f MB; %s)", num_pages,
             page_size, (num_pages - 1) * page_size, num_pages * bytes_per_page / 2**20, layout)
    return num_pages


def lora_sizing(cfg: ModelConfig, c: EngineConfig, lora_dtype: np.dtype, max_lora_rank: int, device) -> LoRAConfig:
    """The adapter slots and the pool of rank rows (multilora.config.lora_pool_size), from
    c.max_loras_per_batch and c.lora_memory_gb (else the device's default)."""
    from multilora.adapters.pool import rank_row_bytes
    row_bytes = rank_row_bytes(cfg, lora_dtype.itemsize)
    memory_gb = c.lora_memory_gb or default_lora_memory_gb(device)
    max_loras_per_batch, pool_rows = lora_pool_size(
        c.max_loras_per_batch, c.lora_memory_gb is not None, int(memory_gb * 2**30), row_bytes,
        max_lora_rank, c.max_num_seqs)
    if max_loras_per_batch:
        log.info("LoRA: %d adapter slots; a pool of %d rank rows (%.2f MB each, %.2f GB): adapters take "
                 "their true rank (%d of rank %d, %d of rank 8)", max_loras_per_batch, pool_rows,
                 row_bytes / 2**20, pool_rows * row_bytes / 2**30,
                 min(max_loras_per_batch, pool_rows // round_to_pages(max_lora_rank)), max_lora_rank,
                 min(max_loras_per_batch, pool_rows // 8))
    return LoRAConfig(max_loras_per_batch=max_loras_per_batch, max_lora_rank=max_lora_rank, pool_rows=pool_rows)


def default_max_rank(lora_modules: dict[str, str], floor: int = 16, experts: bool = False) -> int:
    """The largest rank among the adapters given at start (their adapter_config.json), at least
    `floor` (vLLM's default max_lora_rank): slots are no wider than what is served. On a model
    with experts, an adapter whose target_modules take both gate_proj and up_proj counts twice
    its largest rank: in transformers 4's per-expert layout the experts' gate and up LoRA are
    served fused, at the sum of their ranks (multilora.adapters.per_expert; transformers 5's
    adapters say that rank in their rank_pattern)."""
    best = floor
    for path in lora_modules.values():
        try:
            cfg = json.loads((Path(path) / "adapter_config.json").read_text())
            ranks = [cfg.get("r", 8), *(cfg.get("rank_pattern") or {}).values()]
            top = max(int(r) for r in ranks if isinstance(r, int) and not isinstance(r, bool))
            best = max(best, 2 * top if experts and _targets_gate_and_up(cfg.get("target_modules")) else top)
        except (OSError, ValueError, TypeError, AttributeError, re.error):
            continue  # registering it reports what is wrong
    return best


def _targets_gate_and_up(targets) -> bool:
    """Whether PEFT's target_modules (a list of names, "all-linear" or a regex) take an expert's
    gate_proj and up_proj."""
    names = ("gate_proj", "up_proj")
    if isinstance(targets, str):
        return targets == "all-linear" or all(re.fullmatch(targets, f"model.layers.0.mlp.experts.0.{n}") for n in names)
    return all(any(str(t).split(".")[-1] == n for t in targets or ()) for n in names)


def default_lora_memory_gb(device) -> float:
    """2 GB on a CPU host; on an accelerator 5 % of its memory (what XLA reports), at least 1 GB."""
    if device.platform == "cpu":
        return 2.0
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - not every backend reports memory
        limit = None
    return max(1.0, 0.05 * limit / 2**30) if limit else 2.0


def generation_eos(model_dir: str) -> set[int]:
    p = Path(model_dir) / "generation_config.json"
    if not p.is_file():
        return set()
    try:
        eos = json.loads(p.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError):
        return set()
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}


# generation_config.json's sampling keys a request's unset fields default to (vLLM's
# --generation-config auto): the name here, its valid range
_GENERATION_KEYS = {"temperature": (0.0, float("inf")), "top_p": (0.0, 1.0), "top_k": (-1, float("inf")),
                    "repetition_penalty": (0.0, float("inf"))}


def generation_sampling_defaults(model_dir: str) -> dict:
    """The sampling defaults a model's generation_config.json sets (temperature, top_p, top_k,
    repetition_penalty: those it names), as vLLM takes them by default (its `do_sample` aside);
    top_k 0 (transformers' "off") as -1. A value of the wrong kind or out of range is left out,
    with a warning naming it."""
    p = Path(model_dir) / "generation_config.json"
    try:
        cfg = json.loads(p.read_text()) if p.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}
    out = {}
    for key, (lo, hi) in _GENERATION_KEYS.items():
        value = cfg.get(key) if isinstance(cfg, dict) else None
        if value is None:
            continue
        ok = (type(value) is int if key == "top_k" else type(value) in (int, float)) and lo <= value <= hi
        if key in ("top_p", "repetition_penalty") and ok:
            ok = value > 0
        if not ok:
            log.warning("generation_config.json: %s=%r is not a valid default; left out", key, value)
            continue
        out[key] = -1 if key == "top_k" and value == 0 else value
    return out


def prepare_process(compilation_cache_dir: Optional[str], distributed: Optional[dict] = None) -> None:
    """What an engine's process sets up before anything else: JAX's persistent compilation cache,
    and the CPU kernels' build started on a thread (multilora.kernels.start_build; a first build
    takes tens of seconds, which then overlap with the model's fetch, conversion and read)."""
    enable_compilation_cache(compilation_cache_dir, distributed)
    from multilora import kernels
    kernels.start_build()


def enable_compilation_cache(path: Optional[str], distributed: Optional[dict] = None) -> None:
    """JAX's persistent compilation cache, except for an engine over several processes: there
    an executable read back from the cache (its own process's or another's) disagrees with the
    peers' about its collectives (measured with JAX 0.10 on CPU: gloo "2048 vs 1024 bytes" at the
    first step shape read back, every time, where freshly compiled ones agree), so each process
    compiles afresh."""
    import jax
    if distributed and (distributed.get("num_processes") or 1) > 1:
        log.info("several processes: no persistent compilation cache (see enable_compilation_cache)")
        return
    path = path or os.environ.get("MULTILORA_COMPILATION_CACHE")
    if path is None:  # the user cache ($MULTILORA_CACHE, else $XDG_CACHE_HOME/multilora, else ~/.cache/multilora)
        from multilora.default_model import user_cache_dir
        path = str(user_cache_dir() / "jax_cache")
    if path in ("", "off", "0"):
        return
    try:
        jax.config.update("jax_compilation_cache_dir", path)
        # Every compile, however short: a start's dozens of small ones (the weights' packing,
        # the cache's and the pools' creation, the slot writers) took an engine's warm build from
        # ~2.5 to ~7 s on two cores when they were compiled again each time (0.2 s and up only).
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    except Exception as e:  # never fatal: it only saves time
        log.info("no persistent compilation cache: %s", e)
