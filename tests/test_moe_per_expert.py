"""Qwen3-MoE adapters in transformers 4's per-expert layout (PEFT on transformers 4 adapts each
expert's gate_proj, up_proj and down_proj as a LoRA of its own), fused at load time
(multilora.adapters.per_expert).

transformers 5 cannot build transformers 4's per-expert modules, so the adapters are written
here as PEFT 0.1x wrote them (random per-expert tensors, B nonzero, and its adapter_config.json),
and the references are: for each, its fused twin built here in numpy, independently of
multilora (per layer lora_A (E * R, in) and lora_B (out, R * E) as PEFT's ParamWrapper holds
them, expert e's gate_up LoRA [A_gate; A_up] with B block diagonal, gate's rows and outputs
first, each expert's scaling over the default one folded into its B block), loaded into PEFT
0.21 on transformers 5.25 at float32; and for the adapter without rsLoRA or patterns on gate/up,
PEFT's own conversion of the per-expert folder, which must agree with its twin (PEFT's conversion
scales both gate_up halves by 2 * lora_alpha / (2r), so with rsLoRA it applies sqrt(2) times the
trained scaling: there the twin, which keeps the trained one, is the reference; the adapter on
every Linear, the router too, has only PEFT's conversion). Checked: the host copy of a
per-expert folder equals its twin's exactly; multilora's greedy tokens equal PEFT's in a mixed
batch (base rows beside four adapters), logits within ATOL; the two folders give identical
logits; the engine serves them from its start (default max_lora_rank at the fused rank); each
malformed folder gives an AdapterError that names the tensor or layer, what was expected and
what is allowed, word for word the same from the header alone (probe_adapter), and leaves the
engine's other adapters serving what they served.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from multilora.adapters.adapter import AdapterError, load_adapter, probe_adapter  # noqa: E402
from multilora.config import LoRAConfig, ModelConfig  # noqa: E402
from tests import reference  # noqa: E402
from tests.test_moe import OTHER, run_mixed_batch  # noqa: E402  (OTHER: 8 experts of width 24, every layer sparse)

E, D, M, L = OTHER["num_experts"], OTHER["hidden_size"], OTHER["moe_intermediate_size"], OTHER["num_hidden_layers"]
Q, KV = D, D // OTHER["num_attention_heads"] * OTHER["num_key_value_heads"]
DIMS = {"q_proj": (D, Q), "k_proj": (D, KV), "v_proj": (D, KV), "o_proj": (Q, D), "gate": (D, E),
        "gate_proj": (D, M), "up_proj": (D, M), "down_proj": (M, D)}
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
ALL_LINEAR = list(DIMS)  # what "all-linear" took on transformers 4's Qwen3-MoE: every Linear (the router too)
KEY = "base_model.model.model.layers.{layer}.{module}.lora_{ab}.weight"
ATOL = 1e-4  # multilora's float32 logits against PEFT's (as tests/test_model_parity.py)
MAX_RANK = 16
# name -> PEFT LoraConfig fields (as PEFT 0.1x saved them; lora_dropout 0: PEFT's ParamWrapper,
# which loads the fused twins, refuses any other)
SPECS = {
    # PEFT's own conversion keeps this one's scalings: it is the second reference
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]),
    # rsLoRA; up_proj at rank 2, one expert's gate_proj at rank 3 in layer 1 (zero-padded to 4),
    # down_proj's alpha 4 and expert 2's gate_proj alpha 16 (every expert's own scaling), o_proj rank 2
    "patterns": dict(r=4, lora_alpha=8, use_rslora=True,
                     target_modules=["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                     rank_pattern={"o_proj": 2, "up_proj": 2, "layers.1.mlp.experts.5.gate_proj": 3},
                     alpha_pattern={"down_proj": 4, "experts.2.gate_proj": 16}),
    # no gate_proj: gate_up's gate half a zero block
    "half": dict(r=8, lora_alpha=16, target_modules=["up_proj", "down_proj"]),
    # every Linear, the router (mlp.gate) too: its reference is PEFT's own conversion (no twin)
    "linear": dict(r=4, lora_alpha=4, target_modules="all-linear"),
}


def _peft_rank_alpha(cfg: dict, path: str) -> tuple[int, float]:
    """A module's rank and alpha as PEFT picks them from the patterns (its get_pattern_key)."""
    from peft.utils.other import get_pattern_key
    rp, ap = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    return (rp.get(get_pattern_key(rp.keys(), path), cfg["r"]),
            ap.get(get_pattern_key(ap.keys(), path), cfg["lora_alpha"]))


