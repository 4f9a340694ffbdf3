"""Hugging Face checkpoint folder (config.json + safetensors, one file or index-sharded, fp32 or
bf16) -> Weights placed on the mesh through the sharding rules."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from multilora.config import ModelConfig
from multilora.model.llama import LayerWeights, Weights
from multilora.model.sharding import WEIGHT_AXES, dataclass_shardings, make_mesh, put, rules_for

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# LayerWeights field -> (HF name under model.layers.{i}., transpose to (in, out)?)
_LAYER_MAP = {
    "attn_norm_LD": ("input_layernorm.weight", False),
    "wq_LDO": ("self_attn.q_proj.weight", True),
    "wk_LDO": ("self_attn.k_proj.weight", True),
    "wv_LDO": ("self_attn.v_proj.weight", True),
    "wo_LOD": ("self_attn.o_proj.weight", True),
    "mlp_norm_LD": ("post_attention_layernorm.weight", False),
    "w_gate_LDF": ("mlp.gate_proj.weight", True),
    "w_up_LDF": ("mlp.up_proj.weight", True),
    "w_down_LFD": ("mlp.down_proj.weight", True),
}
_BIAS_MAP = {
    "bq_LO": "self_attn.q_proj.bias",
    "bk_LO": "self_attn.k_proj.bias",
    "bv_LO": "self_attn.v_proj.bias",
}
_O_BIAS = ("bo_LD", "self_attn.o_proj.bias")


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    return dtype


class _TensorIndex:
    """name -> file over one model.safetensors or an index-sharded set."""

    def __init__(self, model_dir: Path):
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: model_dir / f for name, f in weight_map.items()}
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors weights in model folder {str(model_dir)!r}")
            self.files = {}
            for f in files:
                with safe_open(f, "numpy") as h:
                    for name in h.keys():
                        self.files[name] = f
        self._open: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> np.ndarray:
        if name not in self.files:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        f = self.files[name]
        if f not in self._open:
            self._open[f] = safe_open(f, "numpy").__enter__()
        return self._open[f].get_tensor(name)

    def close(self):
        for h in self._open.values():
            h.__exit__(None, None, None)
        self._open.clear()


class Progress:
    """A small stderr progress bar; quiet when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.enabled = total, desc, enabled
        self.n, self.t0, self._last = 0, time.time(), 0.0

    def update(self, k: int = 1):
        self.n += k
        now = time.time()
        if self.enabled and (now - self._last > 0.2 or self.n >= self.total):
            self._last = now
            frac = self.n / max(self.total, 1)
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r{self.desc}: [{bar:<30}] {self.n}/{self.total} {now - self.t0:5.1f}s")
            if self.n >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def load_weights(model_dir: str | Path, cfg: ModelConfig | None = None, dtype="float32",
                 mesh=None, progress: bool = False) -> tuple[ModelConfig, Weights]:
    model_dir = Path(model_dir)
    cfg = cfg or ModelConfig.from_dir(model_dir)
    dt = resolve_dtype(dtype)
    mesh = mesh or make_mesh(1)
    idx = _TensorIndex(model_dir)
    biases = dict(_BIAS_MAP) if cfg.attention_bias else {}
    if cfg.o_proj_bias:
        biases[_O_BIAS[0]] = _O_BIAS[1]
    bar = Progress(len(_LAYER_MAP) + len(biases) + 3, "loading weights", progress)

    def host(name: str, transpose: bool = False, shape=None) -> np.ndarray:
        a = idx.get(name)
        if transpose:
            a = a.T
        if shape is not None and tuple(a.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(a.shape)}, config.json implies {tuple(shape)}")
        return np.asarray(a, dtype=np.float32) if a.dtype != np.float32 else a

    def stacked(suffix: str, transpose: bool) -> np.ndarray:
        out = np.stack([host(f"model.layers.{i}.{suffix}", transpose) for i in range(cfg.num_layers)])
        bar.update()
        return out

    try:
        host_layers = {f: stacked(n, t) for f, (n, t) in _LAYER_MAP.items()}
        host_layers.update({f: stacked(n, False) for f, n in biases.items()})
        d, f_ = cfg.hidden_size, cfg.intermediate_size
        expect = {"wq_LDO": (d, cfg.q_dim), "wk_LDO": (d, cfg.kv_dim), "wv_LDO": (d, cfg.kv_dim),
                  "wo_LOD": (cfg.q_dim, d), "w_gate_LDF": (d, f_), "w_up_LDF": (d, f_), "w_down_LFD": (f_, d)}
        for name, shape in expect.items():
            if host_layers[name].shape[1:] != shape:
                raise ValueError(f"{name} has shape {host_layers[name].shape[1:]}, config.json implies {shape}")
        embed = host("model.embed_tokens.weight", shape=(cfg.vocab_size, d))
        bar.update()
        final_norm = host("model.norm.weight", shape=(d,))
        bar.update()
        lm_head = None
        if not cfg.tie_word_embeddings:
            if "lm_head.weight" not in idx:
                raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
            lm_head = host("lm_head.weight", transpose=True, shape=(d, cfg.vocab_size))
        bar.update()
    finally:
        idx.close()
    host_w = Weights(embed_VD=embed, layers=LayerWeights(**host_layers), final_norm_D=final_norm,
                     lm_head_DV=lm_head)
    return cfg, place_weights(host_w, cfg, mesh, dt)


def place_weights(host_w: Weights, cfg: ModelConfig, mesh, dtype) -> Weights:
    """Host arrays -> device arrays in `dtype`, sharded by the rules table."""
    shardings = dataclass_shardings(host_w, WEIGHT_AXES, mesh, rules_for(cfg, mesh))
    return jax.tree.map(lambda a, s: put(np.asarray(a).astype(dtype), s), host_w, shardings)
