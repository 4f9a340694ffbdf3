"""Engine end to end on a tiny random Llama: greedy tokens equal transformers + PEFT exactly in mixed
batches (base rows and several adapters, both LoRA backends), more adapters than device slots
(slot and host-tier churn), run-time load and unload, preemption, seeds, stop conditions, errors
and streaming; no page leak and no compile after warm-up throughout.

Compiling the step shapes is the cost here (tens of seconds per engine config on a small machine),
so every engine in this file uses the same shapes (KW): after the first, an engine costs a weight
load and jit cache hits. The preemption test shrinks the free page pool by holding pages rather
than building an engine with a smaller KV cache (another shape, another full compile).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from multilora.engine.engine import Engine, PromptTooLongError
from multilora.engine.request import SamplingParams
from multilora.adapters.adapter import AdapterError
from multilora.adapters.registry import AdapterConflictError, AdapterUnloadingError, UnknownAdapterError
from tests import reference

MAX_MODEL_LEN = 64
PAGE_SIZE = 8
KW = dict(max_loras_per_batch=4, max_lora_rank=16, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
          max_num_batched_tokens=64, page_size=PAGE_SIZE)
MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
SPEC = ["a_all_r8", "b_attn_r4_rslora", "c_mlp_r16", "d_regex_patterns"]
_ENGINES: list[Engine] = []


@pytest.fixture(autouse=True, scope="module")
def _forget_engines():
    """After this file, its engines go (other files import its helpers, and with them this
    list: engines kept for the whole session keep their executables' memory mappings)."""
    yield
    _ENGINES.clear()


def make_engine(model_dir, adapters, **overrides) -> Engine:
    """An engine of KW's shapes that compiles the step shapes it meets (warmup=False): a full
    warm-up is ~40 shapes, ~30 s a new configuration on two cores. The engines whose warm-up plan
    is under test ask for it (warmup=True: the module's engine and the mixed batch's other
    backends, whose every step must be planned, and test_no_compile_after_warmup's)."""
    eng = Engine(str(model_dir), {k: str(v) for k, v in adapters.items()}, **{"warmup": False, **KW, **overrides})
    _ENGINES.append(eng)
    return eng


def prompts_of(seed: int, lengths) -> list[list[int]]:
    """Random prompts; ids from 3 (0 is PEFT's padding, 1 and 2 are BOS and EOS)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=n).tolist() for n in lengths]


def assert_clean(eng: Engine) -> None:
    """After a run: every page back, no adapter reference left, nothing compiled outside a warm-up's
    plan (where the engine warmed up)."""
    assert eng.pages.num_free == eng.pages.capacity, "KV pages leaked"
    assert eng.num_waiting == 0 and eng.num_running == 0
    assert all(e["active_requests"] == 0 for e in eng.list_lora_adapters())
    assert eng.runner.compiles_after_warmup == 0


def gen(eng: Engine, prompts, params=GREEDY, lora=None):
    outs = eng.generate(prompts, params, lora=lora)
    assert_clean(eng)
    return outs


def check_vs_peft(cache, model_dir, dirs, prompts, loras, outs, max_new=MAX_NEW):
    want = cache.many(model_dir, [(None if l is None else dirs[l], p) for p, l in zip(prompts, loras)], max_new)
    bad = []
    for i, (p, l, o, w) in enumerate(zip(prompts, loras, outs, want)):
        n = min(max_new, MAX_MODEL_LEN - len(p))
        if o.token_ids != w[:n] or o.lora != l:
            bad.append(f"row {i} (adapter {l}, {len(p)} prompt tokens): engine {o.token_ids} != PEFT {w[:n]}")
    assert not bad, "\n".join(bad)


# ---- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def spec_dirs(tiny_adapters):
    return {name: tiny_adapters[("llama", name)] for name in SPEC}


@pytest.fixture(scope="module")
def extra_dirs(model_dir, tmp_path_factory):
    """12 more adapters: ranks 2..16, different targets, alphas and seeds, some rsLoRA."""
    root = tmp_path_factory.mktemp("engine_adapters")
    targets = [reference.ALL, ["q_proj", "v_proj"], ["gate_proj", "down_proj"], ["k_proj", "o_proj", "up_proj"]]
    out = {}
    for i in range(12):
        out[f"x{i}"] = reference.make_adapter(
            model_dir, root / f"x{i}", seed=1000 + i, r=[2, 4, 8, 16][i % 4], lora_alpha=[4, 8, 16][i % 3],
            target_modules=targets[(i + i // 4) % 4], use_rslora=i % 5 == 0)
    return out


@pytest.fixture(scope="module")
def engine(model_dir, spec_dirs):
    """The shared engine: bgmv, adapters a, b, c of ADAPTER_SPECS under short names."""
    return make_engine(model_dir, {"a": spec_dirs[SPEC[0]], "b": spec_dirs[SPEC[1]], "c": spec_dirs[SPEC[2]]},
                       lora_backend="bgmv", warmup=True)


@pytest.fixture(scope="module")
def short_dirs(spec_dirs, extra_dirs):
    return {"a": spec_dirs[SPEC[0]], "b": spec_dirs[SPEC[1]], "c": spec_dirs[SPEC[2]],
            "d": spec_dirs[SPEC[3]], **extra_dirs}


MIXED_LENGTHS = [1, 2, 3, 5, 7, 8, 9, 13, 16, 17, 24, 31, 33, 40, 47, 53, 20, 11]


# ---- parity --------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["bgmv", "auto", "sgmv"])
def test_mixed_batch_equals_peft(backend, engine, model_dir, spec_dirs, short_dirs, peft_greedy_cache):
    """18 prompts of 1 to 53 tokens over base + 3 adapters (base rows beside adapter rows in every
    step, chunked prefills, page boundaries) give PEFT's greedy tokens row by row."""
    eng = engine if backend == "bgmv" else make_engine(
        model_dir, {"a": spec_dirs[SPEC[0]], "b": spec_dirs[SPEC[1]], "c": spec_dirs[SPEC[2]]},
        lora_backend=backend, warmup=True)
    prompts = prompts_of(1, MIXED_LENGTHS)
    loras = [[None, "a", "b", "c"][i % 4] for i in range(len(prompts))]
    outs = gen(eng, prompts, GREEDY, loras)
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
    check_vs_peft(peft_greedy_cache, model_dir, short_dirs, prompts, loras, outs)


def test_sgmv_tiles_are_sized_for_a_steps_sequences_not_the_pool(model_dir, spec_dirs, short_dirs, peft_greedy_cache):
    """With more slots than a step has sequences (a pool sized by memory), sgmv's tiles are sized
    for max_num_seqs adapters (a step never has more), not for every slot; PEFT's greedy tokens
    still come out with steps of up to max_num_seqs distinct adapters."""
    from multilora.lora.batch import GROUPED, sgmv_num_tiles
    eng = make_engine(model_dir, {"a": spec_dirs[SPEC[0]], "b": spec_dirs[SPEC[1]], "c": spec_dirs[SPEC[2]]},
                      lora_backend="sgmv", max_loras_per_batch=12, max_num_seqs=4)
    assert eng.runner.lora.num_slots == 13
    for t in eng.runner.buckets.tokens:
        slot_T = np.arange(t, dtype=np.int32) % 4 + 1  # four distinct adapters, as many as sequences
        info = eng.runner.lora_batch_preparer(t)(slot_T)
        assert info.tile_slot_G.shape[0] == sgmv_num_tiles(t, 5) and int(info.mode) == GROUPED, t
    prompts = prompts_of(1, MIXED_LENGTHS)
    loras = [[None, "a", "b", "c"][i % 4] for i in range(len(prompts))]
    outs = gen(eng, prompts, GREEDY, loras)
    check_vs_peft(peft_greedy_cache, model_dir, short_dirs, prompts, loras, outs)


@pytest.mark.parametrize("isa", ["best", "avx2"])
def test_bf16_projections_greedy_within_tolerance(isa, model_dir, spec_dirs, peft_refs, monkeypatch):
    """projection_dtype="bfloat16" (the default where the CPU has AMX-BF16 or AVX512-BF16): each greedy token is
    PEFT's float32 argmax given the same prefix, or within bfloat16's tolerance of it (its
    float32 logit at most BF16_RTOL of the largest |logit| below the argmax's): a near tie.
    isa "avx2": the kernels held to what a CPU without AVX512-BF16 runs ($MULTILORA_KERNEL_ISA):
    the packed GEMM on weights widened in registers, the bf16 pools' widened group call."""
    from multilora import kernels
    from tests.test_model_parity import BF16_RTOL
    if isa == "avx2":
        if "avx2" not in kernels.bf16_gemm_isas():
            pytest.skip("multilora's bf16 GEMM has no AVX2 + FMA path here")
        monkeypatch.setenv(kernels.ISA_ENV, "avx2")
    eng = make_engine(model_dir, {"a": spec_dirs[SPEC[0]], "b": spec_dirs[SPEC[1]], "c": spec_dirs[SPEC[2]]},
                      projection_dtype="bfloat16", lora_dtype="bfloat16")
    assert eng.projection_mode in ("bfloat16", "bfloat16-packed")
    if isa == "avx2":
        assert eng.projection_mode == "bfloat16-packed" and kernels.bf16_gemm_isa() == "avx2"
    assert eng.lora_dtype.name == "bfloat16" and eng.slots.weights.qkv_a_LUD.dtype.name == "bfloat16"  # pools written by their bits
    prompts = prompts_of(1, MIXED_LENGTHS)
    loras = [[None, "a", "b", "c"][i % 4] for i in range(len(prompts))]
    outs = gen(eng, prompts, GREEDY, loras)
    names = {None: None, "a": SPEC[0], "b": SPEC[1], "c": SPEC[2]}
    exact = total = 0
    for i, (p, l, o) in enumerate(zip(prompts, loras, outs)):
        logits = peft_refs["llama"].logits(names[l], p + o.token_ids)
        for j, tok in enumerate(o.token_ids):
            row = logits[len(p) + j - 1]
            gap = row.max() - row[tok]
            assert gap <= BF16_RTOL * np.abs(row).max(), (
                f"row {i} (adapter {l}) token {j}: {tok} is {gap:.4f} below PEFT's argmax {row.argmax()}")
            exact += int(row.argmax() == tok)
            total += 1
    assert exact >= 0.9 * total, f"only {exact} of {total} tokens are PEFT's argmax"


def test_bf16_activations_on_a_cpu_keep_a_float32_cache(model_dir, spec_dirs, peft_refs):
    """dtype="bfloat16" on a CPU: the KV cache is float32 (XLA's CPU backend converted a bfloat16
    cache whole, to float32 and back, around every layer's K/V write: O(cache) a layer), the
    pages it holds are counted at float32's bytes, and the greedy tokens are PEFT's float32
    argmax given the same prefix or within bfloat16's tolerance of it, as the bf16 projections'."""
    import jax.numpy as jnp

    from multilora.model.precision import kv_cache_dtype
    from tests.test_model_parity import BF16_RTOL
    assert kv_cache_dtype(jnp.bfloat16, "cpu") == np.float32 and kv_cache_dtype(jnp.float16, "cpu") == np.float32
    assert kv_cache_dtype(jnp.bfloat16, "tpu") == jnp.bfloat16 and kv_cache_dtype(jnp.float32, "cpu") == np.float32
    eng = make_engine(model_dir, {"a": spec_dirs[SPEC[0]], "b": spec_dirs[SPEC[1]]}, dtype="bfloat16")
    from multilora import kernels
    assert eng.runner.kv.k_LPpKH.dtype == jnp.float32 and eng.runner.native_attention == kernels.available()
    prompts = prompts_of(2, MIXED_LENGTHS[:8])
    loras = [[None, "a", "b"][i % 3] for i in range(len(prompts))]
    outs = gen(eng, prompts, GREEDY, loras)
    names = {None: None, "a": SPEC[0], "b": SPEC[1]}
    worst = 0.0
    for i, (p, l, o) in enumerate(zip(prompts, loras, outs)):
        logits = peft_refs["llama"].logits(names[l], p + o.token_ids)
        for j, tok in enumerate(o.token_ids):
            row = logits[len(p) + j - 1]
            worst = max(worst, (row.max() - row[tok]) / np.abs(row).max())
    assert worst <= BF16_RTOL, worst


@pytest.mark.parametrize("max_loaded_loras", [None, 3])
def test_twelve_adapters_through_four_slots(max_loaded_loras, model_dir, extra_dirs, short_dirs,
                                            peft_greedy_cache):
    eng = make_engine(model_dir, extra_dirs, lora_backend="bgmv", max_loaded_loras=max_loaded_loras)
    names = list(extra_dirs)
    loras = []
    for rnd in range(2):
        for i, n in enumerate(names):
            loras.append(n)
            if i % 4 == 3:
                loras.append(None)   # base rows beside four full slots
    prompts = prompts_of(2, np.random.default_rng(3).integers(2, 30, size=len(loras)))
    outs = gen(eng, prompts, GREEDY, loras)
    check_vs_peft(peft_greedy_cache, model_dir, short_dirs, prompts, loras, outs)
    st = eng.registry.stats
    assert st.slot_evictions > 0 and st.slot_misses > 4
    if max_loaded_loras is None:
        # every adapter read once (a request may have waited for its read-ahead: a host miss)
        assert st.loads == 12 and st.host_evictions == 0 and eng.registry.num_host_copies == 12
    else:
        # evicted host copies were read again from their folders
        assert st.host_misses > 0 and st.host_evictions > 0 and eng.registry.num_host_copies <= 3
    # the host tier's bytes are what its copies hold now: a layout prepared for a slot write was
    # counted while it waited and is no longer once the write took it
    held = eng.registry.host_copies
    assert len(held) == eng.registry.num_host_copies
    assert eng.registry.host_bytes == sum(a.nbytes for a in held)
    assert all(a.slot_layout is None for a in held)
    # again, in another order: the resident mix differs, the tokens do not
    order = np.random.default_rng(4).permutation(len(prompts))
    outs2 = gen(eng, [prompts[i] for i in order], GREEDY, [loras[i] for i in order])
    assert [o.token_ids for o in outs2] == [outs[i].token_ids for i in order]


def test_adapters_given_at_start_are_registered_unread_and_read_on_first_use(
        model_dir, extra_dirs, short_dirs, peft_greedy_cache, tmp_path):
    """Adapters given at start are validated from their config and safetensors header only: the
    engine reads no more of them than the host tier holds (max_loaded_loras=3: three reads in
    the background), a request for an unread one waits for its read off the step and gives
    PEFT's tokens, and one whose weights hold NaN (what no header shows) fails only its own
    requests, with the reason."""
    from safetensors.numpy import load_file, save_file
    bad = shutil.copytree(extra_dirs["x1"], tmp_path / "nan")
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = sorted(tensors)[0]
    tensors[key] = np.full_like(tensors[key], np.nan)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    eng = make_engine(model_dir, {**extra_dirs, "nan": bad}, lora_backend="bgmv", max_loaded_loras=3)
    assert len(eng.registry.entries) == 13
    assert eng.registry.num_host_copies == 0 and eng.loader.in_flight() == 3
    assert [eng.registry.entries[f"x{i}"].rank for i in range(12)] == [[2, 4, 8, 16][i % 4] for i in range(12)]
    prompts = prompts_of(21, [9, 14, 6, 11, 17, 8])
    loras = ["x0", "nan", "x7", None, "x11", "nan"]
    outs = gen(eng, prompts, GREEDY, loras)
    for i in (1, 5):
        assert outs[i].finish_reason == "error" and "'nan'" in outs[i].error and "NaN or Inf" in outs[i].error
    keep = [0, 2, 3, 4]
    check_vs_peft(peft_greedy_cache, model_dir, short_dirs, [prompts[i] for i in keep],
                  [loras[i] for i in keep], [outs[i] for i in keep])
    assert eng.registry.stats.load_failures == 1
    # reads requests waited for, each counted once ("nan" twice asked): x7, x11, nan, and x0 if
    # its read-ahead was still under way
    assert 3 <= eng.registry.stats.host_misses <= 4, eng.registry.stats


# ---- adapters at run time ------------------------------------------------------------------------
def test_unload_while_requests_run(engine, model_dir, short_dirs, peft_greedy_cache):
    eng = engine
    eng.load_lora_adapter("X", short_dirs["x0"])
    prompts = prompts_of(5, [12, 30, 7, 19, 25])
    loras = ["X", "X", "a", "X", None]
    dirs = {**short_dirs, "X": short_dirs["x0"]}
    rids = [eng.add_request(p, GREEDY, lora=l) for p, l in zip(prompts, loras)]
    eng.step()
    eng.step()
    assert any(t for t in eng.list_lora_adapters() if t["name"] == "X" and t["slot"] is not None)
    eng.unload_lora_adapter("X")
    [entry] = [e for e in eng.list_lora_adapters() if e["name"] == "X"]
    assert entry["unloading"] and entry["active_requests"] == 3
    with pytest.raises(AdapterUnloadingError, match="'X' is being unloaded"):
        eng.add_request(prompts[0], GREEDY, lora="X")
    with pytest.raises(AdapterUnloadingError):
        eng.generate([prompts[0]], GREEDY, lora="X")
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps < 500
    outs = [eng.pop_output(r) for r in rids]
    assert [o.finish_reason for o in outs] == ["length"] * 5
    check_vs_peft(peft_greedy_cache, model_dir, dirs, prompts, loras, outs)
    assert "X" not in {e["name"] for e in eng.list_lora_adapters()}
    with pytest.raises(UnknownAdapterError, match="'X'"):
        eng.add_request(prompts[0], GREEDY, lora="X")
    assert_clean(eng)
    # the name is free again: another folder under it serves its own weights
    eng.load_lora_adapter("X", short_dirs["x1"])
    outs = gen(eng, prompts[:2], GREEDY, "X")
    check_vs_peft(peft_greedy_cache, model_dir, {"X": short_dirs["x1"]}, prompts[:2], ["X", "X"], outs)
    eng.unload_lora_adapter("X")   # nothing running: gone at once
    assert "X" not in {e["name"] for e in eng.list_lora_adapters()}


def test_load_at_run_time_and_bad_adapters(engine, model_dir, short_dirs, peft_greedy_cache, tmp_path):
    eng = engine
    eng.load_lora_adapter("late", short_dirs["d"])
    prompts = prompts_of(6, [9, 21, 4, 15, 30])
    loras = ["late", None, "late", "a", "b"]
    dirs = {**short_dirs, "late": short_dirs["d"]}
    check_vs_peft(peft_greedy_cache, model_dir, dirs, prompts, loras, gen(eng, prompts, GREEDY, loras))

    before = {e["name"] for e in eng.list_lora_adapters()}
    with pytest.raises(AdapterError, match="'broken'.*does not exist"):
        eng.load_lora_adapter("broken", str(tmp_path / "missing"))
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "adapter_config.json").write_text("{ not json")
    with pytest.raises(AdapterError, match="'broken2'.*JSON"):
        eng.load_lora_adapter("broken2", str(bad_json))
    other_model = tmp_path / "other_model"
    shutil.copytree(short_dirs["a"], other_model)
    cfg = json.loads((other_model / "adapter_config.json").read_text())
    cfg["r"] = "eight"
    (other_model / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match="'broken3'"):
        eng.load_lora_adapter("broken3", str(other_model))
    with pytest.raises(AdapterConflictError, match="'late' is already loaded"):
        eng.load_lora_adapter("late", short_dirs["x2"])
    assert {e["name"] for e in eng.list_lora_adapters()} == before
    with pytest.raises(UnknownAdapterError):
        eng.generate([prompts[0]], GREEDY, lora="broken")
    # the others still serve their own weights ("late" kept its folder)
    loras = ["a", "late", None, "c", "late"]
    check_vs_peft(peft_greedy_cache, model_dir, dirs, prompts, loras, gen(eng, prompts, GREEDY, loras))
    # a pinned adapter is written to its slot at load time and serves like the others
    eng.load_lora_adapter("pinned", short_dirs["x3"], pinned=True)
    [entry] = [e for e in eng.list_lora_adapters() if e["name"] == "pinned"]
    assert entry["pinned"] and entry["slot"] is not None
    loras = ["pinned", "a", "late", None, "pinned"]
    dirs["pinned"] = short_dirs["x3"]
    check_vs_peft(peft_greedy_cache, model_dir, dirs, prompts, loras, gen(eng, prompts, GREEDY, loras))
    assert [e["slot"] for e in eng.list_lora_adapters() if e["name"] == "pinned"] == [entry["slot"]]
    eng.unload_lora_adapter("pinned")
    eng.unload_lora_adapter("late")
    assert {e["name"] for e in eng.list_lora_adapters()} == {"a", "b", "c"}


