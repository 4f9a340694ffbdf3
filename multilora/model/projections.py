"""The dtype of the base model's projection matrices (q, k, v, o, gate, up, down and the LM
head), apart from the activations' and the KV cache's.

    projection_dtype="float32":  the matrices in float32: the exact path (parity with PEFT).
    projection_dtype="bfloat16": the matrices in bfloat16, the sums kept in float32, the results
        back in the activations' dtype. Where multilora's bf16 GEMM runs (one CPU device whose CPU
        has AMX-BF16, AVX512-BF16 or AVX2 + FMA: kernels.bf16_gemm_isa), the matrices are packed
        for it (PackedBf16, mode "bfloat16-packed") and each layer's are read in place inside the
        layer scan; elsewhere they stay in their (L, K, N) layout and XLA's bf16 dot runs them.
        AMX, AVX512-BF16 and XLA round the activations to bfloat16 at each product; the AVX2
        path keeps them float32 and widens the weights in registers (half the bytes of float32
        weights, a float32 product on bf16-rounded weights).
    projection_dtype="auto" (the default): the dtype the user named for the engine; under the
        engine's dtype "auto" (multilora.model.precision), bfloat16 where the packed kernel runs
        on AMX, AVX512-BF16 or AVX2 + FMA (AUTO_BF16_ISAS: on each it is faster than float32,
        benchmarks/log/14-2026-12-04-bf16-projections-avx512bf16.md and, on an AVX2-only AMD
        EPYC, benchmarks/log/36-2026-12-06-avx2-host.md), else the activations' dtype. The
        environment variable MULTILORA_PROJECTION_DTYPE, when set, says what auto means under
        dtype auto (an explicit dtype is obeyed whatever it says).

    mode "int8-packed" (EngineConfig.quantization="int8" on one CPU device with multilora's
        kernels): a weight-only 8-bit base in GGUF's Q8_0 arithmetic. Each projection matrix and
        the LM head stored as int8 with one float32 scale per group of 32 rows of a column
        (kernels.quantize_q8), packed for gemm_q8 (PackedQuant) and read in place in the layer
        scan, widened and scaled in registers (a quarter of float32's bytes, half of bfloat16's).
    mode "int4-packed" (quantization="int4", the CPU kernels only): the projections in GGUF's
        Q4_0 arithmetic (kernels.quantize_q4: 4-bit values, a float32 scale per group of 32),
        the LM head at 8 bits (as llama.cpp keeps its output matrix at more bits than Q4_0).
    mode "int8" (EngineConfig.quantization="int8" elsewhere): a weight-only int8 base. Each projection
        matrix is stored as int8 with one float32 scale per output column (symmetric:
        scale = max |w| / 127 over the column), computed at load from the float checkpoint;
        the product runs over the int8 values widened to the activations' dtype, and the
        scale multiplies the sums. Half the bytes of bfloat16 (a quarter of float32) per
        decode step; the LM head and the embedding keep their dtype.

Everything else (norms, RoPE, attention, the residual stream, the adapters, the sampler) stays
in the engine's dtype.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp

from multilora import kernels

PROJECTION_DTYPES = ("auto", "float32", "bfloat16")
AUTO_ENV = "MULTILORA_PROJECTION_DTYPE"
# The bf16 GEMM's instruction sets (kernels.bf16_gemm_isa) on which auto means bfloat16: those
# measured faster than float32 at decode and prefill (AVX2: benchmarks/log/36).
AUTO_BF16_ISAS = ("avx2", "avx512-bf16", "amx")
# Those on which an auto adapter pool is bfloat16 beside packed projections: the LoRA kernels
# read bf16 rows there as fast as float32 ones. On AVX2 the widening costs more than the bytes
# save (a 64-row decode step with 8 adapters 158 against 152 ms, prefill 900 against 846: log 36).
AUTO_BF16_POOL_ISAS = ("avx512-bf16", "amx")
# The LayerWeights fields that are (in, out) projection matrices (the MLP's absent from a model
# whose every layer is a mixture of experts).
PROJECTIONS = ("wq_LDO", "wk_LDO", "wv_LDO", "wo_LOD", "w_gate_LDF", "w_up_LDF", "w_down_LFD")
# Qwen3-MoE's experts, (E, in, out) a layer: XLA's grouped matmul runs them (multilora.model.moe),
# in bfloat16 in both bfloat16 modes (never packed), and in the float dtype under int8.
EXPERTS = ("w_gate_LEDM", "w_up_LEDM", "w_down_LEMD")


def _present(layers, names):
    return [n for n in names if getattr(layers, n) is not None]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedBf16:
    """A stack of (L, K, N) matrices in the bf16 GEMM's tile layout (kernels.pack_bf16), with
    the number of output columns N and the instructions that multiply them (kernels.bf16_gemm_isa
    when packed: static, so that a program traced for one ISA is never reused for another);
    read in place at a layer index."""

    w_LJIRC: jax.Array
    n: int = dataclasses.field(metadata=dict(static=True))
    isa: str = dataclasses.field(default="", metadata=dict(static=True))

    def matmul(self, x_TK, layer, rows=None) -> jax.Array:
        """x_TK @ W[layer] (float32 sums of bfloat16 weights' products), in x's dtype; rows: x's
        rows from there on are padding, left out (zeros in the product; kernels.gemm_bf16)."""
        return kernels.gemm_bf16(x_TK, self.w_LJIRC, layer, self.n, self.isa or None, rows).astype(x_TK.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantInt8:
    """A stack of (L, K, N) matrices as int8 values and one float32 scale per output column
    (w ~= q * scale); the layer scan slices both leaves as it slices a plain stack."""

    q_LKN: jax.Array
    scale_LN: jax.Array

    def matmul(self, x_TK) -> jax.Array:
        """x_TK @ (q * scale) of one layer's slice (q (K, N), scale (N,)), in x's dtype: the int8
        values widened to x's dtype inside the product, the sums in float32, then scaled."""
        y = jnp.einsum("tk,kn->tn", x_TK, self.q_LKN.astype(x_TK.dtype), preferred_element_type=jnp.float32)
        return (y * self.scale_LN).astype(x_TK.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedQuant:
    """A stack of (L, K, N) matrices at `bits` (8: int8 values, GGUF's Q8_0 arithmetic; 4: 4-bit
    values, its Q4_0) with one float32 scale per group of 32 rows of a column
    (kernels.quantize_q8 / quantize_q4), in gemm_q8's / gemm_q4's column-block layout; read in
    place at a layer index, as PackedBf16 is."""

    q_LJKB: jax.Array
    s_LJGC: jax.Array
    n: int = dataclasses.field(metadata=dict(static=True))
    bits: int = dataclasses.field(default=8, metadata=dict(static=True))

    def matmul(self, x_TK, layer, rows=None) -> jax.Array:
        """x_TK @ W[layer] (float32 sums of the dequantized weights' products), in x's dtype;
        rows: x's rows from there on are padding (zeros in the product)."""
        gemm = kernels.gemm_q8 if self.bits == 8 else kernels.gemm_q4
        return gemm(x_TK, self.q_LJKB, self.s_LJGC, layer, self.n, rows).astype(x_TK.dtype)


QUANTIZED_BITS = {"int8": 8, "int4": 4}


def pack_quant(w_LKN: jax.Array, bits: int) -> PackedQuant:
    """Group-wise quantized and packed at `bits`, a layer at a time (the float32 temporaries are
    one layer's, not the model's)."""
    quantize, pack = (kernels.quantize_q8, kernels.pack_q8) if bits == 8 else (kernels.quantize_q4, kernels.pack_q4)
    parts = [pack(*quantize(w_LKN[i:i + 1])) for i in range(w_LKN.shape[0])]
    q, s = (parts[0] if len(parts) == 1 else
            (jnp.concatenate([p[0] for p in parts]), jnp.concatenate([p[1] for p in parts])))
    return PackedQuant(q, s, int(w_LKN.shape[-1]), bits)


def quantized_mode(quantization: str, like: jax.Array) -> str:
    """What a quantization runs for arrays placed like `like`: "int8-packed" / "int4-packed"
    (group-wise, through multilora's gemm_q8 / gemm_q4) on one CPU device whose kernels run
    them; elsewhere "int8" (one scale per output column, XLA's product: an accelerator's path).
    int4 has no path but the CPU kernels' (ValueError saying so)."""
    if quantization not in QUANTIZED_BITS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZED_BITS)}")
    if _one_cpu_device(like) and kernels.quant_gemm_available():
        return f"{quantization}-packed"
    if quantization == "int8":
        return "int8"
    raise ValueError("quantization int4 runs through multilora's CPU kernels (one CPU device, AVX2 + FMA), "
                     f"not here ({kernels.unavailable_reason() or 'the model is not on one CPU device'}); "
                     "use int8")


