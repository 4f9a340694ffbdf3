"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 2/3, SmolLM2) as a pure
function of pytrees.

    forward(weights, lora, kv, batch, cfg, backend) -> (logits, kv)   [hidden=True: + x_TD]

Layers are stacked along a leading L axis and run under lax.scan (over groups of layers where
sliding-window and global layers alternate, each layer's window static: _scan_layers); the KV
cache rides in the scan carry and is updated in place (the runner donates it). One step packs decode rows and prefill
chunks together (see Batch); every projection adds its per-token LoRA delta through the backend,
and a step with no adapter row skips the LoRA ops (slot 0 adds nothing either way).

Legend: L layers, T tokens, D model dim, N/K query/kv heads, H head dim, F ffn dim, V vocab,
P pages, p page size, X the step's pages, Q logits rows, U adapter pool rows, O out features,
E experts, M an expert's ffn dim.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout

from multilora.config import ModelConfig
from multilora.kernels.attention_pallas import attention_plan, page_vmem_bytes, paged_attention
from multilora.kernels.kv_write_pallas import write_pages, write_rows
from multilora.lora.backend import get_backends
from multilora.lora.backend.base import PoolLayer
from multilora.lora.batch import NO_LORA, PER_TOKEN, LoRABatchInfo
from multilora.model import kv_lanes
from multilora.model.arrays import lora_pool, weight
from multilora.model.attention import (decode_attention, kv_page_writes, max_pages_written, prefill_attention,
                                       softcap_logits, write_kv, write_kv_pages)
from multilora.model.layers import (apply_rope, geglu_tanh, rms_norm, rope_attention_factor, rope_cos_sin,
                                    rope_inv_freq, swiglu)
from multilora.model.moe import ExpertLoRA, grouped_experts, select_experts
from multilora.model.packing import PackSpec, unpack
from multilora.model.projections import PackedBf16, PackedQuant, QuantInt8


def _has_qkv_bias(cfg: ModelConfig) -> bool:
    return cfg.attention_bias


def _has_o_bias(cfg: ModelConfig) -> bool:
    return cfg.o_proj_bias


def _has_qk_norm(cfg: ModelConfig) -> bool:
    return cfg.qk_norm


def _has_mlp_norm(cfg: ModelConfig) -> bool:
    return not cfg.gemma_norms


def _has_gemma_norms(cfg: ModelConfig) -> bool:
    return cfg.gemma_norms


def _untied(cfg: ModelConfig) -> bool:
    return not cfg.tie_word_embeddings


def _has_dense_mlp(cfg: ModelConfig) -> bool:
    return cfg.has_dense_mlp


def _dense_layers(cfg: ModelConfig) -> tuple[int, ...]:
    return tuple(i for i in range(cfg.num_layers) if i not in cfg.moe_layers)


def _has_experts(cfg: ModelConfig) -> bool:
    return bool(cfg.moe_layers)


def _moe_layers(cfg: ModelConfig) -> tuple[int, ...]:
    return cfg.moe_layers


# Each array is declared once, here (multilora.model.arrays): its logical axes (which give its
# shape and its sharding) and its checkpoint tensor (per layer, under "model.layers.{i}.").
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    """One entry per layer, stacked along L. Projections are stored (in, out). A Qwen3-MoE with
    both kinds of layer stacks the dense MLP and the experts over every layer, zeros in the
    layers of the other kind (memory spent only where a model mixes them: Qwen3-MoE's releases
    have every layer sparse)."""

    attn_norm_LD: jax.Array = weight(("layers", "embed"), "input_layernorm.weight")
    wq_LDO: jax.Array = weight(("layers", "embed", "q_out"), "self_attn.q_proj.weight", transpose=True)
    wk_LDO: jax.Array = weight(("layers", "embed", "kv_out"), "self_attn.k_proj.weight", transpose=True)
    wv_LDO: jax.Array = weight(("layers", "embed", "kv_out"), "self_attn.v_proj.weight", transpose=True)
    wo_LOD: jax.Array = weight(("layers", "q_out", "embed"), "self_attn.o_proj.weight", transpose=True)
    w_gate_LDF: Optional[jax.Array] = weight(("layers", "embed", "ffn"), "mlp.gate_proj.weight", transpose=True,
                                             present=_has_dense_mlp, in_layers=_dense_layers)
    w_up_LDF: Optional[jax.Array] = weight(("layers", "embed", "ffn"), "mlp.up_proj.weight", transpose=True,
                                           present=_has_dense_mlp, in_layers=_dense_layers)
    w_down_LFD: Optional[jax.Array] = weight(("layers", "ffn", "embed"), "mlp.down_proj.weight", transpose=True,
                                             present=_has_dense_mlp, in_layers=_dense_layers)
    # Qwen3-MoE's sparse layers (multilora.model.moe): the router and the experts' SwiGLU MLPs
    router_LDE: Optional[jax.Array] = weight(("layers", "embed", "experts"), "mlp.gate.weight", transpose=True,
                                             present=_has_experts, in_layers=_moe_layers)
    w_gate_LEDM: Optional[jax.Array] = weight(("layers", "experts", "embed", "moe_ffn"),
                                              "mlp.experts.{e}.gate_proj.weight", transpose=True,
                                              present=_has_experts, in_layers=_moe_layers)
    w_up_LEDM: Optional[jax.Array] = weight(("layers", "experts", "embed", "moe_ffn"),
                                            "mlp.experts.{e}.up_proj.weight", transpose=True,
                                            present=_has_experts, in_layers=_moe_layers)
    w_down_LEMD: Optional[jax.Array] = weight(("layers", "experts", "moe_ffn", "embed"),
                                              "mlp.experts.{e}.down_proj.weight", transpose=True,
                                              present=_has_experts, in_layers=_moe_layers)
    bq_LO: Optional[jax.Array] = weight(("layers", "q_out"), "self_attn.q_proj.bias", present=_has_qkv_bias)
    bk_LO: Optional[jax.Array] = weight(("layers", "kv_out"), "self_attn.k_proj.bias", present=_has_qkv_bias)
    bv_LO: Optional[jax.Array] = weight(("layers", "kv_out"), "self_attn.v_proj.bias", present=_has_qkv_bias)
    bo_LD: Optional[jax.Array] = weight(("layers", "embed"), "self_attn.o_proj.bias", present=_has_o_bias)
    q_norm_LH: Optional[jax.Array] = weight(("layers", "head_dim"), "self_attn.q_norm.weight", present=_has_qk_norm)
    k_norm_LH: Optional[jax.Array] = weight(("layers", "head_dim"), "self_attn.k_norm.weight", present=_has_qk_norm)
    # The MLP's input norm: Llama's post_attention_layernorm, Gemma 2's pre_feedforward_layernorm
    # (its post_attention_layernorm normalizes the attention's output).
    mlp_norm_LD: Optional[jax.Array] = weight(("layers", "embed"), "post_attention_layernorm.weight",
                                              present=_has_mlp_norm)
    pre_mlp_norm_LD: Optional[jax.Array] = weight(("layers", "embed"), "pre_feedforward_layernorm.weight",
                                                  present=_has_gemma_norms)
    post_attn_norm_LD: Optional[jax.Array] = weight(("layers", "embed"), "post_attention_layernorm.weight",
                                                    present=_has_gemma_norms)
    post_mlp_norm_LD: Optional[jax.Array] = weight(("layers", "embed"), "post_feedforward_layernorm.weight",
                                                   present=_has_gemma_norms)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed_VD: jax.Array = weight(("vocab", "embed"), "model.embed_tokens.weight")
    layers: LayerWeights
    final_norm_D: jax.Array = weight(("embed",), "model.norm.weight")
    lm_head_DV: Optional[jax.Array] = weight(("embed", "vocab"), "lm_head.weight", transpose=True,
                                             present=_untied)  # None: tied to embed_VD


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoRAWeights:
    """The adapters' pools of rank rows (multilora.adapters.pool), stacked along L: A rows in PEFT's
    layout (one rank x in row each), B rows transposed from PEFT's (one out row per rank).
    A slot's rows are LoRABatchInfo.rows_SR; row 0 is zeros. The q/k/v and gate/up A pools hold
    one block of U rows per projection (in the order of their modules)."""

    qkv_a_LUD: jax.Array = lora_pool(("layers", "lora_rows", "embed"), "a", "q_proj", "k_proj", "v_proj")
    q_b_LUO: jax.Array = lora_pool(("layers", "lora_rows", "q_out"), "b", "q_proj")
    k_b_LUO: jax.Array = lora_pool(("layers", "lora_rows", "kv_out"), "b", "k_proj")
    v_b_LUO: jax.Array = lora_pool(("layers", "lora_rows", "kv_out"), "b", "v_proj")
    o_a_LUO: jax.Array = lora_pool(("layers", "lora_rows", "q_out"), "a", "o_proj")
    o_b_LUD: jax.Array = lora_pool(("layers", "lora_rows", "embed"), "b", "o_proj")
    gate_up_a_LUD: jax.Array = lora_pool(("layers", "lora_rows", "embed"), "a", "gate_proj", "up_proj")
    gate_b_LUF: jax.Array = lora_pool(("layers", "lora_rows", "ffn"), "b", "gate_proj")
    up_b_LUF: jax.Array = lora_pool(("layers", "lora_rows", "ffn"), "b", "up_proj")
    down_a_LUF: jax.Array = lora_pool(("layers", "lora_rows", "ffn"), "a", "down_proj")
    down_b_LUD: jax.Array = lora_pool(("layers", "lora_rows", "embed"), "b", "down_proj")
    # Qwen3-MoE's router (mlp.gate) and experts (multilora.model.moe; no features in a model
    # without experts): an experts' rank row holds every expert's row side by side (E * X features)
    router_a_LUD: jax.Array = lora_pool(("layers", "lora_rows", "moe_embed"), "a", "gate")
    router_b_LUE: jax.Array = lora_pool(("layers", "lora_rows", "experts"), "b", "gate")
    experts_gate_up_a_LUY: jax.Array = lora_pool(("layers", "lora_rows", "experts_embed"), "a",
                                                 "experts.gate_up_proj")
    experts_gate_up_b_LUZ: jax.Array = lora_pool(("layers", "lora_rows", "experts_gate_up"), "b",
                                                 "experts.gate_up_proj")
    experts_down_a_LUY: jax.Array = lora_pool(("layers", "lora_rows", "experts_moe_ffn"), "a", "experts.down_proj")
    experts_down_b_LUZ: jax.Array = lora_pool(("layers", "lora_rows", "experts_embed"), "b", "experts.down_proj")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k_LPpKH: jax.Array
    v_LPpKH: jax.Array

    @property
    def page_size(self) -> int:
        return self.k_LPpKH.shape[2]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    """One step's packed tokens: decode rows and prefill chunks together. Padding tokens write to
    page 0 (reserved) and use slot 0.

    token_ids_T, positions_T: the tokens and their positions in their sequences.
    seq_idx_T:       which of the step's sequences a token belongs to (-1 for padding, which
                     comes after the step's own tokens). The sequences with one token this step
                     come first: row b is sequence b for b < num_decode.
    slot_mapping_T:  where each token's K/V is written (page * page_size + offset).
    kv_pages_X:      the pages of all the step's sequences, each sequence's run in order.
    kv_page_seq_X:   the sequence each of those pages belongs to (T for padding pages).
    num_decode:      how many sequences have a single token this step (a scalar).
    logits_idx_Q:    which token rows produce logits (each sequence's last token); rows past the
                     step's own hold T (padding: a gather clips it to the last token).
    lora:            the adapters' per-token metadata (None when LoRA is disabled).
    """

    token_ids_T: jax.Array
    positions_T: jax.Array
    seq_idx_T: jax.Array
    slot_mapping_T: jax.Array
    kv_pages_X: jax.Array
    kv_page_seq_X: jax.Array
    num_decode: jax.Array
    logits_idx_Q: jax.Array
    lora: Optional[LoRABatchInfo]


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype, lane_pack: int = 1) -> KVCache:
    """Zeros (L, P, p, K, H); lane_pack f > 1: (L, P, p, Kg, f * H), f kv heads a row (kv_lanes)."""
    shape = (cfg.num_layers, num_pages, page_size, kv_lanes.groups(cfg.num_kv_heads, lane_pack), lane_pack * cfg.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


# The KV cache's memory order on a TPU: (L, P, K, p, H), a head's page of p rows contiguous. The
# TPU's default for (L, P, p, K, H) tiles the two minor dims (K, H), and the loop's page gathers
# and row scatters want (p, H) tiles; read through the default, a compiled step converted the
# whole cache between the two inside its layer loop, four times per layer (a 64-row decode step
# 59 ms, 485 ms over a 527 MB cache; benchmarks/log/25-2026-12-05-tpu-v5e-kv-heads-major.md). Made in this order and read as k_LPKpH (a
# swap of axes that is free in this layout) and written a row of H at a time (attention.write_kv),
# the step reads and writes the cache in place (59.2 -> 8.4 ms, logits bit-equal).
# With H=64 the (p, H) tiles pad H to 128 lanes on a TPU (SmolLM2: twice the logical bytes;
# the default layout's (K, H) tiles padded the copies the loop made more). The CPU keeps its
# default (row-major) layout and the (L, P, p, K, H) code path: nothing changes there.
KV_HEADS_MAJOR = Layout(major_to_minor=(0, 1, 3, 2, 4))


def kv_heads_major_on(platform: str) -> bool:
    """Whether a cache on this platform is made in KV_HEADS_MAJOR (TPUs only)."""
    return platform == "tpu"


def pallas_attention_on(cache: jax.Array) -> bool:
    """Whether steps over this (heads-major) cache attend through the Pallas kernel: on a TPU,
    unless MULTILORA_PALLAS_ATTENTION=0 (XLA's gathers instead, for comparison)."""
    devices = getattr(getattr(cache, "sharding", None), "device_set", ())
    return (bool(devices) and all(d.platform == "tpu" for d in devices)
            and os.environ.get("MULTILORA_PALLAS_ATTENTION", "1") != "0")


KV_WRITES = ("rows", "pages", "pallas-pages", "pallas-rows")


def kv_write_mode() -> str:
    """How a heads-major cache takes the step's new K/V rows (forward's kv_write):
    rows, XLA's scatter of (token, head) rows; pages, XLA's scatter of whole pages
    (attention.write_kv_pages); pallas-pages (the default), pallas-rows: multilora.kernels.kv_write_pallas
    (pallas-rows does not compile on a v5e: Mosaic takes no DMA at an unaligned row of a tile).
    On a v5e, SmolLM2's shape, a 480-token prefill step took 11.2 ms with rows, 7.0 with pages,
    5.6 with pallas-pages; a 64-row decode step 4.7 / 4.3 / 4.4 ms
    (benchmarks/log/28-2026-12-05-tpu-v5e-kv-writes-and-plans.md).
    MULTILORA_KV_WRITE picks one (a measurement knob: benchmarks/forward_step.py --kv-writes)."""
    mode = os.environ.get("MULTILORA_KV_WRITE", "pallas-pages")
    if mode not in KV_WRITES:
        raise ValueError(f"MULTILORA_KV_WRITE={mode!r}: expected one of {', '.join(KV_WRITES)}")
    return mode


def _kv_writer(mode: str, batch: Batch, page_size: int):
    """write(k_cache, v_cache, layer, k_TKH, v_TKH) -> (k_cache, v_cache) for heads-major
    caches (L, P, K, p, H); the pages' plan, where the mode has one, made once for all layers."""
    if mode not in KV_WRITES:
        raise ValueError(f"kv_write={mode!r}: expected one of {', '.join(KV_WRITES)}")
    interpret = jax.default_backend() != "tpu"
    slots = batch.slot_mapping_T
    if mode == "pallas-rows":
        return lambda kc, vc, i, k, v: write_rows(kc, vc, i, slots, k, v, interpret=interpret)
    if mode in ("pages", "pallas-pages"):
        t, q = slots.shape[0], batch.logits_idx_Q.shape[0]
        plan = kv_page_writes(slots, page_size, max_pages_written(t, min(t, q), page_size))
        if mode == "pages":
            return lambda kc, vc, i, k, v: (write_kv_pages(kc, i, *plan, k), write_kv_pages(vc, i, *plan, v))
        return lambda kc, vc, i, k, v: write_pages(kc, vc, i, *plan, k, v, interpret=interpret)
    return lambda kc, vc, i, k, v: (write_kv(kc, i, slots, k, True), write_kv(vc, i, slots, v, True))


def is_heads_major(cache: jax.Array) -> bool:
    """Whether this cache array is laid out KV_HEADS_MAJOR (forward's kv_heads_major)."""
    layout = getattr(getattr(cache, "format", None), "layout", None)
    return layout is not None and layout.major_to_minor == KV_HEADS_MAJOR.major_to_minor


def kv_cache_formats(shardings: KVCache, heads_major: bool) -> KVCache:
    """What the cache is made, donated and returned in: KV_HEADS_MAJOR on the shardings, or the
    shardings themselves (the device's default layout)."""
    return jax.tree.map(lambda s: Format(KV_HEADS_MAJOR, s) if heads_major else s, shardings)


# The embedding table (V, D) rows-major: the step's lookup takes whole rows. A TPU v5e's default
# layout for SmolLM2's bf16[49152, 576] puts V minor (the axis whose 128-wide tiles pad least), and
# every compiled step then copied the whole table (0.19 ms of a 2.8 ms decode step on the device,
# benchmarks/log/33-2026-12-06-tpu-v5e-host-gap.md) before its lookup; the tied LM head's product
# reads either layout in place. The CPU's default is rows-major already.
EMBED_LAYOUT = Layout(major_to_minor=(0, 1))


def embedding_rows_major(weights: Weights) -> Weights:
    """The same weights with embed_VD in EMBED_LAYOUT on its own sharding (moved only where it
    is not): what the step is then compiled for, so it reads the table in place."""
    e = weights.embed_VD
    layout = getattr(getattr(e, "format", None), "layout", None)
    if layout is None or layout.major_to_minor == EMBED_LAYOUT.major_to_minor:
        return weights
    return dataclasses.replace(weights, embed_VD=jax.device_put(e, Format(EMBED_LAYOUT, e.sharding)))


def kv_page_bytes(cfg: ModelConfig, page_size: int, dtype, heads_major: bool, lane_pack: int = 1) -> int:
    """Device bytes of one page of K and V over all layers: heads-major, a (p, H) tile is padded
    to 128 lanes of H (a TPU's tiles), which doubles the page where H = 64 unless lane_pack
    kv heads share a row (multilora.model.kv_lanes)."""
    kvh, head_dim = kv_lanes.groups(cfg.num_kv_heads, lane_pack), lane_pack * cfg.head_dim
    if heads_major:
        return 2 * cfg.num_layers * page_vmem_bytes(kvh, page_size, head_dim, dtype)
    return 2 * cfg.num_layers * page_size * kvh * head_dim * jnp.dtype(dtype).itemsize


def make_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype, sharding,
                  heads_major: bool, lane_pack: int = 1) -> KVCache:
    """Zeros made in place on the devices of `sharding`, KV_HEADS_MAJOR where asked (by a jitted
    zeros with that output format: no second cache, no host copy)."""
    shape = jax.eval_shape(lambda: init_kv_cache(cfg, num_pages, page_size, dtype, lane_pack))
    formats = kv_cache_formats(KVCache(sharding, sharding), heads_major)
    return jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shape), out_shardings=formats)()