def test_adapter_folder_gone_before_reread(model_dir, short_dirs, peft_greedy_cache, tmp_path):
    """max_loaded_loras=1: adapters are re-read from their folders when they come back to a slot.
    Folders that vanished since fail only their own requests; the batch's other adapters are still
    written to their slots, and a restored folder serves its weights again."""
    copies = {n: shutil.copytree(short_dirs[src], tmp_path / n) for n, src in
              (("gone1", "x4"), ("gone2", "x5"), ("kept", "x6"))}
    eng = make_engine(model_dir, {}, lora_backend="bgmv", max_loaded_loras=1)
    for n, d in copies.items():
        eng.load_lora_adapter(n, d)
    shutil.rmtree(copies["gone1"])
    shutil.rmtree(copies["gone2"])
    prompts = prompts_of(15, [6, 11, 8, 13])
    loras = ["gone1", "gone2", "kept", None]
    outs = gen(eng, prompts, GREEDY, loras)
    for o, n in zip(outs[:2], loras[:2]):
        assert o.finish_reason == "error" and f"'{n}'" in o.error and "does not exist" in o.error
    check_vs_peft(peft_greedy_cache, model_dir, copies, prompts[2:], loras[2:], outs[2:])
    shutil.copytree(short_dirs["x4"], copies["gone1"])
    check_vs_peft(peft_greedy_cache, model_dir, copies, prompts[:3], ["gone1"] * 3,
                  gen(eng, prompts[:3], GREEDY, "gone1"))


