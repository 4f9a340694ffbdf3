"""Tensor parallelism and several processes, on CPU devices.

The pytest process has already started JAX with one CPU device, so every engine here runs in a
subprocess: this file is also that subprocess's script (`python -m tests.test_tensor_parallel
tp|multihost SPEC.json`). One subprocess with 4 CPU devices builds every single-process engine
(tp 1, 2, 4 on bgmv, 2 and 4 on sgmv; a model with one KV head; a Qwen3, a Gemma 2 and a Qwen3-MoE on tp=2; tp=3
for 4 heads) and prints JSON; then two processes joined by jax.distributed (gloo collectives on
127.0.0.1), 2 CPU devices each, run one tp=4 engine in lockstep. The tests assert on those results:
same greedy tokens as one device for a mixed batch (base rows and three adapters), weights, adapter
slots and KV cache split as the rules table says (also after slot writes and steps), no all-gather of the cache in a
compiled step, no compile after warm-up.

Compiling is the cost: each engine compiles one step shape (BUCKETS: every step, decode, prefill
or mixed, pads to it), and all engines share the same shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import reference
from tests.procs import child_env, free_port

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN, PAGE_SIZE = 64, 8
KW = dict(max_loras_per_batch=4, max_lora_rank=16, max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
          max_num_batched_tokens=64, page_size=PAGE_SIZE)
# One step shape for every step (decode rows, prefill chunks or both, padded to 64 tokens): 32 pages
# hold every page of the 8 sequences at once (26 at the longest).
BUCKETS = dict(tokens=(64,), pages=(32,), max_num_seqs=8, max_pages_seq=MAX_MODEL_LEN // PAGE_SIZE,
               page_size=PAGE_SIZE)
MAX_NEW = 8
ADAPTERS = {"a": "a_all_r8", "b": "b_attn_r4_rslora", "c": "c_mlp_r16"}
LORAS = [None, "a", "b", "c", None, "c", "a", "b"]
LENGTHS = [5, 13, 9, 20, 3, 17, 30, 11]   # 108 tokens: chunked prefills over several steps
# one device once (bgmv); every other run is held to PEFT's tokens, which that one gives
LLAMA_RUNS = [dict(model="llama", tp=tp, backend=be) for be, tps in (("bgmv", (1, 2, 4)), ("sgmv", (2, 4))) for tp in tps]
QWEN_RUNS = [dict(model="qwen2", tp=tp, backend="sgmv") for tp in (2, 4)]
NEW_KINDS = ("qwen3", "gemma2", "gemma3", "mistral")
NEW_RUNS = [dict(model=m, tp=2, backend="bgmv") for m in NEW_KINDS]  # against PEFT: no tp=1 run
# Qwen3-MoE: adapter c's experts' gate_up at twice its rank (PEFT fuses gate and up): rank 32
MOE_RUNS = [dict(model="qwen3_moe", tp=2, backend="bgmv", max_lora_rank=32)]
ERROR_RUNS = [dict(model="llama", tp=3, backend="bgmv"), dict(model="llama", tp=8, backend="bgmv")]

# The arrays whose per-device pieces are reported: weights, adapter slots, KV cache.
WEIGHT_FIELDS = ["embed_VD", "lm_head_DV", "wq_LDO", "wk_LDO", "wo_LOD", "w_gate_LDF", "w_down_LFD", "bq_LO",
                 "router_LDE", "w_gate_LEDM", "w_up_LEDM", "w_down_LEMD",
                 "q_norm_LH", "k_norm_LH", "post_attn_norm_LD"]
LORA_FIELDS = ["qkv_a_LUD", "q_b_LUO", "k_b_LUO", "v_b_LUO", "o_a_LUO", "o_b_LUD",
               "gate_up_a_LUD", "gate_b_LUF", "up_b_LUF", "down_a_LUF", "down_b_LUD"]


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, 256, size=n).tolist() for n in LENGTHS]


# ---- the subprocess side (no jax import at module level: the device count is set first) ----------
def _engine(spec, model, tp, backend, **extra):
    from multilora.engine.engine import Engine
    from multilora.engine.runner import Buckets
    names = extra.pop("names", tuple(ADAPTERS))
    adapters = {k: spec["adapters"][model][v] for k, v in ADAPTERS.items() if k in names}
    return Engine(spec["models"][model], adapters, **{**KW, **extra}, buckets=Buckets(**BUCKETS),
                  lora_backend=backend, tensor_parallel_size=tp)


def _generate(eng):
    from multilora.engine.request import SamplingParams
    outs = eng.generate(prompts(), SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True),
                        lora=LORAS)
    return [o.token_ids for o in outs]


def _pieces(arr) -> dict:
    """Global shape, each device's piece, and the device count."""
    return dict(shape=list(arr.shape), piece=list(arr.sharding.shard_shape(arr.shape)),
                devices=len(arr.sharding.device_set),
                pieces_seen=sorted({tuple(s.data.shape) for s in arr.addressable_shards}))


