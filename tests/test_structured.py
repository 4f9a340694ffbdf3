"""Structured output (llguidance) in the engine: the device mask against llguidance's own numpy
version; constrained greedy tokens against the masked argmax of transformers + PEFT logits;
constrained and free rows, base and adapters, in one batch (free rows unchanged, constrained
outputs valid); bad constraints refused with nothing lost.

The tiny Llama here is the conftest one plus the byte-level tokenizer of tests.reference (a
grammar needs token texts); its step shapes are test_engine's, so the compiles are shared.
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest

from multilora.engine.engine import Engine
from multilora.engine.request import SamplingParams
from multilora.engine.structured import StructuredOutput, allow_all, mask_words
from tests import reference
from tests.test_engine import KW, assert_clean, prompts_of

llguidance_numpy = pytest.importorskip("llguidance.numpy")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "n"],
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
def engine(tiny_models, tiny_adapters, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("structured") / "llama"
    shutil.copytree(tiny_models["llama"], model_dir)
    assert reference.make_tiny_tokenizer(model_dir) == reference.TINY_CONFIGS["llama"]["vocab_size"]
    adapters = {name: str(tiny_adapters[("llama", name)]) for name in ("a_all_r8", "c_mlp_r16")}
    return Engine(str(model_dir), adapters, **KW, warmup=False)  # shapes compiled as met


@pytest.mark.parametrize("vocab", [256, 100, 33])
def test_device_mask_equals_llguidance_numpy(vocab):
    """apply_token_bitmask (jnp) against llguidance.numpy.apply_token_bitmask_inplace on random
    words, the sign bit and a vocabulary that is not a multiple of 32 included; an all-ones row
    passes unchanged."""
    import jax.numpy as jnp

    from multilora.engine.logits_process import apply_token_bitmask
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((5, vocab)).astype(np.float32)
    words = rng.integers(-2**31, 2**31, size=(5, mask_words(vocab)), dtype=np.int64).astype(np.int32)
    words[0] = allow_all(1, vocab)[0]
    words[1] = np.int32(-2**31)  # only bit 31 of each word
    want = logits.copy()
    llguidance_numpy.apply_token_bitmask_inplace(want, words)
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(words)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[0], logits[0])


def _masked_greedy_reference(engine, peft, adapter, prompt, spec, max_new):
    """Greedy decoding where each token is the argmax of PEFT's logits under llguidance's mask
    (computed by a matcher of its own), until the grammar ends or max_new tokens."""
    matcher = engine.grammars.matcher(spec)
    out = []
    eos = engine.eos_token_ids
    while len(out) < max_new:
        logits = peft.logits(adapter, prompt + out)[-1][None, :].astype(np.float32).copy()
        mask = allow_all(1, logits.shape[1])
        engine.grammars.fill([(matcher, 0)], mask)
        llguidance_numpy.apply_token_bitmask_inplace(logits, mask)
        tok = int(np.argmax(logits[0]))
        out.append(tok)
        assert matcher.consume_token(tok)
        if tok in eos or matcher.is_stopped():
            break
    return out


def test_constrained_greedy_tokens_equal_the_masked_peft_argmax(engine, peft_refs):
    """Constrained rows of the base model and two adapters (a regex, a choice, a JSON schema),
    in one batch: each greedy token is the argmax of transformers + PEFT's logits under the
    grammar's mask, step after step."""
    peft = peft_refs["llama"]
    prompts = prompts_of(41, [5, 9, 13])
    cases = [(None, StructuredOutput("regex", r"[a-f]{2,5}-[0-9]{2}")),
             ("a_all_r8", StructuredOutput.choice(["the quick fox", "the lazy dog", "hello"])),
             ("c_mlp_r16", StructuredOutput.json_schema(SCHEMA))]
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured=s) for _, s in cases]
    outs = engine.generate(prompts, params, lora=[a for a, _ in cases])
    assert_clean(engine)
    for (adapter, spec), prompt, out in zip(cases, prompts, outs):
        want = _masked_greedy_reference(engine, peft, adapter, prompt, spec, 40)
        assert out.token_ids == want, (adapter, spec.kind)
        assert out.finish_reason == "stop", out
    assert re.fullmatch(r"[a-f]{2,5}-[0-9]{2}", outs[0].text)
    assert outs[1].text in ("the quick fox", "the lazy dog", "hello")
    obj = json.loads(outs[2].text)
    assert set(obj) == {"color", "n"} and obj["color"] in ("red", "green", "blue") and 0 <= obj["n"] <= 99


