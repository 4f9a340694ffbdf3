"""Bad adapters: each gives an AdapterError naming the adapter and the reason, and a failed load
leaves the adapters already on the device untouched.

Bad folders are copies of a good PEFT adapter (tiny Llama, all projections, rank 8) with the
JSON edited or the safetensors rewritten through safetensors.numpy.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import ml_dtypes
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from multilora.config import LoRAConfig, ModelConfig
from multilora.engine.batching import SeqChunk, build_batch
from multilora.engine.runner import jit_slot_writer
from multilora.adapters.adapter import AdapterError, load_adapter, probe_adapter
from multilora.lora.backend import get_backend
from multilora.adapters.pool import LoRASlots, page_rows
from multilora.model.llama import forward, init_kv_cache
from multilora.model.loader import load_weights
from multilora.model.sharding import make_mesh

GOOD = ("llama", "a_all_r8")  # rank 8 on every projection of the 2-layer tiny Llama
MAX_RANK = 16
WEIGHTS = "adapter_model.safetensors"
KEY = "base_model.model.model.layers.{layer}.{block}.{module}.lora_{ab}.weight"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(folder: Path, **changes) -> None:
    p = folder / "adapter_config.json"
    cfg = json.loads(p.read_text())
    cfg.update(changes)
    p.write_text(json.dumps(cfg))


def _edit_weights(folder: Path, fn) -> None:
    tensors = load_file(folder / WEIGHTS)
    save_file(fn(dict(tensors)), folder / WEIGHTS)


def _poison(value):
    def fn(t):
        k = KEY.format(layer=1, block="self_attn", module="v_proj", ab="B")
        arr = t[k].copy()
        arr[3, 1] = value
        t[k] = arr
        return t
    return fn


def _drop(layer, block, module, ab):
    def fn(t):
        del t[KEY.format(layer=layer, block=block, module=module, ab=ab)]
        return t
    return fn


def _add_lm_head(t):
    rng = np.random.default_rng(0)
    t["base_model.model.lm_head.lora_A.weight"] = rng.standard_normal((8, 64)).astype(np.float32)
    t["base_model.model.lm_head.lora_B.weight"] = rng.standard_normal((256, 8)).astype(np.float32)
    return t


def _as_int8(t):
    k = KEY.format(layer=0, block="mlp", module="down_proj", ab="A")
    t[k] = t[k].astype(np.int8)
    return t


def _truncate(folder: Path) -> None:
    f = folder / WEIGHTS
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


# name -> (build(folder made from the good adapter, adapters) -> folder to load, max_lora_rank,
#          words the message must contain)
def _case_missing_folder(d, ads):
    shutil.rmtree(d)
    return d


def _case_missing_config(d, ads):
    (d / "adapter_config.json").unlink()
    return d


def _case_bad_json(d, ads):
    (d / "adapter_config.json").write_text('{"r": 8, "lora_alpha": ')
    return d


def _case_binary_json(d, ads):
    (d / "adapter_config.json").write_bytes(b"\xff\xfe\x00garbage")
    return d


def _case_missing_weights(d, ads):
    (d / WEIGHTS).unlink()
    return d


def _case_truncated_weights(d, ads):
    _truncate(d)
    return d


def _json_case(**changes):
    def build(d, ads):
        _edit_json(d, **changes)
        return d
    return build


def _weights_case(fn):
    def build(d, ads):
        _edit_weights(d, fn)
        return d
    return build


def _case_other_model(d, ads):
    return ads[("qwen2", "a_all_r8")]  # k/v out 16 (1 KV head), ffn 96: Llama has 32 and 128


CASES = {
    "missing_folder": (_case_missing_folder, MAX_RANK, ["does not exist"]),
    "missing_config": (_case_missing_config, MAX_RANK, ["no adapter_config.json"]),
    "unreadable_json": (_case_bad_json, MAX_RANK, ["adapter_config.json", "not readable JSON"]),
    "binary_json": (_case_binary_json, MAX_RANK, ["adapter_config.json", "not readable JSON"]),
    "json_not_object": (lambda d, a: ((d / "adapter_config.json").write_text("[1, 2]"), d)[1], MAX_RANK,
                        ["JSON object"]),
    "missing_safetensors": (_case_missing_weights, MAX_RANK, ["no adapter_model.safetensors"]),
    "truncated_safetensors": (_case_truncated_weights, MAX_RANK, ["adapter_model.safetensors", "not readable"]),
    "integer_weights": (_weights_case(_as_int8), MAX_RANK,
                        ["adapter_model.safetensors", "not readable", "dtype 'I8'", "F32"]),
    "dora": (_json_case(use_dora=True), MAX_RANK, ["use_dora", "DoRA"]),
    "modules_to_save": (_json_case(modules_to_save=["lm_head"]), MAX_RANK, ["modules_to_save", "lm_head"]),
    "lora_bias": (_json_case(lora_bias=True), MAX_RANK, ["lora_bias=true", "not supported"]),
    # PEFT options whose A and B are not a plain delta on this base (its layers copied, embedding
    # rows trained, the base rewritten by the initialization): refused by the option's name
    "layer_replication": (_json_case(layer_replication=[[0, 2], [1, 2]]), MAX_RANK,
                          ["layer_replication=", "copies of the base model's layers", "not supported"]),
    "trainable_tokens": (_json_case(trainable_token_indices=[5, 7]), MAX_RANK,
                         ["trainable_token_indices=", "not supported"]),
    "pissa_init": (_json_case(init_lora_weights="pissa_niter_4"), MAX_RANK,
                   ["init_lora_weights='pissa_niter_4'", "rewrites the base", "path_initial_model_for_weight_conversion"]),
    "olora_init": (_json_case(init_lora_weights="olora"), MAX_RANK, ["init_lora_weights='olora'", "not supported"]),
    "target_embed_tokens": (_json_case(target_modules=["embed_tokens"]), MAX_RANK,
                            ["embed_tokens", "outside the supported set", "q_proj"]),
    "target_lm_head": (_json_case(target_modules=["q_proj", "lm_head"]), MAX_RANK,
                       ["lm_head", "outside the supported set"]),
    "lm_head_lora_key": (_weights_case(_add_lm_head), MAX_RANK, ["lm_head", "not supported"]),
    "shape_of_other_model": (_case_other_model, MAX_RANK, ["do not fit", "another model"]),
    "rank_above_max": (lambda d, a: d, 4, ["rank 8", "max_lora_rank=4"]),
    "nan_weight": (_weights_case(_poison(np.nan)), MAX_RANK, ["layers.1.self_attn.v_proj.lora_B", "NaN or Inf"]),
    "inf_weight": (_weights_case(_poison(-np.inf)), MAX_RANK, ["layers.1.self_attn.v_proj.lora_B", "NaN or Inf"]),
    "lora_a_without_b": (_weights_case(_drop(1, "mlp", "up_proj", "B")), MAX_RANK,
                         ["layer 1 up_proj", "lora_A but not its pair"]),
    "lora_b_without_a": (_weights_case(_drop(0, "self_attn", "q_proj", "A")), MAX_RANK,
                         ["layer 0 q_proj", "lora_B but not its pair"]),
}


def _build(case: str, tmp_path: Path, tiny_adapters) -> tuple[Path, int]:
    build, max_rank, _ = CASES[case]
    folder = _copy(tiny_adapters[GOOD], tmp_path / f"bad_{case}")
    return build(folder, tiny_adapters), max_rank


@pytest.fixture(scope="module")
def llama_cfg(tiny_models):
    return ModelConfig.from_dir(tiny_models["llama"])


def test_good_adapter_loads(tiny_adapters, llama_cfg):
    ad = load_adapter("good", tiny_adapters[GOOD], llama_cfg, MAX_RANK)
    assert ad.rank == 8 and len(ad.target_modules) == 7


@pytest.mark.parametrize("case", list(CASES))
def test_bad_adapter_error_names_adapter_and_reason(case, tmp_path, tiny_adapters, llama_cfg):
    folder, max_rank = _build(case, tmp_path, tiny_adapters)
    name = f"bad-{case}"
    with pytest.raises(AdapterError) as e:
        load_adapter(name, folder, llama_cfg, max_rank)
    msg = str(e.value)
    assert e.value.adapter_name == name
    assert repr(name) in msg, msg
    for word in CASES[case][2]:
        assert word in msg, f"{case}: {word!r} missing from {msg!r}"


DATA_ONLY = {"nan_weight", "inf_weight"}  # what only the weights tell: found when they are read


@pytest.mark.parametrize("case", list(CASES))
def test_probe_from_the_header_refuses_what_the_full_read_refuses(case, tmp_path, tiny_adapters, llama_cfg):
    """probe_adapter (config and safetensors header, no weights read: how adapters given at start
    are registered) gives the full read's error, word for word, for every fault the header shows;
    the faults only the weights show pass it, and load_adapter refuses them on first use."""
    folder, max_rank = _build(case, tmp_path, tiny_adapters)
    with pytest.raises(AdapterError) as full:
        load_adapter("x", folder, llama_cfg, max_rank)
    if case in DATA_ONLY:
        probe = probe_adapter("x", folder, llama_cfg, max_rank)
        assert probe.rank == 8 and probe.nbytes > 0
        return
    with pytest.raises(AdapterError) as probed:
        probe_adapter("x", folder, llama_cfg, max_rank)
    assert str(probed.value) == str(full.value)


def test_probe_agrees_with_the_read_on_rank_and_size(tiny_adapters, llama_cfg):
    for key in (GOOD, ("llama", "d_regex_patterns"), ("llama", "b_attn_r4_rslora")):
        ad = load_adapter("x", tiny_adapters[key], llama_cfg, MAX_RANK)
        probe = probe_adapter("x", tiny_adapters[key], llama_cfg, MAX_RANK)
        assert (probe.rank, probe.nbytes) == (ad.rank, ad.nbytes), key
        assert probe.fingerprint != ad.content_hash


def test_failed_loads_leave_device_slots_intact(tmp_path, tiny_models, tiny_adapters, llama_cfg):
    mesh = make_mesh(1)
    cfg, weights = load_weights(tiny_models["llama"], mesh=mesh)
    slots = LoRASlots(cfg, LoRAConfig(max_loras_per_batch=2, max_lora_rank=8), jnp.float32, mesh,
                      jit_writer=jit_slot_writer)
    slots.load(1, page_rows([2]), load_adapter("a", tiny_adapters[GOOD], cfg, 8))
    slots.load(2, page_rows([1]), load_adapter("d", tiny_adapters[("llama", "d_regex_patterns")], cfg, 8))

    rng = np.random.default_rng(5)
    chunks = [SeqChunk(rng.integers(0, 256, n).tolist(), 0, pages, slot)
              for n, pages, slot in [(6, [3, 9], 0), (7, [5, 1], 1), (5, [7, 2], 2)]]
    fwd = jax.jit(forward, static_argnames=("cfg", "backend"))

    def run():
        be = get_backend("bgmv")
        batch = build_batch(chunks, num_tokens=32, num_pages=8, num_logits=4, page_size=4,
                            prepare_lora=lambda slot_T: be.prepare_lora_batch(slot_T, slots.scalings_S,
                                                                              slots.ranks_S, slots.rows_SR),
                            all_logits=True)
        logits, _ = fwd(weights, slots.weights, init_kv_cache(cfg, 12, 4, jnp.float32), batch, cfg=cfg,
                        backend="bgmv")
        return np.asarray(logits)

    before = run()
    bufs = {k: np.asarray(v).copy() for k, v in vars(slots.weights).items()}
    meta = (slots.scalings_S.copy(), slots.ranks_S.copy(), slots.rows_SR.copy())

    for case in CASES:
        folder, max_rank = _build(case, tmp_path, tiny_adapters)
        with pytest.raises(AdapterError):
            load_adapter(f"bad-{case}", folder, cfg, max_rank)
    # A valid adapter that does not fit the slots (rank 16 > 8) is refused by the pool itself.
    big = load_adapter("c", tiny_adapters[("llama", "c_mlp_r16")], cfg, 64)
    with pytest.raises(ValueError, match="max_lora_rank"):
        slots.load(1, page_rows([1, 2]), big)

    for k, v in vars(slots.weights).items():
        np.testing.assert_array_equal(np.asarray(v), bufs[k], err_msg=k)
    np.testing.assert_array_equal(slots.scalings_S, meta[0])
    np.testing.assert_array_equal(slots.ranks_S, meta[1])
    np.testing.assert_array_equal(slots.rows_SR, meta[2])
    np.testing.assert_array_equal(run(), before)


# Odd config values must end in an AdapterError that names the field (never another exception, and
# never a silent load: each of these configs would serve something other than what it says).
ODD_CONFIGS = {  # case -> (config changes, what the message must name)
    "r_zero": (dict(r=0), "r must be a positive integer"),
    "alpha_zero": (dict(lora_alpha=0), "lora_alpha must be a positive number"),
    "target_not_str": (dict(target_modules=[1]), "target_modules"),
    "alpha_pattern_not_number": (dict(alpha_pattern={"q_proj": "x"}), "alpha_pattern"),
    "r_negative": (dict(r=-8), "r must be a positive integer"),
    "peft_type_loha": (dict(peft_type="LOHA"), "peft_type 'LOHA' is not supported"),
}


@pytest.mark.parametrize("case", list(ODD_CONFIGS))
def test_odd_config_values_give_adapter_error(case, tmp_path, tiny_adapters, llama_cfg):
    folder = _copy(tiny_adapters[GOOD], tmp_path / case)
    changes, named = ODD_CONFIGS[case]
    _edit_json(folder, **changes)
    with pytest.raises(AdapterError, match=re.escape(named)) as info:
        load_adapter(f"odd-{case}", folder, llama_cfg, MAX_RANK)
    assert info.value.adapter_name == f"odd-{case}"


def test_a_bfloat16_host_copy_is_the_float32_one_rounded_once(tiny_adapters, llama_cfg):
    """Host copies for a bfloat16 pool are read in bfloat16: each value the float32 copy's
    rounded to nearest even, as the pool's write would round it (pattern scalings folded in
    float32 first); half the bytes, which the probe counts too."""
    import ml_dtypes
    bf16 = np.dtype(ml_dtypes.bfloat16)
    for key in (GOOD, ("llama", "d_regex_patterns"), ("llama", "b_attn_r4_rslora")):
        f32 = load_adapter("x", tiny_adapters[key], llama_cfg, MAX_RANK)
        half = load_adapter("x", tiny_adapters[key], llama_cfg, MAX_RANK, bf16)
        assert (half.rank, half.scaling, sorted(half.modules)) == (f32.rank, f32.scaling, sorted(f32.modules))
        for m, (a, b) in half.modules.items():
            assert a.dtype == bf16 and b.dtype == bf16
            np.testing.assert_array_equal(a.view(np.uint16), f32.modules[m][0].astype(bf16).view(np.uint16))
            np.testing.assert_array_equal(b.view(np.uint16), f32.modules[m][1].astype(bf16).view(np.uint16))
        assert half.nbytes * 2 == f32.nbytes
        assert probe_adapter("x", tiny_adapters[key], llama_cfg, MAX_RANK, bf16).nbytes == half.nbytes
        assert half.content_hash != f32.content_hash  # what each pool computes with differs
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        load_adapter("x", tiny_adapters[GOOD], llama_cfg, MAX_RANK, np.int8)


def test_a_value_beyond_a_bfloat16_pool_is_refused_for_that_pool_only(tmp_path, tiny_adapters, llama_cfg):
    """3.4e38 is a finite float32 that bfloat16 rounds to Inf: a float32 pool serves the
    adapter, a bfloat16 pool refuses it by name and reason (never an Inf in the pool); the
    largest value that rounds to a finite bfloat16 passes."""
    import ml_dtypes
    bf16 = np.dtype(ml_dtypes.bfloat16)
    edge = np.frombuffer(np.uint32(0x7F7F7FFF).tobytes(), np.float32)[0]  # just below the rounding to Inf
    folder = _copy(tiny_adapters[GOOD], tmp_path / "big")
    _edit_weights(folder, _poison(np.float32(3.4e38)))
    load_adapter("big", folder, llama_cfg, MAX_RANK)  # float32: served as it is
    with pytest.raises(AdapterError, match=r"v_proj: values beyond what the adapter pool's bfloat16 holds") as e:
        load_adapter("big", folder, llama_cfg, MAX_RANK, bf16)
    assert e.value.adapter_name == "big"
    ok = _copy(tiny_adapters[GOOD], tmp_path / "edge")
    _edit_weights(ok, _poison(edge))
    ad = load_adapter("edge", ok, llama_cfg, MAX_RANK, bf16)
    assert np.isfinite(ad.modules["v_proj"][1].astype(np.float32)).all()
    nan = _copy(tiny_adapters[GOOD], tmp_path / "nan")
    _edit_weights(nan, _poison(np.nan))
    with pytest.raises(AdapterError, match="layers.1.self_attn.v_proj.lora_B.*NaN or Inf"):
        load_adapter("nan", nan, llama_cfg, MAX_RANK, bf16)


def _retyped(src: Path, dst: Path, dtype) -> Path:
    """A copy of an adapter folder with its tensors saved in another dtype (torch's safetensors:
    numpy's has no bfloat16)."""
    import torch
    from safetensors.torch import load_file as load_pt, save_file as save_pt
    folder = _copy(src, dst)
    save_pt({k: v.to(dtype).contiguous() for k, v in load_pt(folder / WEIGHTS).items()}, folder / WEIGHTS)
    return folder


def test_the_native_tensor_copier_reads_what_numpy_reads(monkeypatch, tmp_path, tiny_adapters, llama_cfg):
    """load_adapter copies each module's tensors through the kernels' tensor copier (one pass:
    convert, fold a pattern's scaling, check for NaN/Inf) where the process has loaded them, else
    through numpy: the same host copies bit for bit, in float32 and bfloat16, from float32,
    bfloat16 and float16 files (float16 tensors take numpy's path either way), with rank and alpha
    patterns; the same refusals, by name and reason, for a NaN and for a value beyond bfloat16."""
    import ml_dtypes
    import torch
    from multilora import kernels
    if not kernels.available():
        pytest.skip(f"native kernels unavailable: {kernels.unavailable_reason()}")
    assert kernels.tensor_copier() is not None
    bf16 = np.dtype(ml_dtypes.bfloat16)
    folders = [tiny_adapters[k] for k in (GOOD, ("llama", "d_regex_patterns"), ("llama", "b_attn_r4_rslora"))]
    folders += [_retyped(tiny_adapters[("llama", "d_regex_patterns")], tmp_path / "bf16", torch.bfloat16),
                _retyped(tiny_adapters[GOOD], tmp_path / "f16", torch.float16)]
    big = _copy(tiny_adapters[GOOD], tmp_path / "big")
    _edit_weights(big, _poison(np.float32(3.4e38)))
    nan = _copy(tiny_adapters[GOOD], tmp_path / "nan")
    _edit_weights(nan, _poison(np.nan))

    def read_all():
        got = {}
        for folder in folders:
            for dt in (np.float32, bf16):
                ad = load_adapter("x", folder, llama_cfg, MAX_RANK, dt)
                got[(folder.name, np.dtype(dt).name)] = (ad.rank, ad.scaling, ad.content_hash, {
                    m: tuple(x.view(np.uint8).copy() for x in ab) for m, ab in ad.modules.items()})
        errors = []
        for folder, dt in ((big, bf16), (nan, bf16), (nan, np.float32)):
            with pytest.raises(AdapterError) as e:
                load_adapter(folder.name, folder, llama_cfg, MAX_RANK, dt)
            errors.append(str(e.value))
        return got, errors

    native, native_errors = read_all()
    monkeypatch.setattr(kernels, "tensor_copier", lambda: None)
    plain, plain_errors = read_all()
    assert native_errors == plain_errors
    assert "v_proj: values beyond what the adapter pool's bfloat16 holds" in native_errors[0]
    assert "layers.1.self_attn.v_proj.lora_B" in native_errors[1] and "NaN or Inf" in native_errors[1]
    assert native.keys() == plain.keys()
    for key, (rank, scaling, digest, modules) in native.items():
        p_rank, p_scaling, p_digest, p_modules = plain[key]
        assert (rank, scaling, digest) == (p_rank, p_scaling, p_digest), key
        assert modules.keys() == p_modules.keys()
        for m in modules:
            for x, y in zip(modules[m], p_modules[m]):
                np.testing.assert_array_equal(x, y, err_msg=f"{key} {m}")
    # a bfloat16 file's values are what a float32 pool reads exactly, and a bfloat16 one copies
    assert native[("bf16", "float32")][2] != native[("bf16", "bfloat16")][2]


def _as_torch_bin(src: Path, dst: Path, **save_kw) -> Path:
    """The PEFT folder src with its weights as torch.save wrote them before safetensors
    (adapter_model.bin; bfloat16 and a transposed view among them, as a training loop may leave)."""
    import torch
    folder = _copy(src, dst)
    tensors = {k: torch.from_numpy(np.array(v)) for k, v in load_file(folder / WEIGHTS).items()}
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].t().contiguous().t()   # a strided view of its own transpose
    (folder / WEIGHTS).unlink()
    torch.save(tensors, folder / "adapter_model.bin", **save_kw)
    return folder


