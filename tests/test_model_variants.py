"""Configs of the supported families that the parity tests' tinies do not have, as the released
models set them: a tied Qwen2.5 (0.5B to 3B tie their embeddings), a tied Llama 3.2 with `llama3`
rope scaling, a Gemma 3 whose global layers scale their RoPE linearly (4B and up: factor 8), a
Mistral without a window and with its own head_dim (Nemo), a Qwen3 with YaRN, and a Gemma 3
config that sets soft caps. Through the engine at float32, base and
adapter rows in one batch: PEFT's greedy tokens exactly. The engines compile the shapes they use
(warmup=False): a full warm-up's unused buckets were ~3/4 of this file's time; tests/test_engine.py
checks that the warm-up's plan covers every step.
"""

from __future__ import annotations

import numpy as np
import pytest

from multilora.engine.engine import Engine
from multilora.engine.request import SamplingParams
from tests import reference

T = reference.TINY_CONFIGS
VARIANTS = {
    "qwen25_tied": dict(T["qwen2"], tie_word_embeddings=True),
    "llama32_tied": dict(T["llama"], tie_word_embeddings=True),
    "gemma3_linear_global": dict(T["gemma3"], rope_parameters=dict(
        sliding_attention=dict(rope_type="default", rope_theta=10000.0),
        full_attention=dict(rope_type="linear", factor=8.0, rope_theta=1000000.0))),
    "mistral_nemo_like": dict(T["mistral"], sliding_window=None, head_dim=32),
    # YaRN as Qwen3's card extends its context (here an original context of 16: the prompts and
    # their tokens run past it)
    "qwen3_yarn": dict(T["qwen3"], rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                     original_max_position_embeddings=16)),
    # soft caps in a Gemma 3 config: transformers' Gemma 3 caps the final logits only
    "gemma3_capped_config": dict(T["gemma3"], attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
}
NEW = 8


@pytest.mark.parametrize("name", list(VARIANTS))
def test_engine_greedy_tokens_equal_peft(name, tmp_path, peft_greedy_cache):
    model_dir = reference.make_tiny_model(tmp_path / name, VARIANTS[name], seed=3)
    adapter_dir = reference.make_adapter(model_dir, tmp_path / "adapter", seed=4, r=8, lora_alpha=16,
                                         target_modules=reference.ALL)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 23, 14)]
    loras = [None, "a", "a"]
    eng = Engine(str(model_dir), {"a": str(adapter_dir)}, max_loras_per_batch=2, max_lora_rank=16,
                 max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64, page_size=8,
                 projection_dtype="float32", warmup=False)
    outs = eng.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True), loras)
    got = [list(o.token_ids) for o in outs]
    want = peft_greedy_cache.many(model_dir, [(adapter_dir if lora else None, p) for p, lora in zip(prompts, loras)],
                                  NEW)
    assert got == want


# PEFT configs that choose their layers and modules in ways ADAPTER_SPECS do not: "all-linear",
# layers_to_transform (tensors for layer 1 only), exclude_modules, and rank / alpha patterns keyed by
# a module's full path (one layer's q_proj, another's down_proj)
ADAPTER_VARIANTS = {
    "all_linear": dict(r=8, lora_alpha=16, target_modules="all-linear"),
    "layer_1_only": dict(r=8, lora_alpha=16, target_modules=reference.ALL, layers_to_transform=[1]),
    "exclude_o_proj": dict(r=8, lora_alpha=16, target_modules=reference.ALL, exclude_modules=["o_proj"]),
    "full_path_patterns": dict(r=8, lora_alpha=16, target_modules=reference.ALL,
                               rank_pattern={"model.layers.0.self_attn.q_proj": 4},
                               alpha_pattern={"model.layers.1.mlp.down_proj": 3}),
}


def test_adapter_configs_choosing_layers_and_modules(tmp_path, peft_greedy_cache):
    """Each adapter above, all loaded in one engine, base rows beside them: PEFT's greedy tokens."""
    model_dir = reference.make_tiny_model(tmp_path / "qwen2", "qwen2", seed=5)
    adapters = {name: reference.make_adapter(model_dir, tmp_path / name, seed=6 + i, **spec)
                for i, (name, spec) in enumerate(ADAPTER_VARIANTS.items())}
    rng = np.random.default_rng(1)
    loras = [None] + list(adapters) * 2
    prompts = [rng.integers(3, 256, size=int(n)).tolist() for n in rng.integers(4, 24, size=len(loras))]
    eng = Engine(str(model_dir), {n: str(d) for n, d in adapters.items()}, max_loras_per_batch=4,
                 max_lora_rank=16, max_model_len=64, max_num_seqs=len(loras), max_num_batched_tokens=256,
                 page_size=8, projection_dtype="float32", warmup=False)
    outs = eng.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True), loras)
    got = [list(o.token_ids) for o in outs]
    want = peft_greedy_cache.many(model_dir, [(adapters[lora] if lora else None, p) for p, lora in zip(prompts, loras)],
                                  NEW)
    assert got == want
