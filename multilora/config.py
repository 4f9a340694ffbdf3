"""Frozen, hashable configs: the model's (read from a Hugging Face config.json) and the LoRA limits.

They are hashable so that jit can take them as static arguments.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path
from typing import Any, Optional

from multilora.errors import UnsupportedModelError
from multilora.rope_scaling import RopeScaling, gemma3_rope, parse_rope_scaling

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "qwen3_moe")
_ARCH_OF_TYPE = dict(zip(SUPPORTED_MODEL_TYPES, SUPPORTED_ARCHITECTURES))

# The projections a LoRA adapter may target, in the order the model applies them.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Qwen3-MoE's router (mlp.gate: hidden -> experts) and its experts as PEFT adapts them
# (target_parameters on transformers 5's fused expert tensors): one LoRA per expert on
# gate_up_proj (gate and up stacked) and on down_proj.
ROUTER_LORA_MODULE = "gate"
EXPERT_LORA_MODULES = ("experts.gate_up_proj", "experts.down_proj")
ALL_LORA_MODULES = LORA_MODULES + (ROUTER_LORA_MODULE,) + EXPERT_LORA_MODULES

# The adapter slot meaning "base model only" (its buffers are zeros). Defined here, in a module
# without jax, so that the host bookkeeping (adapters/registry.py) can use it without importing jax.
NO_ADAPTER = 0


class LoRAType(enum.Enum):
    """The two halves of a LoRA delta, as PEFT names them (lora_A, lora_B)."""

    A = "A"  # shrink: in_features -> rank
    B = "B"  # expand: rank -> out_features


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q, k and v (Qwen2; Llama with attention_bias)
    o_proj_bias: bool = False     # and on o_proj (Llama with attention_bias; never Qwen2)
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    global_layers: tuple[int, ...] = ()  # layers that attend to every key despite sliding_window
    qk_norm: bool = False         # RMSNorm over each head's q and k before RoPE (Qwen3)
    # Gemma 2: RMSNorm weights applied as (1 + w); norms after attention and after the MLP too
    # (on their outputs, before the residual add); GELU (tanh) in place of SiLU; the embedding
    # times sqrt(hidden_size); attention scores scaled by query_pre_attn_scalar ** -0.5 instead
    # of head_dim ** -0.5; attention scores and final logits soft-capped: cap * tanh(x / cap).
    gemma_norms: bool = False
    hidden_act: str = "silu"
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 3: the sliding-window layers' own RoPE base (no scaling); None: every layer rope_theta's
    local_rope_theta: float | None = None
    # Qwen3-MoE: the layers in moe_layers replace the MLP by num_experts SwiGLU experts of width
    # moe_intermediate_size, num_experts_per_tok of them per token, picked by a router (softmax in
    # float32, top-k, renormalised when norm_topk_prob); the other layers keep the dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()

    @property
    def layer_sparse(self) -> tuple[bool, ...]:
        """Whether each layer's MLP is the sparse mixture of experts (Qwen3-MoE's moe_layers)."""
        return tuple(i in self.moe_layers for i in range(self.num_layers))

    @property
    def has_dense_mlp(self) -> bool:
        """Whether any layer runs the dense MLP (every layer but a mixture-of-experts one)."""
        return len(self.moe_layers) < self.num_layers

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: it attends to every earlier key)."""
        return tuple(None if i in self.global_layers else self.sliding_window for i in range(self.num_layers))

    def expert_dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of one expert's projection (EXPERT_LORA_MODULES)."""
        d, m = self.hidden_size, self.moe_intermediate_size
        return {"experts.gate_up_proj": (d, 2 * m), "experts.down_proj": (m, d)}[module]

    def module_dims(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection, as a LoRA adapter must match them; an
        expert module's are every expert's side by side (E times expert_dims: how a rank row of
        its pool holds them)."""
        if module in EXPERT_LORA_MODULES:
            i, o = self.expert_dims(module)
            return self.num_experts * i, self.num_experts * o
        d, f = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (d, self.q_dim),
            "k_proj": (d, self.kv_dim),
            "v_proj": (d, self.kv_dim),
            "o_proj": (self.q_dim, d),
            "gate_proj": (d, f),
            "up_proj": (d, f),
            "down_proj": (f, d),
            ROUTER_LORA_MODULE: (d, self.num_experts),
        }[module]

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        arch = archs[0] if archs else ""
        known = arch in SUPPORTED_ARCHITECTURES if arch else model_type in SUPPORTED_MODEL_TYPES
        if not known:
            raise UnsupportedModelError(
                f"unsupported architecture {arch or model_type!r}; multilora supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_type {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        arch = arch or _ARCH_OF_TYPE[model_type]
        gemma = arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
        gemma3 = arch == "Gemma3ForCausalLM"
        # Gemma 2/3's MLP reads hidden_activation alone (a hidden_act beside it is never used)
        act = (cfg.get("hidden_activation") or "gelu_pytorch_tanh") if gemma else cfg.get("hidden_act", "silu")
        acts = ("gelu_pytorch_tanh", "gelu_tanh") if gemma else ("silu", "swish")
        if act not in acts:
            raise UnsupportedModelError(f"unsupported hidden_act {act!r} for {arch}; supported: {', '.join(acts)}")
        if cfg.get("use_bidirectional_attention"):
            raise UnsupportedModelError("use_bidirectional_attention=true is not supported (causal LMs only)")
        if cfg.get("mlp_bias") and arch == "LlamaForCausalLM":  # the other families' MLPs never read it
            raise UnsupportedModelError("mlp_bias=true is not supported (MLPs without biases only: mlp_bias=false)")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # Qwen3's and Gemma's config classes default head_dim to 128 and 256, not hidden / heads
        head_dim = cfg.get("head_dim") or {"Qwen3ForCausalLM": 128, "Gemma2ForCausalLM": 256,
                                           "Gemma3ForCausalLM": 256}.get(arch, hidden // num_heads)
        num_kv = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv:
            raise UnsupportedModelError(
                f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}")
        if gemma3:
            rope_theta, rope_scaling, local_theta = gemma3_rope(cfg)
        else:
            rope_scaling = parse_rope_scaling(cfg.get("rope_scaling") or cfg.get("rope_parameters"), cfg)
            rope_theta, local_theta = cfg.get("rope_theta"), None
            if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):
                rope_theta = cfg["rope_parameters"].get("rope_theta")
        # as transformers builds each family's attention: Qwen2's q/k/v always carry biases (o never),
        # Mistral's no projection does, the others follow attention_bias (q/k/v and o alike)
        attention_bias = {"Qwen2ForCausalLM": True, "MistralForCausalLM": False}.get(
            arch, bool(cfg.get("attention_bias", False)))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding, global_layers = _sliding_window(cfg, arch, int(cfg["num_hidden_layers"]))
        moe = _moe_fields(cfg, int(cfg["num_hidden_layers"])) if arch == "Qwen3MoeForCausalLM" else {}
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and arch != "Qwen2ForCausalLM",
            architecture=arch,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=sliding,
            global_layers=global_layers,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
            gemma_norms=gemma,
            hidden_act="gelu_tanh" if gemma else "silu",
            embed_scale=gemma,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)) if gemma else None,
            # Gemma 2 caps scores by default; Gemma 3 never does: its config keeps the field, but
            # transformers' Gemma 3 attention does not apply it (QK norms took its place)
            attn_logit_softcapping=_optional_float(cfg.get("attn_logit_softcapping", 50.0))
            if gemma and not gemma3 else None,
            final_logit_softcapping=_optional_float(cfg.get("final_logit_softcapping", None if gemma3 else 30.0))
            if gemma else None,
            local_rope_theta=local_theta,
            **moe,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        p = Path(path) / "config.json"
        if not p.is_file():
            raise FileNotFoundError(f"no config.json in model folder {str(path)!r}")
        return cls.from_hf_dict(json.loads(p.read_text()))


def _moe_fields(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Qwen3-MoE's expert fields, as transformers' Qwen3MoeConfig reads them (num_experts is
    saved as num_local_experts by transformers 5): a layer is sparse unless it is in
    mlp_only_layers, when num_experts > 0 and (i + 1) % decoder_sparse_step == 0."""
    experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 128)))
    top_k = int(cfg.get("num_experts_per_tok", 8))
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or ())
    if experts < 0 or step < 1:
        raise UnsupportedModelError(f"num_experts={experts} and decoder_sparse_step={step} must be "
                                    "non-negative and positive")
    sparse = tuple(i for i in range(num_layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    if sparse and not 1 <= top_k <= experts:
        raise UnsupportedModelError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={experts}")
    if cfg.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("a shared expert (shared_expert_intermediate_size, Qwen2-MoE's) is not "
                                    "supported; Qwen3-MoE has none")
    return dict(num_experts=experts if sparse else 0, num_experts_per_tok=top_k if sparse else 0,
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", 768)) if sparse else 0,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=sparse)


def _optional_float(x) -> float | None:
    return None if x is None else float(x)


def _sliding_window(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(the window, the layers without it), as transformers reads the config: Mistral's window on
    every layer; Qwen2/Qwen3's (use_sliding_window) on the layers `layer_types` marks, by default
    those from max_window_layers on; Gemma 2's on the layers `layer_types` marks, by default every
    other layer from layer 0; Gemma 3's likewise, by default all but every sliding_window_pattern-th
    (6); Qwen3-MoE's on every layer with use_sliding_window; Llama's nowhere (transformers' Llama
    has no sliding window)."""
    window = cfg.get("sliding_window")
    if arch == "MistralForCausalLM":  # transformers' Mistral has no use_sliding_window: a config's is ignored
        return (int(window) if window else None), ()
    if arch == "Qwen3MoeForCausalLM":  # transformers' Qwen3-MoE: the window on every layer, or none
        return (int(window) if cfg.get("use_sliding_window", False) and window else None), ()
    if arch == "Gemma2ForCausalLM":
        window = cfg.get("sliding_window", 4096)
        default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    elif arch == "Gemma3ForCausalLM":
        window = cfg.get("sliding_window", 4096)
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window", False):
        default = ["sliding_attention" if i >= int(cfg.get("max_window_layers", 28)) else "full_attention"
                   for i in range(num_layers)]
    else:
        return None, ()
    types = cfg.get("layer_types") or default
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if len(types) != num_layers or unknown:
        raise UnsupportedModelError(f"layer_types must name each of the {num_layers} layers "
                                    f"'sliding_attention' or 'full_attention', got {types!r}")
    if not window or "sliding_attention" not in types:
        return None, ()
    return int(window), tuple(i for i, t in enumerate(types) if t == "full_attention")


# The adapter pool (multilora.adapters.pool) hands out rank rows in aligned pages of this many: an
# adapter of rank r holds ceil(r / PAGE_ROWS) pages, and a backend gathers a page as one slice.
PAGE_ROWS = 8


def round_to_pages(rank: int) -> int:
    return -(-rank // PAGE_ROWS) * PAGE_ROWS


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Device-side LoRA limits: how many adapters one batch may use, the widest rank accepted,
    and the pool's rank rows (multilora.adapters.pool): each adapter takes its rank's pages."""

    max_loras_per_batch: int = 8
    max_lora_rank: int = 64
    pool_rows: Optional[int] = None  # rank rows for adapters; None: every slot at max_lora_rank
    target_modules: tuple[str, ...] = LORA_MODULES

    @property
    def num_slots(self) -> int:
        """Slot 0 is "no adapter" (all zeros), so there is one more slot than adapters."""
        return self.max_loras_per_batch + 1

    @property
    def table_width(self) -> int:
        """Entries in a slot's row table: max_lora_rank in whole pages."""
        return round_to_pages(self.max_lora_rank)

    @property
    def adapter_rows(self) -> int:
        """Rows for adapters, in whole pages."""
        rows = self.max_loras_per_batch * self.table_width if self.pool_rows is None else self.pool_rows
        return rows // PAGE_ROWS * PAGE_ROWS

    @property
    def num_rows(self) -> int:
        """Page 0 is all zeros (what table entries past an adapter's pages read): one page more."""
        return self.adapter_rows + PAGE_ROWS


SPECULATIVE_METHODS = ("ngram", "draft_model")
# The never-a-loss rule's default (SpeculativeConfig.max_step_tokens): up to this many tokens a
# step of SmolLM2-135M took about the time of a one-token step on the 2-core CPU machine, 1.1-1.3x
# at 16, 1.2-1.6x at 32 (docs/engine.md, "Speculative decoding"; not measured on a TPU yet).
SPECULATIVE_STEP_TOKENS = 8


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, with vLLM's names: `method` "ngram" (prompt lookup: the tokens that
    followed the last earlier occurrence of the sequence's last n tokens, n from
    prompt_lookup_max down to prompt_lookup_min) or "draft_model" (`model`: the folder of a
    smaller model with the target's vocabulary, whose greedy tokens are the drafts) drafts up to
    num_speculative_tokens tokens per decode row, verified in one step. The never-a-loss rule:
    drafts are added only while the step, drafts included, computes at most max_step_tokens
    tokens, and (vLLM's disable_by_batch_size) not in a step of at least that many sequences."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: Optional[int] = None   # None: prompt_lookup_min, else 5 (vLLM's defaults)
    prompt_lookup_min: Optional[int] = None   # None: prompt_lookup_max, else 5
    max_step_tokens: int = SPECULATIVE_STEP_TOKENS
    disable_by_batch_size: Optional[int] = None
    model: Optional[str] = None               # draft_model: the draft's folder (HF layout)

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: method 'draft_model' takes the draft's folder as `model`, "
                             f"and only it does (method {self.method!r}, model {self.model!r})")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative_config: model must be a folder's path, got {self.model!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        for name, low in (("num_speculative_tokens", 1), ("prompt_lookup_min", 1), ("prompt_lookup_max", 1),
                          ("max_step_tokens", 2)):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < low:
                raise ValueError(f"speculative_config: {name} must be an integer >= {low}, got {val!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be "
                             f"<= prompt_lookup_max ({self.prompt_lookup_max})")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be None or an integer >= 1, got {b!r}")

    @classmethod
    def parse(cls, value: Any) -> Optional["SpeculativeConfig"]:
        """From a SpeculativeConfig, a dict, its JSON text (the command line's) or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object (a dict), got {type(value).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}; "
                             f"allowed: {', '.join(known)}")
        return cls(**value)


def check_target_itl_ms(value) -> None:
    """target_itl_ms must be None (derived), 0 (off) or a number of milliseconds > 0."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"target_itl_ms must be a number of milliseconds > 0, 0 (off: max_num_batched_tokens "
                         f"alone) or None (derived from measured step costs), got {value!r}")


# EngineConfig.dtype's names (multilora.model.precision says what each runs; the CLI lists these)
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# EngineConfig.lora_backend's names (multilora.lora.backend holds each one's class; the CLI lists these)
LORA_BACKEND_CHOICES = ("auto", "bgmv", "sgmv", "dense", "native", "pallas", "reference")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything an Engine is built with besides the model and its adapters: one object that
    the CLI, the server and Python callers fill (multilora.cli.args maps it to command-line flags).
    None means "derived": see the field comments."""

    # adapters
    max_loras_per_batch: Optional[int] = None  # adapter slots (0: LoRA disabled); None: max_num_seqs
    max_lora_rank: Optional[int] = None   # None: the largest rank given at start, at least 16
    lora_memory_gb: Optional[float] = None  # device memory for the pool's rank rows; None: 2 GB (CPU) or 5 %
    max_loaded_loras: Optional[int] = None  # host copies kept (LRU); None: bounded by memory only
    lora_host_memory_gb: float = 4.0      # host copies kept (LRU) within this many GB
    lora_backend: str = "auto"
    # model and memory
    dtype: str = "auto"                   # activations, projections, adapter pool; auto: the platform's fastest (multilora.model.precision)
    projection_dtype: str = "auto"         # the projection matrices' dtype (multilora.model.projections)
    quantization: Optional[str] = None     # "int8" / "int4": a weight-only 8- / 4-bit base (multilora.model.projections)
    lora_dtype: str = "auto"               # the adapter pool's dtype; auto: bf16 beside packed bf16 projections, else dtype (projections.lora_pool_dtype)
    max_model_len: Optional[int] = None   # None: the model's max_position_embeddings
    page_size: int = 16
    num_pages: Optional[int] = None       # None: from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    enable_prefix_caching: bool = True
    # batching
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_prefill_seqs: int = 16
    # each step's prefill tokens budgeted so that a decode step stays within this many ms
    # (multilora.engine.step_budget); None: derived from measured step costs; 0: off
    target_itl_ms: Optional[float] = None
    async_scheduling: Optional[bool] = None  # plan the next step while one runs; None: on an accelerator
    # placement and the rest
    tensor_parallel_size: int = 1
    seed: int = 0
    compilation_cache_dir: Optional[str] = None  # None: $MULTILORA_COMPILATION_CACHE or ~/.cache
    # speculative decoding (a dict, JSON text or SpeculativeConfig; None: off)
    speculative_config: Optional[SpeculativeConfig] = None

    def __post_init__(self):
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_seqs", "page_size",
                     "tensor_parallel_size"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive integer, got {val!r}")
        if self.max_lora_rank is not None and (not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 1):
            raise ValueError(f"max_lora_rank must be a positive integer or None, got {self.max_lora_rank!r}")
        if self.max_loras_per_batch is not None and (
                not isinstance(self.max_loras_per_batch, int) or isinstance(self.max_loras_per_batch, bool)
                or self.max_loras_per_batch < 0):
            raise ValueError(f"max_loras_per_batch must be an integer >= 0 or None (sized by "
                             f"lora_memory_gb), got {self.max_loras_per_batch!r}")
        for name in ("lora_memory_gb", "lora_host_memory_gb"):
            val = getattr(self, name)
            if val is not None and not (isinstance(val, (int, float)) and not isinstance(val, bool) and val > 0):
                raise ValueError(f"{name} must be a number of GB > 0, got {val!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.projection_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"projection_dtype must be auto, float32 or bfloat16, got {self.projection_dtype!r}")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization must be None, 'int8' or 'int4', got {self.quantization!r}")
        if self.quantization is not None and self.projection_dtype != "auto":
            raise ValueError(f"quantization={self.quantization!r} sets the projections' form: "
                             f"leave projection_dtype auto (got {self.projection_dtype!r})")
        if self.lora_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"lora_dtype must be auto, float32 or bfloat16, got {self.lora_dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
        check_target_itl_ms(self.target_itl_ms)
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"async_scheduling must be True, False or None (on with an accelerator), "
                             f"got {self.async_scheduling!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes) -> "EngineConfig":
        unknown = set(changes) - set(self.field_names())
        if unknown:
            raise TypeError(f"unknown engine option(s) {', '.join(sorted(unknown))}; "
                            f"EngineConfig has {', '.join(self.field_names())}")
        return dataclasses.replace(self, **changes)


def lora_pool_size(max_loras_per_batch: Optional[int], memory_given: bool, memory_bytes: int,
                   row_bytes: int, max_rank: int, max_num_seqs: int) -> tuple[int, int]:
    """(adapter slots, rank rows) of the device pool. Slots: max_loras_per_batch if given (0
    disables LoRA), else max_num_seqs (a batch never has more distinct adapters than sequences).
    Rows: as many as the memory budget holds (an adapter of rank r takes r), but no more than
    every slot at max_rank, which is also what a count given alone gets. The budget must hold
    one adapter of max_rank. Rows come in whole pages (PAGE_ROWS)."""
    if max_loras_per_batch == 0:
        return 0, 0
    slots = max_num_seqs if max_loras_per_batch is None else max_loras_per_batch
    full = slots * round_to_pages(max_rank)
    if max_loras_per_batch is not None and not memory_given:
        return slots, full
    rows = min(memory_bytes // max(row_bytes, 1), full) // PAGE_ROWS * PAGE_ROWS
    if rows < round_to_pages(max_rank):
        raise ValueError(f"lora_memory_gb={memory_bytes / 2**30:g} cannot hold one adapter of rank "
                         f"max_lora_rank={max_rank} ({max_rank * row_bytes / 2**20:.1f} MB); raise it, lower "
                         "max_lora_rank, or disable LoRA with max_loras_per_batch=0")
    return min(slots, rows // PAGE_ROWS), int(rows)