@pytest.mark.parametrize("dtype", [np.float32, np.dtype(ml_dtypes.bfloat16)])
def test_a_torch_bin_adapter_is_its_safetensors_twin(dtype, tmp_path, tiny_adapters, llama_cfg):
    """adapter_model.bin (torch.save's zip format, read without torch) gives the host copy, rank,
    size and content hash of the same tensors in safetensors; the probe agrees with the read."""
    folder = _as_torch_bin(tiny_adapters[GOOD], tmp_path / "bin")
    want = load_adapter("x", tiny_adapters[GOOD], llama_cfg, MAX_RANK, dtype)
    got = load_adapter("x", folder, llama_cfg, MAX_RANK, dtype)
    assert got.content_hash == want.content_hash and (got.rank, got.nbytes) == (want.rank, want.nbytes)
    for m, (a, b) in want.modules.items():
        np.testing.assert_array_equal(got.modules[m][0], a)
        np.testing.assert_array_equal(got.modules[m][1], b)
    probe = probe_adapter("x", folder, llama_cfg, MAX_RANK, dtype)
    assert (probe.rank, probe.nbytes) == (got.rank, got.nbytes)


def test_a_torch_bin_that_is_not_a_plain_state_dict_is_refused_unrun(tmp_path, tiny_adapters, llama_cfg):
    """A pickle naming anything but tensors (code above all) is refused, not run; so is
    torch.save's format before torch 1.6 and a storage missing from the archive."""
    import os
    import zipfile

    import torch

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    evil = _copy(tiny_adapters[GOOD], tmp_path / "evil")
    (evil / WEIGHTS).unlink()
    torch.save({"x": Payload()}, evil / "adapter_model.bin")
    legacy = _as_torch_bin(tiny_adapters[GOOD], tmp_path / "legacy", _use_new_zipfile_serialization=False)
    cut = _as_torch_bin(tiny_adapters[GOOD], tmp_path / "cut")
    with zipfile.ZipFile(cut / "adapter_model.bin") as z:
        kept = {n: z.read(n) for n in z.namelist() if not n.endswith("/data/0")}
    with zipfile.ZipFile(cut / "adapter_model.bin", "w") as z:
        for n, data in kept.items():
            z.writestr(n, data)
    for folder, words in ((evil, "system is not a tensor or a float storage: refused"),
                          (legacy, "format before torch 1.6 is not read"), (cut, "storage '0' is missing")):
        for read in (load_adapter, probe_adapter):
            with pytest.raises(AdapterError, match="adapter_model.bin is not readable") as e:
                read("x", folder, llama_cfg, MAX_RANK)
            assert words in str(e.value), str(e.value)
    assert not marker.exists()
