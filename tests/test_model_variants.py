"""Configs of the supported families that the parity tests' tinies do not have, as the released
models set them: a tied Qwen2.5 (0.5B to 3B tie their embeddings), a tied Llama 3.2 with `llama3`
rope scaling, a Gemma 3 whose global layers scale their RoPE linearly (4B and up: factor 8), and a
Mistral without a window and with its own head_dim (Nemo). Through the engine at float32, base and
adapter rows in one batch: PEFT's greedy tokens exactly.
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
                 projection_dtype="float32")
    outs = eng.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True), loras)
    got = [list(o.token_ids) for o in outs]
    want = peft_greedy_cache.many(model_dir, [(adapter_dir if lora else None, p) for p, lora in zip(prompts, loras)],
                                  NEW)
    assert got == want
