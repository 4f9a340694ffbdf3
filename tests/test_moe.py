"""Qwen3-MoE (multilora.model.moe and its place in the model): the grouped experts and their LoRA
against plain-jnp definitions on random shapes, the router against transformers', the config as
transformers reads it, checkpoints with per-expert or fused experts, adapters refused by name
(transformers 4's per-expert layout missing experts, a router or experts on a model without them,
other parameters), the sharding rules, and a second tiny Qwen3-MoE unlike tests/reference.py's (every
layer sparse, 8 experts, top 3 not renormalised, one KV head, a sliding window, tied embeddings,
biases) whose greedy tokens through the forward equal PEFT's in a mixed batch, with adapters on
the router (all-linear), the experts and the attention. The tiny Qwen3-MoE of
tests/reference.py runs through tests/test_model_parity.py with the other families.
"""

from __future__ import annotations

import json
import os
import shutil
import types

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from multilora.adapters.adapter import AdapterError, load_adapter  # noqa: E402
from multilora.config import LoRAConfig, ModelConfig, UnsupportedModelError  # noqa: E402
from multilora.lora.batch import make_lora_batch_info  # noqa: E402
from multilora.model.moe import ExpertLoRA, experts_reference, grouped_experts, route  # noqa: E402
from multilora.model.sharding import TP, rules_for  # noqa: E402
from tests import reference  # noqa: E402

MOE = reference.TINY_CONFIGS["qwen3_moe"]


def _experts(rng, e, d, m):
    return (rng.normal(0, 0.3, (e, d, m)).astype(np.float32), rng.normal(0, 0.3, (e, d, m)).astype(np.float32),
            rng.normal(0, 0.3, (e, m, d)).astype(np.float32))