def _proj(x, w, b=None, layer=None, rows=None):
    """x @ w: the product in w's dtype, accumulated in float32, returned in x's dtype (so bfloat16
    weights under float32 activations run XLA's bfloat16 GEMM; all float32 is a plain f32 dot).
    A PackedBf16 (PackedQuant) w is the whole stack, read in place at `layer` by multilora's bf16
    (8- or 4-bit) GEMM, which leaves x's rows from `rows` on (the bucket's padding) out of the product."""
    if isinstance(w, (PackedBf16, PackedQuant)):
        y = w.matmul(x, layer, rows)
    elif isinstance(w, QuantInt8):  # one layer's slice, as the scan hands it
        y = w.matmul(x)
    else:
        y = jnp.einsum("td,do->to", x.astype(w.dtype), w, preferred_element_type=jnp.float32).astype(x.dtype)
    return y if b is None else y + b.astype(y.dtype)


def forward_packed(weights: Weights, lora: Optional[LoRAWeights], kv: KVCache, batch_buf: jax.Array,
                   fed_M: jax.Array, spec: PackSpec, **kw):
    """forward over a Batch that came to the device as one buffer (multilora.model.packing: one
    host -> device copy a step instead of one per array), packed as (batch, src_T) with src_T
    int32 (T,): where >= 0, the token's id is fed_M[src_T] (the previous step's sampled tokens,
    still on the device) instead of batch.token_ids_T (async scheduling)."""
    batch, src_T = unpack(spec, batch_buf)
    ids_T = jnp.where(src_T >= 0, jnp.take(fed_M, jnp.maximum(src_T, 0), mode="clip"), batch.token_ids_T)
    return forward(weights, lora, kv, dataclasses.replace(batch, token_ids_T=ids_T), **kw)


