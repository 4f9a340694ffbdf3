"""Paged attention for decode-only steps as a Pallas TPU kernel: one grid step a token, scoring
only its own sequence's keys.

Why: the block kernel (multilora.kernels.attention_pallas) takes 16 decode rows a block and
scores every row against all 16 sequences' keys, the masks keeping each row to its own: 16x the
scores a row needs. On a v5e that arithmetic, not the pages' bytes, is most of the 1B shape's
decode step (2.98 ms of 6.84 on the device, against ~0.7 ms for its bytes; neither one wait a
chunk nor 128-token pages changed it: benchmarks/log/40). Here a token's G query heads of one kv
head (padded to a sublane tile) score the keys of its own pages only, a chunk of C pages at a
time, DMA'd from the heads-major cache in place, double-buffered across chunks and tokens; the
copies of pages past the token's last are not issued at all. Not yet timed on a chip, so off by
default: MULTILORA_PALLAS_DECODE=1 takes it for decode-only steps (tpu_steps.sh part `decode`).

Legend: T tokens, N query heads, K kv heads, G = N / K (Gp: padded), H head dim, L layers,
P cache pages, p page size, X the step's pages, C pages per chunk.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from multilora.kernels.attention_pallas import (MASKED, VMEM_LIMIT_BYTES, key_ranges, normalized,
                                                online_softmax_update)
from multilora.kernels.attention_pallas import chunk_pages as block_chunk_pages

DECODE_ENV = "MULTILORA_PALLAS_DECODE"
KEYS_PER_CHUNK = 128   # keys a chunk scores at most (C = this // p pages); a token's own pages only are read


def decode_kernel_on() -> bool:
    """Whether decode-only steps take this kernel ($MULTILORA_PALLAS_DECODE, read at trace time)."""
    return os.environ.get(DECODE_ENV) == "1"


def decode_only(seq_idx_T) -> jax.Array:
    """True where no sequence has more than one token in the step (a sequence's tokens are
    adjacent in the batch; padding tokens are -1)."""
    same = (seq_idx_T[1:] == seq_idx_T[:-1]) & (seq_idx_T[1:] >= 0)
    return ~jnp.any(same)


def chunk_pages(num_step_pages: int, page_size: int) -> int:
    """Pages a chunk holds (C): at most this kernel's KEYS_PER_CHUNK keys, at most the step's pages."""
    return block_chunk_pages(num_step_pages, page_size, KEYS_PER_CHUNK)


def decode_plan(kv_page_seq_X, seq_idx_T, positions_T, page_size: int, sliding_window: int | None = None):
    """Each token's visible flat keys (lo_T, hi_T), its first and end page of X, its chunks (at
    least one: the double buffer's chain), and its first chunk's count (the buffer's parity)."""
    x = kv_page_seq_X.shape[0]
    c = chunk_pages(x, page_size)
    lo_T, hi_T, first_T, end_T = key_ranges(kv_page_seq_X, seq_idx_T, positions_T, page_size, sliding_window)
    first_T = jnp.minimum(first_T, x).astype(jnp.int32)
    end_T = end_T.astype(jnp.int32)
    n_chunks = jnp.maximum(-(-(end_T - first_T) // c), 1).astype(jnp.int32)
    base = (jnp.cumsum(n_chunks) - n_chunks).astype(jnp.int32)
    return lo_T, hi_T, first_T, end_T, n_chunks, base


def _kernel(layer_ref, pages_ref, lo_ref, hi_ref, first_ref, end_ref, n_chunks_ref, base_ref,  # scalar prefetch
            q_ref, k_hbm, v_hbm,                                                           # inputs
            o_ref,                                                                         # output
            kbuf, vbuf, sem, m_ref, l_ref, acc_ref,                                        # scratch
            *, pages_per_chunk: int, num_pages: int, num_tokens: int, scale: float):
    j = pl.program_id(0)
    layer = layer_ref[0]
    _, num_kv, gp, h = q_ref.shape
    p = kbuf.shape[3]
    cp = pages_per_chunk * p

    def each_copy(tok, c, slot, act):
        """act(copy) for each page of token tok's chunk c that the token reads (the same pages
        for a chunk's start and its wait)."""
        x0 = first_ref[tok] + c * pages_per_chunk
        for i in range(pages_per_chunk):
            @pl.when(x0 + i < end_ref[tok])
            def _(i=i):
                page = pages_ref[jnp.minimum(x0 + i, num_pages - 1)]
                act(pltpu.make_async_copy(k_hbm.at[layer, page], kbuf.at[slot, i], sem.at[0, slot]))
                act(pltpu.make_async_copy(v_hbm.at[layer, page], vbuf.at[slot, i], sem.at[1, slot]))

    @pl.when(j == 0)
    def _():
        # Pages a chunk does not read keep what the buffer held: zeros first, then real keys
        # and values, all finite, so that a masked key's zero weight times its value is zero.
        kbuf[...] = jnp.zeros_like(kbuf)
        vbuf[...] = jnp.zeros_like(vbuf)
        each_copy(0, 0, 0, lambda cp_: cp_.start())

    m_ref[...] = jnp.full_like(m_ref, MASKED)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)
    lo, hi = lo_ref[j], hi_ref[j]
    n = n_chunks_ref[j]

    def body(c, carry):
        slot = (base_ref[j] + c) % 2

        @pl.when(c + 1 < n)
        def _():
            each_copy(j, c + 1, 1 - slot, lambda cp_: cp_.start())

        @pl.when((c + 1 >= n) & (j + 1 < num_tokens))
        def _():
            each_copy(j + 1, 0, 1 - slot, lambda cp_: cp_.start())

        each_copy(j, c, slot, lambda cp_: cp_.wait())
        f = (first_ref[j] + c * pages_per_chunk) * p + jax.lax.broadcasted_iota(jnp.int32, (1, cp), 1)
        visible = (f >= lo) & (f <= hi)                                    # (1, cp)
        for k in range(num_kv):
            online_softmax_update(q_ref[0, k], kbuf[slot, :, k].reshape(cp, h), vbuf[slot, :, k].reshape(cp, h),
                                  visible, scale, m_ref.at[k], l_ref.at[k], acc_ref.at[k])
        return carry

    jax.lax.fori_loop(0, n, body, 0)
    for k in range(num_kv):
        o_ref[0, k] = normalized(acc_ref.at[k], l_ref.at[k]).astype(o_ref.dtype)


def sublane_rows(dtype) -> int:
    """A sublane tile's rows for this dtype (8 for 32-bit, 16 for 16-bit)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def paged_decode_attention(q_TNH, k_LPKpH, v_LPKpH, layer, kv_pages_X, plan, interpret: bool = False):
    """paged_attention's result for a step whose tokens are each their own sequence's only one
    (decode_only), from decode_plan's plan of the same step and window."""
    t, n, h = q_TNH.shape
    _, _, num_kv, p, _ = k_LPKpH.shape
    g = n // num_kv
    gp = -(-g // sublane_rows(q_TNH.dtype)) * sublane_rows(q_TNH.dtype)
    x = kv_pages_X.shape[0]
    c = chunk_pages(x, p)
    q_TKGH = jnp.pad(q_TNH.reshape(t, num_kv, g, h), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    kernel = functools.partial(_kernel, pages_per_chunk=c, num_pages=x, num_tokens=t, scale=h ** -0.5)
    block = pl.BlockSpec((1, num_kv, gp, h), lambda j, *_: (j, 0, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=8,
        grid=(t,),
        in_specs=[block, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=block,
        scratch_shapes=[
            pltpu.VMEM((2, c, num_kv, p, h), k_LPKpH.dtype),
            pltpu.VMEM((2, c, num_kv, p, h), v_LPKpH.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((num_kv, gp, 1), jnp.float32),
            pltpu.VMEM((num_kv, gp, 1), jnp.float32),
            pltpu.VMEM((num_kv, gp, h), jnp.float32),
        ],
    )
    out_TKGH = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((t, num_kv, gp, h), q_TNH.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=VMEM_LIMIT_BYTES),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), kv_pages_X.astype(jnp.int32), *plan,
      q_TKGH, k_LPKpH, v_LPKpH)
    return out_TKGH[:, :, :g].reshape(t, n, h)
