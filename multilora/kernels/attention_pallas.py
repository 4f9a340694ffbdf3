"""Ragged paged attention as a Pallas TPU kernel over the heads-major KV cache, for decode rows,
prefill chunks and mixed steps alike, reading the step's pages in place.

The step's batch already lists its pages as one flat run per sequence (Batch.kv_pages_X, tagged
by kv_page_seq_X, in sequence order), so a token of sequence s at position pos sees exactly the
flat key indices [start_s * p, start_s * p + pos] (start_s: the first of its sequence's pages in
that list, p the page size), cut to the last `sliding_window` of them. The kernel takes query
tokens in blocks of tq rows; block j walks the page range its rows need, a chunk of C pages at a
time, DMA'd from the cache at the step's layer (cache_LPKpH: one page of one head is a
contiguous (p, H) tile there) into VMEM, double-buffered (the next chunk, or the next block's
first, in flight while this one is scored), with an online softmax per query row. Per kv head
the block's G query heads go as one (G * tq, H) x (H, C * p) product on the MXU.

Decode rows (one token per sequence, listed first) are blocks of tq sequences: a block scores
its rows against all of its sequences' pages, the masks keep each row to its own; the MXU's
extra work is small next to the pages' bytes, which are read once. What XLA's path did with
gathers, segment scatters and a loop over every page (multilora.model.attention, kept for the
CPU) is here one kernel per layer, whose cost follows the pages the step's tokens read.

Legend: T tokens, N query heads, K kv heads, G = N / K, H head dim, L layers, P cache pages,
p page size, X the step's pages, J query blocks, C pages per chunk.
`paged_attention_reference` is the same in plain jnp, for the tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from multilora.kernels.knobs import positive_int_knob

MASKED = -1e30
# Keys a chunk scores (C = this // p pages). A chunk's fixed costs (its loop step, each kv head's
# two products and their softmax between) dominate the decode step: on a v5e the 1B shape's
# decode step took 8.22 / 7.86 / 7.42 ms at 256 / 512 / 1024 keys a chunk (benchmarks/log/46),
# and over kv heads two to a row (G x 16 = 128 score rows) 8.30 / 7.92 / 7.40 / 7.00 ms at
# 128 / 256 / 512 / 1024 (log 47). Prefill's blocks of 64 rows go the other way (1B prefill
# 10.25 ms at 256 keys against 10.75 at 1024; two heads a row 9.50 / 9.96 / 10.11 ms at
# 128 / 256 / 1024): a chunk's keys are halved while a kv head's score tile (G x tq rows x keys)
# passes SCORE_TILE, DECODE_SCORE_TILE for decode-sized blocks (at most 16 rows).
KEYS_PER_CHUNK = 1024
SCORE_TILE = 64 * 1024
DECODE_SCORE_TILE = 128 * 1024
CHUNK_BUFFER_BYTES = 16 * 1024 * 1024   # VMEM for a chunk's K and V pages, both buffers (C is capped to fit)
VMEM_LIMIT_BYTES = 64 * 1024 * 1024


def query_block(num_tokens: int) -> int:
    """Rows per query block: 16 for decode-sized steps (a block's rows are 16 sequences, whose
    pages it reads once; measured at 64 rows), 64 for longer steps (a prefill chunk's keys are
    then read once per 64 of its tokens; the runner keeps such steps on XLA's path for now)."""
    forced = positive_int_knob("MULTILORA_PALLAS_QUERY_BLOCK")  # a measurement knob (benchmarks/tpu_steps.sh)
    if forced:
        return forced
    return 16 if num_tokens <= 256 else 64


def page_vmem_bytes(num_kv: int, page_size: int, head_dim: int, dtype) -> int:
    """Bytes of one heads-major cache page of one layer's K (or V), all kv heads, in VMEM or a
    TPU's HBM alike: (p, H) tiles whose H is padded to 128 lanes."""
    return num_kv * page_size * (-(-head_dim // 128) * 128) * jnp.dtype(dtype).itemsize


def keys_per_chunk(score_rows: int, block_rows: int = 64) -> int:
    """Keys a chunk scores for a kv head's score_rows (G x tq) query rows in blocks of block_rows
    (tq): KEYS_PER_CHUNK, halved (to 128 at least) while the score tile passes SCORE_TILE
    (DECODE_SCORE_TILE for blocks of at most 16 rows); $MULTILORA_PALLAS_CHUNK_KEYS forces it."""
    forced = positive_int_knob("MULTILORA_PALLAS_CHUNK_KEYS")  # a measurement knob (benchmarks/tpu_steps.sh)
    if forced:
        return forced
    tile = DECODE_SCORE_TILE if block_rows <= 16 else SCORE_TILE
    keys = KEYS_PER_CHUNK
    while keys > 128 and keys * score_rows > tile:
        keys //= 2
    return keys


def chunk_pages(num_step_pages: int, page_size: int, page_bytes: int = 0, keys: int = KEYS_PER_CHUNK) -> int:
    """Pages a chunk holds (C): at most `keys` keys, at most the step's pages, and (page_bytes:
    page_vmem_bytes's) few enough that both buffers of K and V fit CHUNK_BUFFER_BYTES."""
    c = keys // page_size
    if page_bytes:
        c = min(c, CHUNK_BUFFER_BYTES // (4 * page_bytes))
    return max(1, min(num_step_pages, c))


def key_ranges(kv_page_seq_X, seq_idx_T, positions_T, page_size, sliding_window):
    """Each token's visible flat key indices [lo_T, hi_T] (lo > hi for padding tokens) and the
    first page and end page (exclusive) of X each token needs."""
    x = kv_page_seq_X.shape[0]
    real_T = seq_idx_T >= 0
    # compare_all: XLA's default (a loop of gathers) cost 4.2 ms of a 480-token prefill step on a v5e
    start_T = jnp.searchsorted(kv_page_seq_X, seq_idx_T, side="left", method="compare_all").astype(jnp.int32)
    lo_T = start_T * page_size
    hi_T = lo_T + positions_T
    if sliding_window is not None:
        lo_T = jnp.maximum(lo_T, hi_T - sliding_window + 1)
    lo_T = jnp.where(real_T, lo_T, 1).astype(jnp.int32)
    hi_T = jnp.where(real_T, hi_T, 0).astype(jnp.int32)
    first_T = jnp.where(real_T, lo_T // page_size, x)
    end_T = jnp.where(real_T, hi_T // page_size + 1, 0)
    return lo_T, hi_T, first_T, end_T


def _kernel(layer_ref, pages_ref, blk_start_ref, n_chunks_ref, base_ref,   # scalar prefetch
            q_ref, lo_ref, hi_ref, k_hbm, v_hbm,                           # inputs
            o_ref,                                                          # output
            kbuf, vbuf, sem, m_ref, l_ref, acc_ref,                         # scratch
            *, pages_per_chunk: int, num_pages: int, num_blocks: int, scale: float):
    j = pl.program_id(0)
    layer = layer_ref[0]
    num_kv, g, tq, h = q_ref.shape
    p = kbuf.shape[3]
    cp = pages_per_chunk * p

    def copies(blk, c, slot):
        x0 = blk_start_ref[blk] + c * pages_per_chunk
        out = []
        for i in range(pages_per_chunk):
            page = pages_ref[jnp.minimum(x0 + i, num_pages - 1)]
            out.append(pltpu.make_async_copy(k_hbm.at[layer, page], kbuf.at[slot, i], sem.at[0, slot]))
            out.append(pltpu.make_async_copy(v_hbm.at[layer, page], vbuf.at[slot, i], sem.at[1, slot]))
        return out

    @pl.when(j == 0)
    def _():
        for cp_ in copies(0, 0, 0):
            cp_.start()

    m_ref[...] = jnp.full_like(m_ref, MASKED)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)
    lo = jnp.tile(lo_ref[...], (g, 1))   # (g * tq, 1): row r is token r % tq
    hi = jnp.tile(hi_ref[...], (g, 1))
    n = n_chunks_ref[j]

    def body(c, carry):
        slot = (base_ref[j] + c) % 2

        @pl.when(c + 1 < n)
        def _():
            for cp_ in copies(j, c + 1, 1 - slot):
                cp_.start()

        @pl.when((c + 1 >= n) & (j + 1 < num_blocks))
        def _():
            for cp_ in copies(j + 1, 0, 1 - slot):
                cp_.start()

        for cp_ in copies(j, c, slot):
            cp_.wait()

        f0 = (blk_start_ref[j] + c * pages_per_chunk) * p
        f = f0 + jax.lax.broadcasted_iota(jnp.int32, (1, cp), 1)
        visible = (f >= lo) & (f <= hi)                                   # (g * tq, cp)
        for k in range(num_kv):
            online_softmax_update(q_ref[k].reshape(g * tq, h), kbuf[slot, :, k].reshape(cp, h),
                                  vbuf[slot, :, k].reshape(cp, h), visible, scale, m_ref.at[k], l_ref.at[k],
                                  acc_ref.at[k])
        return carry

    jax.lax.fori_loop(0, n, body, 0)
    for k in range(num_kv):
        o_ref[k] = normalized(acc_ref.at[k], l_ref.at[k]).reshape(g, tq, h).astype(o_ref.dtype)


def online_softmax_update(q, keys, vals, visible, scale: float, m_ref, l_ref, acc_ref):
    """One chunk of keys into a kv head's running max (m), sum (l) and weighted values (acc):
    q (R, H) against keys and values (C, H), visible (R or 1, C) the keys each row may see."""
    s = jax.lax.dot_general(q, keys.astype(q.dtype), (((1,), (1,)), ((), ())),
                            precision=_precision(q), preferred_element_type=jnp.float32) * scale
    s = jnp.where(visible, s, MASKED)
    m_prev = m_ref[...]
    m_cur = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    probs = jnp.where(visible, jnp.exp(s - m_cur), 0.0)
    alpha = jnp.exp(m_prev - m_cur)
    l_ref[...] = alpha * l_ref[...] + jnp.sum(probs, axis=1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(probs.astype(vals.dtype), vals, precision=_precision(vals),
                                                  preferred_element_type=jnp.float32)
    m_ref[...] = m_cur


def normalized(acc_ref, l_ref):
    """The running weighted values over their weights' sum (zeros where no key was visible)."""
    l_ = l_ref[...]
    return acc_ref[...] / jnp.where(l_ == 0.0, 1.0, l_)


def _precision(operand):
    return jax.lax.Precision.HIGHEST if operand.dtype == jnp.float32 else None


def attention_plan(kv_page_seq_X, seq_idx_T, positions_T, page_size: int, sliding_window: int | None = None,
                   block_rows: int | None = None, page_bytes: int = 0, chunk_keys: int | None = None,
                   group: int = 1):
    """What paged_attention needs to know of the step besides q and the cache, the same at every
    layer of one window: each token's visible keys (lo_T, hi_T, padded to whole query blocks),
    each block's first page, chunks, and first chunk's count (for the double buffer), and the
    pages a chunk holds (chunk_pages's, from page_bytes, and chunk_keys or keys_per_chunk's for
    `group` query heads a kv head). Made once per step (forward), since each small op of it costs
    a TPU a few microseconds per layer."""
    t, x = seq_idx_T.shape[0], kv_page_seq_X.shape[0]
    tq = block_rows or query_block(t)
    nb = -(-t // tq)
    pad = nb * tq - t
    c = chunk_pages(x, page_size, page_bytes, chunk_keys or keys_per_chunk(group * tq, tq))
    lo_T, hi_T, first_T, end_T = key_ranges(kv_page_seq_X, seq_idx_T, positions_T, page_size, sliding_window)
    lo_T = jnp.pad(lo_T, (0, pad), constant_values=1)
    hi_T = jnp.pad(hi_T, (0, pad), constant_values=0)
    blk_start = jnp.min(jnp.pad(first_T, (0, pad), constant_values=x).reshape(nb, tq), axis=1)
    blk_end = jnp.max(jnp.pad(end_T, (0, pad), constant_values=0).reshape(nb, tq), axis=1)
    blk_start = jnp.where(blk_start >= x, 0, blk_start).astype(jnp.int32)
    n_chunks = jnp.maximum(-(-(blk_end - blk_start) // c), 1).astype(jnp.int32)   # >= 1: every block is written
    base = (jnp.cumsum(n_chunks) - n_chunks).astype(jnp.int32)
    return lo_T[:, None], hi_T[:, None], blk_start, n_chunks, base, c


def paged_attention(q_TNH, k_LPKpH, v_LPKpH, layer, kv_pages_X, kv_page_seq_X, seq_idx_T, positions_T,
                    sliding_window: int | None = None, interpret: bool = False, block_rows: int | None = None,
                    plan=None, chunk_keys: int | None = None, scale: float | None = None):
    """Attention (T, N, H) of every token of the step (decode rows and prefill chunks) against
    its own sequence's keys at positions <= its own, read from the heads-major caches
    (L, P, K, p, H) at `layer` through the step's flat page list. Padding tokens (seq_idx -1)
    get zeros. interpret: Pallas's TPU interpreter (any platform; the tests' path). plan:
    attention_plan's for the same step, window, block_rows and cache (made here where not given,
    with at most chunk_keys keys a chunk). scale: the scores' (default H ** -0.5; a packed cache's
    heads keep their own, multilora.model.kv_lanes)."""
    t, n, h = q_TNH.shape
    _, _, num_kv, p, _ = k_LPKpH.shape
    g = n // num_kv
    x = kv_pages_X.shape[0]
    tq = block_rows or query_block(t)
    nb = -(-t // tq)
    pad = nb * tq - t
    if plan is None:
        plan = attention_plan(kv_page_seq_X, seq_idx_T, positions_T, p, sliding_window, block_rows,
                              page_vmem_bytes(num_kv, p, h, k_LPKpH.dtype), chunk_keys, g)
    lo_T, hi_T, blk_start, n_chunks, base, c = plan
    q_KGTH = jnp.pad(q_TNH, ((0, pad), (0, 0), (0, 0))).reshape(nb * tq, num_kv, g, h).transpose(1, 2, 0, 3)
    kernel = functools.partial(_kernel, pages_per_chunk=c, num_pages=x, num_blocks=nb,
                               scale=h ** -0.5 if scale is None else scale)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(nb,),
        in_specs=[
            pl.BlockSpec((num_kv, g, tq, h), lambda j, *_: (0, 0, j, 0)),
            pl.BlockSpec((tq, 1), lambda j, *_: (j, 0)),
            pl.BlockSpec((tq, 1), lambda j, *_: (j, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((num_kv, g, tq, h), lambda j, *_: (0, 0, j, 0)),
        scratch_shapes=[
            pltpu.VMEM((2, c, num_kv, p, h), k_LPKpH.dtype),
            pltpu.VMEM((2, c, num_kv, p, h), v_LPKpH.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((num_kv, g * tq, 1), jnp.float32),
            pltpu.VMEM((num_kv, g * tq, 1), jnp.float32),
            pltpu.VMEM((num_kv, g * tq, h), jnp.float32),
        ],
    )
    out_KGTH = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((num_kv, g, nb * tq, h), q_TNH.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                             vmem_limit_bytes=VMEM_LIMIT_BYTES),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), kv_pages_X.astype(jnp.int32), blk_start, n_chunks, base,
      q_KGTH, lo_T, hi_T, k_LPKpH, v_LPKpH)
    return out_KGTH.transpose(2, 0, 1, 3).reshape(nb * tq, n, h)[:t]


def paged_attention_reference(q_TNH, k_LPKpH, v_LPKpH, layer, kv_pages_X, kv_page_seq_X, seq_idx_T,
                              positions_T, sliding_window: int | None = None):
    """paged_attention in plain jnp: every token against every key of the step's pages, masked."""
    t, n, h = q_TNH.shape
    _, _, num_kv, p, _ = k_LPKpH.shape
    g = n // num_kv
    lo_T, hi_T, _, _ = key_ranges(kv_page_seq_X, seq_idx_T, positions_T, p, sliding_window)
    k_XKpH = k_LPKpH[layer][kv_pages_X]
    v_XKpH = v_LPKpH[layer][kv_pages_X]
    x = kv_pages_X.shape[0]
    k_FKH = k_XKpH.transpose(0, 2, 1, 3).reshape(x * p, num_kv, h).astype(jnp.float32)
    v_FKH = v_XKpH.transpose(0, 2, 1, 3).reshape(x * p, num_kv, h).astype(jnp.float32)
    q_TKGH = q_TNH.reshape(t, num_kv, g, h).astype(jnp.float32)
    s = jnp.einsum("tkgh,fkh->tkgf", q_TKGH, k_FKH, precision=jax.lax.Precision.HIGHEST) * h ** -0.5
    f = jnp.arange(x * p)
    vis = (f[None, :] >= lo_T[:, None]) & (f[None, :] <= hi_T[:, None])
    s = jnp.where(vis[:, None, None, :], s, MASKED)
    e = jnp.where(vis[:, None, None, :], jnp.exp(s - s.max(-1, keepdims=True)), 0.0)
    den = e.sum(-1, keepdims=True)
    out = jnp.einsum("tkgf,fkh->tkgh", e / jnp.where(den == 0, 1.0, den), v_FKH, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(t, n, h).astype(q_TNH.dtype)