def quantize_int8(w_LKN: jax.Array) -> QuantInt8:
    """Symmetric per-output-column int8: scale = max |w| / 127 over K (1 where a column is all
    zeros), q = round(w / scale); every |w - q * scale| <= scale / 2."""
    w32 = w_LKN.astype(jnp.float32)
    amax_LN = jnp.max(jnp.abs(w32), axis=-2)
    scale_LN = jnp.where(amax_LN > 0, amax_LN / 127.0, 1.0)
    q = jnp.clip(jnp.round(w32 / scale_LN[..., None, :]), -127, 127).astype(jnp.int8)
    return QuantInt8(q, scale_LN)


def pack(w_LKN: jax.Array) -> PackedBf16:
    return PackedBf16(kernels.pack_bf16(w_LKN), int(w_LKN.shape[-1]), kernels.bf16_gemm_isa())


def packed_usable(w: jax.Array) -> bool:
    """Whether the packed bf16 GEMM can serve this array: on one CPU device, the kernel built
    with AMX-BF16, AVX512-BF16 or AVX2 + FMA (kernels.bf16_gemm_isa)."""
    return _one_cpu_device(w) and bool(kernels.bf16_gemm_isa())


def _one_cpu_device(w: jax.Array) -> bool:
    devices = w.sharding.device_set
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def auto_dtype(isa: str, dtype) -> str:
    """What projection_dtype="auto" means beside a bf16 GEMM on `isa` ("" where none runs):
    bfloat16 on AUTO_BF16_ISAS, else the engine's dtype (its name)."""
    return "bfloat16" if isa in AUTO_BF16_ISAS else jnp.dtype(dtype).name


