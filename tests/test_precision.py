"""dtype means its name (multilora.model.precision): an explicit float32 runs float32 everywhere and
gives PEFT's greedy tokens with every other option at its default, whatever the CPU's kernels;
auto is the platform's fastest choice; what runs is reported by name."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from multilora import kernels
from multilora.config import EngineConfig
from multilora.model import projections
from multilora.model.precision import activation_dtype, kv_cache_dtype, resolve_precision
from tests import reference

ON_CPU = jnp.zeros(4)


def test_activation_dtype_auto_is_the_platforms_fastest():
    assert activation_dtype("auto", "cpu") == "float32"
    for platform in ("gpu", "cuda", "tpu"):
        assert activation_dtype("auto", platform) == "bfloat16"
    for name in ("float32", "bfloat16", "float16"):
        assert activation_dtype(name, "cpu") == name and activation_dtype(name, "gpu") == name
    with pytest.raises(ValueError, match="unknown dtype 'half'; choose one of auto, float32, bfloat16, float16"):
        activation_dtype("half", "cpu")
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16, got 'fp32'"):
        EngineConfig(dtype="fp32")
    assert EngineConfig().dtype == "auto"


def test_kv_cache_dtype_holds_16_bit_activations_in_float32_on_a_cpu_only():
    assert kv_cache_dtype("bfloat16", "cpu") == np.float32 and kv_cache_dtype(jnp.float16, "cpu") == np.float32
    assert kv_cache_dtype("bfloat16", "tpu") == jnp.bfloat16 and kv_cache_dtype("float32", "cpu") == np.float32


def test_an_explicit_dtype_is_obeyed_whatever_the_cpu_and_the_environment(monkeypatch):
    """float32 means float32 projections and pool even where auto takes the packed bf16 kernel,
    and even with MULTILORA_PROJECTION_DTYPE set (it says what auto means, nothing else); the
    expert's projection_dtype / lora_dtype still win over what dtype implies."""
    for env in (None, "bfloat16"):
        if env is None:
            monkeypatch.delenv(projections.AUTO_ENV, raising=False)
        else:
            monkeypatch.setenv(projections.AUTO_ENV, env)
        p = resolve_precision("float32", "auto", "auto", None, "auto", ON_CPU)
        assert p.as_dict() == dict(dtype="float32", activations="float32", projections="float32",
                                   kv_cache="float32", adapter_pool="float32")
    monkeypatch.delenv(projections.AUTO_ENV, raising=False)
    packed = kernels.bf16_gemm_isa() != ""
    p = resolve_precision("bfloat16", "auto", "auto", None, "auto", ON_CPU)
    assert (p.activations, p.kv_cache, p.adapter_pool) == ("bfloat16", "float32", "bfloat16")
    assert p.projections == ("bfloat16-packed" if packed else "bfloat16")
    p = resolve_precision("float32", "bfloat16", "auto", None, "auto", ON_CPU)  # the expert's mix
    assert p.activations == "float32" and p.projections == ("bfloat16-packed" if packed else "bfloat16")
    assert resolve_precision("float32", "auto", "bfloat16", None, "auto", ON_CPU).adapter_pool == "bfloat16"
    # a quantization names the projections' form itself (int8-packed where the CPU kernels run)
    assert resolve_precision("float32", "auto", "auto", "int8", "auto", ON_CPU).projections == (
        projections.quantized_mode("int8", ON_CPU))
    # auto: the fastest on this CPU (bf16 projections where the packed kernel runs)
    p = resolve_precision("auto", "auto", "auto", None, "auto", ON_CPU)
    auto_bf16 = kernels.bf16_gemm_isa() in projections.AUTO_BF16_ISAS
    assert p.activations == "float32" and p.projections == ("bfloat16-packed" if auto_bf16 else "float32")
    assert p.describe().startswith("dtype auto: activations float32, projections ")


# ---- an explicit float32 against PEFT, every other option at its default ------------------------
@pytest.fixture(scope="module")
def qwen2_three_adapters(tiny_models, tmp_path_factory):
    """The tiny Qwen2 (q/k/v biases) and three adapters unlike the shared fixtures': ranks 3, 24
    and 16, rsLoRA on one, each on its own subset of the projections."""
    model_dir = tiny_models["qwen2"]
    root = tmp_path_factory.mktemp("precision_adapters")
    specs = {"r3": dict(r=3, lora_alpha=7, target_modules=["q_proj", "k_proj", "down_proj"]),
             "r24": dict(r=24, lora_alpha=12, target_modules=["v_proj", "o_proj", "gate_proj", "up_proj"],
                         use_rslora=True),
             "r16": dict(r=16, lora_alpha=32, target_modules=reference.ALL)}
    return model_dir, {name: reference.make_adapter(model_dir, root / name, seed=70 + i, **spec)
                       for i, (name, spec) in enumerate(specs.items())}