def forward(weights: Weights, lora: Optional[LoRAWeights], kv: KVCache, batch: Batch,
            cfg: ModelConfig, backend: str = "bgmv", hidden: bool = False, native_attention: bool = False,
            kv_heads_major: bool = False, pallas_attention: bool = False, kv_write: str = "rows"):
    """Logits (Q, V) in float32 for the rows batch.logits_idx_Q, and the updated cache; with
    hidden=True also every token's last hidden state x_TD (before the final norm, float32), for
    token_logprobs (prompt logprobs). native_attention: decode rows attend through multilora's
    CPU kernel, reading the cache's pages in place (attention.native_attention_usable).
    kv_heads_major: the cache is laid out KV_HEADS_MAJOR, and the layer loop reads and writes it
    as k_LPKpH (compile the step with the cache's formats in and out, or XLA converts it).
    pallas_attention: every token (decode rows and prefill chunks) attends through the Pallas
    ragged paged-attention kernel (multilora.kernels.attention_pallas), which reads the
    heads-major cache's pages in place (a TPU's path; needs kv_heads_major).
    kv_write: how a heads-major cache takes the step's new K/V rows (KV_WRITES, kv_write_mode)."""
    if kv_heads_major and native_attention:
        raise ValueError("the native attention kernels read (L, P, p, K, H) caches: kv_heads_major is for XLA's")
    if pallas_attention and not kv_heads_major:
        raise ValueError("pallas_attention reads the heads-major cache: it needs kv_heads_major=True")
    bes = get_backends(backend) if lora is not None else ()
    be = bes[0] if bes else None
    info = batch.lora
    softcap = cfg.attn_logit_softcapping
    native_attention = native_attention and softcap is None  # the CPU kernels do not soft-cap: XLA's do
    pallas_attention = pallas_attention and softcap is None  # nor does the Pallas kernel (the XLA path reads heads-major too)
    n, kvh, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    t = batch.token_ids_T.shape[0]
    rope_global = rope_cos_sin(batch.positions_T, rope_inv_freq(cfg), rope_attention_factor(cfg))
    # Gemma 3: the sliding-window layers turn by their own base, unscaled
    rope_local = rope_global if cfg.local_rope_theta is None else rope_cos_sin(
        batch.positions_T, rope_inv_freq(dataclasses.replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None)))
    x_TD = jnp.take(weights.embed_VD, batch.token_ids_T, axis=0, mode="clip")
    # the step's own tokens and logits rows (the rest pad a bucket): packed GEMMs skip the rest
    live_T = jnp.sum(batch.seq_idx_T >= 0, dtype=jnp.int32)
    live_Q = jnp.sum(batch.logits_idx_Q < t, dtype=jnp.int32)
    if cfg.embed_scale:  # Gemma: the scale rounded to the embedding's dtype, as transformers does
        x_TD = x_TD * jnp.asarray(cfg.hidden_size ** 0.5, x_TD.dtype)
    norm = lambda x, w: rms_norm(x, w, cfg.rms_norm_eps, cfg.gemma_norms)  # noqa: E731
    if be is not None:  # each backend's per-step metadata, once for every layer (plan_step)
        d, f = cfg.hidden_size, cfg.intermediate_size
        # each LoRA call's (in, out) features, a stacked call's outputs together (q/k/v, gate/up)
        dims = ((d, n * h + 2 * kvh * h), (n * h, d), (d, 2 * f), (f, d))
        dims += ((d, cfg.num_experts),) if cfg.moe_layers else ()  # the router's LoRA
        for b in bes:
            info = b.plan_step(info, t, dims, x_TD.dtype)
    # Rows with one token this step take the decode path; the prefill kernel sees them as padding.
    is_decode_T = (batch.seq_idx_T >= 0) & (batch.seq_idx_T < batch.num_decode)
    write_hm = _kv_writer(kv_write, batch, kv.page_size) if kv_heads_major else None
    pack = kv.k_LPpKH.shape[-1] // h   # kv heads a row of the cache (multilora.model.kv_lanes)
    if pack > 1 and not pallas_attention:
        raise ValueError(f"a cache of {pack} kv heads a row is read by the Pallas attention only")
    page_bytes = page_vmem_bytes(kv.k_LPpKH.shape[3], kv.page_size, pack * h, kv.k_LPpKH.dtype)
    attention_plans = {w: attention_plan(batch.kv_page_seq_X, batch.seq_idx_T, batch.positions_T, kv.page_size, w,
                                         page_bytes=page_bytes, group=pack * (n // kvh))
                       for w in set(cfg.layer_windows)} if pallas_attention else {}
    prefill_seq_T = jnp.where(is_decode_T, -1, batch.seq_idx_T)
    # A step in which no row has an adapter runs no LoRA op at all, and a shape compiled with a
    # (grouped, per-token) pair of backends runs the one the step's mode names: branches taken
    # at run time, so they cost no extra compiled shapes.

    def with_lora(fn, idx, *base):
        # fn(pools, backend, base): base + its LoRA deltas (the backend adds them), or base itself
        # in a step without adapters (a branch of zeros added outside cost a prefill step ~10 %:
        # every projection's output written as zeros, then read and added). The pools enter the
        # branch whole and the layer is picked inside it, where the pick fuses into the backend's
        # gathers: a layer slice taken outside was copied out whole (the entire pool, every step)
        # to be handed to the branch.
        def run(b):
            if getattr(b, "reads_pool_in_place", False):  # its kernel indexes the layer itself
                pools = lambda: jax.tree.map(lambda a: PoolLayer(a, idx), lora)  # noqa: E731
            else:
                pools = lambda: jax.tree.map(  # noqa: E731
                    lambda a: jax.lax.dynamic_index_in_dim(a, idx, 0, keepdims=False), lora)
            return lambda: tuple(fn(pools(), b, base))
        same = lambda: base  # noqa: E731
        if len(bes) == 1:
            return jax.lax.cond(info.mode != NO_LORA, run(bes[0]), same)
        return jax.lax.switch(jnp.clip(info.mode, NO_LORA, PER_TOKEN), [same, run(bes[0]), run(bes[1])])

    # Packed projections (multilora.model.projections) stay whole, outside the scanned slices:
    # the kernel reads layer idx of the stack in place.
    stacked = weights.layers
    packed = {} if isinstance(stacked, tuple) else {
        f.name: getattr(stacked, f.name) for f in dataclasses.fields(stacked)
        if isinstance(getattr(stacked, f.name), (PackedBf16, PackedQuant))}

    def layer(carry, xs, spec):
        # spec: this layer's (sliding window, sparse MLP), static (cfg.layer_windows, None:
        # global; cfg.layer_sparse)
        window, sparse = spec
        x_TD, k_cache, v_cache = carry
        lw, idx = xs
        lw = dataclasses.replace(lw, **packed) if packed else lw
        hid = norm(x_TD, lw.attn_norm_LD)
        q = _proj(hid, lw.wq_LDO, lw.bq_LO, idx, live_T)
        k = _proj(hid, lw.wk_LDO, lw.bk_LO, idx, live_T)
        v = _proj(hid, lw.wv_LDO, lw.bv_LO, idx, live_T)
        if be is not None:
            q, k, v = with_lora(lambda ll, be, base: be.run_qkv_lora(
                hid, ll.qkv_a_LUD, (ll.q_b_LUO, ll.k_b_LUO, ll.v_b_LUO), info, base), idx, q, k, v)
        q_TNH, k_TKH = q.reshape(t, n, h), k.reshape(t, kvh, h)
        if lw.q_norm_LH is not None:  # Qwen3, Gemma 3: each head's q and k RMS-normed (after LoRA, before RoPE)
            q_TNH = rms_norm(q_TNH, lw.q_norm_LH, cfg.rms_norm_eps, cfg.gemma_norms)
            k_TKH = rms_norm(k_TKH, lw.k_norm_LH, cfg.rms_norm_eps, cfg.gemma_norms)
        cos_TH, sin_TH = rope_global if window is None else rope_local
        q_TNH = apply_rope(q_TNH, cos_TH, sin_TH)
        k_TKH = apply_rope(k_TKH, cos_TH, sin_TH)
        if cfg.query_pre_attn_scalar is not None:  # scores scaled by it ** -0.5, not by h ** -0.5
            q_TNH = q_TNH * jnp.asarray((h / cfg.query_pre_attn_scalar) ** 0.5, q_TNH.dtype)
        if kv_heads_major:
            k_cache, v_cache = write_hm(k_cache, v_cache, idx, kv_lanes.pack_rows(k_TKH, pack),
                                        kv_lanes.pack_rows(v.reshape(t, kvh, h), pack))
        else:
            k_cache = write_kv(k_cache, idx, batch.slot_mapping_T, k_TKH)
            v_cache = write_kv(v_cache, idx, batch.slot_mapping_T, v.reshape(t, kvh, h))
        if pallas_attention:
            attn_TNH = paged_attention(kv_lanes.pack_queries(q_TNH, kvh, pack), k_cache, v_cache, idx,
                                       batch.kv_pages_X, batch.kv_page_seq_X, batch.seq_idx_T, batch.positions_T,
                                       window, interpret=jax.default_backend() != "tpu", plan=attention_plans[window],
                                       scale=h ** -0.5)
            attn_TNH = kv_lanes.unpack_outputs(attn_TNH, kvh, n, pack) if pack > 1 else attn_TNH
        else:
            dec = decode_attention(q_TNH, k_cache, v_cache, idx, batch.kv_pages_X, batch.kv_page_seq_X,
                                   batch.positions_T, batch.num_decode, window, native_attention,
                                   kv_heads_major, logit_softcap=softcap)
            pre = prefill_attention(q_TNH, k_cache, v_cache, idx, batch.kv_pages_X, batch.kv_page_seq_X,
                                    prefill_seq_T, batch.positions_T, window, native_attention,
                                    kv_heads_major, logit_softcap=softcap)
            attn_TNH = jnp.where(is_decode_T[:, None, None], dec, pre)
        attn_TO = attn_TNH.reshape(t, n * h)
        o = _proj(attn_TO, lw.wo_LOD, lw.bo_LD, idx, live_T)
        if be is not None:
            (o,) = with_lora(lambda ll, be, base: (be.run_lora(attn_TO, ll.o_a_LUO, ll.o_b_LUD, info, *base),), idx, o)
        if lw.post_attn_norm_LD is not None:  # Gemma 2: the attention's output normed too
            o = norm(o, lw.post_attn_norm_LD)
        x_TD = x_TD + o
        hid = norm(x_TD, lw.mlp_norm_LD if lw.pre_mlp_norm_LD is None else lw.pre_mlp_norm_LD)
        if sparse:  # Qwen3-MoE: its router's top-k experts, grouped, each with its LoRA
            logits_TE = _proj(hid, lw.router_LDE)
            if be is not None:
                (logits_TE,) = with_lora(lambda ll, be, base: (
                    be.run_lora(hid, ll.router_a_LUD, ll.router_b_LUE, info, *base),), idx, logits_TE)
            weights_TK, experts_TK = select_experts(logits_TE, cfg.num_experts_per_tok, cfg.norm_topk_prob)
            adapters = None if be is None else ExpertLoRA(
                lora.experts_gate_up_a_LUY, lora.experts_gate_up_b_LUZ, lora.experts_down_a_LUY,
                lora.experts_down_b_LUZ, idx, info)
            return (x_TD + grouped_experts(hid, weights_TK, experts_TK, lw.w_gate_LEDM, lw.w_up_LEDM,
                                           lw.w_down_LEMD, adapters), k_cache, v_cache), None
        gate, up = _proj(hid, lw.w_gate_LDF, layer=idx, rows=live_T), _proj(hid, lw.w_up_LDF, layer=idx, rows=live_T)
        if be is not None:
            gate, up = with_lora(lambda ll, be, base: be.run_gate_up_lora(
                hid, ll.gate_up_a_LUD, (ll.gate_b_LUF, ll.up_b_LUF), info, base), idx, gate, up)
        act_TF = swiglu(gate, up) if cfg.hidden_act == "silu" else geglu_tanh(gate, up)
        down = _proj(act_TF, lw.w_down_LFD, layer=idx, rows=live_T)
        if be is not None:
            (down,) = with_lora(lambda ll, be, base: (be.run_lora(act_TF, ll.down_a_LUF, ll.down_b_LUD, info, *base),),
                                idx, down)
        if lw.post_mlp_norm_LD is not None:
            down = norm(down, lw.post_mlp_norm_LD)
        return (x_TD + down, k_cache, v_cache), None

    # (L, P, K, p, H): the order a KV_HEADS_MAJOR cache has in memory, so the swap is free
    swap = (lambda a: jnp.swapaxes(a, 2, 3)) if kv_heads_major else (lambda a: a)  # noqa: E731
    carry = (x_TD, swap(kv.k_LPpKH), swap(kv.v_LPpKH))
    specs = tuple(zip(cfg.layer_windows, cfg.layer_sparse))
    if isinstance(weights.layers, tuple):  # one LayerWeights per layer: unrolled, nothing sliced
        if len(weights.layers) != cfg.num_layers:
            raise ValueError(f"weights hold {len(weights.layers)} split layers; the config has "
                             f"num_layers={cfg.num_layers}")
        for i, lw in enumerate(weights.layers):
            carry, _ = layer(carry, (lw, jnp.int32(i)), specs[i])
    else:
        sliced = dataclasses.replace(stacked, **{name: None for name in packed}) if packed else stacked
        carry = _scan_layers(layer, carry, sliced, specs)
    x_TD, k_cache, v_cache = carry
    k_cache, v_cache = swap(k_cache), swap(v_cache)
    logits = head_logits(weights, cfg, jnp.take(x_TD, batch.logits_idx_Q, axis=0, mode="clip"), live_Q)
    if hidden:  # float32 whatever the weights' dtype: one scorer shape per token bucket
        return logits, KVCache(k_cache, v_cache), x_TD.astype(jnp.float32)
    return logits, KVCache(k_cache, v_cache)


def _window_period(windows) -> int:
    """The shortest p with windows[i] == windows[i % p] for every layer i."""
    return next(p for p in range(1, len(windows) + 1) if all(w == windows[i % p] for i, w in enumerate(windows)))


def _scan_layers(layer, carry, stacked, windows):
    """layer(carry, (weights of layer i, i), windows[i]) for every layer, under one lax.scan over
    groups of p layers, p the period of the windows (each layer's static spec: its window and
    whether its MLP is sparse; 1 where every layer has the same; Gemma 2's alternating local and
    global layers: 2): inside a group each layer's spec is static. The layers past the last
    whole group run after it, unrolled."""
    p, num = _window_period(windows), len(windows)
    g = num // p

    def group(c, xs):
        lw_P, idx_P = xs
        for j in range(p):
            c, _ = layer(c, (jax.tree.map(lambda a: a[j], lw_P), idx_P[j]), windows[j])
        return c, None

    if p == 1:
        carry, _ = jax.lax.scan(lambda c, xs: layer(c, xs, windows[0]), carry, (stacked, jnp.arange(num)))
        return carry
    grouped = jax.tree.map(lambda a: a[:g * p].reshape((g, p) + a.shape[1:]), stacked)
    carry, _ = jax.lax.scan(group, carry, (grouped, jnp.arange(g * p).reshape(g, p)))
    for i in range(g * p, num):
        carry, _ = layer(carry, (jax.tree.map(lambda a: a[i], stacked), jnp.int32(i)), windows[i])
    return carry


def split_layers(weights: Weights) -> Weights:
    """The same weights with `layers` as one LayerWeights per layer (no L axis)."""
    n = jax.tree.leaves(weights.layers)[0].shape[0]
    return dataclasses.replace(weights, layers=tuple(jax.tree.map(lambda a: a[i], weights.layers) for i in range(n)))


def head_logits(weights: Weights, cfg: ModelConfig, x_QD, rows=None) -> jax.Array:
    """The final norm and the LM head: float32 logits (Q, V) of last hidden states x_QD (a packed
    head leaves rows from `rows` on out: zeros)."""
    x_QD = rms_norm(x_QD, weights.final_norm_D, cfg.rms_norm_eps, cfg.gemma_norms)
    if weights.lm_head_DV is None:
        logits = jnp.einsum("qd,vd->qv", x_QD, weights.embed_VD, preferred_element_type=jnp.float32)
    else:  # an untied head, or the projections' copy of the tied one (multilora.model.projections)
        logits = _proj(x_QD.astype(jnp.float32), weights.lm_head_DV, layer=0, rows=rows)
    logits = logits.astype(jnp.float32)
    if cfg.final_logit_softcapping is not None:
        logits = softcap_logits(logits, cfg.final_logit_softcapping)
    return logits


def token_logprobs(weights: Weights, x_TD, next_T, cfg: ModelConfig, k: int):
    """Prompt logprobs: for each token t, the log-probability of next_T[t] after it and the k
    most likely next tokens (ids, logprobs), from its hidden state x_TD (forward(hidden=True))."""
    logp_TV = jax.nn.log_softmax(head_logits(weights, cfg, x_TD), axis=-1)
    chosen_T = jnp.take_along_axis(logp_TV, jnp.clip(next_T, 0, logp_TV.shape[1] - 1)[:, None], axis=-1)[:, 0]
    top_vals_TK, top_ids_TK = jax.lax.top_k(logp_TV, k)
    return chosen_T, top_ids_TK.astype(jnp.int32), top_vals_TK