# ---- scheduling ----------------------------------------------------------------------------------
def drive(eng: Engine, prompts, params, loras, max_steps=3000):
    """generate() with a step bound, so that a scheduler stall fails instead of hanging."""
    rids = [eng.add_request(p, params, lora=l) for p, l in zip(prompts, loras)]
    for _ in range(max_steps):
        if not eng.has_unfinished():
            break
        eng.step()
    else:
        pytest.fail(f"requests still unfinished after {max_steps} steps")
    return [eng.pop_output(r) for r in rids]


def test_preemption_gives_the_same_tokens(engine, model_dir, short_dirs, peft_greedy_cache):
    eng = engine
    prompts = prompts_of(7, [30, 22, 41, 17, 35, 26, 9, 44])
    loras = [None, "a", "b", "c", "a", None, "b", "c"]
    plenty = gen(eng, prompts, GREEDY, loras)
    assert eng.stats["preemptions"] == 0
    # leave free pages for one max-length sequence and one more, as num_pages = that + 1 would
    keep = -(-MAX_MODEL_LEN // PAGE_SIZE) + 1
    held = eng.pages.allocate(eng.pages.num_free - keep)
    try:
        few = drive(eng, prompts, GREEDY, loras)
        assert eng.pages.num_free == keep
    finally:
        eng.pages.free(held)
    assert eng.stats["preemptions"] > 0
    assert [o.token_ids for o in few] == [o.token_ids for o in plenty]
    check_vs_peft(peft_greedy_cache, model_dir, short_dirs, prompts, loras, few)
    assert_clean(eng)


def test_abort_frees_pages_and_adapter(engine):
    eng = engine
    prompts = prompts_of(8, [20, 30])
    rids = [eng.add_request(p, GREEDY, lora="a") for p in prompts]
    eng.step()
    assert eng.pages.num_free < eng.pages.capacity
    assert all(eng.abort_request(r) for r in rids)
    assert not eng.abort_request(rids[0])      # already finished
    outs = [eng.pop_output(r) for r in rids]
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert_clean(eng)


# ---- sampling and stop conditions ----------------------------------------------------------------
def test_seeded_sampling_is_batch_independent(engine):
    eng = engine
    prompts = prompts_of(9, [14, 6, 27, 3, 19, 33])
    seeded = SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=123, ignore_eos=True)
    alone = gen(eng, [prompts[0]], seeded, "a")[0].token_ids
    assert alone == gen(eng, [prompts[0]], seeded, "a")[0].token_ids
    others = [GREEDY, SamplingParams(max_tokens=7, temperature=1.2, ignore_eos=True), seeded,
              SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, seed=9, ignore_eos=True), GREEDY]
    batch = gen(eng, prompts[1:3] + [prompts[0]] + prompts[3:5],
                [others[0], others[1], seeded, others[3], others[4]], ["b", None, "a", "a", "c"])
    assert batch[2].token_ids == alone
    # another seed gives another stream (10 tokens at temperature 0.8 over 256 ids)
    other = gen(eng, [prompts[0]], SamplingParams(max_tokens=MAX_NEW, temperature=0.8, seed=124,
                                                  ignore_eos=True), "a")[0].token_ids
    assert other != alone
    # top_k=1 is greedy whatever the temperature and seed
    greedy = gen(eng, prompts[:3], GREEDY, ["a", None, "b"])
    top1 = gen(eng, prompts[:3], SamplingParams(max_tokens=MAX_NEW, temperature=1.5, top_k=1, ignore_eos=True),
               ["a", None, "b"])
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_max_tokens_stop_token_ids_and_logprobs(engine):
    eng = engine
    p_short, p_long = prompts_of(10, [10, 60])
    outs = gen(eng, [p_short, p_long], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert len(outs[0].token_ids) == 16 and outs[0].finish_reason == "length"
    # the context bounds max_tokens: 60 prompt tokens leave 4
    assert len(outs[1].token_ids) == MAX_MODEL_LEN - 60 and outs[1].finish_reason == "length"
    full = outs[0].token_ids
    stop_tok = full[5]
    j = full.index(stop_tok)
    out = gen(eng, [p_short], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                             stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == full[:j + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    out = gen(eng, [p_short], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == full[:3] and out.finish_reason == "length"
    out = gen(eng, [p_short], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3))[0]
    assert [lp.token_id for lp in out.logprobs] == full[:6]
    for lp in out.logprobs:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id and lp.top[0][1] == pytest.approx(lp.logprob)
        assert lp.logprob <= 0 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_prompt_logprobs_equal_peft(engine, peft_refs):
    """prompt_logprobs (echo): each prompt token's logprob after the ones before it, and the top
    alternatives, equal transformers + PEFT's log-softmax (base and two adapters in one batch,
    prompts long enough to be prefilled in several chunks); a second run of the same prompt,
    whose pages sit in the prefix cache, still computes them all."""
    peft = peft_refs["llama"]
    prompts = prompts_of(51, [45, 23, 9])
    loras = [None, "a", "c"]
    names = {None: None, "a": SPEC[0], "c": SPEC[2]}
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=5)
    outs = gen(engine, prompts, params, loras)
    again = gen(engine, prompts[:1], params, loras[:1])[0]
    for prompt, lora, out in zip(prompts, loras, outs):
        logits = peft.logits(names[lora], prompt).astype(np.float64)
        ref = logits - logits.max(-1, keepdims=True)
        ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            lp = out.prompt_logprobs[j]
            assert lp.token_id == prompt[j]
            assert abs(lp.logprob - ref[j - 1, prompt[j]]) < 2e-4, (lora, j)
            top = np.argsort(-ref[j - 1])[:5]
            assert [t for t, _ in lp.top] == top.tolist(), (lora, j)
            np.testing.assert_allclose([v for _, v in lp.top], ref[j - 1, top], atol=2e-4)
    assert [lp.logprob for lp in again.prompt_logprobs[1:]] == [lp.logprob for lp in outs[0].prompt_logprobs[1:]]
    assert gen(engine, prompts[:1], GREEDY)[0].prompt_logprobs is None


def test_bad_requests_leave_the_engine_untouched(engine):
    eng = engine
    before = dict(eng.stats)
    ok = prompts_of(11, [5])[0]
    too_long = prompts_of(12, [MAX_MODEL_LEN])[0]
    with pytest.raises(PromptTooLongError, match=f"max_model_len={MAX_MODEL_LEN}"):
        eng.generate([ok, too_long], GREEDY, lora="a")
    with pytest.raises(PromptTooLongError, match="64 tokens"):
        eng.add_request(too_long, GREEDY, lora="a")
    with pytest.raises(UnknownAdapterError, match="'nope'.*loaded adapters: a, b, c"):
        eng.generate([ok], GREEDY, lora="nope")
    with pytest.raises(UnknownAdapterError, match="'nope'"):
        eng.add_request(ok, GREEDY, lora="nope")
    with pytest.raises(ValueError, match="no tokenizer.json.*token ids"):
        eng.generate("hello there", GREEDY)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        eng.add_request("hello", GREEDY)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        eng.add_request([5, 256], GREEDY)
    with pytest.raises(ValueError, match="2 sampling params"):
        eng.generate([ok, ok, ok], [GREEDY, GREEDY])
    assert eng.stats == before   # nothing was queued
    assert_clean(eng)
    # bad sampling parameters are refused where they are made, naming the field and the range
    for kwargs, msg in [(dict(max_tokens=0), r"max_tokens must be an integer >= 1, got 0"),
                        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
                        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
                        (dict(temperature=-1.0), r"temperature must be >= 0, got -1.0"),
                        (dict(temperature=float("nan")), "temperature"),
                        (dict(top_k=-2), "top_k"), (dict(logprobs=21), "logprobs"),
                        (dict(stop=[""]), "stop")]:
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**kwargs)
    # and the engine serves on
    assert len(gen(eng, [ok], GREEDY, "a")[0].token_ids) == MAX_NEW


def test_stream_increments_concatenate_to_generate(engine):
    eng = engine
    prompt = prompts_of(13, [17])[0]
    want = gen(eng, [prompt], GREEDY, "b")[0]
    deltas = list(eng.stream(prompt, GREEDY, lora="b"))
    assert sum((d.token_ids for d in deltas), []) == want.token_ids
    assert all(d.token_ids for d in deltas[:-1]) and deltas[-1].finished
    assert deltas[-1].finish_reason == "length" and not any(d.finished for d in deltas[:-1])
    assert_clean(eng)
    # driving step() by hand: each request's finished delta comes exactly once
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 9, 5)]
    rids = [eng.add_request(prompt, p, lora=l) for p, l in zip(params, ["b", None, "a"])]
    finished, tokens = [], {r: [] for r in rids}
    while eng.has_unfinished():
        for d in eng.step():
            tokens[d.request_id] += d.token_ids
            if d.finished:
                finished.append(d.request_id)
    for _ in range(2):
        assert eng.step() == []
    assert sorted(finished) == sorted(rids)
    assert [len(tokens[r]) for r in rids] == [2, 9, 5]
    assert [eng.pop_output(r).token_ids for r in rids] == [tokens[r] for r in rids]
    assert_clean(eng)
    # a consumer that stops early aborts its request: nothing stays behind
    it = eng.stream(prompt, GREEDY, lora="b")
    next(it)
    it.close()
    assert_clean(eng)


