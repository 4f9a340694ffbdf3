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
from multilora.model.arrays import ArrayInfo, arrays, shape_of
from multilora.model.llama import LayerWeights, Weights, embedding_rows_major
from multilora.model.sharding import dataclass_shardings, make_mesh, put, rules_for

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

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
    """Every array that Weights and LayerWeights declare (multilora.model.arrays) and this
    config has, read from its checkpoint tensor, checked against the shape config.json implies,
    stacked along L for per-layer arrays, then placed by the rules table."""
    model_dir = Path(model_dir)
    cfg = cfg or ModelConfig.from_dir(model_dir)
    dt = resolve_dtype(dtype)
    mesh = mesh or make_mesh(1)
    idx = _TensorIndex(model_dir)
    layer_arrays = [(n, a) for n, a in arrays(LayerWeights) if a.present(cfg)]
    top_arrays = [(n, a) for n, a in arrays(Weights) if a.present(cfg)]
    bar = Progress(len(layer_arrays) + len(top_arrays), "loading weights", progress)

    def host(name: str, info: ArrayInfo, shape: tuple[int, ...]) -> np.ndarray:
        if name not in idx and info.key == "lm_head.weight":
            raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
        a = idx.get(name)
        if info.transpose:
            a = a.T
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(a.shape)}, config.json implies {tuple(shape)}")
        return np.asarray(a, dtype=np.float32) if a.dtype != np.float32 else a

    def layer_host(i: int, info: ArrayInfo, shape: tuple[int, ...]) -> np.ndarray:
        if info.in_layers is not None and i not in info.in_layers(cfg):
            return np.zeros(shape, np.float32)
        if "{e}" not in info.key:
            return host(f"model.layers.{i}.{info.key}", info, shape)
        if f"model.layers.{i}.{info.key.format(e=0)}" not in idx:
            return _fused_experts(idx, i, info, shape)
        return np.stack([host(f"model.layers.{i}.{info.key.format(e=e)}", info, shape[1:]) for e in range(shape[0])])

    def read(info: ArrayInfo) -> np.ndarray:
        shape = shape_of(info, cfg)
        if info.axes[0] == "layers":
            out = np.stack([layer_host(i, info, shape[1:]) for i in range(cfg.num_layers)])
        else:
            out = host(info.key, info, shape)
        bar.update()
        return out

    try:
        layers = LayerWeights(**{n: read(a) for n, a in layer_arrays})
        host_w = Weights(layers=layers, **{n: read(a) for n, a in top_arrays})
    finally:
        idx.close()
    return cfg, place_weights(host_w, cfg, mesh, dt)


# An expert's tensor (mlp.experts.{e}.<name>.weight, what transformers' save_pretrained writes) ->
# the fused 3-D tensor holding every expert's (transformers' Qwen3MoeExperts in memory, (E, out, in)):
# its name and, for gate and up, which half of gate_up_proj's out features.
_FUSED_EXPERTS = {"mlp.experts.{e}.gate_proj.weight": ("mlp.experts.gate_up_proj", 0),
                  "mlp.experts.{e}.up_proj.weight": ("mlp.experts.gate_up_proj", 1),
                  "mlp.experts.{e}.down_proj.weight": ("mlp.experts.down_proj", None)}


def _fused_experts(idx: _TensorIndex, layer: int, info: ArrayInfo, shape: tuple[int, ...]) -> np.ndarray:
    """Layer `layer`'s experts (E, in, out) from a checkpoint that holds them fused."""
    name, half = _FUSED_EXPERTS[info.key]
    key = f"model.layers.{layer}.{name}"
    if key not in idx:
        raise KeyError(f"checkpoint has neither {f'model.layers.{layer}.{info.key}'.format(e=0)!r} "
                       f"(per expert) nor {key!r} (fused)")
    a = idx.get(key)
    if half is not None:
        if a.ndim != 3 or a.shape[1] % 2:
            raise ValueError(f"tensor {key!r} has shape {tuple(a.shape)}, expected (experts, 2 * "
                             "moe_intermediate_size, hidden_size)")
        a = a[:, :a.shape[1] // 2] if half == 0 else a[:, a.shape[1] // 2:]
    a = np.swapaxes(a, 1, 2)
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"tensor {key!r} gives experts of shape {tuple(a.shape)}, config.json implies {tuple(shape)}")
    return np.asarray(a, dtype=np.float32)


def place_weights(host_w: Weights, cfg: ModelConfig, mesh, dtype) -> Weights:
    """Host arrays -> device arrays in `dtype`, sharded by the rules table."""
    shardings = dataclass_shardings(host_w, mesh, rules_for(cfg, mesh))
    return embedding_rows_major(jax.tree.map(lambda a, s: put(np.asarray(a).astype(dtype), s), host_w, shardings))