def resolve(projection_dtype: str, dtype, like: jax.Array, implied=None) -> str:
    """What the engine runs: "float32", "bfloat16" (XLA's layout) or "bfloat16-packed",
    for arrays placed like `like`, activations of `dtype`. implied: the dtype the user named for
    the engine (None where it was "auto"), which is what projection_dtype auto means then: an
    explicit float32 runs float32 projections (multilora.model.precision). Raises ValueError on
    an unknown projection_dtype."""
    if projection_dtype not in PROJECTION_DTYPES:
        raise ValueError(f"unknown projection_dtype {projection_dtype!r}; choose one of {', '.join(PROJECTION_DTYPES)}")
    if projection_dtype == "auto" and implied is not None:
        projection_dtype = jnp.dtype(implied).name
        if projection_dtype not in PROJECTION_DTYPES[1:]:  # float16 keeps its dtype
            return projection_dtype
    if projection_dtype == "auto":
        env = os.environ.get(AUTO_ENV, "").strip().lower()
        if env:
            if env not in PROJECTION_DTYPES[1:]:
                raise ValueError(f"{AUTO_ENV}={env!r}: choose one of {', '.join(PROJECTION_DTYPES[1:])}")
            projection_dtype = env
        else:
            projection_dtype = auto_dtype(kernels.bf16_gemm_isa() if _one_cpu_device(like) else "", dtype)
            if projection_dtype not in PROJECTION_DTYPES[1:]:  # float16 models keep their dtype
                return projection_dtype
    if projection_dtype == "bfloat16" and packed_usable(like):
        return "bfloat16-packed"
    return projection_dtype


def describe(precision, like: jax.Array) -> tuple[int, str]:
    """(logging level, message) that the engine logs about its arithmetic (a
    multilora.model.precision.Precision): a warning where the activations are bfloat16 or float16
    on one CPU device. XLA runs those dtypes' arithmetic there far slower than float32 (a 16-row
    decode step of the embedded model: 382 ms against 78 ms, benchmarks/log/35), while dtype auto
    reads bfloat16 weights through multilora's own GEMM kernel with float32 activations."""
    msg = precision.describe()
    if precision.activations in ("bfloat16", "float16") and _one_cpu_device(like):
        return logging.WARNING, (f"{msg}. {precision.activations} activations on a CPU run XLA's "
                                 f"{precision.activations} arithmetic, several times slower than float32 "
                                 "here: for bfloat16 weights at speed use dtype auto (float32 activations, "
                                 "bfloat16 projections through multilora's kernel)")
    return logging.INFO, msg