# ---- a model folder with a tokenizer: text prompts, EOS, stop strings -----------------------------
def word(t: int) -> str:
    return f"w{t:03d}"


@pytest.fixture(scope="module")
def tok_case(model_dir, tmp_path_factory, peft_greedy_cache):
    """The tiny Llama with a word-level tokenizer.json (id t <-> "wNNN", joined by spaces) and a
    generation_config.json whose EOS is the 7th greedy token of PROMPT."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    prompt = prompts_of(14, [8])[0]
    full = peft_greedy_cache(model_dir, None, prompt, 16)
    folder = tmp_path_factory.mktemp("llama_tok")
    for f in ("config.json", "model.safetensors"):
        shutil.copy(Path(model_dir) / f, folder / f)
    tok = Tokenizer(models.WordLevel(vocab={word(i): i for i in range(256)}, unk_token=word(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    eos = full[6]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, eos]}))
    eng = make_engine(folder, {}, lora_backend="bgmv")
    return eng, prompt, full, eos


def test_text_prompts_and_eos(tok_case):
    eng, prompt, full, eos = tok_case
    text = " ".join(word(t) for t in prompt)
    p16 = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    out = gen(eng, text, p16)[0]
    assert out.prompt_token_ids == prompt and out.token_ids == full
    assert out.text == " ".join(word(t) for t in full)
    j = full.index(eos)
    out = gen(eng, [prompt], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert out.token_ids == full[:j + 1] and out.finish_reason == "stop" and out.stop_reason is None
    out = gen(eng, [prompt], p16)[0]   # ignore_eos: on to max_tokens
    assert out.token_ids == full and out.finish_reason == "length"


def test_stop_strings(tok_case):
    eng, prompt, full, _ = tok_case
    full_text = " ".join(word(t) for t in full)
    # a stop string equal to one token's text
    s = word(full[4])
    j = full.index(full[4])
    out = gen(eng, [prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[s, "zzz"]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == s
    assert out.token_ids == full[:j + 1]
    assert out.text == full_text[:full_text.index(s)]
    # one spanning two tokens: it completes with the second
    s2 = word(full[8])[1:] + " " + word(full[9])[:2]
    k = full_text.index(s2)
    n_tokens = next(i + 1 for i in range(16) if len(" ".join(word(t) for t in full[:i + 1])) >= k + len(s2))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=s2)
    out = gen(eng, [prompt], params)[0]
    assert out.finish_reason == "stop" and out.stop_reason == s2
    assert out.token_ids == full[:n_tokens] and out.text == full_text[:k]
    # streamed: the text increments never show the stop string, and add up to the final text
    deltas = list(eng.stream(prompt, params))
    assert "".join(d.text for d in deltas) == out.text
    assert sum((d.token_ids for d in deltas), []) == out.token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert_clean(eng)


def test_background_warmup_gives_the_same_tokens_before_and_after_it_finishes(engine, model_dir, short_dirs):
    """A server's warm-up (warmup="background"): steps run once the first shapes are compiled.
    Here the background thread is held on its first shape (a sampler with logprobs), so that
    requests of every length run while most step shapes are not compiled: each step compiles its
    own. Then a request with logprobs needs the very shape the background thread is compiling,
    and waits for it. The tokens are those of the fully warmed engine, before and after the
    background finishes, and nothing counts as compiled after warm-up."""
    import threading

    eng = make_engine(model_dir, {"a": short_dirs["a"], "b": short_dirs["b"]}, lora_backend="bgmv")
    runner = eng.runner
    jobs, num_first = runner.warmup_jobs()
    held = jobs[num_first][:2]
    assert held[0] == "sampler" and held[1][2], "the background starts with the samplers with logprobs"
    gate, reached = threading.Event(), threading.Event()

    def gated(what, key):  # the background thread waits at its first shape until the gate opens
        if (what, key) == tuple(held) and threading.current_thread().name.startswith("multilora-warmup"):
            reached.set()
            assert gate.wait(120)

    runner.compiler.before_compile = gated
    prompts = prompts_of(5, MIXED_LENGTHS[:8] + [63, 60])
    loras = ["a", None, "b", "a", None, "b", "a", None, "b", "a"]
    with_lp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)
    try:
        runner.warmup(background=True)
        assert reached.wait(60)
        first = set(runner.compiled_steps())
        assert first == {k for k in eng.buckets.first_shapes() if k in set(eng.buckets.all_shapes())}
        status = runner.warmup_status()
        assert not runner.warm and not status["done"] and status["compiled"] == num_first < status["total"]
        before = gen(eng, prompts, lora=loras)
        assert set(runner.compiled_steps()) > first, "no step needed a shape the background had not compiled"
        assert not runner.warm
        threading.Timer(0.5, gate.set).start()
        lp_before = gen(eng, prompts[:1], params=with_lp, lora="a")   # waits for the held sampler
    finally:
        gate.set()
    assert runner.wait_warm(300) and runner.warm
    status = runner.warmup_status()
    assert status["done"] and status["compiled"] == status["total"] == len(jobs)
    after = gen(eng, prompts, lora=loras)
    ref = gen(engine, prompts, lora=loras)
    assert [o.token_ids for o in before] == [o.token_ids for o in after] == [o.token_ids for o in ref]
    lp_ref = gen(engine, prompts[:1], params=with_lp, lora="a")
    assert lp_before[0].token_ids == lp_ref[0].token_ids
    assert [lp.logprob for lp in lp_before[0].logprobs] == pytest.approx([lp.logprob for lp in lp_ref[0].logprobs])
    assert runner.compiles_after_warmup == 0


# ---- last: nothing compiled after warm-up in any engine of this file -----------------------------
def test_no_compile_after_warmup(engine, model_dir, short_dirs):
    """XLA's own compile events, counted while a warmed-up engine runs every kind of step: prompt
    lengths from 1 token to a chunked long one, decode rows beside prefill chunks, base rows and
    adapters together, an adapter swapped into a slot, sampled and greedy rows, logprobs. Not one
    backend compile may happen (the runner's own counter only sees the buckets it knows of)."""
    import jax

    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    eng = make_engine(model_dir, {"a": short_dirs["a"], "b": short_dirs["b"]}, lora_backend="auto", warmup=True)
    assert eng.runner.warm
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        prompts = prompts_of(77, [1, 5, 17, 40, 63, 9, 30, 2])
        params = [GREEDY, SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3),
                  SamplingParams(max_tokens=4, temperature=0.0, logprobs=3)] * 3
        eng.load_lora_adapter("x1", str(short_dirs["x1"]))
        first = eng.add_request(prompts[3], GREEDY, lora="a")
        for _ in range(3):
            eng.step()  # it decodes while the others' prefill chunks join it
        outs = eng.generate(prompts, params[:len(prompts)], lora=["a", None, "b", "x1", None, "a", "b", None])
        assert [o.finish_reason in ("length", "stop") for o in outs] == [True] * len(prompts)
        eng.unload_lora_adapter("x1")
        while eng.has_unfinished():
            eng.step()
        eng.release_finished(first)
        assert_clean(eng)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == [], f"{len(compiles)} XLA compiles after warm-up"
    for e in _ENGINES:   # and the runner's counter, for every engine this module warmed up
        assert not e.runner.warm or e.runner.compiles_after_warmup == 0