def _report(eng) -> dict:
    import re

    import jax
    from multilora.model.sharding import KV_AXES, sharding
    w, slots, kv = eng.runner.weights, eng.slots, eng.runner.kv
    out = dict(mesh=dict(eng.mesh.shape))
    fields = {f: getattr(w, f, None) if hasattr(w, f) else getattr(w.layers, f) for f in WEIGHT_FIELDS}
    out["weights"] = {f: _pieces(a) for f, a in fields.items() if a is not None}
    out["lora"] = {f: _pieces(getattr(slots.weights, f)) for f in LORA_FIELDS}
    # After LoRASlots.load and after the steps (donated cache): still the declared shardings?
    out["lora_kept_sharding"] = all(getattr(slots.weights, f).sharding == getattr(slots.shardings, f)
                                    for f in LORA_FIELDS)
    out["kv"] = _pieces(kv.k_LPpKH)
    out["kv_kept_sharding"] = kv.k_LPpKH.sharding == sharding(eng.mesh, eng.rules, KV_AXES)
    dev0 = eng.mesh.devices.flat[0]
    leaves = jax.tree.leaves(w)
    out["weight_bytes_device0"] = int(sum(s.data.nbytes for a in leaves for s in a.addressable_shards
                                          if s.device == dev0))
    out["weight_bytes_total"] = int(sum(a.nbytes for a in leaves))
    # The compiled steps: which collectives, and the largest all-gather (elements).
    gathers, reduces = [], 0
    for fn in eng.runner.compiled_steps().values():
        for shape in re.findall(r"= \(?(\w+\[[\d,]*\])[^=]*? all-gather(?:-start)?\(", fn.as_text()):
            gathers.append(int(np.prod([int(d) for d in shape.split("[")[1].rstrip("]").split(",") if d])))
        reduces += len(re.findall(r" all-reduce(?:-start)?\(", fn.as_text()))
    out["largest_all_gather"] = max(gathers, default=0)
    out["all_reduces"] = reduces
    out["compiles_after_warmup"] = eng.runner.compiles_after_warmup
    return out


def _worker_tp(spec) -> dict:
    import jax
    jax.config.update("jax_num_cpu_devices", spec["devices"])
    results = []
    for run in spec["runs"]:
        r = dict(run)
        try:
            eng = _engine(spec, run["model"], run["tp"], run["backend"],
                          **{k: v for k, v in run.items() if k not in ("model", "tp", "backend")})
        except ValueError as e:
            r["error"] = str(e)
            results.append(r)
            continue
        r["tokens"] = _generate(eng)
        r.update(_report(eng))
        results.append(r)
        del eng
    return dict(devices=[str(d) for d in jax.devices()], runs=results)


def _worker_multihost(spec) -> dict:
    """One of the processes: the leader loads adapter c at run time (replayed by the followers
    at the next step) and generates; the followers mirror its steps."""
    import jax
    jax.config.update("jax_num_cpu_devices", spec["local_devices"])
    dist = dict(coordinator_address=spec["coordinator"], num_processes=spec["num_processes"],
                process_id=spec["process_id"])
    eng = _engine(spec, "llama", spec["tp"], spec["backend"], names=("a", "b"), distributed=dist)
    out = dict(process=jax.process_index(), processes=jax.process_count(), local=jax.local_device_count(),
               global_devices=jax.device_count(), leader=eng.is_leader)
    if eng.is_leader:
        eng.load_lora_adapter("c", spec["adapters"]["llama"][ADAPTERS["c"]])
        try:
            out["tokens"] = _generate(eng)
        finally:
            eng.stop_followers()
    else:
        try:
            eng.add_request([5, 6, 7])
        except RuntimeError as e:
            out["follower_add_error"] = str(e)
        eng.follow()
    out["steps"] = eng.stats["steps"]
    out["generated_tokens"] = eng.stats["generated_tokens"]
    out["compiles_after_warmup"] = eng.runner.compiles_after_warmup
    out["kv_piece"] = list(eng.runner.kv.k_LPpKH.sharding.shard_shape(eng.runner.kv.k_LPpKH.shape))
    return out