def test_free_rows_are_untouched_by_constrained_rows_in_their_batch(engine):
    """Sampled constrained rows (json_object and a JSON schema, seeds given) beside free greedy
    rows of the base and an adapter: the free rows' tokens equal their run alone, and the
    constrained outputs are valid."""
    free_prompts = prompts_of(42, [6, 11, 7, 4])
    free_loras = [None, "a_all_r8", "c_mlp_r16", None]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = [o.token_ids for o in engine.generate(free_prompts, greedy, lora=free_loras)]
    cons = [SamplingParams(max_tokens=48, temperature=1.0, seed=s, structured=StructuredOutput.json_schema(SCHEMA))
            for s in range(3)]
    cons.append(SamplingParams(max_tokens=24, temperature=0.7, seed=9, structured=StructuredOutput("json_object")))
    outs = engine.generate(free_prompts + prompts_of(43, [8, 5, 9, 3]), [greedy] * 4 + cons,
                           lora=free_loras + ["a_all_r8", None, "c_mlp_r16", "a_all_r8"])
    assert_clean(engine)
    assert [o.token_ids for o in outs[:4]] == alone
    for o in outs[4:7]:
        assert o.finish_reason == "stop" and set(json.loads(o.text)) == {"color", "n"}, o
    assert outs[7].text.startswith("{") and outs[7].error is None
    if outs[7].finish_reason == "stop":
        assert isinstance(json.loads(outs[7].text), dict)


def test_bad_constraints_are_refused_and_lose_nothing(engine):
    """A regex, schema or grammar that does not compile is a ValueError naming the problem at
    add_request; a request already running is not disturbed; min_tokens past the end of a grammar
    does not wedge it (the grammar allows only EOS once complete)."""
    rid = engine.add_request(prompts_of(44, [6])[0], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    engine.step()
    for spec, words in [(StructuredOutput("regex", "a(b"), "regex"),
                        (StructuredOutput("json", json.dumps({"type": "objectx"})), "objectx"),
                        (StructuredOutput("grammar", "start: nothing_here"), "grammar")]:
        with pytest.raises(ValueError, match=words):
            engine.add_request([5, 6, 7], SamplingParams(structured=spec))
    assert engine.num_waiting + engine.num_running == 1
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop_output(rid).token_ids) == 6
    out = engine.generate([9, 10, 11], SamplingParams(max_tokens=12, min_tokens=8, temperature=0.0,
                                                      structured=StructuredOutput.choice(["hello"])))[0]
    assert (out.text, out.finish_reason, out.error) == ("hello", "stop", None)
    assert_clean(engine)
    for bad in (lambda: StructuredOutput.choice([]), lambda: StructuredOutput.json_schema("{not json"),
                lambda: StructuredOutput.json_schema([1]), lambda: StructuredOutput("xml", "<a/>")):
        with pytest.raises(ValueError):
            bad()


def test_structured_params_cross_processes_as_json():
    """Several processes send SamplingParams as JSON (engine.commands.params_dict)."""
    from multilora.engine.commands import params_dict
    p = SamplingParams(max_tokens=5, structured=StructuredOutput.json_schema(SCHEMA))
    assert SamplingParams(**json.loads(json.dumps(params_dict(p)))) == p