def _scaling(cfg: dict, r: int, alpha: float) -> float:
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _module(layer: int, proj: str, expert: int | None = None) -> str:
    if proj in EXPERT_PROJS:
        return f"mlp.experts.{expert}.{proj}"
    return "mlp.gate" if proj == "gate" else f"self_attn.{proj}"


def write_per_expert(folder: Path, model_dir: Path, spec: dict, seed: int) -> Path:
    """A transformers 4 PEFT adapter folder: random per-expert A (r, in) and B (out, r) of every
    targeted projection, layer and expert (B nonzero), the ranks the patterns say."""
    rng = np.random.default_rng(seed)
    cfg = {**dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=str(model_dir), r=8,
                  lora_alpha=8, lora_dropout=0.0, bias="none", fan_in_fan_out=False, inference_mode=True,
                  init_lora_weights=True, modules_to_save=None, use_rslora=False, use_dora=False, rank_pattern={},
                  alpha_pattern={}, layers_to_transform=None, layers_pattern=None, revision=None), **spec}
    tensors = {}
    for layer in range(L):
        for proj in ALL_LINEAR if cfg["target_modules"] == "all-linear" else cfg["target_modules"]:
            d_in, d_out = DIMS[proj]
            for expert in range(E) if proj in EXPERT_PROJS else (None,):
                module = _module(layer, proj, expert)
                r, _ = _peft_rank_alpha(cfg, f"model.layers.{layer}.{module}")
                for ab, shape in (("A", (r, d_in)), ("B", (d_out, r))):
                    key = KEY.format(layer=layer, module=module, ab=ab)
                    tensors[key] = rng.normal(0, 0.3, shape).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def write_fused_twin(folder: Path, per_expert: Path) -> Path:
    """The transformers 5 PEFT adapter (target_parameters gate_up_proj, down_proj) computing what
    the per-expert one does, built in numpy: per layer and fused parameter, expert e's A' (R, in)
    and B' (out, R), gate's rank rows and outputs before up's (zero where a projection is not
    targeted), B' scaled per expert by its scaling over the default one; saved as PEFT's
    ParamWrapper holds them (lora_A rows e * R + j, lora_B columns j * E + e; gate_up the inner
    wrapper, under base_layer) with the fused parameters' scaling the default one."""
    cfg = json.loads((per_expert / "adapter_config.json").read_text())
    tensors = load_file(str(per_expert / "adapter_model.safetensors"))
    s0 = _scaling(cfg, cfg["r"], cfg["lora_alpha"])
    out = {k: v for k, v in tensors.items() if ".experts." not in k}
    targets = [p for p in cfg["target_modules"] if p in EXPERT_PROJS]
    params = {"gate_up_proj": [p for p in ("gate_proj", "up_proj") if p in targets],
              "down_proj": [p for p in ("down_proj",) if p in targets]}
    params = {k: v for k, v in params.items() if v}
    fused_rank = {}
    for layer in range(L):
        for param, projs in params.items():
            halves = ("gate_proj", "up_proj") if param == "gate_up_proj" else ("down_proj",)
            d_in, d_half = DIMS[halves[0]]
            ranks = {p: max(tensors[KEY.format(layer=layer, module=_module(layer, p, e), ab="A")].shape[0]
                            for e in range(E)) if p in projs else 0 for p in halves}
            rank = sum(ranks.values())
            assert fused_rank.setdefault(param, rank) == rank, "one fused rank per parameter over the layers"
            a = np.zeros((E, rank, d_in), np.float32)
            b = np.zeros((E, len(halves) * d_half, rank), np.float32)
            for e in range(E):
                row = 0
                for i, p in enumerate(halves):
                    if p in projs:
                        module = _module(layer, p, e)
                        a_p, b_p = (tensors[KEY.format(layer=layer, module=module, ab=ab)] for ab in "AB")
                        r, alpha = _peft_rank_alpha(cfg, f"model.layers.{layer}.{module}")
                        assert a_p.shape[0] == r
                        a[e, row:row + r] = a_p
                        b[e, i * d_half:(i + 1) * d_half, row:row + r] = b_p * np.float32(_scaling(cfg, r, alpha) / s0)
                    row += ranks[p]
            wrapper = "experts.base_layer" if param == "gate_up_proj" and len(params) == 2 else "experts"
            out[KEY.format(layer=layer, module=f"mlp.{wrapper}", ab="A")] = a.reshape(E * rank, d_in)
            out[KEY.format(layer=layer, module=f"mlp.{wrapper}", ab="B")] = np.ascontiguousarray(
                b.transpose(1, 2, 0).reshape(-1, rank * E))
    keep = lambda pat: not any(p in pat for p in EXPERT_PROJS)  # noqa: E731  (the attention's patterns)
    twin = dict(cfg, target_modules=[p for p in cfg["target_modules"] if p not in EXPERT_PROJS],
                target_parameters=sorted(params),
                rank_pattern={**{k: v for k, v in cfg["rank_pattern"].items() if keep(k)},
                              **{rf".*\.{p}": r for p, r in fused_rank.items()}},
                alpha_pattern={**{k: v for k, v in cfg["alpha_pattern"].items() if keep(k)},
                               **{rf".*\.{p}": s0 * (math.sqrt(r) if cfg.get("use_rslora") else r)
                                  for p, r in fused_rank.items()}})
    folder.mkdir(parents=True)
    save_file(out, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(twin, indent=2))
    return folder


