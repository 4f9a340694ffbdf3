"""The LoRA delta of one projection as a Pallas TPU kernel that reads the step's own adapters'
pages straight from the pool in HBM: y_TO = sum over the step's adapters a of
onehot(local_T == a) * ((x_TD @ A_a.T) * scaling_a) @ B_a.

Why: an XLA gather of a slot's rows costs far more on a TPU than the bytes it moves, and the
one-hot product over every slot (sglang-jax's) reads the whole pool, so a memory-sized pool of
hundreds of slots costs in proportion to its size. Here a step names its distinct adapters
(LoRABatchInfo.step_slots_A, at most max_num_seqs of them however many slots the pool holds),
and the kernel DMAs only their pages (PAGE_ROWS rank rows each, anywhere in the pool) into VMEM,
a chunk of adapters at a time, double-buffered: the next chunk's pages are in flight while the
MXU works on this one (so intended; on a v5e the two do not overlap yet, benchmarks/log/48). A
chunk holds `chunk_adapters` adapters, W = chunk_adapters x R rank columns (R the row table's
width), sized so that W fills the MXU's 128 lanes; the shrink is one
(tm, D) x (D, W) product, the expand one (tm, W) x (W, O), and the one-hot over the chunk's
columns picks each token's own adapter.

Tokens go in tiles of tm rows (grid axis 0); tile i visits only the chunks from the first to the
last its tokens use (the step's adapters are numbered in order of first appearance, so the
sequences of a prefill tile use a short run of chunks), and nothing is read or computed for the
others. Every tile visits at least one chunk (its output must be written), base rows
(local_T = A, matching no column) get zeros. The caller adds the base outputs: base + delta
written by the kernel itself (no delta out to HBM) was slower on a v5e, SmolLM2's prefill step
with 64 adapters 5.56 -> 5.70 ms back to back, the 1B shape's 10.87 -> 11.43 (benchmarks/log/49).

Legend: T tokens, D in features, O out features, L layers, U pool rows, A step adapters,
C chunks of adapters, W rank columns of a chunk, Q pages of a chunk, R row table width.
`lora_delta_reference` is the same product in plain jnp, for the tests.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from multilora.config import NO_ADAPTER, PAGE_ROWS
from multilora.kernels.knobs import positive_int_knob, switch_knob

LANES = 128
VMEM_LIMIT_BYTES = 64 * 1024 * 1024   # a v5e core has 128 MiB of VMEM; the default scope is 16 MiB
VMEM_BUDGET_BYTES = 40 * 1024 * 1024  # what one call's buffers may take (tm is picked to fit)


# Adapters per chunk in place of chunk_adapters' pick (a probe's knob: benchmarks/lora_kernel_probe.py)
CHUNK_ENV = "MULTILORA_LORA_CHUNK_ADAPTERS"
# A chunk's adapter copies are issued in a loop (pl.loop), a smaller module for Mosaic to compile
# than unrolled copies: on a v5e a LoRA step compiled in 3.4-5.7 s against 12.4-16.1 s unrolled, at
# the same step times (benchmarks/log/40). "0" unrolls them (tpu_steps.sh's part `copyloop`).
COPY_LOOP_ENV = "MULTILORA_LORA_COPY_LOOP"
# "1": a chunk whose adapters' pages are one run of the pool comes in one copy a pool (W rows)
# instead of a copy an adapter; a step whose calls are one token tile each (decode) orders its
# adapters by pool page for it (a tile visits every chunk anyway), so that adapters loaded one
# after another (the registry hands pages lowest first) make whole-chunk runs. Off: on a v5e, on
# a step whose adapters are consecutive slots, 11-21 % faster at 64 adapters and 9-17 % slower at
# 8 (benchmarks/log/49; tpu_steps.sh's part `chunkcopy`).
CHUNK_COPY_ENV = "MULTILORA_LORA_CHUNK_COPY"
# A chunk's copies are waited on with one wait a buffer (a DMA semaphore counts the bytes that
# arrived, and a chunk's copies into one buffer always total that buffer: W rows a pool) instead
# of one wait a copy, halving the scalar core's work a copy: on a v5e a SmolLM2 decode step with
# 64 adapters 5.61 -> 5.40 ms (4.27 -> 4.12 back to back), the others unchanged (benchmarks/log/48).
# The default; "0" waits on each copy.
ONE_WAIT_ENV = "MULTILORA_LORA_ONE_WAIT"
# Copies of the pool's zero page (page 0: a padding entry's pages, and the pages past a lower
# rank's in the row table) come from a block of zeros in VMEM instead of from HBM. A step's
# adapters fill whole chunks of 8 (rank 16), so a decode step with 3 adapters reads 5 padding
# entries' pages, more bytes than its own. On a v5e, SmolLM2's 64-adapter decode step 4.35 -> 4.23
# ms back to back, alternating, the others unchanged (benchmarks/log/49). The default; "0" off.
ZERO_LOCAL_ENV = "MULTILORA_LORA_ZERO_PAGE_LOCAL"


def chunk_adapters(table_width: int, num_adapters: int = 0) -> int:
    """Adapters per chunk: enough that a chunk's rank columns fill the MXU's lanes (or
    $MULTILORA_LORA_CHUNK_ADAPTERS), no more than the step's num_adapters where given (a padding
    entry still costs its copies), and an even number where the width is an odd number of pages,
    so that a chunk's rows are whole (16, 128) tiles of a bfloat16 buffer."""
    n = positive_int_knob(CHUNK_ENV) or max(1, LANES // table_width)
    if num_adapters:
        n = min(n, num_adapters)
    if (table_width // PAGE_ROWS) % 2 and n % 2:
        n = n - 1 if n > 1 else 2
    return n


def chunk_copy_on() -> bool:
    """Whether a chunk whose pages are one run comes in one copy ($MULTILORA_LORA_CHUNK_COPY)."""
    return switch_knob(CHUNK_COPY_ENV)


def one_wait_on() -> bool:
    """Whether a chunk's copies into a buffer are waited on at once ($MULTILORA_LORA_ONE_WAIT,
    on unless "0")."""
    return switch_knob(ONE_WAIT_ENV, default=True)


def zero_local_on() -> bool:
    """Whether the zero page's copies come from VMEM ($MULTILORA_LORA_ZERO_PAGE_LOCAL, on unless "0")."""
    return switch_knob(ZERO_LOCAL_ENV, default=True)


def token_tile(num_tokens: int, d_in: int, d_out: int, itemsize: int) -> int:
    """Rows per token tile: the whole step where its x block, f32 accumulators and output blocks
    (d_out: the features of every output of the call together) fit the VMEM budget, else the
    largest power of two (>= 8) that does (the step is padded to whole tiles)."""
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


def _kernel(layer_ref, meta_ref, x_ref, local_ref, scale_ref, *refs, nb: int, pages_per_chunk: int,
            a_offs: tuple, rank_cols: int, per_chunk: int, num_tiles: int, num_chunks: int,
            copy_loop: bool = False, chunk_copy: bool = False, one_wait: bool = True,
            zero_local: bool = False):
    """layer_ref, meta_ref (SMEM): the layer; the plan's pages and runs, then the tile size's
    lo / n / start (lora_plan's "meta"; the chunks' runs after the entries' where chunk_copy).
    a_hbm: the A pool (L, U, D), a_offs the first rows of the call's outputs' blocks in it; refs:
    nb B pools (HBM), nb outputs, then the scratch: A's buffer (both slots, a block of W rows per
    output), nb B buffers, the DMA semaphores, nb accumulators. chunk_copy: a chunk whose pages
    are one run in one copy a pool. one_wait: a buffer's copies waited on at once. zero_local: the
    scratch ends with zero blocks (R rows) for A and each B, the source of the zero page's copies."""
    a_hbm, refs = refs[0], refs[1:]
    b_hbm, y_refs = refs[:nb], refs[nb:2 * nb]
    abuf, bbufs, sem, accs = refs[2 * nb], refs[2 * nb + 1:3 * nb + 1], refs[3 * nb + 1], refs[3 * nb + 2:4 * nb + 2]
    zero_a, zero_bs = (refs[4 * nb + 2], refs[4 * nb + 3:]) if zero_local else (None, ())
    i, j = pl.program_id(0), pl.program_id(1)
    layer = layer_ref[0]
    per_adapter = rank_cols // PAGE_ROWS
    w = per_chunk * rank_cols   # rows of a block's buffer
    o_pages, o_runs = 0, num_chunks * pages_per_chunk
    o_chunk_runs = o_runs + num_chunks * per_chunk
    o_lo = o_chunk_runs + (num_chunks if chunk_copy else 0)
    o_n, o_start = o_lo + num_tiles, o_lo + 2 * num_tiles

    def dmas(tile, jj, slot, act):
        """act(copy) for each copy of the tile's jj-th chunk into buffer `slot`: an adapter whose
        pages are consecutive in the pool (the registry hands pages lowest first, so a loaded
        adapter's usually are) in one copy of its rank rows per pool, another page by page.
        Started and waited on alike, so that each wait matches its copy."""
        c = meta_ref[o_lo + tile] + jj

        def copy(first_page, dst_row, rows, maybe_zero=False):
            """rows rank rows from first_page on, of each pool, to buffer rows dst_row on (where
            maybe_zero and zero_local, page 0's from the zero blocks instead)."""
            row = pl.multiple_of(first_page * PAGE_ROWS, PAGE_ROWS)

            def issue(a_src, b_src):
                for k, a_off in enumerate(a_offs):
                    act(pltpu.make_async_copy(a_src(a_off), abuf.at[slot, pl.ds(k * w + dst_row, rows)],
                                              sem.at[0, slot]))
                for k in range(nb):
                    act(pltpu.make_async_copy(b_src(k), bbufs[k].at[slot, pl.ds(dst_row, rows)], sem.at[1 + k, slot]))

            def from_pool():
                issue(lambda a_off: a_hbm.at[layer, pl.ds(a_off + row, rows)],
                      lambda k: b_hbm[k].at[layer, pl.ds(row, rows)])

            if not (zero_local and maybe_zero):
                from_pool()
                return
            zero = first_page == 0
            pl.when(zero)(lambda: issue(lambda _: zero_a.at[pl.ds(0, rows)], lambda k: zero_bs[k].at[pl.ds(0, rows)]))
            pl.when(jnp.logical_not(zero))(from_pool)

        def adapter(a, dst):
            """The copies of the chunk's a-th adapter, to its rank columns from dst on."""
            entry = c * per_chunk + a
            first = o_pages + entry * per_adapter
            if per_adapter == 1:
                copy(meta_ref[first], dst, PAGE_ROWS, maybe_zero=True)
                return
            run = meta_ref[o_runs + entry] == 1

            @pl.when(run)
            def _():   # a run never starts at the zero page: the registry keeps page 0 for it
                copy(meta_ref[first], dst, rank_cols)

            @pl.when(jnp.logical_not(run))
            def _():
                for q in range(per_adapter):
                    copy(meta_ref[first + q], dst + q * PAGE_ROWS, PAGE_ROWS, maybe_zero=True)

        def each_adapter():
            if copy_loop:
                @pl.loop(0, per_chunk)
                def _(a):
                    adapter(a, pl.multiple_of(a * rank_cols, rank_cols))
            else:
                for a in range(per_chunk):
                    adapter(a, a * rank_cols)

        if not chunk_copy:
            each_adapter()
            return
        whole = meta_ref[o_chunk_runs + c] == 1

        @pl.when(whole)
        def _():
            copy(meta_ref[o_pages + c * pages_per_chunk], 0, w)

        @pl.when(jnp.logical_not(whole))
        def _():
            each_adapter()

    n_i = meta_ref[o_n + i]
    active = j < n_i
    slot = (meta_ref[o_start + i] + j) % 2

    @pl.when((i == 0) & (j == 0))
    def _():
        if zero_local:
            for z in (zero_a, *zero_bs):
                z[...] = jnp.zeros_like(z)
        dmas(0, 0, 0, lambda cp: cp.start())

    @pl.when(active)
    def _():
        last_of_tile = j + 1 >= n_i

        # the next active step's pages in flight while this step's math runs (started after this
        # step's wait instead made no difference on a v5e: benchmarks/log/49)
        @pl.when(jnp.logical_not(last_of_tile))
        def _():
            dmas(i, j + 1, 1 - slot, lambda cp: cp.start())

        @pl.when(last_of_tile & (i + 1 < num_tiles))
        def _():
            dmas(i + 1, 0, 1 - slot, lambda cp: cp.start())

        c = meta_ref[o_lo + i] + j
        if one_wait:   # one wait a buffer for its whole W rows (the semaphores count bytes,
            # whichever rows they came to)
            pltpu.make_async_copy(abuf.at[slot], abuf.at[slot], sem.at[0, slot]).wait()
            for k in range(nb):
                pltpu.make_async_copy(bbufs[k].at[slot], bbufs[k].at[slot], sem.at[1 + k, slot]).wait()
        else:
            dmas(i, j, slot, lambda cp: cp.wait())

        @pl.when(j == 0)
        def _():
            for acc in accs:
                acc[...] = jnp.zeros_like(acc)

        x = x_ref[...]
        col = c * per_chunk + jax.lax.broadcasted_iota(jnp.int32, (1, w), 1) // rank_cols
        mine, scale = local_ref[...] == col, scale_ref[c]
        for k in range(nb):
            a = abuf[slot, pl.ds(k * w, w), :]
            h = jax.lax.dot_general(x, a.astype(x.dtype), (((1,), (1,)), ((), ())), precision=_precision(x),
                                    preferred_element_type=jnp.float32)                # (tm, W)
            h = jnp.where(mine, h * scale, 0.0)
            b = bbufs[k][slot]
            accs[k][...] += jnp.dot(h.astype(b.dtype), b, precision=_precision(b), preferred_element_type=jnp.float32)

        @pl.when(last_of_tile)
        def _():
            for y_ref, acc in zip(y_refs, accs):
                y_ref[...] = acc[...].astype(y_ref.dtype)


def lora_plan(step_slots_A, local_T, rows_SR, scalings_S, tiles) -> dict:
    """What lora_delta derives from the step's adapters, the same for every layer and projection:
    the pages of each chunk, the rank columns' scalings, and for each token tile size in `tiles`
    the tokens' padded chunk columns and each tile's run of chunks. Made once per step
    (PallasLoRABackend.plan_step): each small op of it costs a TPU a few microseconds per call, and
    inside the step's branches XLA does not hoist them out of the layer loop. With
    $MULTILORA_LORA_CHUNK_COPY=1 also each chunk's run flag, and a step of one token tile a call
    takes its adapters in order of pool page."""
    t = local_T.shape[0]
    r = rows_SR.shape[1]
    if r % PAGE_ROWS:
        raise ValueError(f"the row table's width {r} is not whole pages of {PAGE_ROWS}")
    a_cnt = step_slots_A.shape[0]
    per_chunk = chunk_adapters(r, a_cnt)
    chunk_copy = chunk_copy_on()
    if chunk_copy and all(tm >= t for tm in tiles):
        step_slots_A, local_T = by_pool_page(step_slots_A, local_T, rows_SR)
    num_chunks = -(-a_cnt // per_chunk)
    slots = jnp.pad(step_slots_A.astype(jnp.int32), (0, num_chunks * per_chunk - a_cnt))
    rows_AR = jnp.take(rows_SR, slots, axis=0, mode="clip")
    # padding entries (slot 0) read the zero page, never slot 0's rows
    pages = jnp.where(slots[:, None] == NO_ADAPTER, 0, rows_AR[:, ::PAGE_ROWS] // PAGE_ROWS)
    # each entry's pages one run of consecutive pool pages: read in one copy (the kernel's `dmas`)
    runs = jnp.all(pages == pages[:, :1] + jnp.arange(pages.shape[1], dtype=pages.dtype), axis=1).astype(jnp.int32)
    if chunk_copy:   # each chunk's pages one run of the pool: read in one copy a pool
        q = pages.shape[1] * per_chunk
        by_chunk = pages.reshape(num_chunks, q)
        chunk_runs = jnp.all(by_chunk == by_chunk[:, :1] + jnp.arange(q, dtype=pages.dtype), axis=1)
        runs = jnp.concatenate([runs, chunk_runs.astype(jnp.int32)])
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
        start = (jnp.cumsum(n) - n).astype(jnp.int32)
        # the kernel's scalars in one array (one copy into SMEM a call, not one per array)
        by_tile[tm] = dict(local=local_pad[:, None], meta=jnp.concatenate([pages, runs, lo, n, start]))
    # chunk_runs: the meta's layout, which the kernel is compiled for (lora_deltas)
    return dict(scale=scale_C1W, chunk_runs=chunk_copy, tiles=by_tile)


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
    (y,) = lora_deltas(x_TD, a_pool_LUD, (b_pool_LUO,), layer, step_slots_A, local_T, rows_SR, scalings_S,
                       (a_block,), a_blocks, interpret, tile_rows, plan)
    return y


def by_pool_page(step_slots_A, local_T, rows_SR):
    """(step_slots_A, local_T) with the step's adapters in order of their first pool page
    (padding entries last), each token's index following its adapter."""
    a_cnt = step_slots_A.shape[0]
    first_page = jnp.take(rows_SR[:, 0], step_slots_A, mode="clip")
    key = jnp.where(step_slots_A == NO_ADAPTER, jnp.iinfo(jnp.int32).max, first_page)
    order = jnp.argsort(key, stable=True)
    new_index = jnp.zeros((a_cnt,), jnp.int32).at[order].set(jnp.arange(a_cnt, dtype=jnp.int32))
    local = jnp.where(local_T < a_cnt, jnp.take(new_index, jnp.minimum(local_T, a_cnt - 1)), local_T)
    return jnp.take(step_slots_A, order), local.astype(local_T.dtype)


def lora_deltas(x_TD, a_pool_LUD, b_pools_LUO, layer, step_slots_A, local_T, rows_SR, scalings_S,
                a_block_ids=None, a_blocks: int = 1, interpret: bool = False, tile_rows: int | None = None,
                plan: dict | None = None):
    """The deltas of several projections over one input (q/k/v, gate/up), in one call: output k
    from A block a_block_ids[k] of the stacked A pool (default: block k) and B pool b_pools_LUO[k].
    One call reads x once and walks the step's adapters once for all of them, where separate calls
    each pay a call's fixed cost (its scalars, its first pages' wait, x read again): ~4 us on a
    v5e, 210 calls a step of SmolLM2's shape. Arguments as lora_delta's."""
    t, d = x_TD.shape
    nb = len(b_pools_LUO)
    a_block_ids = tuple(range(nb)) if a_block_ids is None else tuple(a_block_ids)
    outs = [b.shape[2] for b in b_pools_LUO]
    r = rows_SR.shape[1]
    tm = tile_rows or token_tile(t, d, sum(outs), jnp.dtype(x_TD.dtype).itemsize)
    if plan is None or tm not in plan["tiles"]:
        plan = lora_plan(step_slots_A, local_T, rows_SR, scalings_S, (tm,))
    per_chunk = chunk_adapters(r, step_slots_A.shape[0])
    num_chunks = -(-step_slots_A.shape[0] // per_chunk)
    w = per_chunk * r
    nt = -(-t // tm)
    pad = nt * tm - t
    x_pad = jnp.pad(x_TD, ((0, pad), (0, 0))) if pad else x_TD
    tile = plan["tiles"][tm]
    block_rows = a_pool_LUD.shape[1] // a_blocks
    zero_local = zero_local_on()
    kernel = functools.partial(_kernel, nb=nb, pages_per_chunk=w // PAGE_ROWS,
                               a_offs=tuple(k * block_rows for k in a_block_ids), rank_cols=r,
                               per_chunk=per_chunk, num_tiles=nt, num_chunks=num_chunks,
                               copy_loop=os.environ.get(COPY_LOOP_ENV) != "0", chunk_copy=plan["chunk_runs"],
                               one_wait=one_wait_on(), zero_local=zero_local)
    any_space = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(nt, num_chunks),
        in_specs=[
            pl.BlockSpec((tm, d), lambda i, j, *_: (i, 0)),
            pl.BlockSpec((tm, 1), lambda i, j, *_: (i, 0)),
            pl.BlockSpec((num_chunks, 1, w), lambda i, j, *_: (0, 0, 0)),
        ] + [any_space] * (1 + nb),
        out_specs=[pl.BlockSpec((tm, o), lambda i, j, *_: (i, 0)) for o in outs],
        scratch_shapes=[pltpu.VMEM((2, nb * w, d), a_pool_LUD.dtype)]
        + [pltpu.VMEM((2, w, o), b.dtype) for o, b in zip(outs, b_pools_LUO)]
        + [pltpu.SemaphoreType.DMA((1 + nb, 2))]
        + [pltpu.VMEM((tm, o), jnp.float32) for o in outs]
        + ([pltpu.VMEM((r, d), a_pool_LUD.dtype)] + [pltpu.VMEM((r, o), b.dtype) for o, b in zip(outs, b_pools_LUO)]
           if zero_local else []),
    )
    ys = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((nt * tm, o), x_TD.dtype) for o in outs],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT_BYTES),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), tile["meta"], x_pad, tile["local"], plan["scale"],
      a_pool_LUD, *b_pools_LUO)
    return tuple(y[:t] if pad else y for y in ys)


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