def lora_pool_dtype(lora_dtype: str, dtype, projection_mode: str = "", lora_backend: str = "auto",
                    isa: str | None = None):
    """The adapter pool's dtype: lora_dtype when given; auto: bfloat16 beside packed bfloat16
    projections (projection_mode "bfloat16-packed": one CPU device with multilora's kernels, which
    read bf16 rows exactly widened and write them in place) when the LoRA backend is auto or
    native and the kernels run on AUTO_BF16_POOL_ISAS (`isa`, kernels.bf16_gemm_isa() when
    None), else the engine's dtype. A bf16 pool halves the bytes each adapter costs a decode
    step and in memory (twice the adapters per GB); the float32 path stays the exact one."""
    if lora_dtype not in PROJECTION_DTYPES:
        raise ValueError(f"unknown lora_dtype {lora_dtype!r}; choose one of {', '.join(PROJECTION_DTYPES)}")
    if lora_dtype != "auto":
        return jnp.dtype(lora_dtype)
    if projection_mode == "bfloat16-packed" and lora_backend in ("auto", "native"):
        if (kernels.bf16_gemm_isa() if isa is None else isa) in AUTO_BF16_POOL_ISAS:
            return jnp.dtype(jnp.bfloat16)
    return jnp.dtype(dtype)


def convert(weights, mode: str):
    """The Weights with their projection matrices (and an untied LM head, or a copy of the tied
    embedding as the head) in the form `mode` (resolve's answer) names; other arrays untouched.
    A tied embedding keeps its float32 table for the token lookup."""
    layers = weights.layers
    if mode in ("float32", "float16"):
        change = {n: getattr(layers, n).astype(mode) for n in _present(layers, PROJECTIONS + EXPERTS)
                  if getattr(layers, n).dtype != mode}
        return dataclasses.replace(weights, layers=dataclasses.replace(layers, **change)) if change else weights
    if mode == "bfloat16":
        change = {n: getattr(layers, n).astype(jnp.bfloat16) for n in _present(layers, PROJECTIONS + EXPERTS)}
        head = weights.lm_head_DV.astype(jnp.bfloat16) if weights.lm_head_DV is not None else None
        return dataclasses.replace(weights, layers=dataclasses.replace(layers, **change), lm_head_DV=head)
    if mode == "int8":  # a layer at a time: the float32 temporaries are one layer's, not the model's
        change = {n: _quantize_layers(getattr(layers, n)) for n in _present(layers, PROJECTIONS)}
        return dataclasses.replace(weights, layers=dataclasses.replace(layers, **change))
    if mode in ("int8-packed", "int4-packed"):  # the LM head at 8 bits (a tied embedding keeps its table)
        bits = QUANTIZED_BITS[mode.split("-")[0]]
        change = {n: pack_quant(getattr(layers, n), bits) for n in _present(layers, PROJECTIONS)}
        head_DV = weights.lm_head_DV if weights.lm_head_DV is not None else weights.embed_VD.T
        return dataclasses.replace(weights, layers=dataclasses.replace(layers, **change),
                                   lm_head_DV=pack_quant(head_DV[None], 8))
    if mode != "bfloat16-packed":
        raise ValueError(f"unknown projection mode {mode!r}")
    change = {n: pack(getattr(layers, n)) for n in _present(layers, PROJECTIONS)}
    change.update({n: getattr(layers, n).astype(jnp.bfloat16) for n in _present(layers, EXPERTS)})
    head_DV = weights.lm_head_DV if weights.lm_head_DV is not None else weights.embed_VD.T
    return dataclasses.replace(weights, layers=dataclasses.replace(layers, **change),
                               lm_head_DV=pack(head_DV[None]))


def _quantize_layers(w_LKN: jax.Array) -> QuantInt8:
    parts = [quantize_int8(w_LKN[i:i + 1]) for i in range(w_LKN.shape[0])]
    if len(parts) == 1:
        return parts[0]
    return QuantInt8(jnp.concatenate([p.q_LKN for p in parts]), jnp.concatenate([p.scale_LN for p in parts]))