def _edit(src: Path, dst: Path, tensors_fn=None, **config) -> Path:
    """A copy of the adapter folder src, its tensors passed through tensors_fn, its config changed."""
    shutil.copytree(src, dst)
    if tensors_fn is not None:
        t = load_file(str(dst / "adapter_model.safetensors"))
        save_file(tensors_fn(dict(t)), str(dst / "adapter_model.safetensors"))
    if config:
        p = dst / "adapter_config.json"
        p.write_text(json.dumps(dict(json.loads(p.read_text()), **config)))
    return dst


def _k(layer, expert, proj, ab):
    """The tensor name of an expert's projection's lora_A or lora_B."""
    return KEY.format(layer=layer, module=_module(layer, proj, expert), ab=ab)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(model folder, {name: per-expert folder}, {name: fused twin folder}) for SPECS on the OTHER
    tiny Qwen3-MoE of tests/test_moe.py; "linear" has no twin (PEFT converts its folder)."""
    root = tmp_path_factory.mktemp("qwen3_moe_per_expert")
    model = reference.make_tiny_model(root / "model", OTHER, seed=11)
    per = {name: write_per_expert(root / name, model, spec, seed=31 + i)
           for i, (name, spec) in enumerate(SPECS.items())}
    twins = {name: write_fused_twin(root / f"{name}_fused", folder) for name, folder in per.items() if name != "linear"}
    return model, per, twins


@pytest.fixture(scope="module")
def cfg(folders):
    return ModelConfig.from_dir(folders[0])


def test_the_twins_read_in_peft_as_peft_converts_the_per_expert_folder(folders):
    """PEFT 0.21 converts a per-expert folder itself on transformers 5 (gate_up at rank 2r, alpha
    2 * lora_alpha): without rsLoRA or patterns on gate/up it keeps the trained scalings, and
    its logits are the numpy twin's, which checks the twins' layout against PEFT's."""
    model, per, twins = folders
    ref = reference.PeftReference(model, {"converted": per["plain"], "twin": twins["plain"]})
    ids = np.random.default_rng(3).integers(3, 256, size=12).tolist()
    base = reference.PeftReference(model, {}).logits(None, ids)
    np.testing.assert_allclose(ref.logits("converted", ids), ref.logits("twin", ids), atol=1e-5, rtol=0)
    assert np.abs(ref.logits("twin", ids) - base).max() > 0.05  # the adapter shows in the logits


