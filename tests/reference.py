"""The references: tiny random checkpoints and PEFT adapters made with transformers + PEFT, and
their logits. Test-only code: torch never enters the package."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

TINY_CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False, hidden_act="silu",
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=64)),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=256, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False),
    "tied": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=48,
                 intermediate_size=128, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
                 max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                 tie_word_embeddings=True, hidden_act="silu", attention_bias=True),  # biases on q/k/v/o
    # per-head q/k RMSNorm; head_dim 32 apart from hidden / heads = 16 (q_dim 128 > hidden 64); a
    # sliding window of 5 on the layers from max_window_layers=1 on (layer 0 global, layer 1 local)
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=256, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  tie_word_embeddings=False, hidden_act="silu", attention_bias=False, use_sliding_window=True,
                  sliding_window=5, max_window_layers=1),
    # a sliding window of 5 keys on every layer: most test prompts are longer
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=256, hidden_size=64,
                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=5,
                    tie_word_embeddings=False, hidden_act="silu"),
    # local (window 5) and global layers alternating over 3 layers (a whole pair and one more),
    # soft caps small enough to bend the scores and logits, query_pre_attn_scalar apart from
    # head_dim, random (1 + w) norm weights (make_tiny_model), tied embeddings
    "gemma2": dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=256, hidden_size=64,
                   intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                   query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                   sliding_window=5, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh"),
    # Gemma 3 (text): as Gemma 2, with per-head q/k (1 + w) norms, no soft caps, and the local
    # layers' own RoPE base (10000 against the global layers' 1e6, each visible in the logits);
    # a window of 5 on all but every third layer (layer_types from sliding_window_pattern 3)
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=256, hidden_size=64,
                   intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
                   rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                                        full_attention=dict(rope_type="default", rope_theta=1000000.0)),
                   query_pre_attn_scalar=24, sliding_window=5, sliding_window_pattern=3,
                   tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh"),
    # Qwen3-MoE: Qwen3's attention; layer 0 sparse (4 experts of width 32, top 2, renormalised),
    # layer 1 the dense MLP (mlp_only_layers); the router's weights widened
    # (make_tiny_model) so that its choices differ from token to token
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=256, hidden_size=64,
                      intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, hidden_act="silu"),
}
# The kinds every parity test runs on; the others (Qwen3, Mistral, Gemma 2) run in a subset of the
# tests and backends (tests/test_model_parity.py), which keeps the suite's time in bounds.
CORE_KINDS = ("llama", "qwen2", "tied")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_SPECS = {
    "a_all_r8": dict(r=8, lora_alpha=16, target_modules=ALL),
    "b_attn_r4_rslora": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], use_rslora=True),
    "c_mlp_r16": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "d_regex_patterns": dict(r=8, lora_alpha=8, target_modules=r".*\.(k_proj|down_proj|q_proj)",
                             rank_pattern={"k_proj": 2}, alpha_pattern={"down_proj": 32}),
}


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_tokenizer(folder: Path) -> int:
    """A byte-level BPE over printable ASCII with exactly 256 tokens (the tiny models' vocab):
    <|endoftext|>, <|im_start|>, <|im_end|> (= eos id 2 of the tiny config), then the rest."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = sorted({c for w, _ in tok.pre_tokenizer.pre_tokenize_str(string.printable) for c in w})
    corpus = ("the quick brown fox jumps over the lazy dog. hello world, how are you today? "
              "once upon a time there was a little model that served many adapters at once. "
              "user assistant system: tell me a story about cats and dogs and birds. "
              "many small requests share one batch; each names its adapter or none. "
              "streaming tokens arrive one by one while other clients wait their turn.").split(". ") * 10
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}))
    return tok.get_vocab_size()


def make_tiny_model(folder: Path, kind: str | dict, seed: int = 0) -> Path:
    """A random checkpoint of TINY_CONFIGS[kind] (or of the config dict `kind`) in folder."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg_dict = dict(TINY_CONFIGS[kind] if isinstance(kind, str) else kind)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**cfg_dict)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # HF init is tiny (biases zero); widen it so that errors show in the logits
        for name, p in model.named_parameters():
            if p.ndim in (2, 3):  # 3: transformers 5's fused experts (E, out, in)
                p.normal_(0.0, 0.08)
            if name.endswith("mlp.gate.weight"):  # the MoE router: choices that vary token to token
                p.normal_(0.0, 0.5)
            if name.endswith(".bias"):
                p.normal_(0.0, 0.2)
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # ones by default: a no-op to test
                p.uniform_(0.5, 1.5)
            if cfg_dict["model_type"].startswith("gemma") and name.endswith("norm.weight"):  # zeros: (1 + w) = 1
                p.normal_(0.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_tokenized_tiny_model(folder: Path, kind: str | dict = "llama") -> Path:
    """make_tiny_model in a new folder that also holds the byte-level tokenizer (what a server
    test needs: texts in, texts out)."""
    folder.mkdir(parents=True, exist_ok=True)
    make_tiny_tokenizer(folder)
    make_tiny_model(folder, kind)
    return folder


def make_adapter(model_dir: Path, folder: Path, seed: int, **lora_kwargs) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    cfg = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora_kwargs)
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.mul_(0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def peft_logits(model_dir: Path, adapter_dir: Path | None, token_ids: list[int]) -> np.ndarray:
    """(T, V) logits of one sequence through transformers (+ PEFT when adapter_dir is given)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([token_ids]))
    return out.logits[0].numpy()


