"""The references: tiny random checkpoints and PEFT adapters made with transformers + PEFT, and
their logits. Test-only code: torch never enters the package."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

TINY_CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False, hidden_act="silu",
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=64)),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=256, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False),
    "tied": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=48,
                 intermediate_size=128, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
                 max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                 tie_word_embeddings=True, hidden_act="silu"),
}

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_SPECS = {
    "a_all_r8": dict(r=8, lora_alpha=16, target_modules=ALL),
    "b_attn_r4_rslora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], use_rslora=True),
    "c_mlp_r16": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "d_regex_patterns": dict(r=8, lora_alpha=8, target_modules=r".*\.(k_proj|down_proj|q_proj)",
                             rank_pattern={"k_proj": 2}, alpha_pattern={"down_proj": 32}),
}


def make_tiny_model(folder: Path, kind: str, seed: int = 0) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg_dict = dict(TINY_CONFIGS[kind])
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**cfg_dict)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # HF init is tiny; widen it so that errors show in the logits
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
            if p.ndim == 1 and kind == "qwen2":
                p.normal_(0.0, 0.2) if p.shape[0] != cfg_dict["hidden_size"] else None
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_adapter(model_dir: Path, folder: Path, seed: int, **lora_kwargs) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    cfg = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora_kwargs)
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.mul_(0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def peft_logits(model_dir: Path, adapter_dir: Path | None, token_ids: list[int]) -> np.ndarray:
    """(T, V) logits of one sequence through transformers (+ PEFT when adapter_dir is given)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([token_ids]))
    return out.logits[0].numpy()


def peft_greedy(model_dir: Path, adapter_dir: Path | None, token_ids: list[int], max_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([token_ids]), max_new_tokens=max_new, do_sample=False,
                             min_new_tokens=max_new, pad_token_id=0, eos_token_id=None)
    return out[0, len(token_ids):].tolist()


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))
