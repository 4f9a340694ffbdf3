"""The LoRA delta of one projection as a Pallas TPU kernel that reads the step's own adapters'
pages straight from the pool in HBM: y_TO = sum over the step's adapters a of
onehot(local_T == a) * ((x_TD @ A_a.T) * scaling_a) @ B_a.

Why: an XLA gather of a slot's rows costs far more on a TPU than the bytes it moves, and the
one-hot product over every slot (sglang-jax's) reads the whole pool, so a memory-sized pool of
hundreds of slots costs in proportion to its size. Here a step names its distinct adapters
(LoRABatchInfo.step_slots_A, at most max_num_seqs of them however many slots the pool holds),
and the kernel DMAs only their pages (PAGE_ROWS rank rows each, anywhere in the pool) into VMEM,
a chunk of adapters at a time, double-buffered: the next chunk's pages are in flight while the
MXU works on this one. A chunk holds `chunk_adapters` adapters, W = chunk_adapters x R rank
columns (R the row table's width), sized so that W fills the MXU's 128 lanes; the shrink is one
(tm, D) x (D, W) product, the expand one (tm, W) x (W, O), and the one-hot over the chunk's
columns picks each token's own adapter.

Tokens go in tiles of tm rows (grid axis 0); tile i visits only the chunks from the first to the
last its tokens use (the step's adapters are numbered in order of first appearance, so the
sequences of a prefill tile use a short run of chunks), and nothing is read or computed for the
others. Every tile visits at least one chunk (its output must be written), base rows
(local_T = A, matching no column) get zeros.

Legend: T tokens, D in features, O out features, L layers, U pool rows, A step adapters,
C chunks of adapters, W rank columns of a chunk, Q pages of a chunk, R row table width.
`lora_delta_reference` is the same product in plain jnp, for the tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from multilora.config import NO_ADAPTER, PAGE_ROWS

LANES = 128
VMEM_LIMIT_BYTES = 64 * 1024 * 1024   # a v5e core has 128 MiB of VMEM; the default scope is 16 MiB
VMEM_BUDGET_BYTES = 40 * 1024 * 1024  # what one call's buffers may take (tm is picked to fit)


def chunk_adapters(table_width: int) -> int:
    """Adapters per chunk: enough that a chunk's rank columns fill the MXU's lanes, and an even
    number where the width is an odd number of pages, so that a chunk's rows are whole (16, 128)
    tiles of a bfloat16 buffer."""
    n = max(1, LANES // table_width)
    if (table_width // PAGE_ROWS) % 2 and n % 2:
        n = n - 1 if n > 1 else 2
    return n


def token_tile(num_tokens: int, d_in: int, d_out: int, itemsize: int) -> int:
    """Rows per token tile: the whole step where its x block, f32 accumulator and output block
    fit the VMEM budget, else the largest power of two (>= 8) that does (the step is padded to
    whole tiles)."""
    def fits(tm):
        return tm * (2 * d_in * itemsize + 4 * d_out + 2 * d_out * itemsize) <= VMEM_BUDGET_BYTES // 2
    if fits(num_tokens):
        return num_tokens
    tm = 1 << (num_tokens.bit_length() - 1)
    while tm > 8 and not fits(tm):
        tm //= 2
    return tm


def _precision(operand):
    # float32 pools multiply in float32 (the MXU's default takes bf16 passes)
    return jax.lax.Precision.HIGHEST if operand.dtype == jnp.float32 else None


def _kernel(layer_ref, pages_ref, lo_ref, n_ref, start_ref,      # scalar prefetch (SMEM)
            x_ref, local_ref, scale_ref, a_hbm, b_hbm,           # inputs
            y_ref,                                                # output
            abuf, bbuf, sem, acc,                                 # scratch
            *, pages_per_chunk: int, a_off: int, rank_cols: int, per_chunk: int, num_tiles: int):
    i, j = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]

    def copies(tile, jj, slot):
        c = lo_ref[tile] + jj
        out = []
        for q in range(pages_per_chunk):
            row = pl.multiple_of(pages_ref[c * pages_per_chunk + q] * PAGE_ROWS, PAGE_ROWS)
            dst = pl.ds(q * PAGE_ROWS, PAGE_ROWS)
            out.append(pltpu.make_async_copy(a_hbm.at[layer, pl.ds(a_off + row, PAGE_ROWS)],
                                             abuf.at[slot, dst], sem.at[0, slot]))
            out.append(pltpu.make_async_copy(b_hbm.at[layer, pl.ds(row, PAGE_ROWS)],
                                             bbuf.at[slot, dst], sem.at[1, slot]))
        return out

    active = j < n_ref[i]
    slot = (start_ref[i] + j) % 2

    @pl.when((i == 0) & (j == 0))
    def _():
        for cp in copies(0, 0, 0):
            cp.start()

    @pl.when(active)
    def _():
        # The next active step's pages go in flight before this step waits for its own.
        last_of_tile = j + 1 >= n_ref[i]

        @pl.when(jnp.logical_not(last_of_tile))
        def _():
            for cp in copies(i, j + 1, 1 - slot):
                cp.start()

        @pl.when(last_of_tile & (i + 1 < num_tiles))
        def _():
            for cp in copies(i + 1, 0, 1 - slot):
                cp.start()

        for cp in copies(i, j, slot):
            cp.wait()

        @pl.when(j == 0)
        def _():
            acc[...] = jnp.zeros_like(acc)

        c = lo_ref[i] + j
        x = x_ref[...]
        a = abuf[slot]
        h = jax.lax.dot_general(x, a.astype(x.dtype), (((1,), (1,)), ((), ())), precision=_precision(x),
                                preferred_element_type=jnp.float32)            # (tm, W)
        col = c * per_chunk + jax.lax.broadcasted_iota(jnp.int32, (1, h.shape[1]), 1) // rank_cols
        h = jnp.where(local_ref[...] == col, h * scale_ref[c], 0.0)
        b = bbuf[slot]
        acc[...] += jnp.dot(h.astype(b.dtype), b, precision=_precision(b), preferred_element_type=jnp.float32)

        @pl.when(last_of_tile)
        def _():
            y_ref[...] = acc[...].astype(y_ref.dtype)


def lora_plan(step_slots_A, local_T, rows_SR, scalings_S, tiles) -> dict:
    """What lora_delta derives from the step's adapters, the same for every layer and projection:
    the pages of each chunk, the rank columns' scalings, and for each token tile size in `tiles`
    the tokens' padded chunk columns and each tile's run of chunks. Made once per step
    (PallasLoRABackend.plan_step): each small op of it costs a TPU a few microseconds per call, and
    inside the step's branches XLA does not hoist them out of the layer loop."""
    t = local_T.shape[0]
    r = rows_SR.shape[1]
    if r % PAGE_ROWS:
        raise ValueError(f"the row table's width {r} is not whole pages of {PAGE_ROWS}")
    per_chunk = chunk_adapters(r)
    a_cnt = step_slots_A.shape[0]
    num_chunks = -(-a_cnt // per_chunk)
    slots = jnp.pad(step_slots_A.astype(jnp.int32), (0, num_chunks * per_chunk - a_cnt))
    rows_AR = jnp.take(rows_SR, slots, axis=0, mode="clip")
    # padding entries (slot 0) read the zero page, never slot 0's rows
    pages = jnp.where(slots[:, None] == NO_ADAPTER, 0, rows_AR[:, ::PAGE_ROWS] // PAGE_ROWS)
    pages = pages.reshape(-1).astype(jnp.int32)                                       # (C * Q,)
    scale_C1W = jnp.repeat(jnp.take(scalings_S, slots, mode="clip").astype(jnp.float32), r).reshape(
        num_chunks, 1, per_chunk * r)
    local_T = jnp.where(local_T < a_cnt, local_T, num_chunks * per_chunk).astype(jnp.int32)
    by_tile = {}
    for tm in sorted(set(tiles)):
        nt = -(-t // tm)
        local_pad = jnp.pad(local_T, (0, nt * tm - t), constant_values=num_chunks * per_chunk)
        # each tile's run of chunks: from the first to the last its tokens use (one, if none)
        chunk_T = local_pad.reshape(nt, tm) // per_chunk
        used = chunk_T < num_chunks
        lo = jnp.min(jnp.where(used, chunk_T, num_chunks), axis=1)
        hi = jnp.max(jnp.where(used, chunk_T, -1), axis=1)
        lo = jnp.where(lo >= num_chunks, 0, lo).astype(jnp.int32)
        n = jnp.maximum(hi - lo + 1, 1).astype(jnp.int32)
        by_tile[tm] = dict(local=local_pad[:, None], lo=lo, n=n, start=(jnp.cumsum(n) - n).astype(jnp.int32))
    return dict(pages=pages, scale=scale_C1W, tiles=by_tile)


def lora_delta(x_TD, a_pool_LUD, b_pool_LUO, layer, step_slots_A, local_T, rows_SR, scalings_S,
               a_block: int = 0, a_blocks: int = 1, interpret: bool = False, tile_rows: int | None = None,
               plan: dict | None = None):
    """One projection's LoRA delta (T, O) in x's dtype, for the step's adapters step_slots_A
    (slots, 0 = padding) and each token's index into them local_T (A or more: no adapter).
    a_pool_LUD / b_pool_LUO: the whole pools (L layers), read at `layer` in place; a_block: which
    block of a stacked A pool (q/k/v, gate/up: a_blocks blocks of equal rows) holds this
    projection's A rows. interpret: Pallas's TPU interpreter (any platform; the tests' path).
    tile_rows: rows per token tile (default: token_tile's pick). plan: lora_plan's for the same
    step (made here where not given, or where it lacks this call's tile size)."""
    t, d = x_TD.shape
    o = b_pool_LUO.shape[2]
    r = rows_SR.shape[1]
    tm = tile_rows or token_tile(t, d, o, jnp.dtype(x_TD.dtype).itemsize)
    if plan is None or tm not in plan["tiles"]:
        plan = lora_plan(step_slots_A, local_T, rows_SR, scalings_S, (tm,))
    per_chunk = chunk_adapters(r)
    num_chunks = -(-step_slots_A.shape[0] // per_chunk)
    w = per_chunk * r
    nt = -(-t // tm)
    pad = nt * tm - t
    x_pad = jnp.pad(x_TD, ((0, pad), (0, 0))) if pad else x_TD
    tile = plan["tiles"][tm]
    kernel = functools.partial(_kernel, pages_per_chunk=w // PAGE_ROWS, a_off=a_block * (a_pool_LUD.shape[1] // a_blocks),
                               rank_cols=r, per_chunk=per_chunk, num_tiles=nt)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(nt, num_chunks),
        in_specs=[
            pl.BlockSpec((tm, d), lambda i, j, *_: (i, 0)),
            pl.BlockSpec((tm, 1), lambda i, j, *_: (i, 0)),
            pl.BlockSpec((num_chunks, 1, w), lambda i, j, *_: (0, 0, 0)),
            pl.BlockSpec(memory_space=pl.ANY),
            pl.BlockSpec(memory_space=pl.ANY),
        ],
        out_specs=pl.BlockSpec((tm, o), lambda i, j, *_: (i, 0)),
        scratch_shapes=[
            pltpu.VMEM((2, w, d), a_pool_LUD.dtype),
            pltpu.VMEM((2, w, o), b_pool_LUO.dtype),
            pltpu.SemaphoreType.DMA((2, 2)),
            pltpu.VMEM((tm, o), jnp.float32),
        ],
    )
    y = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((nt * tm, o), x_TD.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT_BYTES),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), plan["pages"], tile["lo"], tile["n"], tile["start"],
      x_pad, tile["local"], plan["scale"], a_pool_LUD, b_pool_LUO)
    return y[:t] if pad else y


def lora_delta_reference(x_TD, a_pool_LUD, b_pool_LUO, layer, step_slots_A, local_T, rows_SR, scalings_S,
                         a_block: int = 0, a_blocks: int = 1):
    """lora_delta in plain jnp: each token's adapter's rows gathered, shrink, scale, expand."""
    a_UD = a_pool_LUD[layer]
    b_UO = b_pool_LUO[layer]
    a_cnt = step_slots_A.shape[0]
    has_T = local_T < a_cnt
    slot_T = jnp.where(has_T, jnp.take(step_slots_A, jnp.minimum(local_T, a_cnt - 1)), 0)
    rows_TR = jnp.take(rows_SR, slot_T, axis=0)
    a_TRD = jnp.take(a_UD, rows_TR + a_block * (a_UD.shape[0] // a_blocks), axis=0).astype(jnp.float32)
    b_TRO = jnp.take(b_UO, rows_TR, axis=0).astype(jnp.float32)
    h_TR = jnp.einsum("td,trd->tr", x_TD.astype(jnp.float32), a_TRD)
    h_TR = h_TR * jnp.take(scalings_S, slot_T)[:, None]
    y_TO = jnp.einsum("tr,tro->to", h_TR, b_TRO)
    return jnp.where(has_T[:, None], y_TO, 0.0).astype(x_TD.dtype)
