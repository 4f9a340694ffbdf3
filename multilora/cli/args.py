"""Command-line flags for the engine, shared by `multilora generate` and `multilora serve`: one
flag per EngineConfig field, and the way back from parsed flags to an EngineConfig. Both the CLI
and the server import this module (neither imports the other)."""

from __future__ import annotations

import argparse
import json

from multilora.config import DTYPE_CHOICES, LORA_BACKEND_CHOICES, EngineConfig


def parse_lora_modules(items) -> dict[str, str]:
    """--lora-modules: each `name=path`, or vLLM's JSON form `{"name": ..., "path": ...}` (an
    optional "base_model_name" is taken and not acted on: the adapter's fit to the base model is
    checked from its tensors). A name given twice, or a malformed item, ends the command naming it."""
    out = {}
    for item in items or []:
        if item.lstrip().startswith("{"):
            try:
                obj = json.loads(item)
            except json.JSONDecodeError as e:
                raise SystemExit(f"--lora-modules: {item!r} is not valid JSON ({e})") from None
            extra = set(obj) - {"name", "path", "base_model_name"} if isinstance(obj, dict) else set()
            if not isinstance(obj, dict) or extra or not all(isinstance(obj.get(k), str) and obj[k]
                                                             for k in ("name", "path")):
                raise SystemExit(f"--lora-modules expects name=path or a JSON object with \"name\" and "
                                 f"\"path\" (and optionally \"base_model_name\"), got {item!r}")
            name, path = obj["name"], obj["path"]
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise SystemExit(f"--lora-modules expects name=path, got {item!r}")
        if name in out:
            raise SystemExit(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out


_HELP = {
    "max_loras_per_batch": "adapter slots: distinct adapters resident, and so in one batch, at once (0 "
                           "disables LoRA; default: --max-num-seqs)",
    "max_lora_rank": "largest adapter rank served (default: the largest rank among --lora-modules, at least 16); "
                     "adapters take their own rank's memory, not this",
    "lora_memory_gb": "device memory for the adapter pool, where each adapter takes rows for its true rank "
                      "(default: 2 GB on CPU, 5%% of an accelerator's memory)",
    "max_loaded_loras": "host copies of adapters kept in memory, LRU (default: bounded by --lora-host-memory-gb only)",
    "lora_host_memory_gb": "host memory for adapter copies, LRU (an evicted adapter is read again from its folder)",
    "lora_backend": "LoRA kernel: auto picks by step shape",
    "dtype": "activations, weights and adapter pool: float32 (exact: PEFT's numbers), bfloat16, float16, "
             "or auto: the platform's fastest (a CPU: float32 activations with bfloat16 projections "
             "through multilora's kernel where it runs; an accelerator: bfloat16). The start-up log "
             "and /health say what runs",
    "projection_dtype": "dtype of the base model's projection matrices alone, over --dtype's choice "
                        "(activations stay --dtype): bfloat16 products summed in float32 are 2-4x faster "
                        "where the CPU has AMX-BF16 or AVX512-BF16; auto: what --dtype implies",
    "quantization": "a weight-only base at fewer bits, computed at load (adapters and activations keep "
                    "their dtype): int8 (on a CPU with multilora's kernels GGUF's Q8_0 arithmetic, a scale a "
                    "group of 32; elsewhere a scale an output column) or int4 (GGUF's Q4_0, the CPU kernels "
                    "only; the LM head at 8 bits)",
    "lora_dtype": "dtype of the adapter pool on the device (activations and sums stay float32): "
                  "bfloat16 halves the bytes a step reads per adapter and doubles the adapters a "
                  "--lora-memory-gb holds; auto: bfloat16 beside packed bfloat16 projections (multilora's "
                  "kernels read and write it), else --dtype; float32: the exact path",
    "max_model_len": "context length (default: the model's max_position_embeddings)",
    "num_pages": "KV cache pages (default: from --kv-cache-memory-gb)",
    "enable_prefix_caching": "share the KV pages of common prompt prefixes (per adapter); on by default",
    "max_num_batched_tokens": "tokens per step: decode rows plus prefill chunks",
    "max_prefill_seqs": "prefill chunks per step",
    "target_itl_ms": "inter-token latency to keep while prompts arrive: a step with decode rows carries "
                     "only the prefill tokens that its measured cost keeps within this many ms (a long "
                     "prompt prefills in smaller chunks); default: twice a decode-only step's measured "
                     "cost, at least 50 ms; 0: off (--max-num-batched-tokens alone)",
    "async_scheduling": "plan and dispatch the next step while the current one runs (its sampled tokens "
                        "go to the next step on the device; steps whose requests use penalties, grammars "
                        "or prompt logprobs wait); default: on with an accelerator (TPU), off on the CPU",
    "tensor_parallel_size": "devices to split the model over (with several processes: all of them)",
    "page_size": "tokens per KV cache page (and per prefix-cache entry)",
    "kv_cache_memory_gb": "memory for the KV cache when --num-pages is not given",
    "max_num_seqs": "sequences running at once (decode rows per step)",
    "seed": "engine seed: a request without its own seed samples from one derived from this and its "
            "arrival order, so the same requests in the same order repeat",
    "speculative_config": "speculative decoding as JSON, vLLM's names: '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
                          "or '{\"method\": \"draft_model\", \"model\": DIR, \"num_speculative_tokens\": 4}' "
                          "(also max_step_tokens, disable_by_batch_size: when it steps aside); default: off",
    "compilation_cache_dir": "JAX's persistent compilation cache (default: $MULTILORA_COMPILATION_CACHE, "
                             "else under the user cache)",
}
_CHOICES = {"lora_backend": list(LORA_BACKEND_CHOICES),
            "dtype": list(DTYPE_CHOICES), "projection_dtype": ["auto", "float32", "bfloat16"],
            "lora_dtype": ["auto", "float32", "bfloat16"], "quantization": ["int8", "int4"]}


# vLLM's names for the same flags, so that a vLLM command line runs as it is
_VLLM_ALIASES = {"max_loras_per_batch": ["--max-loras"], "max_loaded_loras": ["--max-cpu-loras"]}


def add_engine_args(p) -> None:
    p.add_argument("--model", default=None, help="HF checkpoint folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
                   help="adapters registered at start: PEFT folders under the names requests use")
    p.add_argument("--enable-lora", action="store_true",
                   help="accepted for vLLM's command lines: LoRA is on unless --max-loras-per-batch is 0")
    defaults = EngineConfig()
    for f in EngineConfig.__dataclass_fields__.values():
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if f.name in ("enable_prefix_caching", "async_scheduling"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=_HELP[f.name])
            continue
        kind = {"int": int, "float": float, "str": str}.get(
            str(f.type).replace("Optional[", "").rstrip("]"), str)
        p.add_argument(flag, *_VLLM_ALIASES.get(f.name, []), type=kind, default=default,
                       choices=_CHOICES.get(f.name), help=_HELP.get(f.name))


def engine_config_from_args(args) -> EngineConfig:
    return EngineConfig(**{name: getattr(args, name) for name in EngineConfig.field_names()
                           if hasattr(args, name)})


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several processes (hosts); see docs/distributed.md")
    g.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                   help="process 0's address for jax.distributed (same on every process)")
    g.add_argument("--num-processes", type=int, default=1)
    g.add_argument("--process-id", type=int, default=0,
                   help="this process's index; 0 takes the requests and prints the outputs")


def distributed_kwargs(args) -> dict | None:
    if getattr(args, "coordinator_address", None) is None and getattr(args, "num_processes", 1) <= 1:
        return None
    return dict(coordinator_address=args.coordinator_address, num_processes=args.num_processes,
                process_id=args.process_id)


def build_engine(args, **extra):
    """Engine(**engine_kwargs(args), **extra). What a user got wrong at launch (a model or adapter
    folder missing or unreadable, a model or adapter not supported, a budget the machine cannot
    hold, more devices than it has) ends the command with its message, not a traceback
    (--log-level debug keeps the traceback)."""
    from multilora.engine.engine import Engine
    kwargs = engine_kwargs(args)
    try:
        return Engine(progress=True, **kwargs, **extra)
    except (ValueError, OSError) as e:
        if getattr(args, "log_level", None) == "debug":
            raise
        raise SystemExit(f"error: {e}") from None


def engine_kwargs(args) -> dict:
    """Engine(**engine_kwargs(args)): the model, its adapters, the config and the processes. A bad
    option ends the command with its message (a launch error, not a traceback)."""
    try:
        config = engine_config_from_args(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return dict(model=args.model, lora_modules=parse_lora_modules(args.lora_modules),
                config=config, distributed=distributed_kwargs(args))
