"""The step's new K and V rows written into the heads-major KV cache (L, P, K, p, H) as Pallas TPU
kernels, in place (the caches are aliased to the outputs).

Why: XLA's scatter of the step's (token, head) rows of H (multilora.model.attention.write_kv) costs
about 0.1 us per row on a TPU, whatever the bytes: 1.2 ms of a 64-row decode step of SmolLM2's
shape, and most of a 480-token prefill step (benchmarks/log/27-2026-12-05-tpu-v5e-pallas-kernels.md).
Two ways, both measured on the chip (benchmarks/kv_write_probe.py):

- `write_pages`: by whole pages. The step's writes are grouped by page once per step
  (multilora.model.attention.kv_page_writes: the distinct pages its tokens write, and for each
  slot of those pages the token that writes it); per layer, a grid over those pages reads each
  page of K and of V into VMEM (the pipeline's block), puts the new rows over it, and the block
  goes back to the same page. A step of n tokens touches at most n pages, a prefill chunk about
  n / p of them.
- `write_rows`: one DMA per token (all of its K heads, strided) from the new rows straight to its
  slot of the cache, every DMA in flight at once.

Legend: T tokens, K kv heads, p page size, H head dim, L layers, P cache pages, U pages written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _pages_kernel(layer_ref, page_ref, n_ref,                     # scalar prefetch
                  src_ref, k_new_ref, v_new_ref, k_old_ref, v_old_ref,  # inputs (blocks of page u)
                  k_out_ref, v_out_ref):                           # outputs (the same pages)
    u = pl.program_id(0)

    @pl.when(u < n_ref[0])
    def _():
        written = src_ref[...] >= 0                               # (p, 1): slots a token writes
        k_out_ref[...] = jnp.where(written[None], k_new_ref[...], k_old_ref[...])
        v_out_ref[...] = jnp.where(written[None], v_new_ref[...], v_old_ref[...])


# Steps of at most this many tokens build their pages' new rows as a one-hot product (below).
ONE_HOT_MAX_TOKENS = 1024


def page_slot_rows(new_TKH, src_Up, dtype):
    """(U, K, p, H) in `dtype`: for each slot of the pages written, the new row of the token that
    writes it (src_Up; -1: none, zeros). XLA's row gather costs a TPU ~0.1 us a row, whatever its
    bytes (0.26 ms of a 64-row decode step of SmolLM2's shape, 0.8 ms of a 480-token prefill:
    benchmarks/log/33-2026-12-06-tpu-v5e-host-gap.md), so a step of up to ONE_HOT_MAX_TOKENS
    tokens takes them as one product with a one-hot (U * p, T) matrix on the MXU instead: exact
    (one term per row, float32 accumulation, float32 rows at full precision), its work T x U x p
    x K x H. Non-finite rows enter the product as zeros, so that one token's inf or NaN cannot
    reach another token's slots (0 x NaN); the gather keeps them."""
    t, kvh, h = new_TKH.shape
    u, p = src_Up.shape
    if t > ONE_HOT_MAX_TOKENS:
        return jnp.swapaxes(jnp.take(new_TKH, jnp.maximum(src_Up, 0), axis=0), 1, 2).astype(dtype)
    onehot = (src_Up.reshape(u * p, 1) == jnp.arange(t, dtype=src_Up.dtype)[None, :]).astype(new_TKH.dtype)
    finite = jnp.where(jnp.isfinite(new_TKH), new_TKH, 0).reshape(t, kvh * h)
    precision = jax.lax.Precision.HIGHEST if new_TKH.dtype == jnp.float32 else None
    rows = jnp.dot(onehot, finite, precision=precision, preferred_element_type=jnp.float32)
    return jnp.swapaxes(rows.reshape(u, p, kvh, h), 1, 2).astype(dtype)


