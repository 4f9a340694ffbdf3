"""Adapters straight from memory (issue 41): a load from arrays answers as its folder does; an
in-place load (copy-on-write) serves the new weights at once, even under a prefix cached with the
old ones, exactly as a fresh engine holding the new weights does, while requests added before it
finish on the old weights; bad arrays are refused with nothing lost.

Engines use test_engine.py's shapes (KW), so their compiles hit the session's cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from multilora.adapters.adapter import AdapterError
from multilora.adapters.registry import AdapterConflictError
from multilora.engine.engine import Engine
from multilora.engine.request import SamplingParams

KW = dict(max_loras_per_batch=4, max_lora_rank=16, max_model_len=64, max_num_seqs=8,
          max_num_batched_tokens=64, page_size=8, lora_backend="bgmv")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def tensors_of(folder):
    return load_file(str(folder / "adapter_model.safetensors")), json.loads((folder / "adapter_config.json").read_text())


def prompts_of(seed, lengths):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=n).tolist() for n in lengths]


def tokens(eng, prompts, lora):
    outs = eng.generate(prompts, GREEDY, lora=lora)
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


def assert_clean(eng):
    assert eng.pages.num_free == eng.pages.capacity, "KV pages leaked"
    assert eng.num_waiting == 0 and eng.num_running == 0
    assert all("\0" not in name for name in eng.registry.entries), "a replaced entry outlived its requests"
    assert eng.runner.compiles_after_warmup == 0


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def dirs(tiny_adapters):
    return {"a": tiny_adapters[("llama", "a_all_r8")], "c": tiny_adapters[("llama", "c_mlp_r16")],
            "d": tiny_adapters[("llama", "d_regex_patterns")]}


@pytest.fixture(scope="module")
def engine(model_dir, dirs):
    return Engine(str(model_dir), {"a": str(dirs["a"]), "d": str(dirs["d"])}, **KW)


def flipped(tensors):
    """Weights not seen before: every B negated and scaled (a strong, different adapter)."""
    return {k: (-1.7 * v if "lora_B" in k else v) for k, v in tensors.items()}


def test_tensors_answer_as_their_folder(engine, dirs):
    import jax.numpy as jnp
    prompts = prompts_of(1, [5, 17, 30])
    for folder_name in ("a", "d"):  # d: rank_pattern and alpha_pattern
        t, cfg = tensors_of(dirs[folder_name])
        name = f"t_{folder_name}"
        engine.load_lora_adapter(name, tensors={k: jnp.asarray(v) for k, v in t.items()}, config=cfg)
        assert tokens(engine, prompts, name) == tokens(engine, prompts, folder_name)
        assert engine.adapter_version(name) == engine.adapter_version(folder_name)  # v1, the same hash
        engine.unload_lora_adapter(name)
    assert_clean(engine)


def test_inplace_under_a_cached_prefix_serves_the_new_weights(engine, model_dir, dirs, tmp_path):
    t_old, cfg = tensors_of(dirs["a"])
    t_new = flipped(t_old)
    shared = prompts_of(2, [40])[0]
    prompts = [shared, shared[:32] + prompts_of(3, [6])[0], shared[:24] + prompts_of(4, [3])[0]]
    engine.load_lora_adapter("p", tensors=t_old, config=cfg)
    v1 = engine.adapter_version("p")
    old_tokens = tokens(engine, prompts, "p")
    outs = engine.generate(prompts, GREEDY, lora="p")  # the prefix is cached under the old weights
    assert outs[0].num_cached_tokens > 0 and [o.token_ids for o in outs] == old_tokens
    with pytest.raises(AdapterConflictError, match="load_inplace"):
        engine.load_lora_adapter("p", tensors=t_new, config=cfg)
    engine.load_lora_adapter("p", tensors=t_new, config=cfg, load_inplace=True)
    v2 = engine.adapter_version("p")
    assert v2.startswith("v2-") and v2[3:] != v1[3:]
    new = engine.generate(prompts, GREEDY, lora="p")
    assert all(o.lora_version == v2 and o.lora == "p" for o in new)
    assert new[0].num_cached_tokens == 0, "KV cached under the old weights served the new ones"
    assert [o.token_ids for o in new] != old_tokens

    # A fresh engine holding the new weights, from a folder: the same tokens.
    from safetensors.numpy import save_file
    folder = tmp_path / "new"
    folder.mkdir()
    save_file(t_new, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    fresh = Engine(str(model_dir), {"p": str(folder)}, **KW)
    assert tokens(fresh, prompts, "p") == [o.token_ids for o in new]
    assert fresh.adapter_version("p")[3:] == v2[3:]  # the same weights, the same hash
    # and once more, back to the old weights in place: the old tokens again
    engine.load_lora_adapter("p", tensors=t_old, config=cfg, load_inplace=True)
    assert engine.adapter_version("p") == "v3-" + v1[3:]
    assert tokens(engine, prompts, "p") == old_tokens
    # a mix of "p" follows it: the mix made before the load is rebuilt from the new weights
    mix = engine.add_mix({"p": 1.0})
    engine.load_lora_adapter("p", tensors=t_new, config=cfg, load_inplace=True)
    assert engine.add_mix({"p": 1.0}) == mix and tokens(engine, prompts, mix) == [o.token_ids for o in new]
    engine.unload_lora_adapter(mix)
    engine.unload_lora_adapter("p")
    assert_clean(engine)


def test_requests_added_before_an_inplace_load_finish_on_their_weights(engine, dirs):
    """32 streams (8 running, the rest waiting) when the load comes: none corrupted, none failed."""
    t_old, cfg = tensors_of(dirs["a"])
    t_new = flipped(t_old)
    prompts = prompts_of(5, [7, 12, 20, 9])
    engine.load_lora_adapter("q", tensors=t_old, config=cfg)
    want_old = tokens(engine, prompts, "q")
    before = [engine.add_request(p, GREEDY, lora="q") for p in prompts * 8]
    for _ in range(4):  # some decoding under the old weights
        engine.step()
    assert engine.num_running > 0 and engine.num_waiting > 0
    engine.load_lora_adapter("q", tensors=t_new, config=cfg, load_inplace=True)
    assert [e["name"] for e in engine.list_lora_adapters()].count("q") == 1
    after = [engine.add_request(p, GREEDY, lora="q") for p in prompts]
    while engine.has_unfinished():
        engine.step()
    got_before = [engine.pop_output(r) for r in before]
    got_after = [engine.pop_output(r) for r in after]
    assert [o.token_ids for o in got_before] == want_old * 8
    assert all(o.finish_reason == "length" for o in got_before + got_after)
    assert all(o.lora == "q" and o.lora_version.startswith("v1-") for o in got_before)
    assert all(o.lora_version.startswith("v2-") for o in got_after)
    want_new = tokens(engine, prompts, "q")
    assert [o.token_ids for o in got_after] == want_new != want_old
    engine.unload_lora_adapter("q")
    assert_clean(engine)


@pytest.mark.parametrize("case, match", [
    ("shape", r"do not fit the base model"),
    ("missing_b", r"but not its pair"),
    ("nan", r"NaN or Inf"),
    ("name", r"is not a LoRA A/B weight"),
    ("rank", r"config says"),
])
def test_bad_tensors_are_refused_with_nothing_lost(engine, dirs, case, match):
    t, cfg = tensors_of(dirs["a"])
    prompts = prompts_of(6, [9, 21])
    engine.load_lora_adapter("r", tensors=t, config=cfg)
    v, want = engine.adapter_version("r"), tokens(engine, prompts, "r")
    bad, bad_cfg = dict(t), dict(cfg)
    key_a = next(k for k in t if "q_proj.lora_A" in k)
    if case == "shape":
        bad[key_a] = t[key_a][:, :-1]
    elif case == "missing_b":
        del bad[key_a.replace("lora_A", "lora_B")]
    elif case == "nan":
        bad[key_a] = t[key_a].copy()
        bad[key_a][0, 0] = np.nan
    elif case == "name":
        bad["base_model.model.lm_head.lora_A.weight"] = t[key_a]
    elif case == "rank":
        bad_cfg["r"] = 4
    with pytest.raises(AdapterError, match=match) as err:
        engine.load_lora_adapter("r", tensors=bad, config=bad_cfg, load_inplace=True)
    assert "'r'" in str(err.value)
    with pytest.raises(AdapterError):  # a new name: refused too, and not registered
        engine.load_lora_adapter("r2", tensors=bad, config=bad_cfg)
    assert "r2" not in engine.registry.entries
    assert engine.adapter_version("r") == v and tokens(engine, prompts, "r") == want
    engine.unload_lora_adapter("r")
    assert_clean(engine)


def test_argument_errors(engine, dirs):
    t, cfg = tensors_of(dirs["a"])
    with pytest.raises(ValueError, match="need config"):
        engine.load_lora_adapter("s", tensors=t)
    with pytest.raises(ValueError, match="either path"):
        engine.load_lora_adapter("s")
    with pytest.raises(ValueError, match="give one of them"):
        engine.load_lora_adapter("s", str(dirs["a"]), tensors=t, config=cfg)
    with pytest.raises(AdapterError, match="must be a PEFT adapter_config dict"):
        engine.load_lora_adapter("s", tensors=t, config="r=8")
    assert "s" not in engine.registry.entries


def test_inplace_from_a_folder(engine, dirs):
    """A folder load in place (the server's and vLLM's path): the new folder's weights at once."""
    prompts = prompts_of(7, [11])
    engine.load_lora_adapter("f", str(dirs["a"]))
    engine.load_lora_adapter("f", str(dirs["c"]), load_inplace=True)
    engine.load_lora_adapter("cc", str(dirs["c"]))
    assert tokens(engine, prompts, "f") == tokens(engine, prompts, "cc")
    assert engine.adapter_version("f")[3:] == engine.adapter_version("cc")[3:]
    engine.unload_lora_adapter("f")
    engine.unload_lora_adapter("cc")
    assert_clean(engine)


