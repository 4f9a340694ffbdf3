"""The default model's GGUF -> HF conversion, checked against transformers' own GGUF loading.

The conversion runs once per machine into the user cache (`default_model_dir()`), so repeated runs
reuse it; everything after that is a few seconds, bar transformers' GGUF load (~15 s on 2 cores).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: its threads spin otherwise

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from multilora import default_model as gd

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]

# Strings on which our tokenizer and transformers' GGUF tokenizer agree: digits, runs of spaces,
# newlines, tabs, CRLF, unicode (2-, 3- and 4-byte), contractions, special tokens in text.
AGREEING_TEXTS = [
    "Hello world",
    "Hello 123 world\n\n  x",
    "3.14159 + 2,718 = 5.86",
    "price: $1,000,000!!",
    "héllo 日本語 🤗 café naïve Ωmega",
    " leading space",
    "   ",
    "tabs\tand\r\nCRLF\n",
    "don't you're I'll WE'VE",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x ** 2  # square\n",
]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return gd.default_model_dir()


@pytest.fixture(scope="session")
def gguf_file(model_dir) -> Path:
    return gd.fetch_default_gguf(gd.user_cache_dir())


@pytest.fixture(scope="session")
def our_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def ref_tokenizer(gguf_file):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="session")
def our_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_folder_is_complete_and_second_call_is_instant(model_dir):
    assert gd.is_converted(model_dir)
    t0 = time.perf_counter()
    assert gd.default_model_dir() == model_dir
    assert time.perf_counter() - t0 < 0.5
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (576, 30, 9, 3, 64, 49152)
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    assert not [p for p in model_dir.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_logits_match_transformers_gguf_loader(model_dir, gguf_file, our_model, our_tokenizer):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).eval()
    ids = our_tokenizer("The quick brown fox jumps over 12 lazy dogs.", return_tensors="pt").input_ids
    with torch.no_grad():
        ours, theirs = our_model(ids).logits, ref(ids).logits
    # Same dequantized weights, same q/k un-permutation: the match is exact in practice.
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=1e-4, rtol=0)


def test_tokenizer_matches_transformers_gguf_tokenizer(our_tokenizer, ref_tokenizer):
    for text in AGREEING_TEXTS:
        ours, theirs = our_tokenizer(text)["input_ids"], ref_tokenizer(text)["input_ids"]
        assert ours == theirs, (text, our_tokenizer.convert_ids_to_tokens(ours))
        assert our_tokenizer.decode(ours) == ref_tokenizer.decode(theirs) == text
    assert (our_tokenizer.bos_token, our_tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert (our_tokenizer.bos_token_id, our_tokenizer.eos_token_id) == (1, 2)
    assert len(our_tokenizer) == len(ref_tokenizer) == 49152
    ours = our_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours == ref_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert our_tokenizer(ours)["input_ids"] == ref_tokenizer(ours)["input_ids"]


def test_digits_split_like_llama_cpp(model_dir, our_tokenizer, ref_tokenizer):
    """`tokenizer.ggml.pre` is "smollm": each digit is split off before GPT-2's regex runs
    (llama.cpp's rule, and SmolLM2's own Digits+ByteLevel tokenizer.json). transformers' GGUF
    tokenizer ignores "smollm" and uses GPT-2's regex alone, so only a run of 2+ spaces before a
    digit differs: it cuts "  1" into Ġ Ġ 1, a split the model never saw in training."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))  # what the engine itself loads
    assert raw.encode("a  1").tokens == ["a", "ĠĠ", "1"]
    assert raw.encode("x\n\n 5").tokens == ["x", "ĊĊĠ", "5"]
    assert ref_tokenizer.convert_ids_to_tokens(ref_tokenizer("a  1")["input_ids"]) == ["a", "Ġ", "Ġ", "1"]
    for text in AGREEING_TEXTS:
        assert raw.encode(text).ids == our_tokenizer(text)["input_ids"]


def test_greedy_generation_knows_paris(model_dir, our_model, our_tokenizer):
    """multilora's Engine on the converted default model answers the question, token for token
    as transformers does on the same folder (the reference)."""
    from multilora import Engine, SamplingParams

    ids = our_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        ref = our_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    # Compiled on demand (warmup=False): only the few shapes this prompt needs.
    eng = Engine(str(model_dir), max_loras_per_batch=0, max_model_len=128, max_num_batched_tokens=64,
                 warmup=False)
    chat_ids = eng.tokenizer.encode_chat(MESSAGES, True)
    assert chat_ids == ids
    out = eng.generate([chat_ids], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert out.token_ids == ref[:len(out.token_ids)], (out.token_ids, ref)
    assert len(out.token_ids) == 12 or out.finish_reason == "stop"
    assert "Paris" in out.text, out.text


@pytest.mark.parametrize("cut", ["garbage", "header", "metadata", "tensors"])
def test_corrupt_gguf_gives_clear_error(gguf_file, tmp_path, cut):
    data = gguf_file.read_bytes()
    bad = tmp_path / f"bad-{cut}.gguf"
    bad.write_bytes({
        "garbage": b"this is not a gguf file at all",
        "header": data[:20],
        "metadata": data[:1_000_000],
        "tensors": data[: len(data) * 3 // 5],
    }[cut])
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=bad.name):
        gd.convert_gguf_to_hf(bad, out, progress=False)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [bad]


def test_interrupted_conversion_leaves_no_folder(gguf_file, tmp_path, monkeypatch):
    import safetensors.numpy

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.numpy, "save_file", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        gd.convert_gguf_to_hf(gguf_file, out, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_gguf_env_override(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv(gd.GGUF_ENV, str(gguf_file))
    assert gd.fetch_default_gguf(tmp_path / "unused") == gguf_file
    monkeypatch.setenv(gd.GGUF_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        gd.fetch_default_gguf(tmp_path / "unused")


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv(gd.CACHE_ENV, str(tmp_path / "a"))
    assert gd.user_cache_dir() == tmp_path / "a"
    monkeypatch.delenv(gd.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gd.user_cache_dir() == tmp_path / "xdg" / "multilora"


def test_cli_prints_folder(model_dir):
    proc = subprocess.run([sys.executable, "-m", "multilora.default_model"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == model_dir.resolve()


@pytest.mark.parametrize("text", ["Hello world, ça va? 日本語のテキスト 🤖\n\n  12 345\tend",
                                  "  leading spaces, ünïcödé ✓✓ and <|im_end|> inside"])
def test_incremental_detokenizer_equals_whole_decode(model_dir, text):
    """Token by token, the engine's incremental text only grows and ends equal to one decode of
    all ids (multi-byte characters split over tokens are held back, not garbled)."""
    from multilora.engine.tokenizer import Detokenizer, load_tokenizer
    tok = load_tokenizer(model_dir)
    ids = tok.encode(text, add_special_tokens=False)
    detok, prev = Detokenizer(tok), ""
    for i in range(1, len(ids) + 1):
        cur = detok.decode(ids[:i])
        assert cur.startswith(prev) and "\ufffd" not in cur
        prev = cur
    assert prev == tok.decode(ids)