def test_a_per_expert_folder_reads_as_its_fused_twin(folders, cfg):
    """The host copy of each per-expert folder equals its twin's value for value (float32 and
    bfloat16: the same rows, each value rounded once), and the header-only probe agrees with the
    read on rank and size; the fused ranks are the halves' sums."""
    _, per, twins = folders
    ranks = {"plain": 8, "patterns": 6, "half": 8}
    for name in twins:
        for dtype in (np.float32, jnp.bfloat16):
            got = load_adapter(name, per[name], cfg, MAX_RANK, dtype)
            want = load_adapter(name, twins[name], cfg, MAX_RANK, dtype)
            assert (got.rank, got.scaling, got.target_modules) == (want.rank, want.scaling, want.target_modules)
            assert got.rank == ranks[name]
            for module, (a, b) in got.modules.items():
                np.testing.assert_array_equal(a, want.modules[module][0], err_msg=f"{name} {module} A")
                np.testing.assert_array_equal(b, want.modules[module][1], err_msg=f"{name} {module} B")
            assert got.content_hash == want.content_hash
        probe = probe_adapter(name, per[name], cfg, MAX_RANK)
        assert (probe.rank, probe.nbytes) == (got.rank, load_adapter(name, per[name], cfg, MAX_RANK).nbytes)
    a, _ = load_adapter("half", per["half"], cfg, MAX_RANK).modules["experts.gate_up_proj"]
    assert a.shape == (L, 8, E * D)  # up's 8 rows only: the gate half takes none
    linear = load_adapter("linear", per["linear"], cfg, MAX_RANK)
    assert linear.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate", "experts.gate_up_proj",
                                     "experts.down_proj")


def test_per_expert_arrays_read_as_the_folder(folders, cfg):
    """adapter_from_tensors (arrays in memory, PEFT's names) reads transformers 4's per-expert
    names as a folder's: the same host copy."""
    from multilora.adapters.adapter import adapter_from_tensors
    _, per, _ = folders
    for name in ("patterns", "linear"):
        config = json.loads((per[name] / "adapter_config.json").read_text())
        got = adapter_from_tensors(name, load_file(str(per[name] / "adapter_model.safetensors")), config, cfg, MAX_RANK)
        assert got.content_hash == load_adapter(name, per[name], cfg, MAX_RANK).content_hash


def test_a_nan_in_one_expert_is_named_when_the_weights_are_read(folders, cfg, tmp_path):
    """What only the weights tell (a NaN in one expert's B): the header-only probe passes, the
    read names the tensor."""
    _, per, _ = folders
    key = _k(1, 4, "up_proj", "B")

    def poison(t):
        t[key] = t[key].copy()
        t[key][2, 1] = np.nan
        return t
    folder = _edit(per["plain"], tmp_path / "nan", poison)
    assert probe_adapter("nan", folder, cfg, MAX_RANK).rank == 8
    with pytest.raises(AdapterError, match=f"tensor {key!r} holds NaN or Inf values"):
        load_adapter("nan", folder, cfg, MAX_RANK)


