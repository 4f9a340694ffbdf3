"""Pure building blocks of a Llama-family layer: RMSNorm, rotary embeddings, SwiGLU (GeGLU for Gemma).

Legend: T tokens, D model dim, N heads, H head dim, F ffn dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from multilora.config import ModelConfig


def row_sum(x: jax.Array) -> jax.Array:
    """Sums over the last axis, keeping it (size 1), in one fixed order whatever the other axes:
    halves added elementwise until one column is left (an odd column carried along). XLA's CPU
    reduce sums a row in another order when the rows are few (fewer than 8: split into windows
    of 32, then summed) than when they are many, so a token's norm, and with bfloat16
    projections at times its greedy token, depended on how many tokens shared its step
    (speculative decoding verifies drafts in larger steps than decoding takes them). Elementwise
    adds are the same for every row whatever the shape."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        s = x[..., :half] + x[..., half:2 * half]
        x = jnp.concatenate([s, x[..., 2 * half:]], axis=-1) if x.shape[-1] % 2 else s
    return x


def rms_norm(x_TD: jax.Array, w_D: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
    """RMSNorm over the last axis, times w (Llama: cast back, then times w) or, plus_one, times
    (1 + w) in float32 before the cast back (Gemma's). The mean of squares in row_sum's order:
    a row's result never depends on the other rows of its step."""
    x32 = x_TD.astype(jnp.float32)
    var_T1 = row_sum(x32 * x32) * (1.0 / x_TD.shape[-1])
    normed = x32 * jax.lax.rsqrt(var_T1 + eps)
    if plus_one:
        return (normed * (1.0 + w_D.astype(jnp.float32))).astype(x_TD.dtype)
    return normed.astype(x_TD.dtype) * w_D


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies (H/2,), scaled as the config asks (llama3, linear, yarn)."""
    h = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    rs = cfg.rope_scaling
    if rs is None:
        return inv.astype(np.float32)
    if rs.rope_type == "linear":
        return (inv / rs.factor).astype(np.float32)
    if rs.rope_type == "yarn":
        return _yarn_inv_freq(inv, h, cfg.rope_theta, rs).astype(np.float32)
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(inv_h: np.ndarray, h: int, theta: float, rs) -> np.ndarray:
    """YaRN's frequencies (transformers' _compute_yarn_parameters): a frequency that turns more
    than beta_fast times over the original context is kept, one that turns fewer than
    beta_slow times is interpolated (divided by factor), and those between are ramped linearly
    over their dimension index."""
    def dim_of(rotations: float) -> float:
        return h * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(rs.beta_fast), dim_of(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, h - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(h // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp
    return inv_h / rs.factor * (1.0 - keep) + inv_h * keep


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor on cos and sin (YaRN's attention scaling; 1 for the other scalings)."""
    rs = cfg.rope_scaling
    return rs.attention_factor if rs is not None and rs.rope_type == "yarn" else 1.0


def rope_cos_sin(positions_T: jax.Array, inv_freq_h: np.ndarray, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    freqs_Th = positions_T.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq_h)[None, :]
    emb_TH = jnp.concatenate([freqs_Th, freqs_Th], axis=-1)
    if scale == 1.0:
        return jnp.cos(emb_TH), jnp.sin(emb_TH)
    return jnp.cos(emb_TH) * scale, jnp.sin(emb_TH) * scale


def apply_rope(x_TNH: jax.Array, cos_TH: jax.Array, sin_TH: jax.Array) -> jax.Array:
    """Hugging Face's rotate-half convention (not the interleaved one)."""
    half = x_TNH.shape[-1] // 2
    x1, x2 = x_TNH[..., :half], x_TNH[..., half:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos_TH[:, None, :], sin_TH[:, None, :]
    out = x_TNH.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x_TNH.dtype)


def swiglu(gate_TF: jax.Array, up_TF: jax.Array) -> jax.Array:
    return jax.nn.silu(gate_TF) * up_TF


def geglu_tanh(gate_TF: jax.Array, up_TF: jax.Array) -> jax.Array:
    """Gemma's MLP gate: GELU in its tanh approximation (transformers' gelu_pytorch_tanh)."""
    return jax.nn.gelu(gate_TF, approximate=True) * up_TF
