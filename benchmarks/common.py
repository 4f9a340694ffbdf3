"""Shared pieces of the benchmark harnesses: random-weight models of a real model's shape,
random PEFT adapters, fixed-seed prompts, medians."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from pathlib import Path

SMOLLM2_135M = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True, hidden_act="silu", bos_token_id=1, eos_token_id=2)
# Llama-3.2-1B's shape (the 1B-class shape; random weights where the model cannot travel)
LLAMA_3_2_1B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=2048,
    intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=True, hidden_act="silu", bos_token_id=128000, eos_token_id=128001)
LLAMA_3_1_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    tie_word_embeddings=False, hidden_act="silu", bos_token_id=128000, eos_token_id=128001)
SHAPES = {"smollm2-135m": SMOLLM2_135M, "llama-3.2-1b": LLAMA_3_2_1B, "llama-3.1-8b": LLAMA_3_1_8B}
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_random_model(folder: Path, config: dict = SMOLLM2_135M, seed: int = 0, dtype: str = "float32") -> Path:
    """A checkpoint of the given shape with random weights, written with numpy + safetensors
    (no torch, so it also runs where only JAX is installed). Saved once, reused. dtype float16
    halves the file (5 GB in float32 at the 1B shape); the loader casts to the engine's dtype."""
    import numpy as np
    from safetensors.numpy import save_file
    if (folder / "config.json").is_file():
        return folder
    c = config
    rng = np.random.default_rng(seed)
    d, f, h = c["hidden_size"], c["intermediate_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    qo, kvo = c["num_attention_heads"] * h, c["num_key_value_heads"] * h

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)

    t = {"model.embed_tokens.weight": w(c["vocab_size"], d), "model.norm.weight": np.ones(d, dtype)}
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        t.update({pre + "input_layernorm.weight": np.ones(d, dtype),
                  pre + "post_attention_layernorm.weight": np.ones(d, dtype),
                  pre + "self_attn.q_proj.weight": w(qo, d), pre + "self_attn.k_proj.weight": w(kvo, d),
                  pre + "self_attn.v_proj.weight": w(kvo, d), pre + "self_attn.o_proj.weight": w(d, qo),
                  pre + "mlp.gate_proj.weight": w(f, d), pre + "mlp.up_proj.weight": w(f, d),
                  pre + "mlp.down_proj.weight": w(d, f)})
    if not c.get("tie_word_embeddings"):
        t["lm_head.weight"] = w(c["vocab_size"], d)
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(t, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(dict(c, torch_dtype=dtype)))
    tmp.rename(folder)
    return folder


def make_random_adapters(model_dir: Path, root: Path, count: int, rank=16,
                         modules=tuple(ALL_MODULES)) -> list[Path]:
    """`count` PEFT adapter folders (rank `rank`, random A and B on every given projection), in
    the exact layout PEFT's save_pretrained writes, so PEFT and multilora both load them. A
    list of ranks is cycled: adapter i has rank[i % len(rank)]."""
    import numpy as np
    from safetensors.numpy import save_file
    c = json.loads((Path(model_dir) / "config.json").read_text())
    d, f = c["hidden_size"], c["intermediate_size"]
    h = c.get("head_dim") or d // c["num_attention_heads"]
    dims = {"q_proj": (d, c["num_attention_heads"] * h), "k_proj": (d, c["num_key_value_heads"] * h),
            "v_proj": (d, c["num_key_value_heads"] * h), "o_proj": (c["num_attention_heads"] * h, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    paths = [root / f"adapter_{i:04d}" for i in range(count)]
    ranks = [rank] if isinstance(rank, int) else list(rank)
    for i, p in enumerate(paths):
        if (p / "adapter_model.safetensors").is_file():
            continue
        rank = ranks[i % len(ranks)]
        rng = np.random.default_rng(1000 + i)
        t = {}
        for layer in range(c["num_hidden_layers"]):
            for m in modules:
                part = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{m}"
                d_in, d_out = dims[m]
                t[key + ".lora_A.weight"] = (rng.standard_normal((rank, d_in), dtype=np.float32) * 0.02)
                t[key + ".lora_B.weight"] = (rng.standard_normal((d_out, rank), dtype=np.float32) * 0.02)
        p.mkdir(parents=True, exist_ok=True)
        save_file(t, str(p / "adapter_model.safetensors"), metadata={"format": "pt"})
        (p / "adapter_config.json").write_text(json.dumps(dict(
            peft_type="LORA", task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
            target_modules=list(modules), bias="none", use_rslora=False, use_dora=False,
            fan_in_fan_out=False, modules_to_save=None, init_lora_weights=True, inference_mode=True,
            base_model_name_or_path=str(model_dir))))
    return paths


def fixed_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(seed)
    lens = rng.integers(max(1, length - 8), length + 9, size=n)
    return [rng.integers(3, vocab, size=int(k)).tolist() for k in lens]


def median(xs):
    return statistics.median(xs)


def machine_info() -> dict:
    cpu = "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    import jax
    return dict(cpu=cpu, cores=os.cpu_count(), python=platform.python_version(), jax=jax.__version__,
                backend=jax.default_backend())


def save_json(path, obj) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=2))


def scratch(name: str) -> str:
    """A default output path outside the repository (the user cache's bench/ folder): a try-out
    never overwrites a recorded file under benchmarks/results, which a log cites; pass --json
    benchmarks/results/NAME to record a run."""
    from multilora.default_model import user_cache_dir
    return str(user_cache_dir() / "bench" / "out" / name)