def test_per_expert_adapters_give_peft_greedy_tokens_in_a_mixed_batch(folders, peft_greedy_cache):
    """Base rows beside the four per-expert adapters in one batch, prefilled together then
    decoded a token a step: PEFT's greedy tokens (the fused twins; "linear": its own conversion)
    exactly, every step's logits within ATOL of PEFT's on the same tokens; then each twin in its
    adapter's slot gives the same logits bit for bit."""
    from multilora.adapters.pool import LoRASlots, page_rows
    from multilora.engine.runner import jit_slot_writer
    from multilora.model.loader import load_weights
    from multilora.model.sharding import make_mesh
    model, per, twins = folders
    mesh = make_mesh(1)
    cfg, weights = load_weights(model, mesh=mesh)
    slots = LoRASlots(cfg, LoRAConfig(max_loras_per_batch=4, max_lora_rank=MAX_RANK), jnp.float32, mesh,
                      jit_writer=jit_slot_writer)
    names = {1: "plain", 2: "patterns", 3: "half", 4: "linear"}
    refs = {name: twins.get(name, per[name]) for name in names.values()}  # "linear": PEFT converts it

    def fill(folders_of):
        for slot, name in names.items():
            slots.load(slot, page_rows([slot]), load_adapter(name, folders_of[name], cfg, MAX_RANK))  # rank <= 8

    fill(per)
    assert slots.ranks_S.tolist() == [0, 8, 6, 8, 8]
    seqs = [(7, 0), (5, 1), (9, 2), (4, 3), (8, 4), (6, 2), (5, 3), (6, 1)]  # (prompt length, slot)
    prompts = [np.random.default_rng(41 + i).integers(3, 256, size=n).tolist() for i, (n, _) in enumerate(seqs)]
    new = 6
    got, logits = run_mixed_batch(cfg, weights, slots, seqs, prompts, new, mesh)
    want = peft_greedy_cache.many(model, [(None if s == 0 else refs[names[s]], p)
                                          for p, (_, s) in zip(prompts, seqs)], new)
    assert got == want
    ref = reference.PeftReference(model, refs)
    for i, ((n, s), p) in enumerate(zip(seqs, prompts)):
        full = ref.logits(None if s == 0 else names[s], p + got[i][:-1])[n - 1:]
        err = np.abs(logits[i] - full).max()
        assert err <= ATOL, f"sequence {i} (slot {s}): max |logit error| {err:.2e} > {ATOL}"
    fill(refs)
    _, twin_logits = run_mixed_batch(cfg, weights, slots, seqs, prompts, new, mesh)
    for i in range(len(seqs)):
        np.testing.assert_array_equal(twin_logits[i], logits[i], err_msg=f"sequence {i}")


def _drop_expert(layer, expert, proj):
    def fn(t):
        del t[_k(layer, expert, proj, "A")], t[_k(layer, expert, proj, "B")]
        return t
    return fn


def _set(key, shape):
    def fn(t):
        t[key] = np.ones(shape, np.float32)
        return t
    return fn


def _add(layer, expert, proj, r=4):
    def fn(t):  # an expert's lora_A and lora_B of the right shapes
        d_in, d_out = DIMS[proj]
        return _set(_k(layer, expert, proj, "A"), (r, d_in))(_set(_k(layer, expert, proj, "B"), (d_out, r))(t))
    return fn


def _drop(key):
    def fn(t):
        del t[key]
        return t
    return fn


def _both_layouts(twin: Path):
    def fn(t):  # layer 0's fused down_proj beside its per-expert one
        fused = load_file(str(twin / "adapter_model.safetensors"))
        t.update({k: v for k, v in fused.items() if ".layers.0.mlp.experts.lora_" in k})
        return t
    return fn