def _main(argv) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    mode, spec_path = argv
    spec = json.loads(Path(spec_path).read_text())
    result = _worker_tp(spec) if mode == "tp" else _worker_multihost(spec)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# ---- the pytest side ------------------------------------------------------------------------------
def _parse(stdout: str) -> dict:
    lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
    assert lines, "the subprocess printed no result"
    return json.loads(lines[-1][len("RESULT "):])


def _spec(tiny_models, tiny_adapters, **kw) -> dict:
    return dict(models={k: str(v) for k, v in tiny_models.items()},
                adapters={m: {ad: str(tiny_adapters[(m, ad)]) for ad in ADAPTERS.values()}
                          for m in ("llama", "qwen2", *NEW_KINDS, "qwen3_moe")}, **kw)


def _launch(mode: str, spec: dict, path: Path) -> subprocess.Popen:
    path.write_text(json.dumps(spec))
    return subprocess.Popen([sys.executable, "-m", "tests.test_tensor_parallel", mode, str(path)], cwd=ROOT,
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"subprocess timed out after {timeout}s; stderr tail:\n{err[-4000:]}")
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}); stderr tail:\n{err[-4000:]}"
    return _parse(out)



def _peft_tokens(peft_greedy_cache, tiny_models, tiny_adapters, model: str) -> list[list[int]]:
    """transformers + PEFT's greedy tokens for the mixed batch (LORAS over prompts()) on a tiny."""
    return peft_greedy_cache.many(tiny_models[model],
                                  [(None if l is None else tiny_adapters[(model, ADAPTERS[l])], p)
                                   for l, p in zip(LORAS, prompts())], MAX_NEW)


@pytest.fixture(scope="module")
def tp_runs(tiny_models, tiny_adapters, tmp_path_factory):
    spec = _spec(tiny_models, tiny_adapters, devices=4, runs=LLAMA_RUNS + QWEN_RUNS + NEW_RUNS + MOE_RUNS + ERROR_RUNS)
    res = _finish(_launch("tp", spec, tmp_path_factory.mktemp("tp") / "spec.json"), timeout=900)
    assert len(res["devices"]) == 4
    return {(r["model"], r["tp"], r["backend"]): r for r in res["runs"]}


@pytest.mark.parametrize("backend", ["bgmv", "sgmv"])
def test_tp_tokens_equal_one_device(backend, tp_runs, tiny_models, tiny_adapters, peft_greedy_cache):
    """tp 2 and 4 give the 1-device greedy tokens for a mixed batch, PEFT's (bgmv on one device
    gives them)."""
    want = _peft_tokens(peft_greedy_cache, tiny_models, tiny_adapters, "llama")
    assert tp_runs[("llama", 1, "bgmv")]["tokens"] == want
    for tp in (2, 4):
        r = tp_runs[("llama", tp, backend)]
        assert r["mesh"]["tp_kv"] * r["mesh"]["tp_rep"] == tp
        assert r["tokens"] == want, f"{backend} tp={tp} differs from PEFT's (one device's) tokens"
        assert r["compiles_after_warmup"] == 0