def test_a_slow_adapter_read_delays_only_its_own_requests(engine, model_dir, short_dirs, peft_greedy_cache):
    """An adapter whose host copy is gone is read again on the loader's thread: the step never
    waits for it; requests for other adapters (and the base model) run to the end meanwhile; a
    read that fails fails only its own requests."""
    import threading
    gate = threading.Event()
    real_read = engine.loader.read

    def slow_read(name, path):
        assert gate.wait(timeout=120), "the test never released the read"
        return real_read(name, path)

    engine.load_lora_adapter("slow", str(short_dirs["d"]))
    engine.registry.drop_host_copy("slow")  # as if evicted from the host tier: the next use reads the folder
    engine.loader.read = slow_read
    try:
        prompts = prompts_of(71, [9, 14, 6])
        loras = [None, "slow", "a"]
        ids = [engine.add_request(p, GREEDY, l) for p, l in zip(prompts, loras)]
        done: set[str] = set()
        for _ in range(200):
            done |= {d.request_id for d in engine.step() if d.finished}
            if {ids[0], ids[2]} <= done:
                break
        assert {ids[0], ids[2]} <= done, "requests beside a slow adapter read did not finish"
        slow_req = engine.request(ids[1])
        assert not slow_req.output_token_ids and ids[1] not in done
        assert engine.loader.in_flight("slow") == 1
        gate.set()
        while ids[1] not in done:
            done |= {d.request_id for d in engine.step() if d.finished}
        outs = [engine.pop_output(r) for r in ids]
        check_vs_peft(peft_greedy_cache, model_dir, {**short_dirs, "slow": short_dirs["d"]}, prompts, loras, outs)
        assert_clean(engine)

        # A read that fails: its request ends with the reason, the one beside it is untouched.
        engine.registry.drop_host_copy("slow")
        engine.registry.drop_slot("slow")

        def failing_read(name, path):
            raise AdapterError(name, "the folder went bad")

        engine.loader.read = failing_read
        outs = engine.generate(prompts[:2], GREEDY, lora=[None, "slow"])
        assert outs[1].finish_reason == "error" and "went bad" in outs[1].error
        assert outs[0].finish_reason == "length"
        check_vs_peft(peft_greedy_cache, model_dir, short_dirs, prompts[:1], [None], outs[:1])
        assert_clean(engine)
    finally:
        gate.set()
        engine.loader.read = real_read
        engine.unload_lora_adapter("slow")