# case -> (folder builder (per-expert folders, twins, destination), max_lora_rank, words the message holds)
CASES = {
    "missing_expert": (lambda per, tw, d: _edit(per["plain"], d, _drop_expert(1, 6, "gate_proj")), MAX_RANK,
                       ["layer 1 gate_proj has LoRA tensors for experts 0-5, 7 but none for 6",
                        "PEFT adapts every expert", "have 8"]),
    "missing_experts": (lambda per, tw, d: _edit(per["half"], d, lambda t: _drop_expert(0, 3, "up_proj")(
                            _drop_expert(0, 4, "up_proj")(_drop_expert(0, 0, "up_proj")(t)))), MAX_RANK,
                        ["layer 0 up_proj has LoRA tensors for experts 1-2, 5-7 but none for 0, 3-4"]),
    "bad_a_shape": (lambda per, tw, d: _edit(per["plain"], d, _set(_k(0, 2, "up_proj", "A"), (4, D - 1))), MAX_RANK,
                    [f"{_k(0, 2, 'up_proj', 'A')!r} has shape (4, {D - 1})", f"takes lora_A (r, {D})",
                     f"up_proj: {D} -> {M}"]),
    "bad_b_shape": (lambda per, tw, d: _edit(per["plain"], d, _set(_k(1, 7, "down_proj", "B"), (D, 5))), MAX_RANK,
                    [f"{_k(1, 7, 'down_proj', 'B')!r} has shape ({D}, 5)", f"takes lora_B ({D}, 4) beside its "
                     "lora_A (4, 24)"]),
    "expert_out_of_range": (lambda per, tw, d: _edit(per["plain"], d, _add(0, E, "down_proj")), MAX_RANK,
                            [f"layers.0.mlp.experts.{E}.down_proj.lora_", f"names expert {E}, but the base model's "
                             f"layers have {E} experts (0-{E - 1}"]),
    "a_without_b": (lambda per, tw, d: _edit(per["plain"], d, _drop(_k(0, 1, "up_proj", "B"))), MAX_RANK,
                    [f"{_k(0, 1, 'up_proj', 'A')!r} has no lora_B beside it"]),
    "rank_not_the_configs": (lambda per, tw, d: _edit(per["plain"], d, rank_pattern={"experts.3.down_proj": 2}),
                             MAX_RANK, ["layer 0 experts.3.down_proj: weights have rank 4 but the config says 2"]),
    "fused_rank_too_big": (lambda per, tw, d: _edit(per["plain"], d), 7,
                           ["rank 8 (experts.gate_up_proj of layer 0: gate_proj 4 + up_proj 4, fused) exceeds "
                            "max_lora_rank=7"]),
    "both_layouts": (lambda per, tw, d: _edit(per["plain"], d, _both_layouts(tw["plain"])), MAX_RANK,
                     ["layer 0 adapts the experts' down_proj twice"]),
    "not_lora": (lambda per, tw, d: _edit(per["plain"], d, _set(
                     "base_model.model.model.layers.0.mlp.experts.1.w1.lora_A.weight", (4, D))), MAX_RANK,
                 ["'base_model.model.model.layers.0.mlp.experts.1.w1.lora_A.weight' is not a LoRA A/B weight of an "
                  "expert's gate_proj, up_proj, down_proj"]),
    "layer_out_of_range": (lambda per, tw, d: _edit(per["plain"], d, _add(L, 0, "up_proj")), MAX_RANK,
                           [f"names layer {L}, but the base model has {L} layers"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_malformed_per_expert_folder_is_refused_by_name(case, folders, cfg, tmp_path):
    """Each an AdapterError naming the adapter, the tensor or the layer, what was expected and
    what is allowed; the header alone (probe_adapter: how adapters given at start register)
    gives the same message word for word."""
    _, per, twins = folders
    build, max_rank, words = CASES[case]
    folder = build(per, twins, tmp_path / case)
    with pytest.raises(AdapterError) as full:
        load_adapter(f"bad-{case}", folder, cfg, max_rank)
    msg = str(full.value)
    assert full.value.adapter_name == f"bad-{case}" and repr(f"bad-{case}") in msg
    for word in words:
        assert word in msg, f"{case}: {word!r} missing from {msg!r}"
    with pytest.raises(AdapterError) as probed:
        probe_adapter(f"bad-{case}", folder, cfg, max_rank)
    assert str(probed.value) == msg


def test_per_expert_tensors_on_a_model_or_layer_without_experts_are_refused(folders, tmp_path):
    """On a dense model, and on a Qwen3-MoE layer whose MLP is dense: named, as the fused
    layout's are."""
    _, per, _ = folders
    llama = ModelConfig.from_hf_dict(reference.TINY_CONFIGS["llama"])
    with pytest.raises(AdapterError, match="adapts MoE experts, but the base model has none"):
        load_adapter("p", per["half"], llama, MAX_RANK)
    cut = ModelConfig.from_hf_dict(dict(OTHER, mlp_only_layers=[1]))
    with pytest.raises(AdapterError, match=r"layers\.1\.mlp\.experts\.\d+\.\w+\.lora_[AB]\.weight' adapts experts in "
                                           "layer 1, whose MLP is dense"):
        load_adapter("p", per["half"], cut, MAX_RANK)


def test_the_default_max_lora_rank_counts_gate_and_up_fused(folders, tmp_path):
    """On a model with experts, an adapter given at start whose target_modules take gate_proj and
    up_proj counts at twice its rank (their fused rank); up_proj alone, or no experts, at its rank."""
    from multilora.engine.build import default_max_rank
    _, per, _ = folders
    assert default_max_rank({"a": str(per["plain"])}, floor=1, experts=True) == 8
    assert default_max_rank({"a": str(per["plain"])}, floor=1) == 4
    assert default_max_rank({"a": str(per["half"])}, floor=1, experts=True) == 8
    regex = _edit(per["plain"], tmp_path / "regex", target_modules=r".*\.(q_proj|gate_proj|up_proj)")
    linear = _edit(per["plain"], tmp_path / "linear", target_modules="all-linear")
    assert default_max_rank({"a": str(regex), "b": str(linear)}, floor=1, experts=True) == 8
    assert default_max_rank({"a": str(per["plain"])}, experts=True) == 16  # the floor


def test_the_engine_serves_per_expert_adapters_and_refusals_change_nothing(folders, peft_greedy_cache, tmp_path):
    """An engine given two per-expert folders at start (registered from their headers, read on
    first use; the default max_lora_rank the fused rank of r 12 on gate and up, 24) serves
    PEFT's greedy tokens beside base rows; loading each malformed folder at run time raises its
    AdapterError and leaves the listed adapters and what they serve as they were."""
    from multilora.engine.engine import Engine
    from multilora.engine.request import SamplingParams
    model, per, twins = folders
    wide = write_per_expert(tmp_path / "wide", model,
                            dict(r=12, lora_alpha=24, target_modules=["gate_proj", "up_proj"]), seed=61)
    dirs = {"plain": per["plain"], "wide": wide}
    twin_of = {"plain": twins["plain"], "wide": write_fused_twin(tmp_path / "wide_fused", wide)}
    eng = Engine(str(model), {k: str(v) for k, v in dirs.items()}, warmup=False, max_loras_per_batch=2,
                 max_model_len=32, max_num_seqs=4, max_num_batched_tokens=32, page_size=4)
    assert eng.lora_cfg.max_lora_rank == 24
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = [np.random.default_rng(51 + i).integers(3, 256, size=n).tolist() for i, n in enumerate([6, 9, 5, 7])]
    loras = ["plain", None, "wide", "plain"]
    first = [o.token_ids for o in eng.generate(prompts, greedy, lora=loras)]
    want = peft_greedy_cache.many(model, [(None if a is None else twin_of[a], p) for p, a in zip(prompts, loras)], 4)
    assert first == want
    listed = {e["name"] for e in eng.list_lora_adapters()}
    assert listed == {"plain", "wide"}
    for case, (build, _, words) in CASES.items():
        if case == "fused_rank_too_big":
            continue  # a rank this engine takes
        with pytest.raises(AdapterError, match=f"'bad-{case}'") as info:
            eng.load_lora_adapter(f"bad-{case}", str(build(per, twins, tmp_path / f"engine_{case}")))
        assert words[0] in str(info.value)
    assert {e["name"] for e in eng.list_lora_adapters()} == listed
    assert [o.token_ids for o in eng.generate(prompts, greedy, lora=loras)] == first