# The float32 path's log-probabilities against PEFT's (summation orders differ, nothing else):
# measured within 2e-6; bfloat16-rounded projection weights move them by ~1e-3 and more.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def peft_qwen2(qwen2_three_adapters):
    model_dir, adapters = qwen2_three_adapters
    return reference.PeftReference(model_dir, adapters)


def run_mixed_rows(model_dir, adapters, **options):
    """8 mixed rows (base and three adapters), 12 greedy tokens each with their logprobs."""
    from multilora.engine.engine import Engine
    from multilora.engine.request import SamplingParams
    eng = Engine(str(model_dir), {k: str(v) for k, v in adapters.items()}, max_loras_per_batch=4, max_lora_rank=32,
                 max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, page_size=8, warmup=False, **options)
    rng = np.random.default_rng(61)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 17, 9, 30, 2, 12, 23, 7)]
    loras = [None, "r3", "r24", "r16", "r3", None, "r16", "r24"]
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1),
                        lora=loras)
    return eng, prompts, loras, outs


def deviations(peft, prompts, loras, outs):
    """(rows whose greedy tokens differ from PEFT's argmax given the same prefix, the largest
    |engine logprob - PEFT logprob| of a chosen token)."""
    bad, worst = [], 0.0
    for i, (p, l, o) in enumerate(zip(prompts, loras, outs)):
        logits = peft.logits(l, p + o.token_ids)[len(p) - 1:-1]
        top = logits.max(-1, keepdims=True)
        logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        if list(logits.argmax(-1)) != o.token_ids:
            bad.append(f"row {i} ({l}): engine {o.token_ids} != PEFT argmax {list(logits.argmax(-1))}")
        got = np.array([lp.logprob for lp in o.logprobs])
        worst = max(worst, float(np.abs(got - logp[np.arange(len(got)), o.token_ids]).max()))
    return bad, worst


@pytest.mark.parametrize("backend", ["auto", "bgmv", "sgmv"])
def test_explicit_float32_gives_pefts_greedy_tokens(backend, qwen2_three_adapters, peft_qwen2, monkeypatch):
    """Engine(dtype="float32") with the projection and pool dtypes at their defaults and no
    MULTILORA_PROJECTION_DTYPE: PEFT's greedy tokens row by row, and each chosen token's
    logprob within LOGPROB_ATOL of PEFT's. Before dtype meant its name, auto projections ran
    bfloat16 on every x86 host with the packed kernel (on an AVX512-BF16 host 3 of 8 such rows
    differed: issue 61)."""
    monkeypatch.delenv(projections.AUTO_ENV, raising=False)
    eng, prompts, loras, outs = run_mixed_rows(*qwen2_three_adapters, dtype="float32", lora_backend=backend)
    assert eng.precision.as_dict() == dict(dtype="float32", activations="float32", projections="float32",
                                           kv_cache="float32", adapter_pool="float32")
    bad, worst = deviations(peft_qwen2, prompts, loras, outs)
    assert not bad, "\n".join(bad)
    assert worst <= LOGPROB_ATOL, f"a logprob {worst:.2e} off PEFT's"
    eng.shutdown()


@pytest.mark.skipif(kernels.bf16_gemm_isa() not in projections.AUTO_BF16_ISAS,
                    reason="auto is float32 here: no packed bf16 kernel on this CPU")
def test_auto_is_the_faster_mix_and_says_so(qwen2_three_adapters, peft_qwen2, monkeypatch):
    """The default (dtype auto) takes bfloat16 projections where the packed kernel runs: its
    logprobs are measurably not float32's (so the test above can fail), within bfloat16's reach."""
    monkeypatch.delenv(projections.AUTO_ENV, raising=False)
    eng, prompts, loras, outs = run_mixed_rows(*qwen2_three_adapters)
    assert eng.precision.dtype == "auto" and eng.precision.projections == "bfloat16-packed"
    _, worst = deviations(peft_qwen2, prompts, loras, outs)
    assert LOGPROB_ATOL < worst < 0.5, worst
    eng.shutdown()