def peft_greedy(model_dir: Path, adapter_dir: Path | None, token_ids: list[int], max_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([token_ids]), max_new_tokens=max_new, do_sample=False,
                             min_new_tokens=max_new, pad_token_id=0, eos_token_id=None)
    return out[0, len(token_ids):].tolist()


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


class PeftReference:
    """One base model with several PEFT adapters loaded side by side (loaded on first use, once),
    and memoized logits: far cheaper than peft_logits' reload per call when a test asks for many
    (adapter, sequence) pairs. adapter None means the plain transformers model."""

    def __init__(self, model_dir: Path, adapter_dirs: dict[str, Path], dtype=torch.float32):
        self.model_dir, self.adapter_dirs = Path(model_dir), dict(adapter_dirs)
        self.dtype = dtype  # the model and adapters run in it (bfloat16: PEFT's bf16 reference)
        self._model = None
        self._own: dict[str, object] = {}  # adapter -> a model of its own (see _load)
        self._memo: dict[tuple, np.ndarray] = {}

    def _load(self):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
        base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
        # PEFT holds several adapters with target_parameters (MoE experts) in one model only when
        # they target the same parameters: then each adapter gets a model of its own
        own = any(json.loads((Path(f) / "adapter_config.json").read_text()).get("target_parameters")
                  for f in self.adapter_dirs.values())
        model = None
        for name, folder in self.adapter_dirs.items():
            if own:
                own_base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
                self._own[name] = PeftModel.from_pretrained(own_base, folder).to(self.dtype).eval()
            elif model is None:
                model = PeftModel.from_pretrained(base, folder, adapter_name=name)
            else:
                model.load_adapter(folder, adapter_name=name)
        self._model = (model if model is not None else base).to(self.dtype).eval()

    def logits(self, adapter: str | None, token_ids) -> np.ndarray:
        """(T, V) float32 logits of one sequence."""
        key = (adapter, tuple(int(t) for t in token_ids))
        if key not in self._memo:
            if self._model is None:
                self._load()
            ids = torch.tensor([list(key[1])])
            with torch.no_grad():
                if adapter in self._own:
                    out = self._own[adapter](ids)
                elif adapter is None:
                    if hasattr(self._model, "disable_adapter"):
                        with self._model.disable_adapter():
                            out = self._model(ids)
                    else:
                        out = self._model(ids)
                else:
                    self._model.set_adapter(adapter)
                    out = self._model(ids)
            self._memo[key] = out.logits[0].float().numpy()
        return self._memo[key]


def peft_greedy_many(model_dir: Path, adapter_dir: Path | None, prompts: list[list[int]],
                     max_new: int) -> list[list[int]]:
    """peft_greedy for several prompts on one adapter, loading the model once."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([list(ids)]), max_new_tokens=max_new, do_sample=False,
                                 min_new_tokens=max_new, pad_token_id=0, eos_token_id=None)
            outs.append(out[0, len(ids):].tolist())
    return outs


class PeftGreedyCache:
    """Memoized peft_greedy: each (model, adapter folder, prompt) is generated once, at the longest
    max_new asked for; shorter asks get a prefix (greedy decoding is prefix-stable). Prompts must
    avoid token 0, which generate() treats as padding."""

    def __init__(self):
        self._memo: dict[tuple, list[int]] = {}

    @staticmethod
    def _key(model_dir, adapter_dir, ids) -> tuple:
        return (str(model_dir), None if adapter_dir is None else str(adapter_dir), tuple(int(t) for t in ids))

    def many(self, model_dir: Path, pairs, max_new: int) -> list[list[int]]:
        """pairs: (adapter folder or None, prompt ids) -> PEFT's greedy tokens for each."""
        keys = [self._key(model_dir, a, ids) for a, ids in pairs]
        missing: dict = {}
        for k in keys:
            if len(self._memo.get(k, ())) < max_new:
                missing.setdefault(k[1], {})[k] = None
        for adapter_dir, ks in missing.items():
            ks = list(ks)
            outs = peft_greedy_many(Path(model_dir), None if adapter_dir is None else Path(adapter_dir),
                                    [list(k[2]) for k in ks], max_new)
            self._memo.update(zip(ks, outs))
        return [self._memo[k][:max_new] for k in keys]

    def __call__(self, model_dir: Path, adapter_dir: Path | None, ids, max_new: int) -> list[int]:
        return self.many(model_dir, [(adapter_dir, ids)], max_new)[0]


def tokenized_llama(tiny_models, tiny_adapters, folder, adapters=("a_all_r8", "b_attn_r4_rslora", "c_mlp_r16")):
    """A copy of the tiny Llama in `folder` with the byte-level tokenizer (a grammar or a text needs
    token texts), and its adapters under their first letters: (model folder, {letter: folder})."""
    import shutil
    model_dir = folder / "llama"
    shutil.copytree(tiny_models["llama"], model_dir)
    make_tiny_tokenizer(model_dir)
    return model_dir, {name[0]: tiny_adapters[("llama", name)] for name in adapters}
