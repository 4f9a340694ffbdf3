"""One declaration per array (multilora.model.arrays): every weight and LoRA pool field declares
its axes (and checkpoint tensor, or PEFT modules), and the loader, the shardings and the pools
follow from them. Checked on the tiny checkpoints: shapes, values against the safetensors, and
the errors of a checkpoint that does not match its config."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from multilora.config import ALL_LORA_MODULES, LORA_MODULES, ModelConfig
from multilora.adapters.pool import POOLS, lora_buffer_shapes, lora_feature_dims
from multilora.model.arrays import arrays, shape_of
from multilora.model.llama import LayerWeights, LoRAWeights, Weights
from multilora.model.loader import load_weights


def test_every_field_declares_its_array():
    for cls in (LayerWeights, LoRAWeights):
        assert [f.name for f in dataclasses.fields(cls)] == [n for n, _ in arrays(cls)]
    assert [f.name for f in dataclasses.fields(Weights) if f.name != "layers"] == [n for n, _ in arrays(Weights)]
    # each PEFT module (the experts' too): one A block and one B pool, and nothing else
    for side in ("a", "b"):
        mods = [m for info in POOLS.values() if info.side == side for m in info.modules]
        assert sorted(mods) == sorted(ALL_LORA_MODULES), side


@pytest.mark.parametrize("kind", ["llama", "qwen2", "tied", "qwen3", "gemma2"])
def test_loaded_weights_follow_their_declarations(kind, tiny_models):
    """Shapes from the declared axes, absent arrays None (biases, a tied head), values equal to
    the checkpoint's tensors (transposed where declared), and the LoRA pools' shapes."""
    model_dir = tiny_models[kind]
    cfg = ModelConfig.from_dir(model_dir)
    _, w = load_weights(model_dir, cfg)
    tensors = load_file(str(model_dir / "model.safetensors"))
    for name, info in arrays(LayerWeights):
        got = getattr(w.layers, name)
        if not info.present(cfg):
            assert got is None, name
            continue
        assert got.shape == shape_of(info, cfg), name
        want = tensors[f"model.layers.1.{info.key}"]
        np.testing.assert_array_equal(np.asarray(got[1]), want.T if info.transpose else want)
    for name, info in arrays(Weights):
        got = getattr(w, name)
        assert (got is None) == (not info.present(cfg)), name
        if got is not None:
            want = tensors[info.key]
            np.testing.assert_array_equal(np.asarray(got), want.T if info.transpose else want)
    assert (w.layers.bq_LO is not None) == (kind in ("qwen2", "tied")) and (w.lm_head_DV is None) == (kind in ("tied", "gemma2"))
    assert (w.layers.q_norm_LH is not None) == (kind == "qwen3")  # (L, head_dim): Qwen3's per-head q/k norms
    # Gemma 2: its pre-MLP norm in place of mlp_norm_LD, norms after attention and after the MLP
    assert (w.layers.mlp_norm_LD is None) == (w.layers.post_attn_norm_LD is not None) == (kind == "gemma2")
    # an adapter's module shapes (what adapter.py validates against) agree with the pools
    widths = lora_feature_dims(cfg)
    for module in LORA_MODULES:
        a_pool = next(k for k, i in POOLS.items() if i.side == "a" and module in i.modules)
        b_pool = next(k for k, i in POOLS.items() if i.side == "b" and module in i.modules)
        assert cfg.module_dims(module) == (widths[a_pool], widths[b_pool]), module
    shapes = lora_buffer_shapes(cfg, 24)
    assert shapes["qkv_a_LUD"] == (cfg.num_layers, 3 * 24, cfg.hidden_size)
    assert shapes["k_b_LUO"] == (cfg.num_layers, 24, cfg.kv_dim)
    assert shapes["down_a_LUF"] == (cfg.num_layers, 24, cfg.intermediate_size)


def test_a_checkpoint_that_does_not_match_its_config_is_refused(tiny_models, tmp_path):
    src = tiny_models["llama"]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    key = "model.layers.1.self_attn.k_proj.weight"
    tensors[key] = np.zeros((tensors[key].shape[0] + 1, tensors[key].shape[1]), np.float32)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + ".*config.json implies"):
        load_weights(bad)
    del tensors[key]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(KeyError, match="k_proj"):
        load_weights(bad)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight and tie_word_embeddings is false"):
        load_weights(bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=True)))
    load_weights(bad)  # tied: no lm_head needed