@pytest.mark.parametrize("t,e,k", [(13, 5, 2), (1, 4, 1), (9, 3, 3), (32, 8, 2)])
def test_grouped_experts_match_the_reference(t, e, k):
    """Rows sorted by expert through ragged_dot, weighted and summed back per token: the dense
    definition, also with experts that no token picks (empty groups)."""
    rng = np.random.default_rng(t * 100 + e)
    d, m = 16, 8
    x = rng.normal(size=(t, d)).astype(np.float32)
    w = _experts(rng, e, d, m)
    experts = np.stack([rng.choice(e - (e > k), size=k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    got = jax.jit(grouped_experts)(x, weights, experts, *w)
    want = experts_reference(x, weights, experts, *w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", [True, False])
def test_router_matches_transformers(norm):
    """Softmax over the experts in float32, the top k, renormalised with norm_topk_prob: the
    weights and experts of transformers' Qwen3MoeTopKRouter."""
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    config = Qwen3MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=3, norm_topk_prob=norm)
    router = Qwen3MoeTopKRouter(config)
    rng = np.random.default_rng(3)
    w = rng.normal(0, 0.5, (6, 16)).astype(np.float32)
    x = rng.normal(size=(11, 16)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w))
        _, want_w, want_e = router(torch.from_numpy(x))
    got_w, got_e = route(jnp.asarray(x), jnp.asarray(w.T), 3, norm)
    np.testing.assert_array_equal(np.asarray(got_e), want_e.numpy())
    np.testing.assert_allclose(np.asarray(got_w), want_w.numpy(), atol=1e-6)


def test_expert_lora_matches_the_definition():
    """Each routed row adds its adapter's delta of its own expert, scaling * B_e A_e, to gate/up
    and down (W_e + scaling * B_e A_e, as PEFT's ParamWrapper): the dense definition with the
    adapted weights, per token; base rows (slot 0) get the base experts."""
    rng = np.random.default_rng(5)
    t, e, k, d, m, r, slots = 10, 4, 2, 16, 8, 8, 3
    x = rng.normal(size=(t, d)).astype(np.float32)
    wg, wu, wd = _experts(rng, e, d, m)
    experts = np.stack([rng.choice(e, size=k, replace=False) for _ in range(t)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    slot_T = rng.integers(0, slots, t).astype(np.int32)
    slot_T[:2] = [0, 2]
    scalings = np.array([0.0, 2.0, 0.5], np.float32)
    # per slot s >= 1 and expert: A (r, in), B (out, r); the pools keep slot s's rows at page s
    a_gu = rng.normal(0, 0.2, (slots, e, r, d)).astype(np.float32)
    b_gu = rng.normal(0, 0.2, (slots, e, 2 * m, r)).astype(np.float32)
    a_dn = rng.normal(0, 0.2, (slots, e, r, m)).astype(np.float32)
    b_dn = rng.normal(0, 0.2, (slots, e, d, r)).astype(np.float32)
    u = slots * r  # page s holds slot s (page 0, slot 0: zeros, as the pool's zero page)
    pools = [np.zeros((1, u, e * x_), np.float32) for x_ in (d, 2 * m, m, d)]
    for s in range(1, slots):
        rows = slice(s * r, (s + 1) * r)
        pools[0][0, rows] = a_gu[s].transpose(1, 0, 2).reshape(r, -1)
        pools[1][0, rows] = b_gu[s].transpose(2, 0, 1).reshape(r, -1)
        pools[2][0, rows] = a_dn[s].transpose(1, 0, 2).reshape(r, -1)
        pools[3][0, rows] = b_dn[s].transpose(2, 0, 1).reshape(r, -1)
    rows_SR = np.arange(slots * r, dtype=np.int32).reshape(slots, r)
    info = make_lora_batch_info(slot_T, scalings, np.array([0, r, r]), rows_SR)
    lora = ExpertLoRA(*map(jnp.asarray, pools), jnp.int32(0), jax.tree.map(jnp.asarray, info))
    got = np.asarray(jax.jit(grouped_experts)(x, weights, experts, wg, wu, wd, lora))
    for i in range(t):
        s = slot_T[i]
        delta = lambda a, b: scalings[s] * np.einsum("eor,eri->eio", b[s], a[s])  # noqa: E731
        gu = delta(a_gu, b_gu) if s else np.zeros((e, d, 2 * m), np.float32)
        dn = delta(a_dn, b_dn) if s else np.zeros((e, m, d), np.float32)
        want = experts_reference(x[i:i + 1], weights[i:i + 1], experts[i:i + 1], wg + gu[..., :m],
                                 wu + gu[..., m:], wd + dn)
        np.testing.assert_allclose(got[i], np.asarray(want)[0], atol=1e-4, rtol=1e-4, err_msg=f"token {i}, slot {s}")


def test_config_reads_the_experts_as_transformers_does():
    """Sparse layers: not in mlp_only_layers, every decoder_sparse_step-th; num_experts saved as
    num_local_experts by transformers 5; head_dim hidden / heads unless given; a window on every
    layer with use_sliding_window; what is not Qwen3-MoE's refused by name."""
    cfg = ModelConfig.from_hf_dict(MOE)
    assert cfg.moe_layers == (0,) and cfg.layer_sparse == (True, False) and cfg.has_dense_mlp
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (4, 2, 32, True)
    assert cfg.qk_norm and cfg.head_dim == 32 and cfg.sliding_window is None
    assert cfg.module_dims("experts.gate_up_proj") == (4 * 64, 4 * 64) and cfg.expert_dims("experts.down_proj") == (32, 64)
    saved = {k: v for k, v in MOE.items() if k not in ("num_experts", "mlp_only_layers", "head_dim")}
    cfg = ModelConfig.from_hf_dict(dict(saved, num_local_experts=6, decoder_sparse_step=2, num_hidden_layers=4,
                                        use_sliding_window=True, sliding_window=7))
    assert cfg.moe_layers == (1, 3) and cfg.num_experts == 6 and cfg.head_dim == 16
    assert cfg.layer_windows == (7, 7, 7, 7)
    dense = ModelConfig.from_hf_dict(dict(MOE, mlp_only_layers=[0, 1]))
    assert dense.moe_layers == () and dense.num_experts == 0 and not dense.layer_sparse[0]
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=5 must be between 1 and num_experts=4"):
        ModelConfig.from_hf_dict(dict(MOE, num_experts_per_tok=5))
    with pytest.raises(UnsupportedModelError, match="shared expert"):
        ModelConfig.from_hf_dict(dict(MOE, shared_expert_intermediate_size=64))
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf_dict(dict(MOE, hidden_act="gelu"))


def test_sharding_rules_split_each_expert_over_its_width():
    """Under tensor parallelism the experts are split like the dense MLP (over their width),
    the router and the experts' LoRA pools replicated; a width tp does not divide is named."""
    cfg = ModelConfig.from_hf_dict(MOE)
    mesh = types.SimpleNamespace(shape={"tp_kv": 2, "tp_rep": 1})
    rules = rules_for(cfg, mesh)
    assert rules["moe_ffn"] == TP and rules["experts"] is None and rules["experts_embed"] is None
    assert rules["experts_gate_up"] is None and rules["experts_moe_ffn"] is None
    odd = ModelConfig.from_hf_dict(dict(MOE, moe_intermediate_size=33))
    with pytest.raises(ValueError, match="moe_intermediate_size=33"):
        rules_for(odd, mesh)
    # every layer sparse: the dense width is not split (only the idle LoRA pools have it)
    sparse = ModelConfig.from_hf_dict(dict(MOE, mlp_only_layers=[], intermediate_size=97))
    assert rules_for(sparse, mesh)["ffn"] is None


# A tiny Qwen3-MoE unlike reference.TINY_CONFIGS["qwen3_moe"]: every layer sparse, 8 experts of
# width 24, top 3 not renormalised, one KV head, head_dim from hidden / heads (12), a window of 6
# keys on every layer, tied embeddings, q/k/v/o biases.
OTHER = dict(MOE, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_experts=8,
             num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[], num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=1, use_sliding_window=True, sliding_window=6,
             tie_word_embeddings=True, attention_bias=True)
OTHER.pop("head_dim")


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """(model folder, {name: adapter folder}) of the OTHER config: an adapter on the seven
    projections (PEFT puts gate/up/down on the experts), one on every linear layer ("all-linear":
    the router too) and one on the experts' down_proj only."""
    root = tmp_path_factory.mktemp("qwen3_moe_other")
    model = reference.make_tiny_model(root / "model", OTHER, seed=11)
    adapters = {"all": reference.make_adapter(model, root / "all", seed=12, r=4, lora_alpha=8,
                                              target_modules=reference.ALL),
                "linear": reference.make_adapter(model, root / "linear", seed=14, r=8, lora_alpha=8,
                                                 target_modules="all-linear", use_rslora=True),
                "down": reference.make_adapter(model, root / "down", seed=13, r=8, lora_alpha=4,
                                               target_modules=[], target_parameters=["mlp.experts.down_proj"])}
    return model, adapters


def test_fused_experts_load_like_per_expert_ones(other, tmp_path):
    """A checkpoint holding each layer's experts fused (transformers 5's gate_up_proj (E, 2M, D)
    and down_proj (E, D, M)) loads to the same weights as save_pretrained's per-expert tensors;
    neither present is named."""
    from multilora.model.loader import load_weights
    model, _ = other
    fused = tmp_path / "fused"
    shutil.copytree(model, fused)
    tensors = load_file(str(fused / "model.safetensors"))
    for i in range(OTHER["num_hidden_layers"]):
        per = lambda n: np.stack([tensors.pop(f"model.layers.{i}.mlp.experts.{e}.{n}.weight") for e in range(8)])  # noqa: E731
        tensors[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.concatenate([per("gate_proj"), per("up_proj")], 1)
        tensors[f"model.layers.{i}.mlp.experts.down_proj"] = per("down_proj")
    save_file(tensors, str(fused / "model.safetensors"))
    cfg, want = load_weights(model)
    _, got = load_weights(fused)
    assert want.layers.w_gate_LDF is None and want.layers.w_gate_LEDM.shape == (2, 8, 48, 24)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    del tensors["model.layers.1.mlp.experts.down_proj"]
    save_file(tensors, str(fused / "model.safetensors"))
    with pytest.raises(KeyError, match=r"neither 'model.layers.1.mlp.experts.0.down_proj.weight'.*nor "
                                       r"'model.layers.1.mlp.experts.down_proj'"):
        load_weights(fused)


def test_adapters_on_what_is_not_supported_are_refused_by_name(other, tmp_path, tiny_models, tiny_adapters):
    """Transformers 4's per-expert LoRA tensors for one expert of eight, a router's or experts'
    LoRA on a model without them, a parameter other than the router's and the experts': each an
    AdapterError that names it (tests/test_moe_per_expert.py reads the per-expert layout)."""
    model, adapters = other
    cfg = ModelConfig.from_dir(model)
    config = json.loads((adapters["down"] / "adapter_config.json").read_text())
    v4 = tmp_path / "v4"
    shutil.copytree(adapters["down"], v4)
    tensors = load_file(str(v4 / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.mlp.experts.3.up_proj.lora_A.weight"] = np.zeros((4, 48), np.float32)
    save_file(tensors, str(v4 / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="layer 0 up_proj has LoRA tensors for experts 3 but none for 0-2, 4-7"):
        load_adapter("v4", v4, cfg, 16)
    llama = ModelConfig.from_dir(tiny_models["llama"])
    with pytest.raises(AdapterError, match="adapts MoE experts, but the base model has none"):
        load_adapter("d", adapters["down"], llama, 16)
    router = tmp_path / "router"
    shutil.copytree(adapters["linear"], router)
    tensors = {k: v for k, v in load_file(str(router / "adapter_model.safetensors")).items()
               if ".mlp.gate." in k or ".self_attn." in k}
    save_file(tensors, str(router / "adapter_model.safetensors"))
    cut = ModelConfig.from_hf_dict(dict(OTHER, mlp_only_layers=[1]))  # layer 1 dense: no router there
    with pytest.raises(AdapterError, match="layers.1.mlp.gate.lora_A.weight' adapts an MoE router"):
        load_adapter("r", router, cut, 16)
    dense = {k.replace("self_attn.q_proj", "mlp.up_proj").replace("self_attn.k_proj", "mlp.gate_proj"): v
             for k, v in tensors.items() if ".self_attn.q_proj" in k or ".self_attn.k_proj" in k}
    save_file({k: (v if "lora_A" in k else np.zeros((80, v.shape[1]), np.float32)) for k, v in dense.items()},
              str(router / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="adapts a dense MLP, but layer 0 of the base model is a mixture of experts"):
        load_adapter("r", router, cfg, 16)
    (v4 / "adapter_config.json").write_text(json.dumps(dict(config, target_parameters=["lm_head.weight"])))
    with pytest.raises(AdapterError, match="target_parameters 'lm_head.weight' is not supported"):
        load_adapter("v4", v4, cfg, 16)


def run_mixed_batch(cfg, weights, slots, seqs, prompts, new, mesh):
    """Greedy decoding of `seqs` ((prompt length, slot)) together: prefilled in one batch, then a
    token a step. Returns (tokens, logits) per sequence, logits (new, V)."""
    from multilora.engine.batching import SeqChunk, build_batch, decode_first
    from multilora.lora.backend import get_backend
    from multilora.model.llama import forward, init_kv_cache
    page = 4
    pages = [list(range(1 + 4 * i, 5 + 4 * i)) for i in range(len(seqs))]
    be = get_backend("bgmv")
    fwd = jax.jit(forward, static_argnames=("cfg", "backend"))
    kv = jax.device_put(init_kv_cache(cfg, 32, page, jnp.float32), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))
    chunks = [SeqChunk(p, 0, pg, s) for p, pg, (_, s) in zip(prompts, pages, seqs)]
    tokens, logits_of = [[] for _ in seqs], [[] for _ in seqs]
    for step in range(new):
        order = decode_first(chunks)
        batch = build_batch([chunks[i] for i in order], num_tokens=64, num_pages=32, num_logits=8, page_size=page,
                            prepare_lora=lambda slot_T: be.prepare_lora_batch(slot_T, slots.scalings_S, slots.ranks_S,
                                                                              slots.rows_SR))
        logits, kv = fwd(weights, slots.weights, kv, batch, cfg=cfg, backend="bgmv")
        logits = np.asarray(logits)
        for j, i in enumerate(order):
            tokens[i].append(int(np.argmax(logits[j])))
            logits_of[i].append(logits[j])
        chunks = [SeqChunk([tokens[i][-1]], n + step, pages[i], s) for i, (n, s) in enumerate(seqs)]
    return tokens, [np.stack(x) for x in logits_of]


def test_another_qwen3_moe_gives_peft_greedy_tokens_in_a_mixed_batch(other, peft_greedy_cache):
    """The OTHER tiny Qwen3-MoE, base rows beside its two adapters in one batch, prefilled
    together then decoded a token a step: PEFT's greedy tokens (transformers' generate) exactly."""
    from multilora.adapters.pool import LoRASlots, page_rows
    from multilora.engine.runner import jit_slot_writer
    from multilora.model.loader import load_weights
    from multilora.model.sharding import make_mesh
    model, adapters = other
    mesh = make_mesh(1)
    cfg, weights = load_weights(model, mesh=mesh)
    assert cfg.moe_layers == (0, 1) and cfg.layer_windows == (6, 6) and cfg.tie_word_embeddings
    slots = LoRASlots(cfg, LoRAConfig(max_loras_per_batch=3, max_lora_rank=16), jnp.float32, mesh,
                      jit_writer=jit_slot_writer)
    names = {1: "all", 2: "down", 3: "linear"}
    for slot, name in names.items():
        adapter = load_adapter(name, adapters[name], cfg, 16)
        slots.load(slot, page_rows([2 * slot - 1, 2 * slot][:-(-adapter.rank // 8)]), adapter)
    assert slots.ranks_S.tolist() == [0, 8, 8, 16]  # "all", "linear": gate_up fused at twice r
    assert "gate" in load_adapter("linear", adapters["linear"], cfg, 16).target_modules  # the router
    seqs = [(7, 0), (5, 1), (9, 2), (4, 3), (8, 0), (6, 2), (5, 3)]  # (prompt length, slot)
    prompts = [np.random.default_rng(21).integers(3, 256, size=n).tolist() for n, _ in seqs]
    new = 6
    got, _ = run_mixed_batch(cfg, weights, slots, seqs, prompts, new, mesh)
    want = peft_greedy_cache.many(model, [(None if s == 0 else adapters[names[s]], p)
                                          for p, (_, s) in zip(prompts, seqs)], new)
    assert got == want