def test_train_and_serve_example_short_form(engine):
    """examples/train_and_serve.py's loop on the tiny model: it trains, pushes in place, and its
    rollouts answer with each push's version."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "examples" / "train_and_serve.py"
    spec = importlib.util.spec_from_file_location("train_and_serve", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # its training forward is the engine's model: the same greedy next token with a zero LoRA
    from multilora.model.loader import load_weights
    _, weights = load_weights(engine.model_path, engine.cfg, "float32")
    for prompt in prompts_of(8, [5, 19]):
        logits = mod.forward(weights, mod.init_lora(engine.cfg, 4), np.asarray(prompt), engine.cfg, 2.0)
        assert int(np.argmax(logits[-1])) == tokens(engine, [prompt], None)[0][0]
    lines = []
    res = mod.run(engine, steps=4, every=2, rank=8, rollouts=4, max_tokens=4, seq_len=24, log=lines.append)
    assert len(res["push_s"]) == 2 and len(lines) == 2
    assert res["versions"] == {engine.adapter_version("policy")} and engine.adapter_version("policy").startswith("v2-")
    engine.unload_lora_adapter("policy")
    assert_clean(engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_host_copy_from_tensors_is_the_folders(model_dir, dirs, dtype):
    """Bit for bit the folder's host copy (rank and alpha patterns included) and so the same
    content hash: a folder and its arrays share prefix-cache pages."""
    import ml_dtypes

    from multilora.adapters.adapter import adapter_from_tensors, load_adapter
    from multilora.config import ModelConfig
    cfg = ModelConfig.from_dir(model_dir)
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    for name in ("a", "d"):
        t, config = tensors_of(dirs[name])
        got = adapter_from_tensors(name, t, config, cfg, 16, dt)
        want = load_adapter(name, dirs[name], cfg, 16, dt)
        assert (got.rank, got.scaling, sorted(got.modules)) == (want.rank, want.scaling, sorted(want.modules))
        for m, (a, b) in want.modules.items():
            assert np.array_equal(got.modules[m][0], a) and np.array_equal(got.modules[m][1], b)
        assert got.content_hash == want.content_hash
