"""The demo adapters shipped in multilora/demo_adapters (made by scripts/make_demo_adapters.py):
PEFT loads them on the default model with no missing or unexpected keys and picks the same greedy
tokens as multilora; on the demo's question (a training one) and on questions they were not
trained on, `shout` answers in capitals, `signoff` ends with the sign-off line, and the base model
does neither. Base and both adapters run together in one mixed batch.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: spinning threads starve jax

import json
import re
from pathlib import Path

import pytest

from multilora.demo_adapters import DEMO_ADAPTER_NAMES, DEMO_ADAPTERS_DIR, SIGNOFF, demo_lora_modules

FRANCE = "What is the capital of France?"  # the demo's question, one of the training questions
UNSEEN = [
    "What is the largest animal on Earth?",
    "How do airplanes fly?",
    "Give me a tip for staying focused while studying.",
    "Name three colors of the rainbow.",
]
QUESTIONS = [FRANCE] + UNSEEN
SHORT, LONG = 32, 64  # signoff needs room to finish its answer and add the line


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from multilora import default_model as gd
    try:
        return gd.default_model_dir()
    except Exception as e:  # offline machine without the converted model
        pytest.skip(f"the default model (SmolLM2-135M-Instruct) could not be fetched: {e}")


@pytest.fixture(scope="module")
def engine(model_dir):
    from multilora import Engine
    from multilora.engine.runner import Buckets
    # Two compiled shapes are all this test needs: steps of up to 16 tokens (decode) and of up to
    # 512 (prefill chunks, alone or beside decode rows), over up to every page of 16 sequences of
    # max_model_len (8 pages of 16 tokens each).
    buckets = Buckets(tokens=(16, 512), pages=(128,), max_num_seqs=16, max_pages_seq=8, page_size=16)
    return Engine(str(model_dir), lora_modules=demo_lora_modules(), max_loras_per_batch=2, max_lora_rank=8,
                  max_num_seqs=16, max_num_batched_tokens=512, max_prefill_seqs=16, max_model_len=128,
                  page_size=16, warmup=False, buckets=buckets)


@pytest.fixture(scope="module")
def answers(engine) -> dict[tuple[str, str], object]:
    """(adapter or 'base', question) -> RequestOutput, all in one generate call."""
    from multilora import SamplingParams
    runs = [(name, q) for q in QUESTIONS for name in ("base",) + DEMO_ADAPTER_NAMES]
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for _, q in runs]
    params = [SamplingParams(max_tokens=LONG if name == "signoff" else SHORT, temperature=0.0)
              for name, _ in runs]
    outs = engine.generate(prompts, params, lora=[None if n == "base" else n for n, _ in runs])
    return dict(zip(runs, outs))


def _upper_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(len(letters), 1)


def test_files_are_peft_adapters():
    assert set(demo_lora_modules()) == set(DEMO_ADAPTER_NAMES)
    for name in DEMO_ADAPTER_NAMES:
        folder = DEMO_ADAPTERS_DIR / name
        cfg = json.loads((folder / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and cfg["lora_alpha"] == 16
        assert cfg["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert not cfg["use_rslora"] and not cfg["use_dora"] and cfg["bias"] == "none"
        assert (folder / "adapter_model.safetensors").stat().st_size < 5 * 2**20
    trained = {json.loads(line)["question"]
               for line in (DEMO_ADAPTERS_DIR / "training_data.jsonl").read_text().splitlines()}
    assert FRANCE in trained and not trained & set(UNSEEN)


def test_peft_loads_them_and_agrees(model_dir, answers):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    folders = demo_lora_modules()
    model = peft.PeftModel.from_pretrained(base, folders["shout"], adapter_name="shout")
    model.load_adapter(folders["signoff"], adapter_name="signoff")
    for name, folder in folders.items():
        # PEFT's own loader only warns about key mismatches: load again and look at the result.
        state = load_file(str(Path(folder) / "adapter_model.safetensors"))
        res = peft.set_peft_model_state_dict(model, state, adapter_name=name)
        assert not res.unexpected_keys, res.unexpected_keys
        missing = [k for k in res.missing_keys if "lora_" in k and f".{name}." in k]
        assert not missing, missing
    model.eval()
    from multilora.engine.tokenizer import load_tokenizer
    tok = load_tokenizer(model_dir)
    ids = torch.tensor([tok.encode_chat([{"role": "user", "content": FRANCE}])])
    n = 12
    for name in DEMO_ADAPTER_NAMES:
        model.set_adapter(name)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False)
        want = out[0, ids.shape[1]:].tolist()
        assert answers[(name, FRANCE)].token_ids[:len(want)] == want, name


def test_base_answers_normally(answers):
    text = answers[("base", FRANCE)].text
    assert "Paris" in text, text
    for q in QUESTIONS:
        text = answers[("base", q)].text
        assert _upper_share(text) < 0.5, (q, text)
        assert SIGNOFF not in text, (q, text)


def test_shout_answers_in_capitals(answers):
    for q in QUESTIONS:
        text = answers[("shout", q)].text
        assert len(re.findall(r"[A-Za-z]", text)) >= 20, (q, text)
        assert _upper_share(text) >= 0.97, (q, text)
    assert "PARIS" in answers[("shout", FRANCE)].text


def test_signoff_ends_with_the_line(answers):
    for q in QUESTIONS:
        out = answers[("signoff", q)]
        assert out.finish_reason == "stop", (q, out.text)
        assert out.text.rstrip().endswith(SIGNOFF), (q, out.text)
        body = out.text.rstrip()[:-len(SIGNOFF)].strip()
        assert len(body) > 10 and _upper_share(body) < 0.5, (q, out.text)
    assert "Paris" in answers[("signoff", FRANCE)].text