@pytest.mark.parametrize("tp", [2, 4])
def test_weights_slots_and_cache_are_sharded(tp, tp_runs):
    """The Llama tiny (4 heads, 2 KV heads, FFN 128, vocab 256) on tp devices: Megatron splits,
    LoRA B/A split with their base layers, the KV cache split by KV heads as far as they go."""
    r = tp_runs[("llama", tp, "bgmv")]
    g = min(tp, 2)  # gcd(KV heads, tp): KV head groups
    assert r["mesh"] == {"tp_kv": g, "tp_rep": tp // g}
    w = r["weights"]
    d, qo, kvo, f, v = 64, 64, 32, 128, 256

    def piece(entry):  # a layer weight's per-device piece, without L
        assert entry["devices"] == tp and entry["pieces_seen"] == [entry["piece"]]
        return entry["piece"][1:]

    assert w["embed_VD"]["piece"] == [v // tp, d]
    assert w["lm_head_DV"]["piece"] == [d, v // tp]
    assert piece(w["wq_LDO"]) == [d, qo // tp]           # column-parallel
    assert piece(w["wk_LDO"]) == [d, kvo // g]           # KV heads: split into g groups
    assert piece(w["wo_LOD"]) == [qo // tp, d]           # row-parallel
    assert piece(w["w_gate_LDF"]) == [d, f // tp]
    assert piece(w["w_down_LFD"]) == [f // tp, d]
    lo = {k: e["piece"][1:] for k, e in r["lora"].items()}
    u = 4 * 16 + 8                                       # pool rows: 4 slots at rank 16, + the zero page
    assert lo["qkv_a_LUD"] == [3 * u, d]                 # A of column-parallel layers: replicated
    assert lo["q_b_LUO"] == [u, qo // tp]                # ... B split by output
    assert lo["k_b_LUO"] == lo["v_b_LUO"] == [u, kvo // g]
    assert lo["o_a_LUO"] == [u, qo // tp]                # A of row-parallel layers: split by input
    assert lo["o_b_LUD"] == [u, d]                       # ... B replicated
    assert lo["gate_up_a_LUD"] == [2 * u, d]
    assert lo["gate_b_LUF"] == lo["up_b_LUF"] == [u, f // tp]
    assert lo["down_a_LUF"] == [u, f // tp]
    assert lo["down_b_LUD"] == [u, d]
    assert r["lora_kept_sharding"], "a slot write changed the buffers' sharding"
    assert r["kv_kept_sharding"], "the donated KV cache came back in another sharding"
    kv = r["kv"]
    assert kv["piece"][3] == 2 // g and kv["shape"][3] == 2   # (L, P, p, K, H): K split in g groups
    # Megatron: 1/tp of the weight bytes per device, plus the replicated norms (and k/v split
    # only g ways): 1.09x of 1/tp for tp=4 here.
    assert r["weight_bytes_device0"] < r["weight_bytes_total"] / tp * 1.15
    # The compiled steps: no gather of the cache, only the logits (Q x V) are gathered.
    assert r["largest_all_gather"] <= 8 * v
    assert r["all_reduces"] >= 3   # embedding, and per layer after o and down (with LoRA h)


def test_fewer_kv_heads_than_devices_replicates_the_cache(tp_runs, tiny_models, tiny_adapters, peft_greedy_cache):
    """Qwen2 tiny has one KV head: on 2 and 4 devices every device holds the whole KV cache and
    computes all of k/v (documented), q/FFN still split; tokens equal PEFT's (one device's)."""
    want = _peft_tokens(peft_greedy_cache, tiny_models, tiny_adapters, "qwen2")
    for tp in (2, 4):
        r = tp_runs[("qwen2", tp, "sgmv")]
        assert r["tokens"] == want, f"qwen2 tp={tp} differs from PEFT's (one device's) tokens"
        assert r["mesh"] == {"tp_kv": 1, "tp_rep": tp}
        assert r["kv"]["piece"] == r["kv"]["shape"]                      # replicated cache
        assert r["weights"]["wk_LDO"]["piece"] == r["weights"]["wk_LDO"]["shape"]
        assert r["weights"]["wq_LDO"]["piece"][2] == 64 // tp
        assert r["weights"]["bq_LO"]["piece"][1] == 64 // tp
        assert r["compiles_after_warmup"] == 0 and r["lora_kept_sharding"] and r["kv_kept_sharding"]


@pytest.mark.parametrize("model", NEW_KINDS)
def test_newer_architectures_on_two_devices_give_peft_tokens(model, tp_runs, tiny_models, tiny_adapters,
                                                             peft_greedy_cache):
    """The Qwen3, Gemma 2 and 3 (4 heads of 32) and Mistral (4 of 16) tinies, 2 KV heads, on tp=2:
    PEFT's greedy tokens for the mixed batch, the projections split as Llama's, their own norm
    weights replicated."""
    r = tp_runs[(model, 2, "bgmv")]
    want = _peft_tokens(peft_greedy_cache, tiny_models, tiny_adapters, model)
    assert r["tokens"] == want
    w = r["weights"]
    assert r["mesh"] == {"tp_kv": 2, "tp_rep": 1}
    hf = reference.TINY_CONFIGS[model]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * head_dim, hf["num_key_value_heads"] * head_dim
    assert w["wq_LDO"]["piece"][1:] == [64, q // 2] and w["wo_LOD"]["piece"][1:] == [q // 2, 64]
    assert w["wk_LDO"]["piece"][1:] == [64, kv // 2]
    norms = {"qwen3": ("q_norm_LH", "k_norm_LH"), "gemma2": ("post_attn_norm_LD",),
             "gemma3": ("q_norm_LH", "k_norm_LH", "post_attn_norm_LD"), "mistral": ()}[model]
    for f in norms:
        assert w[f]["piece"] == w[f]["shape"] and w[f]["devices"] == 2, f
    assert r["compiles_after_warmup"] == 0 and r["lora_kept_sharding"] and r["kv_kept_sharding"]


def test_qwen3_moe_on_two_devices_gives_peft_tokens(tp_runs, tiny_models, tiny_adapters, peft_greedy_cache):
    """The Qwen3-MoE tiny (4 experts of width 32, layer 1 dense) on tp=2, adapters with the
    experts' LoRA beside base rows: PEFT's greedy tokens; each expert split over its width (gate
    and up by output, down by input), the router replicated."""
    r = tp_runs[("qwen3_moe", 2, "bgmv")]
    want = _peft_tokens(peft_greedy_cache, tiny_models, tiny_adapters, "qwen3_moe")
    assert r["tokens"] == want
    w = r["weights"]
    assert w["w_gate_LEDM"]["piece"] == [2, 4, 64, 32 // 2] == w["w_up_LEDM"]["piece"]
    assert w["w_down_LEMD"]["piece"] == [2, 4, 32 // 2, 64]
    assert w["router_LDE"]["piece"] == w["router_LDE"]["shape"] == [2, 64, 4]
    assert w["w_gate_LDF"]["piece"] == [2, 64, 96 // 2]  # the dense layer's MLP, as Llama's
    assert r["compiles_after_warmup"] == 0 and r["lora_kept_sharding"] and r["kv_kept_sharding"]


def test_heads_not_divisible_is_a_clear_error(tp_runs):
    err = tp_runs[("llama", 3, "bgmv")]["error"]
    assert "tensor_parallel_size=3 must divide" in err and "num_attention_heads=4" in err
    err = tp_runs[("llama", 8, "bgmv")]["error"]
    assert "tensor_parallel_size=8 needs that many devices" in err and "4 available" in err


def test_two_processes_match_one(tp_runs, tiny_models, tiny_adapters, tmp_path):
    """Two processes on 127.0.0.1 (gloo), 2 CPU devices each, one tp=4 engine: process 0 takes the
    requests (and loads an adapter at run time), process 1 mirrors every step; the tokens equal a
    single device's."""
    port = free_port()
    procs = []
    for pid in range(2):
        spec = _spec(tiny_models, tiny_adapters, coordinator=f"127.0.0.1:{port}", num_processes=2,
                     process_id=pid, local_devices=2, tp=4, backend="bgmv")
        procs.append(_launch("multihost", spec, tmp_path / f"spec{pid}.json"))
    try:
        leader, follower = (_finish(p, timeout=600) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert leader["leader"] and not follower["leader"]
    assert leader["processes"] == 2 and leader["global_devices"] == 4 and leader["local"] == 2
    assert leader["tokens"] == tp_runs[("llama", 1, "bgmv")]["tokens"]
    assert "only process 0 takes requests" in follower["follower_add_error"]
    # Lockstep: the follower ran the same steps and sampled the same number of tokens.
    assert follower["steps"] == leader["steps"] > 0
    assert follower["generated_tokens"] == leader["generated_tokens"] == len(LORAS) * MAX_NEW
    assert leader["compiles_after_warmup"] == follower["compiles_after_warmup"] == 0
    assert leader["kv_piece"][3] == 1   # 2 KV heads over tp_kv=2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