def test_engine_seed_repeats_unseeded_requests_whatever_their_ids(model_dir):
    """Requests without a seed sample from one derived from the engine seed and their arrival
    order (not their ids, which a server draws at random): two engines with the same seed give
    the same tokens for the same requests under other ids; another engine seed, other tokens."""
    prompts = prompts_of(21, [9, 17, 5])
    params = SamplingParams(max_tokens=MAX_NEW, temperature=1.0, ignore_eos=True)

    def run(seed, tag):
        eng = make_engine(model_dir, {}, max_loras_per_batch=0, seed=seed)
        ids = [eng.add_request(p, params, request_id=f"{tag}-{i}") for i, p in enumerate(prompts)]
        while eng.has_unfinished():
            eng.step()
        return [eng.pop_output(rid).token_ids for rid in ids]

    first, again, other = run(5, "x"), run(5, "y"), run(6, "z")
    assert first == again
    assert first != other


def peft_mix_greedy(model_dir, dirs: dict, weights: dict, prompts, max_new: int) -> list[list[int]]:
    """PEFT's own weighted mix: add_weighted_adapter(..., combination_type="cat"), greedy."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    names = list(weights)
    model = PeftModel.from_pretrained(base, dirs[names[0]], adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(dirs[n], adapter_name=n)
    model.add_weighted_adapter(names, [weights[n] for n in names], "mix", combination_type="cat")
    model.set_adapter("mix")
    model.eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            g = model.generate(torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new,
                               do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(g[0, len(p):].tolist())
    return out


def test_weighted_mix_equals_peft_cat_in_a_mixed_batch(model_dir, spec_dirs, peft_greedy_cache):
    """An exact weighted mix of three adapters (one rsLoRA, different targets and ranks, a
    negative weight) computed in the batch beside base rows and a single adapter's rows: greedy
    tokens equal PEFT's add_weighted_adapter(..., "cat") mix, and the others equal PEFT alone.
    The mix is registered once under its canonical name; a rank over max_lora_rank, an unknown
    part or a bad weight is refused naming the problem, and nothing changes."""
    dirs = {"a": spec_dirs[SPEC[0]], "c": spec_dirs[SPEC[2]], "b": spec_dirs[SPEC[1]]}
    eng = make_engine(model_dir, dirs, max_lora_rank=32, max_loras_per_batch=4)
    weights = {"a": 0.7, "c": -0.4, "b": 0.5}  # PEFT takes its config from the first: a, no rsLoRA
    mix = eng.add_mix(weights)
    assert mix == "mix(a=0.7,b=0.5,c=-0.4)" and eng.add_mix(dict(reversed(list(weights.items())))) == mix
    prompts = prompts_of(31, [7, 12, 3, 19, 9])
    loras = [mix, None, "a", mix, "b"]
    outs = gen(eng, prompts, GREEDY, loras)
    want_mix = peft_mix_greedy(model_dir, dirs, weights, [prompts[0], prompts[3]], MAX_NEW)
    assert [outs[0].token_ids, outs[3].token_ids] == want_mix
    check_vs_peft(peft_greedy_cache, model_dir, dirs, [prompts[i] for i in (1, 2, 4)],
                  [loras[i] for i in (1, 2, 4)], [outs[i] for i in (1, 2, 4)])
    assert outs[0].token_ids != gen(eng, [prompts[0]], GREEDY, "a")[0].token_ids  # the mix is not just a
    before = set(eng.registry.entries)
    for bad, match in (({"a": 1.0, "c": 1.0, "b": 1.0, "zzz": 1.0}, "zzz"), ({"a": float("nan")}, "finite"),
                       ({}, "adapters"), ({mix: 1.0}, "itself a mix")):
        with pytest.raises(Exception, match=match):
            eng.add_mix(bad)
    small = make_engine(model_dir, dirs, max_lora_rank=16, max_loras_per_batch=4)
    with pytest.raises(ValueError, match="max_lora_rank=16"):
        small.add_mix({"a": 1.0, "c": 1.0})
    assert set(eng.registry.entries) == before


def test_a_load_read_while_streams_decode_pauses_inside_steps_and_serves_peft(engine, model_dir, short_dirs,
                                                                               peft_greedy_cache):
    """A run-time load (read_adapter_async, the server's path) read while requests run: the
    engine's gate is closed during every step and open between them, the read finishes while
    the streams go on, and the adapter then serves PEFT's tokens."""
    eng = engine
    launch, gate_open = eng.runner.launch, []

    def watched(*a, **kw):
        gate_open.append(eng.loader.gate.is_open)
        return launch(*a, **kw)
    eng.runner.launch = watched
    try:
        prompts = prompts_of(4, [11, 7, 19, 5])
        for p, lora in zip(prompts, ["a", None, "b", "a"]):
            eng.add_request(p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), lora)
        fut = eng.read_adapter_async("paced", short_dirs["d"])
        steps = 0
        while eng.has_unfinished() and steps < 500:
            eng.step()
            steps += 1
            assert eng.loader.gate.is_open
        adapter = fut.result(timeout=60)
    finally:
        eng.runner.launch = launch
    assert gate_open and not any(gate_open)
    eng.load_lora_adapter("paced", short_dirs["d"], adapter=adapter)
    try:
        prompts = prompts_of(3, [9, 21, 4])
        loras = ["paced", None, "a"]
        dirs = {**short_dirs, "paced": short_dirs["d"]}
        check_vs_peft(peft_greedy_cache, model_dir, dirs, prompts, loras, gen(eng, prompts, GREEDY, loras))
    finally:
        eng.unload_lora_adapter("paced")


def test_a_dropped_engine_is_freed_with_its_loader_thread(model_dir, spec_dirs):
    """Nothing the engine starts keeps it alive: once dropped (after serving a request on an
    adapter) it is collected, device arrays and host copies with it, and its adapter loader's
    thread ends (engines built one after another in a process used to pile up until OOM)."""
    import gc
    import threading
    import time
    import weakref
    before = {t.ident for t in threading.enumerate() if "lora-load" in t.name}
    eng = Engine(str(model_dir), {n: str(spec_dirs[n]) for n in SPEC[:2]}, **KW)
    eng.generate([prompts_of(5, [6])[0]], GREEDY, lora=[SPEC[0]])
    ref = weakref.ref(eng)
    del eng
    gc.collect()
    assert ref() is None
    deadline = time.time() + 5
    while time.time() < deadline and {t.ident for t in threading.enumerate() if "lora-load" in t.name} - before:
        time.sleep(0.1)
    assert not {t.ident for t in threading.enumerate() if "lora-load" in t.name} - before