def write_pages(k_LPKpH, v_LPKpH, layer, page_U, num_pages, src_Up, k_TKH, v_TKH, interpret: bool = False):
    """k_LPKpH, v_LPKpH with the step's rows written at layer: page_U the distinct pages written
    (entries from num_pages on repeat the last one: the pipeline neither reads nor writes a
    block whose index does not change), src_Up the token writing each slot of those pages (-1:
    none; the slot keeps its value)."""
    _, _, kvh, p, h = k_LPKpH.shape
    u = page_U.shape[0]
    k_new_UKpH = page_slot_rows(k_TKH, src_Up, k_LPKpH.dtype)
    v_new_UKpH = page_slot_rows(v_TKH, src_Up, v_LPKpH.dtype)
    page_block = pl.BlockSpec((None, kvh, p, h), lambda i, *_: (i, 0, 0, 0))
    cache_block = pl.BlockSpec((None, None, kvh, p, h), lambda i, layer_ref, page_ref, _: (layer_ref[0], page_ref[i], 0, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(u,),
        in_specs=[pl.BlockSpec((None, p, 1), lambda i, *_: (i, 0, 0)), page_block, page_block,
                  cache_block, cache_block],
        out_specs=[cache_block, cache_block],
    )
    return pl.pallas_call(
        _pages_kernel,
        grid_spec=grid_spec,
        out_shape=(jax.ShapeDtypeStruct(k_LPKpH.shape, k_LPKpH.dtype),
                   jax.ShapeDtypeStruct(v_LPKpH.shape, v_LPKpH.dtype)),
        input_output_aliases={6: 0, 7: 1},   # counted with the scalar-prefetch operands
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), page_U.astype(jnp.int32),
      jnp.reshape(jnp.asarray(num_pages, jnp.int32), (1,)), src_Up[:, :, None].astype(jnp.int32),
      k_new_UKpH, v_new_UKpH, k_LPKpH, v_LPKpH)


def _rows_kernel(layer_ref, page_ref, off_ref,            # scalar prefetch
                 k_new_hbm, v_new_hbm, k_in, v_in,         # inputs (HBM)
                 k_out, v_out,                             # outputs (HBM, aliased to k_in / v_in)
                 sem):
    del k_in, v_in
    layer = layer_ref[0]
    t = page_ref.shape[0]

    def copy(cache, new, i):
        return pltpu.make_async_copy(new.at[i], cache.at[layer, page_ref[i], :, pl.ds(off_ref[i], 1)], sem)

    def start(i, c):
        copy(k_out, k_new_hbm, i).start()
        copy(v_out, v_new_hbm, i).start()
        return c

    def wait(i, c):
        copy(k_out, k_new_hbm, i).wait()
        copy(v_out, v_new_hbm, i).wait()
        return c

    jax.lax.fori_loop(0, t, start, 0)
    jax.lax.fori_loop(0, t, wait, 0)


def write_rows(k_LPKpH, v_LPKpH, layer, slot_mapping_T, k_TKH, v_TKH, interpret: bool = False):
    """k_LPKpH, v_LPKpH with each token's (K, H) row written at its slot of layer, one DMA each."""
    _, _, kvh, p, h = k_LPKpH.shape
    k_new = k_TKH.astype(k_LPKpH.dtype)[:, :, None, :]   # (T, K, 1, H): a token's DMA source
    v_new = v_TKH.astype(v_LPKpH.dtype)[:, :, None, :]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(1,),
        in_specs=[any_spec] * 4, out_specs=[any_spec] * 2,
        scratch_shapes=[pltpu.SemaphoreType.DMA(())],
    )
    return pl.pallas_call(
        _rows_kernel,
        grid_spec=grid_spec,
        out_shape=(jax.ShapeDtypeStruct(k_LPKpH.shape, k_LPKpH.dtype),
                   jax.ShapeDtypeStruct(v_LPKpH.shape, v_LPKpH.dtype)),
        input_output_aliases={5: 0, 6: 1},
        compiler_params=pltpu.CompilerParams(has_side_effects=True),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), (slot_mapping_T // p).astype(jnp.int32),
      (slot_mapping_T % p).astype(jnp.int32), k_new, v_new, k_LPKpH, v_LPKpH)
